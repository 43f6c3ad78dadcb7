"""The GEMM seam: every schedule multiplies through one small callable, as torch's
`_pipelined_all_gather_and_consume` takes its consumer. The default is cuBLAS
through torch (traced, so tests see where each chunk ran); a fused kernel, an
FP8 GEMM or a modelled clock plugs in here without touching the schedules."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..comm import trace
from .streams import off_capture


class Gemm(Protocol):
    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 op: str, chunk: int = 0) -> torch.Tensor:
        """`a @ b` (2-D, or 3-D batched), into `out` when given; returns the product."""


def out_dtype(gemm: Gemm, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.dtype:
    """The dtype of what `gemm` makes from `x`: `out`'s, else the GEMM's own `out_dtype`
    (an FP8 GEMM outputs bf16 / fp32), else `x`'s. Schedules size their output,
    partial-sum and receive buffers with it: a reduction never runs in FP8."""
    if out is not None:
        return out.dtype
    return getattr(gemm, "out_dtype", None) or x.dtype


def matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *, op: str,
           chunk: int = 0) -> torch.Tensor:
    """cuBLAS (or the CPU's BLAS) through `torch.mm` / `torch.bmm`: the same kernels as
    `torch.matmul`, with less dispatch on the host."""
    trace.record("gemm", op, chunk)
    with off_capture():
        if a.dim() == 3:
            return torch.bmm(a, b, out=out)
        return torch.mm(a, b, out=out)

"""The FP8 operands of one layer's passes (the 'tensorwise' recipe: a scale per tensor,
from its current amax), made from a layer's `Precision`.

- Forward: the input is quantized once, before any transfer; when it is to be gathered
  (sequence parallelism) its amax is the TP group's, so the gathered FP8 tensor has one
  scale. The weight is quantized with its own shard's amax. Both, with their scales, are
  what the forward leaves for the backward (`Fp8Forward`: allocated by the caller, so a
  replayed pass writes them at the same addresses).
- Backward: the output gradient is quantized (e5m2 under 'hybrid'), with the TP group's
  amax where it is gathered (a row layer under SP). The dgrad reuses the forward's FP8
  weight, transposed; the wgrad reuses the FP8 input (the column layer gathers the
  forward's FP8 input, half the bytes of bf16) and the FP8 gradient, transposed, when
  fp8_wgrad is on; otherwise it runs in the parameters' dtype on the saved input.
- A transposed copy (`col_major`) is what cuBLAS needs for the second operand of every
  FP8 GEMM (column-major) and for the wgrad's first (row-major g^T): Transformer
  Engine keeps the same 'columnwise' copies. Transposing FP8 data is exact.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.transport import Transport
from ..overlap.fp8 import ScaledGemm, amax, quantize, scale_for, shared_amax
from .precision import Precision


def col_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D) with the same values, laid out column-major (a transposed copy)."""
    return t.t().contiguous().t()


def quantized(x: torch.Tensor, dtype: torch.dtype, tp: Optional[Transport] = None,
              op: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, its scale); the amax is the TP group's when `tp` is given (a tensor the
    pass gathers: `op`'s amax exchange, named '<op>_amax')."""
    a = shared_amax(x, tp, f"{op}_amax") if tp is not None else amax(x)
    s = scale_for(a, dtype)
    return quantize(x, s, dtype), s


class Fp8Forward:
    """What an FP8 forward pass writes for its backward: the FP8 input rows and weight,
    with their scales. `rows`: the input flattened to [tokens, k]."""

    def __init__(self, p: Precision, rows: torch.Tensor, weight: torch.Tensor):
        self.p = p
        self.x8 = torch.empty(rows.shape, dtype=p.fwd, device=rows.device)
        self.w8 = torch.empty(weight.shape, dtype=p.fwd, device=weight.device)
        self.x_scale = torch.empty((), dtype=torch.float32, device=rows.device)
        self.w_scale = torch.empty((), dtype=torch.float32, device=rows.device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.x8, self.w8, self.x_scale, self.w_scale

    def operands(self, x2: torch.Tensor, weight: torch.Tensor, tp: Transport, op: str,
                 gathered: bool, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, ScaledGemm]:
        """Quantize the input (with the group's amax when `gathered`) and the weight into
        this object's tensors; returns (x8, w8, the scaled GEMM of x8 @ w8^T)."""
        fwd = self.p.fwd
        a = shared_amax(x2, tp, f"{op}_amax") if gathered else amax(x2)
        self.x_scale.copy_(scale_for(a, fwd))
        quantize(x2, self.x_scale, fwd, out=self.x8)
        self.w_scale.copy_(scale_for(amax(weight), fwd))
        quantize(weight, self.w_scale, fwd, out=self.w8)
        return self.x8, self.w8, ScaledGemm(self.x_scale, self.w_scale, out_dtype)


class Fp8Backward:
    """A backward pass's FP8 side: the forward's FP8 weight and scales, and the gradient's
    FP8 type. The pass quantizes the gradient with `grad()`."""

    def __init__(self, p: Precision, w8: torch.Tensor, w_scale: torch.Tensor,
                 x_scale: torch.Tensor):
        self.p, self.w8, self.w_scale, self.x_scale = p, w8, w_scale, x_scale

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.w8, self.w_scale, self.x_scale

    def grad(self, g: torch.Tensor, tp: Optional[Transport] = None, op: str = ""
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g in the gradient's FP8 type, its scale); the group's amax with `tp`."""
        return quantized(g, self.p.grad, tp, op)

    def dgrad(self, g_scale: torch.Tensor, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, ScaledGemm]:
        """(w8T, the GEMM of g8 @ w8): the schedules multiply by `w8T.t()`, the FP8
        weight column-major."""
        return self.w8.t().contiguous(), ScaledGemm(g_scale, self.w_scale, out_dtype)

    def wgrad(self, g_scale: torch.Tensor, out_dtype: torch.dtype) -> ScaledGemm:
        """The GEMM of g8^T @ x8 (the FP8 input's scale)."""
        return ScaledGemm(g_scale, self.x_scale, out_dtype)

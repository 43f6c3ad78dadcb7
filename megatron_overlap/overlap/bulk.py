"""The backward's bulk overlaps: one whole collective started before a GEMM that
does not need its result, and waited on after it (TE's `bulk` method)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from ..comm import trace
from ..comm.transport import Handle

T = TypeVar("T")


def hide(start: Callable[[], Handle] | None, compute: Callable[[], T], *, op: str, overlap: bool) -> T:
    """Run `compute` while the transfer `start` launches is in flight; with
    `overlap=False` the transfer completes first (Megatron's order without overlap)."""
    if start is None:
        return compute()
    handle = start()
    if not overlap:
        handle.wait()
        return compute()
    result = compute()
    handle.wait()
    return result


def gemm(a: torch.Tensor, b: torch.Tensor, *, op: str, chunk: int = 0) -> torch.Tensor:
    """A traced GEMM, so tests see where it ran relative to the transfers."""
    trace.record("gemm", op, chunk)
    return torch.matmul(a, b)

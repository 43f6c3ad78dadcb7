"""The backward's bulk overlaps: one whole collective started before a GEMM that
does not need its result, and waited on after it (TE's `bulk` method)."""

from __future__ import annotations

from typing import Callable, TypeVar

from ..comm.transport import Handle

T = TypeVar("T")


def hide(start: Callable[[], Handle] | None, compute: Callable[[], T], *, overlap: bool) -> T:
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

"""The backward's bulk overlaps: one whole collective started before a GEMM that
does not need its result, and waited on after it (TE's `bulk` method)."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from ..comm.transport import Handle
from .streams import beside

T = TypeVar("T")


def hide(start: Callable[[], Handle] | None, compute: Callable[[], T], *, overlap: bool,
         landed: Optional[Callable[[], object]] = None) -> T:
    """Run `compute` while the transfer `start` launches is in flight; with
    `overlap=False` the transfer completes first (Megatron's order without overlap).
    `landed`: work on what the transfer brought (the gathered input's transposed copy
    for the wgrad), run beside `compute` once the transfer has landed (`streams.beside`)."""
    if start is None:
        with beside(landed):
            return compute()
    handle = start()
    if not overlap:
        handle.wait()
        with beside(landed):
            return compute()
    with beside(landed, handle.wait):
        return compute()

"""How a transport lays out a pass's workspaces: one bump allocator over byte buffers,
restarted at every pass, that grows to the largest pass seen.

The symmetric-heap transports (`symm`, `nvshmem`) carve their workspaces this way, and
`null` does too, so that what a layer keeps on `null` (the compute-side benchmarks'
transport) is what it keeps on a heap: the largest pass's workspaces, not one buffer per
workspace call. A pass's workspaces never overlap each other; the next pass reuses the
same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .transport import CommError

ALIGN = 256
MIN_GROWTH = 2 << 20  # a growth's granularity (bytes) at the least


def grown_size(need: int, frees: bool) -> int:
    """Bytes of the allocation a heap grows to for a pass that needs `need`: the next
    power of two where outgrown allocations are kept (growths double, so the kept ones
    sum to less than the newest), else `need` rounded up to 1/8 to 1/16 of its power of
    two (and to `MIN_GROWTH`): at most 1/8 more than needed."""
    if not frees:
        return 1 << max(need - 1, 1).bit_length()
    step = max(1 << max(need.bit_length() - 4, 0), MIN_GROWTH)
    return -(-need // step) * step


@dataclass
class Buffer:
    local: torch.Tensor  # uint8: this rank's part of one (symmetric) allocation
    handle: object = None  # backend-specific (torch's _SymmetricMemory; None for nvshmem, null)
    base: int = 0  # bytes from the start of what `handle` maps to `local` (a pool segment's block)

    def holds(self, t: torch.Tensor) -> bool:
        start = self.local.data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + self.local.numel()


class Bump:
    """The carving state: `bufs` (the newest last), where the next workspace starts in
    it, the bytes this pass carved so far and the growths made (the workspaces'
    generation). The owner decides when and how to grow (`fits`, `grow`) and when to
    release outgrown buffers (`bufs[:-1]`)."""

    def __init__(self) -> None:
        self.bufs: list[Buffer] = []
        self.offset = 0  # into bufs[-1]
        self.used = 0  # bytes this pass carved, across growths: what a growth must hold
        self.growths = 0
        # the views handed out from bufs[-1], by (offset, shape, dtype): the same pass
        # asks for the same ones every step, and a view costs microseconds of host time
        self._views: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def size(shape: Sequence[int], dtype: torch.dtype) -> int:
        """What a workspace of `shape` and `dtype` takes, aligned."""
        return -(-(math.prod(shape) * dtype.itemsize) // ALIGN) * ALIGN

    def restart(self) -> None:
        """A new pass: carve from the start of the newest buffer again."""
        self.offset = self.used = 0

    def fits(self, size: int) -> bool:
        return bool(self.bufs) and self.offset + size <= self.bufs[-1].local.numel()

    def grow(self, buf: Buffer) -> None:
        """Carve from `buf` on (its size: `grown_size(used + size, ...)`): the workspaces
        this pass already has stay where they are, in the outgrown buffer."""
        self.bufs.append(buf)
        self.growths += 1
        self.offset = 0
        self._views.clear()

    def take(self, shape: Sequence[int], dtype: torch.dtype, size: int | None = None
             ) -> torch.Tensor:
        """The next workspace (after `fits`, or a `grow`); `size`: `size(shape, dtype)`."""
        key = (self.offset, tuple(shape), dtype)
        view = self._views.get(key)
        if view is None:
            nbytes = math.prod(key[1]) * dtype.itemsize
            view = self._views[key] = (
                self.bufs[-1].local[self.offset:self.offset + nbytes].view(dtype).view(key[1]))
        size = self.size(key[1], dtype) if size is None else size
        self.offset += size
        self.used += size
        return view

    def carve(self, shape: Sequence[int], dtype: torch.dtype, alloc: Callable[[int], Buffer],
              frees: bool, capturing: Callable[[], bool], who: Callable[[], str]) -> torch.Tensor:
        """The next workspace, the heap grown first where it does not fit: to
        `grown_size(used + size, frees)` bytes from `alloc`, never inside a CUDA-graph
        capture (`capturing`), which is refused naming `who()` (the transport, the pass)."""
        size = self.size(shape, dtype)
        if not self.fits(size):
            if capturing():
                held = self.bufs[-1].local.numel() if self.bufs else 0
                raise CommError(f"{who()} needs {self.used + size} workspace bytes, more than the "
                                f"{held} held, during CUDA-graph capture; run the layer once "
                                f"eagerly with the largest token count before capturing")
            self.grow(alloc(grown_size(self.used + size, frees)))
        return self.take(shape, dtype, size)

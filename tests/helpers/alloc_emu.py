"""Pass replay (`overlap.replay`) on CPU, with the addresses the CUDA caching allocator
would give: whether a layer's pass signatures recur step after step, which is what
decides capture and replay on a GPU, depends on where the allocator puts the tensors a
pass's caller allocates (its outputs, an FP8 forward's FP8 input, weight and scales).
CPU malloc says nothing about that, so every tensor storage made under `Tracker` is
placed by `CachingAllocator`, an emulation of the CUDA caching allocator's placement
(c10/cuda/CUDACachingAllocator.cpp): sizes rounded up to 512 bytes; the small pool
(<= 1 MiB) carved from 2 MiB segments, the large pool from 20 MiB ones (or the size
rounded to 2 MiB); best fit, the smallest free block that fits, the lowest address among
equal sizes; split at the front; merged with free neighbours when freed. One stream,
no record_stream (the library uses none).

`emulated_replay(tracker)` makes `PassGraphs` run on CPU with those addresses: a pass
whose signature is seen a second time is 'captured' and later 'replayed' as on a GPU
(the body still runs, so the ranks' transfers happen), and what a captured or replayed
pass allocates inside goes to the graph pool, never to the emulated allocator, as a
graph's scratch does."""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SMALL, SMALL_SEGMENT, MIN_BLOCK = 1 << 20, 2 << 20, 512


class CachingAllocator:
    """Where the CUDA caching allocator would put each allocation (addresses only)."""

    def __init__(self):
        self.blocks: dict[int, list] = {}  # ptr -> [size, free, prev ptr, next ptr, small pool]
        self._next_segment = 1 << 32

    def _segment(self, size: int, small: bool) -> int:
        seg = (SMALL_SEGMENT if small else 20 << 20 if size < 10 << 20
               else -(-size // SMALL_SEGMENT) * SMALL_SEGMENT)
        ptr, self._next_segment = self._next_segment, self._next_segment + seg + (1 << 24)
        self.blocks[ptr] = [seg, True, None, None, small]
        return ptr

    def alloc(self, nbytes: int) -> int:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL
        fits = [(b[0], p) for p, b in self.blocks.items() if b[1] and b[4] == small and b[0] >= size]
        ptr = min(fits)[1] if fits else self._segment(size, small)
        b = self.blocks[ptr]
        rest = b[0] - size
        if rest >= MIN_BLOCK if small else rest > SMALL:  # split: the allocation takes the front
            self.blocks[ptr + size] = [rest, True, ptr, b[3], small]
            if b[3] is not None:
                self.blocks[b[3]][2] = ptr + size
            b[0], b[3] = size, ptr + size
        b[1] = False
        return ptr

    def free(self, ptr: int) -> None:
        b = self.blocks[ptr]
        b[1] = True
        if b[3] is not None and self.blocks[b[3]][1]:  # merge the next block
            nxt = self.blocks.pop(b[3])
            b[0], b[3] = b[0] + nxt[0], nxt[3]
            if nxt[3] is not None:
                self.blocks[nxt[3]][2] = ptr
        if b[2] is not None and self.blocks[b[2]][1]:  # merge into the previous block
            prev = self.blocks[b[2]]
            prev[0], prev[3] = prev[0] + b[0], b[3]
            if b[3] is not None:
                self.blocks[b[3]][2] = b[2]
            del self.blocks[ptr]


class Tracker(TorchDispatchMode):
    """Inside it, every new tensor storage is placed by a `CachingAllocator` (and freed
    there when the storage dies). `device`: False while making what stays off the device
    (results kept on the host); `graph_pool`: True while a captured or replayed pass runs."""

    def __init__(self):
        super().__init__()
        self.allocator, self.device, self.graph_pool = CachingAllocator(), True, False
        self._at: dict[int, int | None] = {}  # id of a live storage -> its emulated address

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    if s.nbytes() and id(s) not in self._at:
                        self._at[id(s)] = None if self.graph_pool else self.allocator.alloc(s.nbytes())
                        weakref.finalize(s, self._free, id(s))
        return out

    def _free(self, key: int) -> None:
        ptr = self._at.pop(key, None)
        if ptr is not None:
            self.allocator.free(ptr)

    def address(self, t: torch.Tensor) -> int:
        """`t`'s emulated address (its real one when made outside the tracker)."""
        s = t.untyped_storage()
        base = self._at.get(id(s))
        return t.data_ptr() if base is None else base + (t.data_ptr() - s.data_ptr())


class _StandIn:
    def replay(self) -> None:
        pass


@contextlib.contextmanager
def emulated_replay(tracker: Tracker) -> Iterator[None]:
    """PassGraphs on CPU with `tracker`'s addresses (the module docstring)."""
    from megatron_overlap.overlap import replay

    P = replay.PassGraphs
    saved = replay._signature, P._usable, P._capture, P.run
    run = P.run

    def signature(tp, tensors):
        return (replay._token(tp), tp.generation) + tuple(
            None if t is None else (tracker.address(t), t.shape, t.stride(), t.dtype) for t in tensors)

    def capture(self, tp, body):
        self.captures += 1
        return replay._Graph(_StandIn(), (), (), "")

    def graphed_run(self, tp, body, tensors, static=()):
        key = self._key(tp, tensors, static)
        graphed = (self.failed is None and self._usable(tp, tensors)
                   and (key in self._graphs or self._seen.get(key, 0) + 1 >= self.capture_after))
        if not graphed:
            return run(self, tp, body, tensors, static)
        run(self, tp, lambda: None, tensors, static)  # counts the capture or the replay
        tracker.graph_pool = True
        try:
            body()  # what the graph would do, its scratch in the graph pool
        finally:
            tracker.graph_pool = False

    replay._signature = signature
    P._usable = lambda self, tp, tensors: replay.enabled() and self.off is None
    P._capture, P.run = capture, graphed_run
    try:
        yield
    finally:
        replay._signature, P._usable, P._capture, P.run = saved

"""`null`: the transport contract with every transfer skipped. Running a schedule
on it gives the schedule's compute side alone (the same chunk GEMMs, order and
waits, with chunks treated as already resident): the floor an overlapped layer
can reach, and what the compute-side benchmark and the tuner measure against one
monolithic GEMM. Never used for training: outputs are not the collective's result.

Its workspaces behave like a real transport's. A real one hands out the same
preallocated buffers call after call (symm) or caching-allocator blocks
(torch_p2p), holding real data. A fresh `torch.empty` per call would add
allocations the real runs do not pay, and all-zero buffers would flatter the
GEMMs (a GPU draws less power on zeros and clocks higher), so each workspace slot
is allocated once, filled with random values, and handed out again at the same
place of every later pass.

`like`: the transport whose compute side this stands for. Its backends are then
this one's, so a pass on it runs under the same streams rule (the SM margin where
that transport's kernels need SMs) as on the real one: the floor of that pass.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .transport import Handle, SendRecv, Transport


class _Done(Handle):
    def wait(self) -> None:
        return None


_DONE = _Done()


class NullTransport(Transport):
    name = "null"
    replayable = True

    def __init__(self, world_size: int, rank: int = 0, seed: int = 0,
                 like: Transport | None = None):
        super().__init__(rank, world_size)
        self._slots: dict[tuple, torch.Tensor] = {}
        self._index = 0
        self._seed = seed
        self._backends = like.backends if like is not None else (self.name,)

    @property
    def backends(self) -> tuple[str, ...]:
        return self._backends

    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        self._index = 0

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        key = (self._index, tuple(shape), dtype, str(device))
        self._index += 1
        if key not in self._slots:
            # drawn in the slot's own dtype where torch can (no float32 copy at twice the
            # size beside it: a real transport's first pass does not allocate one either)
            g = torch.Generator(device=device or "cpu").manual_seed(self._seed + self._index)
            draw = dtype if dtype.is_floating_point and dtype.itemsize >= 2 else torch.bfloat16
            t = torch.randn(tuple(shape), generator=g, dtype=draw, device=device)
            self._slots[key] = t if draw == dtype else t.to(dtype)
        return self._slots[key]

    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        return _DONE

    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle:
        return _DONE

    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

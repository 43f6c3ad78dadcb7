"""`null`: the transport contract with every transfer skipped. Running a schedule
on it gives the schedule's compute side alone (the same chunk GEMMs, order and
waits, with chunks treated as already resident): the floor an overlapped layer
can reach, and what the compute-side benchmark and the tuner measure against one
monolithic GEMM. Never used for training: outputs are not the collective's result.

Its workspaces behave like a heap transport's (`symm`, `nvshmem`): carved in call order
from one buffer per device, restarted at every pass (`bump`), grown to the largest pass
seen, at the size `symm` grows to. So a layer keeps on `null` what it keeps on `symm`
(the compute-side benchmarks report that memory), and a pass reads workspaces that the
previous pass used. A fresh `torch.empty` per call would add allocations the real runs
do not pay, and all-zero buffers would flatter the GEMMs (a GPU draws less power on
zeros and clocks higher), so each buffer is filled with random values when allocated:
normal bf16 values, with the bytes that would read as an FP8 NaN or infinity changed,
so that every dtype a pass views them as holds finite numbers when allocated (later, the
bytes hold whatever the passes wrote, as a heap's do). As on a heap, a growth inside a
CUDA-graph capture is an error, and once a graph not ours has captured a pass (it replays
into the buffers it captured), no outgrown buffer is released.

`like`: the transport whose compute side this stands for. Its backends are then
this one's, so a pass on it runs under the same streams rule (the SM margin where
that transport's kernels need SMs) as on the real one: the floor of that pass.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from .bump import Buffer, Bump
from .transport import Handle, SendRecv, Transport


def _capturing(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_current_stream_capturing()


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
        self._heaps: dict[str, Bump] = {}  # device -> its workspaces
        self._policy: dict[str, tuple] = {}  # device -> how its heap grows (`Bump.carve`'s)
        self._pinned = False  # a capture not ours ran a pass: nothing is released
        self._ours = False  # our pass replay is capturing (`recording_waits`)
        self._seed = seed
        self._backends = like.backends if like is not None else (self.name,)

    @property
    def backends(self) -> tuple[str, ...]:
        return self._backends

    @property
    def why_no_wait(self) -> str:
        return ""  # no transfer (the mirror's copies run before the GEMM, on its stream)

    @property
    def generation(self) -> int:
        return sum(h.growths for h in self._heaps.values())  # a growth moved the workspaces

    @property
    def bytes_held(self) -> int:
        return sum(b.numel() for b in self.buffers())

    def buffers(self) -> list[torch.Tensor]:
        """Every byte buffer held (uint8), the newest of each device last."""
        return [b.local for h in self._heaps.values() for b in h.bufs]

    @contextlib.contextmanager
    def recording_waits(self) -> Iterator[list[str]]:
        self._ours = True  # the capture inside is our pass replay's
        try:
            yield []
        finally:
            self._ours = False

    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        for device, heap in self._heaps.items():
            heap.restart()
            if _capturing(device):
                self._pinned |= not self._ours
            elif len(heap.bufs) > 1 and not self._pinned:
                # the previous pass's work (on any stream) may still use an outgrown buffer
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                del heap.bufs[:-1]

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        key = str(device) if device is not None else "cpu"
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = Bump()
            self._policy[key] = (lambda n: Buffer(self._random_bytes(n, torch.device(key))), True,
                                 lambda: _capturing(key), lambda: f"megatron_overlap[{self.name}]: a pass")
        return heap.carve(shape, dtype, *self._policy[key])

    def _random_bytes(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` (even: a growth's size) of normal bf16 values, no byte an FP8 NaN or
        infinity: e5m2 reads one in every byte whose bits 2-6 are all set (e4m3 in a
        subset of those), which randn's bf16 makes only in mantissa bytes; bit 6 cleared
        there moves a mantissa, no exponent."""
        g = torch.Generator(device=device).manual_seed(self._seed + len(self._heaps) + nbytes)
        raw = torch.randn(nbytes // 2, generator=g, dtype=torch.bfloat16, device=device).view(torch.uint8)
        return raw.sub_(((raw & 0x7C) == 0x7C).to(torch.uint8) * 0x40)

    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        return _DONE

    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle:
        return _DONE

    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

"""`null`: the transport contract with every transfer skipped. Running a schedule
on it gives the schedule's compute side alone (the same chunk GEMMs, order and
waits, with chunks treated as already resident): the floor an overlapped layer
can reach, and what the compute-side benchmark measures against one monolithic
GEMM. Never used for training: outputs are not the collective's result."""

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

    def __init__(self, world_size: int, rank: int = 0):
        super().__init__(rank, world_size)

    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        return _DONE

    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle:
        return _DONE

    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle:
        return _DONE

"""`torch_p2p`: the transport contract on torch.distributed. Batched isend/irecv
for ring steps and torch's async collectives for the rest. NCCL runs them on its
own communication streams (so they overlap the GEMMs on the compute stream);
gloo runs them on its own threads on CPU. Works across nodes and any topology."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .transport import Handle, SendRecv, Transport, as_bytes


class _Works(Handle):
    """torch's works of one transfer. A transfer may be waited on from more than one
    stream (a ring's GEMM stream waits for an arrival, and the per-peer transport waits
    for it again before forwarding it through its other transport), and each waiter's
    stream must be ordered after it. The works are waited on once (a second wait of a
    gloo send or receive waits for another message); on a GPU that wait orders the
    current stream, and an event recorded there right after orders every later waiter's
    stream."""

    def __init__(self, works: Sequence[dist.Work], timeout, cuda: bool = False):
        self._works, self._timeout, self._cuda = list(works), timeout, cuda
        self._done: torch.cuda.Event | bool = False

    def wait(self) -> None:
        if isinstance(self._done, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(self._done)
            return
        if self._done:
            return
        for work in self._works:
            if not work.wait(self._timeout):
                raise TimeoutError(f"no completion within {self._timeout}")
        self._works.clear()
        self._done = True
        if self._cuda:
            self._done = torch.cuda.Event()
            self._done.record()


class _ReduceScatterByAllReduce(Handle):
    """gloo's reduce_scatter_tensor ignores wait(timeout) (a silent peer would hang it);
    its all_reduce honours it. So on CPU: all-reduce a copy, keep this rank's block."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, rank: int, world: int,
                 group: dist.ProcessGroup, timeout):
        self._out, self._rank, self._world = out, rank, world
        self._buf = inp.contiguous().clone()
        self._works = _Works([dist.all_reduce(self._buf, group=group, async_op=True)], timeout)

    def wait(self) -> None:
        self._works.wait()
        if self._buf is not None:
            self._out.copy_(self._buf.chunk(self._world)[self._rank].view_as(self._out))
            self._buf = None


class TorchP2PTransport(Transport):
    name = "torch_p2p"

    def __init__(self, group: dist.ProcessGroup, timeout=None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self.group = group
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]

    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        ops = [dist.P2POp(dist.isend, as_bytes(t), self._global[p], self.group) for t, p, _ in sends]
        ops += [dist.P2POp(dist.irecv, as_bytes(t), self._global[p], self.group) for t, p in recvs]
        cuda = any(t.is_cuda for t, *_ in (*sends, *recvs))
        return _Works(dist.batch_isend_irecv(ops) if ops else [], self.timeout, cuda)

    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int) -> Handle:
        return _Works([dist.all_gather_into_tensor(as_bytes(out), as_bytes(inp.contiguous()),
                                                   group=self.group, async_op=True)], self.timeout,
                      out.is_cuda)

    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle:
        if inp.device.type == "cpu":  # gloo: bounded by the timeout, see the class
            return _ReduceScatterByAllReduce(out, inp, self.rank, self.world_size, self.group,
                                             self.timeout)
        return _Works([dist.reduce_scatter_tensor(out, inp.contiguous(), group=self.group,
                                                  async_op=True)], self.timeout, out.is_cuda)

    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle:
        return _Works([dist.all_reduce(tensor, group=self.group, async_op=True)], self.timeout,
                      tensor.is_cuda)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "dist_backend": str(dist.get_backend(self.group))}

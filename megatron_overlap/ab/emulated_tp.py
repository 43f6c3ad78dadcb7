"""One process playing one rank of a TP group of `world` ranks, for measuring
a layer's compute side on one GPU (or checking it on a CPU): Megatron and our
layers build and run at that TP size's per-rank dimensions while no peer exists.

Inside `EmulatedTP(world)`:

- Megatron's TP group is an `EmulatedGroup` (size `world`, this process its rank
  `rank`), so every per-rank dimension (heads, ffn and qkv widths, sequence
  shards) is the real one.
- Megatron's TP collectives, the entry points its linears and its sequence-parallel
  mappings call (`dist_all_gather_func`, `dist_reduce_scatter_func` of
  `tensor_parallel.layers` and `.mappings`, `torch.distributed.all_reduce`), run on
  the emulation's `transport` when given the emulated group: the very collectives
  our schedules call. On `NullTransport` they do nothing (what the null transport
  does for our layers: Megatron's arm pays the output allocation it makes itself,
  nothing else); on `MirrorTransport` they compute a defined result.
- Our layers get the same transport (`use`), and the two things they ask the TP
  group (the ranks' agreement on shapes and settings, the topology) are answered
  as `world` identical peers on one node and one P2P domain (the flat ring).

`MirrorTransport` gives both sides one deterministic meaning, so that Megatron's
layer and ours can be checked against each other: every emulated peer holds
exactly this rank's tensors. All-gather tiles the input `world` times;
reduce-scatter returns `world` x this rank's block; all-reduce `world` x the
input; a ring step receives what it sends (every peer forwards the same block).
The ring reduce-scatter has no such meaning (what a peer sends is its partial of
another block than the one this rank sends); it is refused, naming the fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from ..comm import NullTransport, Topology, Transport
from ..comm.transport import Handle, SendRecv


class EmulatedGroup:
    """Megatron's TP group as it sees it (`size()`, `rank()`): `world` ranks, this one
    `rank`. Not a process group: nothing may communicate over it."""

    def __init__(self, world: int, rank: int = 0):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"EmulatedGroup: rank {rank} of {world} ranks is no TP rank")
        self._world, self._rank = world, rank
        self.group_name = f"emulated_tp{world}"

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"EmulatedGroup(world={self._world}, rank={self._rank})"


def _copied(transport: Transport, t: torch.Tensor, done: Handle) -> Handle:
    """The handle of the mirror's copies just enqueued for tensors like `t` on the current
    stream of t's device: waiting orders the waiter's stream after them, as a real
    transfer's handle does (`comm.heap.EventHandle`). A ring's wait runs on the stream
    of the chunk GEMM that reads the block (`overlap.streams`: a side stream with
    `gemm_streams` > 1 or a non-zero `gemm_priority`), not on the one that copied."""
    if not t.is_cuda:
        return done
    from ..comm.heap import EventHandle

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return EventHandle(event, transport)


class MirrorTransport(NullTransport):
    """Every peer holds exactly this rank's tensors (module docstring). For checks
    only: its copies are not what a real transfer costs. They run on the stream that
    starts the transfer; its handle orders the waiter's stream after them."""

    name = "mirror"

    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        for (t, _, dest), (buf, _) in zip(sends, recvs):
            if dest is not t:
                raise NotImplementedError(
                    f"MirrorTransport: '{op}' runs a ring reduce-scatter, whose peers send "
                    f"partials of other blocks than this rank's and so have no mirrored "
                    f"meaning; check it with method "
                    f"pipeline (or bulk) for that pass")
            buf.copy_(t)
        done = super()._start_exchange(sends, recvs, op, chunk)
        return _copied(self, recvs[0][0], done) if recvs else done

    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int) -> Handle:
        for block in out.chunk(self.world_size):
            block.copy_(inp.reshape(block.shape))
        return _copied(self, out, super()._start_all_gather(out, inp, op, chunk))

    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle:
        out.copy_(inp.chunk(self.world_size)[self.rank].reshape(out.shape)).mul_(self.world_size)
        return _copied(self, out, super()._start_reduce_scatter(out, inp, op, chunk))

    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle:
        tensor.mul_(self.world_size)
        return _copied(self, tensor, super()._start_all_reduce(tensor, op, chunk))


class EmulatedTP(contextlib.AbstractContextManager):
    """The emulation (module docstring); needs torch.distributed and Megatron's
    parallel state initialised (one process: a world of 1 and TP 1), which it
    changes on entry and restores on exit."""

    def __init__(self, world: int, rank: int = 0, transport: Transport | None = None):
        self.world, self.rank = world, rank
        self.group = EmulatedGroup(world, rank)
        self.transport: Transport = transport or NullTransport(world, rank)
        self._undo: list[tuple[Any, str, Any]] = []

    # -- what runs on the transport ------------------------------------------------
    def use(self, transport: Transport, modules: Iterable[torch.nn.Module] = ()) -> None:
        """Megatron's collectives, and every overlapped linear in `modules`, run on
        `transport` from now on."""
        if (transport.world_size, transport.rank) != (self.world, self.rank):
            raise ValueError(f"EmulatedTP: a transport for rank {transport.rank} of "
                             f"{transport.world_size} in an emulated TP group where this is rank "
                             f"{self.rank} of {self.world}")
        self.transport = transport
        for root in modules:
            for m in root.modules():
                if hasattr(m, "overlap_plan"):
                    m._transport = transport

    def _all_gather(self, original):
        def all_gather(output, input_, group=None, async_op=False, **kw):
            if group is not self.group:
                return original(output, input_, group=group, async_op=async_op, **kw)
            h = self.transport.all_gather(output, input_, op="megatron_all_gather")
            return h if async_op else h.wait()
        return all_gather

    def _reduce_scatter(self, original):
        def reduce_scatter(output, input_, op=dist.ReduceOp.SUM, group=None, async_op=False, **kw):
            if group is not self.group:
                return original(output, input_, op=op, group=group, async_op=async_op, **kw)
            h = self.transport.reduce_scatter(output, input_, op="megatron_reduce_scatter")
            return h if async_op else h.wait()
        return reduce_scatter

    def _all_reduce(self, original):
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, **kw):
            if group is not self.group:
                return original(tensor, op=op, group=group, async_op=async_op, **kw)
            h = self.transport.all_reduce(tensor, op="megatron_all_reduce")
            return h if async_op else h.wait()
        return all_reduce

    def _agree(self, original):
        def all_gather_object(obj, group, what, timeout=None):
            return [obj] * self.world if group is self.group else original(obj, group, what, timeout)
        return all_gather_object

    def _topology(self, original):
        flat = Topology(self.rank, (0,) * self.world, (0,) * self.world, tuple(range(self.world)))

        def topology(group, device=None):
            return flat if group is self.group else original(group, device)
        return topology

    # -- entering and leaving ------------------------------------------------------
    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "EmulatedTP":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import layers, mappings

        from .. import comm
        from ..layers import agree

        if not dist.is_initialized() or parallel_state.get_tensor_model_parallel_group(
                check_initialized=False) is None:
            raise RuntimeError("EmulatedTP needs torch.distributed and Megatron's parallel state "
                               "initialised first (a world of 1: initialize_model_parallel(1))")
        self._set(parallel_state, "_TENSOR_MODEL_PARALLEL_GROUP", self.group)
        for name in ("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK"):
            self._set(parallel_state, name, None)  # the getters then ask the group
        for mod in (layers, mappings):
            self._set(mod, "dist_all_gather_func", self._all_gather(mod.dist_all_gather_func))
            self._set(mod, "dist_reduce_scatter_func",
                      self._reduce_scatter(mod.dist_reduce_scatter_func))
        self._set(dist, "all_reduce", self._all_reduce(dist.all_reduce))
        self._set(agree, "all_gather_object", self._agree(agree.all_gather_object))
        self._set(comm, "topology", self._topology(comm.topology))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)

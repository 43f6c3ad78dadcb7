"""`nvshmem`: the transport contract on NVSHMEM (nvshmem4py), inside a node and
across nodes. Every transfer is a host-initiated put-with-signal on a CUDA stream
into the peer's symmetric heap (NVSHMEM moves it on copy engines between P2P
peers and through its proxy and the NIC across nodes); the receiver waits for the
signal on its communication stream, and the GEMM stream waits on that.

- Bootstrap: the torch process group. Rank 0 of the TP group makes NVSHMEM's unique
  id and broadcasts it over the group: no MPI. One NVSHMEM job per process, whose
  PEs are the TP group's ranks (a process is in one TP group).
- Workspaces, growth, streams and the watchdog: `heap.HeapTransport`.
- Signals: one slot per (channel, source rank, sequence number in the pass), set to
  1 by the put and waited for with "== 1". Every slot is used once per pass and all
  are zeroed at `begin_pass`, before NVSHMEM's on-stream barrier, so the values are
  the same at every call: CUDA-graph replays need nothing else.
- Collectives push (put to every peer, then sum or copy locally in rank order),
  because a remote peer's memory cannot be read with a plain copy.
- Sources that are not in the heap are staged into it first: remote (InfiniBand)
  puts need registered memory, and every rank makes the same staging decision, so
  the workspace layout stays symmetric.
- NVSHMEM's waits have no device-side timeout: a wait the watchdog cannot release
  ends the process with the diagnosis (see `watchdog`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .heap import Buffer, HeapTransport
from .transport import CommError, Handle, Peer, SendRecv

EXCHANGE, COLLECTIVE = 0, 1  # signal channels
MAX_SEQ = 256  # transfers per (channel, peer) in one pass
_runtime: dict[str, object] = {}  # the process's NVSHMEM job: {"group": ..., "transports": n}


def _modules():
    try:
        import nvshmem.bindings as nb
        import nvshmem.core as core
    except ImportError as exc:
        raise ImportError(
            "megatron_overlap: backend 'nvshmem' needs nvshmem4py: pip install nvshmem4py-cu13 "
            "(or -cu12, matching your CUDA), which brings cuda-core; or pick backend='symm' / "
            "'torch_p2p'") from exc
    return core, nb


def _init_runtime(group: dist.ProcessGroup, device: torch.device) -> None:
    """Start NVSHMEM once per process over `group`'s ranks (unique id over torch)."""
    if _runtime:
        if _runtime["group"] is not group:
            raise CommError(
                "megatron_overlap[nvshmem]: NVSHMEM already runs over another process group in "
                "this process; one NVSHMEM job per process, over its TP group: build every "
                "nvshmem layer of this process on the same TP group")
        return
    import numpy as np
    from cuda.core import Device

    core, _ = _modules()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    uid = core.get_unique_id(empty=rank != 0)
    from .exchange import broadcast_object

    raw = broadcast_object(uid._data.view(np.int8).tobytes(), 0, group, "NVSHMEM unique id")
    if rank:
        uid._data.view(np.int8)[:] = np.frombuffer(raw, dtype=np.int8)
    dev = Device(device.index if device.index is not None else torch.cuda.current_device())
    dev.set_current()
    core.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
    _runtime.update(group=group, transports=0)


class NvshmemTransport(HeapTransport):
    name = "nvshmem"
    frees_outgrown = False  # nvshmem_free is collective over every PE of the job, not one group

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout=None,
                 initial_bytes: int = 1 << 20):
        super().__init__(group, device, timeout)
        self._watchdog.abort_after_s = max(2.0, 0.5 * self.timeout.total_seconds())
        self._core, self._nb = _modules()
        _init_runtime(group, self.device)
        _runtime["transports"] = int(_runtime["transports"]) + 1
        self._closed = False
        self._tensors: list[torch.Tensor] = []  # every allocation, for close()
        self._sig = self._alloc(2 * self.world_size * MAX_SEQ * 8).local.view(torch.int64).view(
            2, self.world_size, MAX_SEQ)
        self._bufs.append(self._alloc(initial_bytes))
        self._sent: dict[int, int] = {}
        self._got: dict[int, int] = {}
        self._coll = 0

    # -- contract extras ---------------------------------------------------------------------
    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        super().begin_pass(name, comm_priority)
        self._sent.clear()
        self._got.clear()
        self._coll = 0
        stream = torch.cuda.current_stream()
        # Every slot used last pass was waited for (the caller's stream is ordered after
        # those waits), so zeroing them loses nothing; peers put again only after the barrier.
        self._sig.zero_()
        self._nb.barrier_all_on_stream(stream.cuda_stream)
        self._watch(stream, f"the barrier starting '{name}'", None)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "pes": self.world_size}

    def close(self) -> None:
        """Free this transport's symmetric memory and, with the process's last one, end
        the NVSHMEM job. Collective: every rank of the group calls it."""
        if self._closed:
            return
        torch.cuda.synchronize(self.device)
        for t in self._tensors:
            self._core.interop.torch.free_tensor(t)
        self._tensors.clear()
        self._bufs.clear()
        self._closed = True
        _runtime["transports"] = int(_runtime["transports"]) - 1
        if _runtime["transports"] == 0:
            self._core.finalize()
            _runtime.clear()

    # -- the four transfers ------------------------------------------------------------------
    def _start_exchange(self, sends: Sequence[tuple[torch.Tensor, Peer, torch.Tensor]],
                        recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        for t, _ in recvs:
            self._locate(t, op, "receive buffer")
        for _, _, dst in sends:
            self._locate(dst, op, "send destination")
        staged = [(self._stage_for(t), t) for t, _, _ in sends]
        with self._on_comm_stream() as stream:
            for (src, t), (_, peer, dst) in zip(staged, sends):
                if src is not t:
                    src.copy_(t)
                self._put(dst, src, peer, EXCHANGE, self._next(self._sent, peer, op), stream)
            for _, peer in recvs:
                self._wait(peer, EXCHANGE, self._next(self._got, peer, op), stream,
                           f"'{op}' chunk {chunk} from rank {peer}")
            return self._event(stream)

    def _start_all_gather(self, out, inp, op, chunk) -> Handle:
        recv = self.workspace((self.world_size, *inp.shape), inp.dtype)
        seq = self._collective(op)
        with self._on_comm_stream() as stream:
            recv[self.rank].copy_(inp)
            self._push(lambda p: (recv[self.rank], recv[self.rank]), seq, stream)
            self._wait_all(seq, stream, op, chunk)
            out.copy_(recv.view(out.shape))
            return self._event(stream)

    def _start_reduce_scatter(self, out, inp, op, chunk) -> Handle:
        rows = out.shape[0]
        src = self._stage_for(inp)
        recv = self.workspace((self.world_size, *out.shape), out.dtype)
        seq = self._collective(op)
        with self._on_comm_stream() as stream:
            if src is not inp:
                src.copy_(inp)
            self._push(lambda p: (recv[self.rank], src[p * rows:(p + 1) * rows]), seq, stream)
            self._wait_all(seq, stream, op, chunk)
            own = src[self.rank * rows:(self.rank + 1) * rows]
            self._sum_into(out, lambda p: own if p == self.rank else recv[p])
            return self._event(stream)

    def _start_all_reduce(self, tensor, op, chunk) -> Handle:
        src = self.workspace(tensor.shape, tensor.dtype)
        recv = self.workspace((self.world_size, *tensor.shape), tensor.dtype)
        seq = self._collective(op)
        with self._on_comm_stream() as stream:
            src.copy_(tensor)
            self._push(lambda p: (recv[self.rank], src), seq, stream)
            self._wait_all(seq, stream, op, chunk)
            self._sum_into(tensor, lambda p: src if p == self.rank else recv[p])
            return self._event(stream)

    # -- helpers -----------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> Buffer:
        local = self._core.interop.torch.bytetensor((nbytes,), except_on_del=False)
        local.zero_()
        # every PE's zero before any put into it: a peer ahead in the same pass (a heap
        # grown mid-pass) would otherwise put into the new allocation before this zero runs.
        # Its first put comes from its communication stream, which is ordered after the
        # stream that grew the heap (`_on_comm_stream`), so after this barrier there.
        stream = torch.cuda.current_stream(self.device)
        self._nb.barrier_all_on_stream(stream.cuda_stream)
        self._watch(stream, f"the barrier after allocating {nbytes} bytes", None)
        self._tensors.append(local)
        return Buffer(local)

    def _next(self, counters: dict[int, int], peer: int, op: str) -> int:
        seq = counters.get(peer, 0)
        if seq >= MAX_SEQ:
            raise CommError(f"megatron_overlap[nvshmem]: '{op}': more than {MAX_SEQ} transfers "
                            f"with rank {peer} in one layer pass; call begin_pass per pass")
        counters[peer] = seq + 1
        return seq

    def _collective(self, op: str) -> int:
        self._coll += 1
        if self._coll > MAX_SEQ:
            raise CommError(f"megatron_overlap[nvshmem]: '{op}': more than {MAX_SEQ} "
                            f"collectives in one layer pass")
        return self._coll - 1

    def _put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, channel: int, seq: int,
             stream: torch.cuda.Stream) -> None:
        """`src` into `dst`'s place in `peer`'s heap, then slot (channel, me, seq) there := 1."""
        slot = self._sig[channel, self.rank, seq]
        self._nb.putmem_signal_on_stream(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                                         slot.data_ptr(), 1, self._nb.Signal_op.SIGNAL_SET, peer,
                                         stream.cuda_stream)

    def _wait(self, peer: int, channel: int, seq: int, stream: torch.cuda.Stream, what: str) -> None:
        slot = self._sig[channel, peer, seq]
        self._nb.signal_wait_until_on_stream(slot.data_ptr(), self._nb.Cmp_type.CMP_EQ, 1,
                                             stream.cuda_stream)
        self._watch(stream, what, slot)

    def _push(self, parts, seq: int, stream: torch.cuda.Stream) -> None:
        """For every peer p: parts(p) = (destination, source); put source there."""
        for p in range(self.world_size):
            if p != self.rank:
                dst, src = parts(p)
                self._put(dst, src, p, COLLECTIVE, seq, stream)

    def _wait_all(self, seq: int, stream: torch.cuda.Stream, op: str, chunk: int) -> None:
        for p in range(self.world_size):
            if p != self.rank:
                self._wait(p, COLLECTIVE, seq, stream, f"'{op}' chunk {chunk} from rank {p}")

    def _watch(self, stream: torch.cuda.Stream, what: str, slot: torch.Tensor | None) -> None:
        def release() -> None:  # set the slot the stuck wait polls, from a side stream
            if slot is not None:
                with torch.cuda.stream(torch.cuda.Stream(device=self.device)):
                    slot.fill_(1)
        self._watchdog.watch(stream, f"rank {self.rank}/{self.world_size} waited for {what}",
                             release)

"""`symm`: the transport contract on torch symmetric memory, the role TE's
Userbuffers plays. Every rank of the TP group maps every peer's buffer, so a
transfer is a plain device-to-device copy into the peer's buffer (a copy engine
does it: no SMs taken from the GEMM) followed by a signal the peer waits on.

- Workspaces: one symmetric buffer per transport, carved by a bump allocator that
  restarts at every `begin_pass`; the same call sequence gives the same layout on
  every rank, so a send's destination is "the same place in the peer's buffer".
  It grows (collectively: all ranks see the same shapes) to the largest pass seen,
  so shorter sequences need no new allocation; outgrown buffers are kept, never
  freed under a peer's copy.
- Ring exchange: push. Copy into the peer's workspace, `put_signal`; the receiver
  `wait_signal`s on the communication stream, and the GEMM stream waits on that.
- Bulk all-gather / reduce-scatter / all-reduce: pull. Stage into the workspace,
  barrier, read the peers' workspaces (copies for gathers, adds for reductions).
- Every device wait is watched by a host thread (`watchdog`); a peer that never
  signals becomes a CommError naming rank, pass, chunk and peer. Bootstrap is the
  torch process group (no MPI). Intra-node only: one NVLink / P2P domain.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .transport import CommError, Handle, Peer, SendRecv, Transport
from .watchdog import Watchdog

PASS_BARRIER, BULK_BARRIER, EXCHANGE = 0, 1, 2  # signal-pad channels
_ALIGN = 256


def _symm():
    import torch.distributed._symmetric_memory as symm_mem
    return symm_mem


@dataclass
class _Buffer:
    local: torch.Tensor  # uint8, this rank's part of a symmetric allocation
    handle: object  # torch _SymmetricMemory

    def holds(self, t: torch.Tensor) -> bool:
        start = self.local.data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + self.local.numel()


class _Event(Handle):
    def __init__(self, event: torch.cuda.Event, transport: "SymmTransport"):
        self._event, self._transport = event, transport

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)
        self._transport.check()


class SymmTransport(Transport):
    name = "symm"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout=None,
                 initial_bytes: int = 1 << 20):
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self.group, self.device = group, torch.device(device)
        self._failure: str | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._priority = 0
        self._bufs: list[_Buffer] = []
        self._offset = 0  # bump pointer into the newest buffer
        self._pass, self._pass_bytes = "", 0
        self.pass_bytes: dict[str, int] = {}  # high-water workspace bytes per layer pass
        self._watchdog = Watchdog(self.timeout.total_seconds(), self._fail)
        # Device-side backstop for a dead host: a trap, long after the watchdog.
        # torch reads this argument as microseconds (its message says so).
        self._device_timeout_ms = int((self.timeout.total_seconds() * 4 + 10) * 1e6)
        self._signals = self._alloc(_ALIGN)  # signal pads and barriers live here
        self._bufs.append(self._alloc(initial_bytes))

    # -- contract extras ---------------------------------------------------------------------
    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        self.check()
        self._offset, self._pass, self._pass_bytes = 0, name, 0
        self._priority = comm_priority
        # Every peer is past its previous pass (and its reads of our workspace) once this
        # barrier passes on the compute stream; copies of this pass are ordered after it.
        self._barrier(PASS_BARRIER, torch.cuda.current_stream(), f"the barrier starting '{name}'")

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = -(-nbytes // _ALIGN) * _ALIGN
        buf = self._bufs[-1]
        if self._offset + size > buf.local.numel():
            if torch.cuda.is_current_stream_capturing():
                raise CommError(
                    f"megatron_overlap[symm]: rank {self.rank}: '{self._pass}' needs "
                    f"{self._pass_bytes + size} workspace bytes, more than the "
                    f"{buf.local.numel()} held, during CUDA-graph capture; run the layer "
                    f"once eagerly with the largest token count before capturing")
            buf = self._alloc(1 << max(self._pass_bytes + size - 1, 1).bit_length())
            self._bufs.append(buf)
            self._offset = 0
        view = buf.local[self._offset:self._offset + nbytes].view(dtype).view(tuple(shape))
        self._offset += size
        self._pass_bytes += size
        self.pass_bytes[self._pass] = max(self.pass_bytes.get(self._pass, 0), self._pass_bytes)
        return view

    def check(self) -> None:
        if self._failure is not None:
            raise CommError(f"megatron_overlap[symm]: {self._failure}. A peer may have crashed, "
                            f"run a different schedule, or be slower than "
                            f"MEGATRON_OVERLAP_TIMEOUT_S={self.timeout.total_seconds():g}s")

    @property
    def bytes_held(self) -> int:
        return sum(b.local.numel() for b in self._bufs)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "buffer_bytes": self.bytes_held, "device": str(self.device)}

    # -- the four transfers ------------------------------------------------------------------
    def _start_exchange(self, sends: Sequence[tuple[torch.Tensor, Peer, torch.Tensor]],
                        recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        sig = self._signals.handle
        for t, _ in recvs:
            self._locate(t, op, "receive buffer")
        with self._on_comm_stream() as stream:
            for t, peer, dst in sends:
                self._remote(dst, peer, op).copy_(t)
                sig.put_signal(peer, EXCHANGE, self._device_timeout_ms)
            for _, peer in recvs:
                sig.wait_signal(peer, EXCHANGE, self._device_timeout_ms)
                self._watch(stream, f"'{op}' chunk {chunk} from rank {peer}", EXCHANGE, [peer])
            return self._event(stream)

    def _start_all_gather(self, out, inp, op, chunk) -> Handle:
        stage = self._stage_for(inp)
        rows = inp.shape[0]
        with self._staged(stage, inp, op, chunk) as stream:
            for p in range(self.world_size):
                out[p * rows:(p + 1) * rows].copy_(self._remote(stage, p, op))
            return self._event(stream)

    def _start_reduce_scatter(self, out, inp, op, chunk) -> Handle:
        stage = self._stage_for(inp)
        rows = out.shape[0]
        with self._staged(stage, inp, op, chunk) as stream:
            self._sum_into(out, lambda p: self._remote(stage, p, op)[self.rank * rows:(self.rank + 1) * rows])
            return self._event(stream)

    def _start_all_reduce(self, tensor, op, chunk) -> Handle:
        stage = self.workspace(tensor.shape, tensor.dtype)
        with self._staged(stage, tensor, op, chunk) as stream:
            self._sum_into(tensor, lambda p: self._remote(stage, p, op))
            return self._event(stream)

    # -- helpers -----------------------------------------------------------------------------
    def _stage_for(self, inp: torch.Tensor) -> torch.Tensor:
        """Where peers read `inp` from: itself when a schedule already wrote it into the
        workspace (a pipeline's chunk GEMM output: no staging copy), else a new slot."""
        if inp.is_contiguous() and any(b.holds(inp) for b in self._bufs):
            return inp
        return self.workspace(inp.shape, inp.dtype)

    def _sum_into(self, out: torch.Tensor, part) -> None:
        """Sum in rank order on every rank, so all ranks get bit-identical results."""
        out.copy_(part(0))
        for p in range(1, self.world_size):
            out.add_(part(p))

    def _alloc(self, nbytes: int) -> _Buffer:
        symm_mem = _symm()
        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        local.zero_()
        return _Buffer(local, symm_mem.rendezvous(local, self.group.group_name))

    def _locate(self, t: torch.Tensor, op: str, what: str) -> tuple[_Buffer, int]:
        for buf in self._bufs:
            if buf.holds(t):
                if not t.is_contiguous():
                    break
                return buf, t.data_ptr() - buf.local.data_ptr()
        raise CommError(f"megatron_overlap[symm]: '{op}': the {what} is not a contiguous "
                        f"workspace tensor; schedules must take it from transport.workspace()")

    def _remote(self, t: torch.Tensor, peer: int, op: str) -> torch.Tensor:
        """The tensor at `t`'s place in `peer`'s part of the same symmetric buffer."""
        if peer == self.rank:
            return t
        buf, offset = self._locate(t, op, "send destination")
        return buf.handle.get_buffer(peer, tuple(t.shape), t.dtype, offset // t.element_size())

    def _comm_stream(self) -> torch.cuda.Stream:
        lo, hi = torch.cuda.Stream.priority_range()  # numerically lower = more urgent
        prio = min(max(self._priority, hi), lo)
        if prio not in self._streams:
            self._streams[prio] = torch.cuda.Stream(device=self.device, priority=prio)
        return self._streams[prio]

    @contextlib.contextmanager
    def _on_comm_stream(self) -> Iterator[torch.cuda.Stream]:
        """Enqueue on the communication stream, after what the caller's stream has so far."""
        stream = self._comm_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield stream

    @contextlib.contextmanager
    def _staged(self, stage: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                ) -> Iterator[torch.cuda.Stream]:
        """Copy `inp` into this rank's stage and wait until every peer has too."""
        with self._on_comm_stream() as stream:
            if stage is not inp:
                stage.copy_(inp)
            self._barrier(BULK_BARRIER, stream, f"'{op}' chunk {chunk} (staging barrier)")
            yield stream

    def _barrier(self, channel: int, stream: torch.cuda.Stream, what: str) -> None:
        with torch.cuda.stream(stream):
            self._signals.handle.barrier(channel, self._device_timeout_ms)
        self._watch(stream, what, channel, [p for p in range(self.world_size) if p != self.rank])

    def _event(self, stream: torch.cuda.Stream) -> Handle:
        event = torch.cuda.Event()
        event.record(stream)
        return _Event(event, self)

    def _watch(self, stream, what: str, channel: int, peers: list[int]) -> None:
        def release() -> None:  # set the slots the stuck wait spins on, from a side stream
            pad = self._signals.handle.get_signal_pad(
                self.rank, [(EXCHANGE + 1) * self.world_size], torch.int32)
            with torch.cuda.stream(torch.cuda.Stream(device=self.device)):
                for p in peers:
                    pad[channel * self.world_size + p].fill_(1)
        self._watchdog.watch(stream, f"rank {self.rank}/{self.world_size} waited for {what}",
                             release)

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message

"""`symm`: the transport contract on torch symmetric memory, the role TE's
Userbuffers plays. Every rank of the TP group maps every peer's buffer, so a
transfer is a plain device-to-device copy into the peer's buffer (a copy engine
does it: no SMs taken from the GEMM) followed by a signal the peer waits on.

- Workspaces, growth, streams and the watchdog: `heap.HeapTransport`.
- Ring exchange: push. Copy into the peer's workspace, `put_signal`; the receiver
  `wait_signal`s on the communication stream, and the GEMM stream waits on that.
- Bulk all-gather / reduce-scatter / all-reduce: pull. Stage into the workspace,
  barrier, read the peers' workspaces (copies for gathers, adds for reductions).
- Bootstrap is the torch process group (no MPI). Intra-node only: one NVLink / P2P
  domain (or ranks sharing one GPU).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .heap import ALIGN, Buffer, HeapTransport
from .transport import CommError, Handle, Peer, SendRecv

PASS_BARRIER, BULK_BARRIER, EXCHANGE = 0, 1, 2  # signal-pad channels


def _symm():
    import torch.distributed._symmetric_memory as symm_mem
    return symm_mem


class SymmTransport(HeapTransport):
    name = "symm"
    replayable = True  # put/wait_signal and barrier keep no host-side state
    frees_outgrown = True  # a dropped allocation is unmapped here; peers' mappings keep theirs

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout=None,
                 initial_bytes: int = 1 << 20):
        super().__init__(group, device, timeout)
        # Device-side backstop: a wait kernel still spinning shortly after the watchdog
        # fired traps. The watchdog's release cannot reach a stuck stream when
        # CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting: one hardware queue, blocked
        # behind the wait), so then the trap turns the hang into a CUDA error, after the
        # watchdog printed the diagnosis. In milliseconds: torch's signal kernels turn the
        # argument into nanoseconds with `timeout_ms * 1e6`.
        timeout_s = self.timeout.total_seconds()
        self._device_timeout_ms = int((timeout_s + max(2.0, 0.5 * timeout_s)) * 1e3)
        self._watchdog.abort_after_s = max(2.0, 0.5 * timeout_s) + 5.0  # if even the trap fails
        self._signals = self._alloc(ALIGN)  # signal pads and barriers live here
        self._bufs.append(self._alloc(initial_bytes))

    # -- contract extras ---------------------------------------------------------------------
    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        super().begin_pass(name, comm_priority)
        # Every peer is past its previous pass (and its reads of our workspace) once this
        # barrier passes on the compute stream; copies of this pass are ordered after it.
        self._barrier(PASS_BARRIER, torch.cuda.current_stream(),
                      f"the barrier starting '{name}' (before chunk 0, with {self._others})")
        self._release_outgrown()

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
    def _alloc(self, nbytes: int) -> Buffer:
        """A symmetric allocation of its own: where torch's `symm_mem.empty` would take it
        from its implicit memory pool, the allocation that function makes without one
        (a pool keeps a freed block cached, never for the device, and could hand ranks
        different blocks). Peer addresses count from the handle's buffer pointer
        (`base`: 0 for an allocation of its own), checked here on this rank's mapping."""
        symm_mem = _symm()
        if getattr(symm_mem, "_should_use_implicit_mempool", None) is not None:
            local = symm_mem._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8,
                                                                self.device)
        else:  # a torch without the pool: empty() allocates on its own
            local = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        local.zero_()
        # done on the device before any peer can map it: rendezvous syncs the hosts only,
        # and a peer ahead in the same pass pushes into the new allocation at once, which
        # a zero still queued behind this rank's work would wipe (growth is rare, never
        # inside a capture: `workspace` refuses it there)
        self._device_sync(torch.cuda.current_stream(self.device))
        handle = symm_mem.rendezvous(local, self.group.group_name)
        base = local.data_ptr() - handle.buffer_ptrs[self.rank]
        mine = (handle.get_buffer(self.rank, (nbytes,), torch.uint8, base).data_ptr()
                if base >= 0 else None)
        if mine != local.data_ptr():
            raise CommError(
                f"megatron_overlap[symm]: rank {self.rank}: torch's symmetric memory maps a "
                f"{nbytes}-byte workspace at {handle.buffer_ptrs[self.rank]:#x} + {base}, not "
                f"where it was allocated ({local.data_ptr():#x}); peers' copies would land "
                "elsewhere. Use another --tp-comm-overlap-backend (torch_p2p)")
        return Buffer(local, handle, base)

    def _remote(self, t: torch.Tensor, peer: int, op: str) -> torch.Tensor:
        """The tensor at `t`'s place in `peer`'s part of the same symmetric buffer, as
        bytes seen in `t`'s dtype (FP8 included: a copy moves bytes alike)."""
        if peer == self.rank:
            return t
        buf, offset = self._locate(t, op, "send destination")
        nbytes = t.numel() * t.element_size()
        return buf.handle.get_buffer(peer, (nbytes,), torch.uint8, buf.base + offset).view(
            t.dtype).view(tuple(t.shape))

    @contextlib.contextmanager
    def _staged(self, stage: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                ) -> Iterator[torch.cuda.Stream]:
        """Copy `inp` into this rank's stage and wait until every peer has too."""
        with self._on_comm_stream() as stream:
            if stage is not inp:
                stage.copy_(inp)
            self._barrier(BULK_BARRIER, stream,
                          f"'{op}' chunk {chunk} (staging barrier with {self._others})")
            yield stream

    def _barrier(self, channel: int, stream: torch.cuda.Stream, what: str) -> None:
        with torch.cuda.stream(stream):
            self._signals.handle.barrier(channel, self._device_timeout_ms)
        self._watch(stream, what, channel, [p for p in range(self.world_size) if p != self.rank])

    @functools.cached_property
    def _others(self) -> str:
        """The peers a barrier waits for, for its diagnosis ('rank 1', 'ranks 0, 2, 3')."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        return f"rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"

    def _watch(self, stream, what: str, channel: int, peers: list[int]) -> None:
        self._watchdog.watch(stream, f"rank {self.rank}/{self.world_size} waited for {what}",
                             lambda: self._release([channel], peers))

    def _release(self, channels: list[int], peers: list[int]) -> None:
        """Set the signal slots a stuck wait spins on, from a side stream."""
        pad = self._signals.handle.get_signal_pad(
            self.rank, [(EXCHANGE + 1) * self.world_size], torch.int32)
        with torch.cuda.stream(torch.cuda.Stream(device=self.device)):
            for channel in channels:
                for p in peers:
                    pad[channel * self.world_size + p].fill_(1)

    def _release_all(self) -> None:
        self._release([PASS_BARRIER, BULK_BARRIER, EXCHANGE],
                      [p for p in range(self.world_size) if p != self.rank])

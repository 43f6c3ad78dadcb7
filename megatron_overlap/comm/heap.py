"""What the symmetric-heap transports (`symm`, `nvshmem`) share: workspaces carved
from symmetric allocations, the per-pass bookkeeping, the communication streams and
the watchdog that turns a wait that never ends into a diagnosis.

- Workspaces: a bump allocator (`bump.Bump`, whose layout `null` shares) over the
  newest symmetric allocation, restarted at every `begin_pass`; the same call sequence
  gives the same layout on every rank, so a send's destination is "the same place in
  the peer's heap". It grows
  (collectively: every rank sees the same shapes) to the largest pass seen, so
  shorter sequences need no new allocation. Growth inside CUDA-graph capture is an
  error. Where the backend can free one allocation alone (`symm`: its own mappings
  unmapped, a peer's kept until that peer lets go), a growth takes what the pass needs
  (`grown_size`: at most 1/8 more) and the outgrown allocations are released at the next
  pass, once its barrier has passed on this rank's device (every peer is done with the
  previous pass) and this rank's device work is done. Not once a CUDA graph not ours has
  captured a pass (Megatron's own graphs: they replay into the addresses they captured,
  and no generation tells them the workspace moved): from then on, and elsewhere
  (`nvshmem`, whose free is collective over the whole job), a growth doubles and outgrown
  allocations are kept.
- Device waits are watched by a host thread (`watchdog`); a peer that never signals
  becomes a CommError naming rank, pass, chunk and peer.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

# MIN_GROWTH, grown_size: re-exported (tests, backends)
from .bump import ALIGN, MIN_GROWTH, Buffer, Bump, grown_size  # noqa: F401
from .transport import CommError, Handle, Transport
from .watchdog import Watchdog

def sum_in_rank_order(out: torch.Tensor, part: Callable[[int], torch.Tensor], world: int) -> None:
    """out = part(0) + ... + part(world - 1), in rank order on every rank, so all ranks
    get bit-identical results. Half-precision partials accumulate in fp32 and round
    once at the end, as torch's async TP does (a ring in the data type rounds once
    per hop; tests/test_reduction.py measures both against fp64)."""
    if out.dtype in (torch.bfloat16, torch.float16) and world > 1:
        acc = part(0).float()
        for p in range(1, world):
            acc.add_(part(p))
        out.copy_(acc)
        return
    out.copy_(part(0))
    for p in range(1, world):
        out.add_(part(p))


class EventHandle(Handle):
    """A transfer enqueued on a communication stream: waiting orders the caller's
    stream after it, then surfaces any failure the watchdog diagnosed."""

    def __init__(self, event: torch.cuda.Event, transport: "HeapTransport"):
        self._event, self._transport = event, transport

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)
        self._transport.check()


class HeapTransport(Transport):
    """Base of the transports whose peers write into each other's symmetric heap."""

    frees_outgrown = False  # whether one rank can release one allocation on its own

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout=None):
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self.group, self.device = group, torch.device(device)
        self._failure: str | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._priority = 0
        self._heap = Bump()  # the workspaces (its growths: their generation)
        self._pinned = False  # a capture not ours holds the addresses: nothing is released
        self._pass = ""
        self.pass_bytes: dict[str, int] = {}  # high-water workspace bytes per layer pass
        self._watchdog = Watchdog(self.timeout.total_seconds(), self._fail)

    # -- what a heap backend provides ------------------------------------------------------
    @abc.abstractmethod
    def _alloc(self, nbytes: int) -> Buffer:
        """A new symmetric allocation of `nbytes` (collective over the group), zeroed."""

    # -- contract extras ---------------------------------------------------------------------
    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        self.check()
        if self._capturing() and self._watchdog.captured is None:
            self._pinned = True  # captured by someone else's graph (ours record their waits)
        self._heap.restart()
        self._pass = name
        self._priority = comm_priority

    def _release_outgrown(self) -> None:
        """Release every allocation but the newest, where the backend frees (a backend's
        `begin_pass` calls it once its pass barrier is enqueued): no pass carves from them
        any more (a pass restarts in the newest), none of our graphs replays on them
        (`generation` moved on when they were outgrown), and once this rank's device has
        passed the barrier no peer's copy or read of the previous pass touches them.
        Inside a capture, which cannot wait: the next eager pass does it."""
        if (not self.frees_outgrown or len(self._bufs) < 2 or self._pinned
                or self._capturing()):
            return
        self._device_sync()
        del self._bufs[:-1]

    def _device_sync(self, stream: torch.cuda.Stream | None = None) -> None:
        """Wait on the host for `stream` (None: the whole device). A wait queued before it
        that a peer never answers fails there: raised as the watchdog's diagnosis."""
        if self.device.type != "cuda":
            return
        try:
            stream.synchronize() if stream is not None else torch.cuda.synchronize(self.device)
        except RuntimeError:
            self.check()  # a peer that never reached its barrier: the watchdog's diagnosis
            raise

    def _who(self) -> str:
        """Who needs a workspace (a refused growth names it)."""
        return f"megatron_overlap[{self.name}]: rank {self.rank}: '{self._pass}'"

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    @property
    def _bufs(self) -> list[Buffer]:
        """Every allocation still held, the newest (the one carved from) last."""
        return self._heap.bufs

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        view = self._heap.carve(shape, dtype, self._alloc, self.frees_outgrown and not self._pinned,
                                self._capturing, self._who)
        self.pass_bytes[self._pass] = max(self.pass_bytes.get(self._pass, 0), self._heap.used)
        return view

    def check(self) -> None:
        if (self._failure is None and self._watchdog.overdue()
                and not torch.cuda.is_current_stream_capturing()):  # a query would break it
            self._watchdog.poll()  # the watchdog thread may be starved of the GIL: poll here
        if self._failure is not None:
            raise CommError(f"megatron_overlap[{self.name}]: {self._failure}. A peer may have "
                            f"crashed, run a different schedule, or be slower than "
                            f"MEGATRON_OVERLAP_TIMEOUT_S={self.timeout.total_seconds():g}s")

    # -- CUDA-graph replay of whole passes ---------------------------------------------------
    @property
    def generation(self) -> int:
        return self._heap.growths  # a new allocation (counted, never repeated): workspaces moved

    @contextlib.contextmanager
    def recording_waits(self) -> Iterator[list[str]]:
        waits: list[str] = []
        self._watchdog.captured = waits
        try:
            yield waits
        finally:
            self._watchdog.captured = None

    def replay_diagnosis(self, name: str, waits: Sequence[str]) -> str:
        what = "; ".join(w.split(" waited for ", 1)[-1] for w in waits) or "nothing"
        return (f"rank {self.rank}/{self.world_size}: the CUDA-graph replay of '{name}' did not "
                f"finish; it waits for: {what}")

    def watch_replay(self, diagnosis: str) -> None:
        """Watch the replay as one wait (its diagnosis lists every wait of the pass: one of
        them never finished); the release sets every signal slot. A replay is never
        issued inside a capture (`overlap.replay` checked)."""
        self._watchdog.watch(torch.cuda.current_stream(), diagnosis, self._release_all,
                             capturing=False)

    def _release_all(self) -> None:
        """Let every stuck wait of this rank move on (the watchdog's release)."""

    @property
    def bytes_held(self) -> int:
        return sum(b.local.numel() for b in self._bufs)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "buffer_bytes": self.bytes_held, "device": str(self.device)}

    # -- helpers for backends ----------------------------------------------------------------
    def _in_heap(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and any(b.holds(t) for b in self._bufs)

    def _stage_for(self, inp: torch.Tensor) -> torch.Tensor:
        """Where peers find `inp`: itself when a schedule already wrote it into the
        heap (a pipeline's chunk GEMM output: no staging copy), else a new slot."""
        return inp if self._in_heap(inp) else self.workspace(inp.shape, inp.dtype)

    def _locate(self, t: torch.Tensor, op: str, what: str) -> tuple[Buffer, int]:
        for buf in self._bufs:
            if buf.holds(t):
                if not t.is_contiguous():
                    break
                return buf, t.data_ptr() - buf.local.data_ptr()
        raise CommError(f"megatron_overlap[{self.name}]: '{op}': the {what} is not a contiguous "
                        f"workspace tensor; schedules must take it from transport.workspace()")

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

    def _event(self, stream: torch.cuda.Stream) -> Handle:
        event = torch.cuda.Event()
        event.record(stream)
        return EventHandle(event, self)

    def _sum_into(self, out: torch.Tensor, part) -> None:
        sum_in_rank_order(out, part, self.world_size)

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message

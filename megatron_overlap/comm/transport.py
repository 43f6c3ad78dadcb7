"""The transport contract: the few ways a schedule moves chunks between the
ranks of one tensor-parallel group. Every backend (torch_p2p, symm, nvshmem)
implements the four `_start_*` methods; the overlap algorithms are written once
against the public ones and run unchanged on all of them.

Every call only *starts* a transfer and returns a `Handle`; the schedule puts
GEMMs between the start and the `wait()`. The public methods record both ends
in the trace (`comm.trace`), so tests can check what overlapped what.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import os
import sys
import time
from typing import Iterator, NamedTuple, Sequence

import torch

from ..config import env as envvars
from . import stats, trace

Peer = int  # a rank *within* the TP group
SendRecv = tuple[torch.Tensor, Peer]
# A send may name where it lands: a workspace tensor on *this* rank whose place in
# the workspace is the destination on the peer (symmetric buffers have the same
# layout on every rank). Without it the send lands where the tensor itself sits.
Send = tuple[torch.Tensor, Peer] | tuple[torch.Tensor, Peer, torch.Tensor]


# FP8 tensors are moved, never reduced: gathers and ring steps carry them as their bytes
# (`as_bytes`), and a reduction of one is a ContractError (reductions stay in bf16 / fp32).
FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or for an FP8 tensor its uint8 view (same storage, same shape): gloo
    takes no float8 dtype, and a transfer that moves bytes needs none."""
    return t.view(torch.uint8) if t.dtype in FLOAT8 else t


def default_timeout() -> datetime.timedelta:
    """How long a wait may block before it is a diagnosed failure, not a hang."""
    return datetime.timedelta(seconds=envvars.timeout_s())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _peers(peers: "str | tuple[tuple[int, ...], tuple[int, ...]]") -> str:
    """Who a transfer involved, for messages (formatted only when one is needed)."""
    if isinstance(peers, str):
        return peers
    to, frm = peers
    return ", ".join([f"to {p}" for p in to] + [f"from {p}" for p in frm])


class CommError(RuntimeError):
    """A transfer failed or timed out; the message names rank, op, chunk and peers."""


OPEN_PASS_FIRST = ("A pass opens the transport's pass first: tp.begin_pass(name) "
                   "(layers.functions.begin does).")  # the fix, in every ContractError about it


class ContractError(CommError):
    """A schedule broke the transport contract (a workspace() before its pass's
    begin_pass(), or workspace calls that differ between ranks); names the pass."""


class Call(NamedTuple):
    """One contract call of a recorded pass: `key` is what must agree across ranks."""

    key: tuple  # ("begin_pass",) | ("workspace", shape, dtype)
    where: str  # the caller, for messages

    def describe(self) -> str:
        if self.key[0] == "begin_pass":
            return f"begin_pass() at {self.where}"
        return f"workspace({self.key[1]}, {self.key[2]}) at {self.where}"


def _caller() -> str:
    f = sys._getframe(2)  # the schedule that called the public method
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


class Handle(abc.ABC):
    """One started transfer. `wait()` returns once its buffers may be read / reused
    (on a GPU: once the current stream is ordered after it)."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class _TracedHandle(Handle):
    def __init__(self, inner: Handle, transport: "Transport", op: str, chunk: int, peers: str,
                 via: str):
        self._inner, self._transport, self._op, self._chunk, self._peers, self._via = (
            inner, transport, op, chunk, peers, via)

    def wait(self) -> None:
        t0 = time.perf_counter()
        try:
            self._inner.wait()
        except Exception as exc:  # timeouts and peer failures surface here
            t = self._transport
            where = t.name if self._via == t.name else f"{t.name} via {self._via}"
            raise CommError(
                f"megatron_overlap[{where}]: rank {t.rank}/{t.world_size} waited for "
                f"'{self._op}' chunk {self._chunk} ({_peers(self._peers)}) and it failed: {exc}. "
                f"A peer may have crashed, run a different schedule (ranks that disagree on "
                f"token counts or settings, a rank without install()), or be slower than "
                f"MEGATRON_OVERLAP_TIMEOUT_S={t.timeout.total_seconds():g}s."
            ) from exc
        stats.waited(self._op, time.perf_counter() - t0)
        trace.record("wait", self._op, self._chunk, self._via)


class Transport(abc.ABC):
    """Moves chunks within one TP group. `rank` and peers are group-local ranks."""

    name: str = "abstract"
    # Whether a pass on it may be captured in a CUDA graph once and replayed: its
    # transfers keep no host-side state from call to call (`overlap.replay`).
    replayable: bool = False

    def __init__(self, rank: int, world_size: int, timeout: datetime.timedelta | None = None):
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout or default_timeout()

    # -- the contract: what a schedule calls -------------------------------------------
    def exchange(self, sends: Sequence[Send], recvs: Sequence[SendRecv], *,
                 op: str, chunk: int) -> Handle:
        """Send each tensor to its peer and receive each buffer from its peer, at once
        (one ring step). Receive buffers, and send destinations, are `workspace`
        tensors. A send may forward what the previous exchange received: each transport
        orders an exchange after its previous ones."""
        self.check()
        full = [(s[0], s[1], s[2] if len(s) > 2 else s[0]) for s in sends]
        nbytes = sum(_nbytes(t) for t, _, _ in full)
        return self._started(self._start_exchange(full, recvs, op, chunk), op, chunk,
                             (tuple(p for _, p, _ in full), tuple(p for _, p in recvs)), nbytes)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, op: str, chunk: int = 0) -> Handle:
        """`out` (world_size x rows of `inp`) receives every rank's `inp`, in rank order."""
        self.check()
        return self._started(self._start_all_gather(out, inp, op, chunk), op, chunk, "all ranks", _nbytes(inp))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, op: str, chunk: int = 0) -> Handle:
        """`out` receives the sum over ranks of this rank's row block of `inp`."""
        self.check()
        self._no_fp8_sum(inp, op)
        return self._started(self._start_reduce_scatter(out, inp, op, chunk), op, chunk, "all ranks",
                             _nbytes(inp))

    def all_reduce(self, tensor: torch.Tensor, *, op: str, chunk: int = 0) -> Handle:
        """`tensor` becomes the sum over ranks, in place."""
        self.check()
        self._no_fp8_sum(tensor, op)
        return self._started(self._start_all_reduce(tensor, op, chunk), op, chunk, "all ranks", _nbytes(tensor))

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
                  ) -> torch.Tensor:
        """A tensor peers may write into directly: receive buffers of `exchange`.
        Valid until the next `begin_pass`; the same call sequence gives the same
        layout on every rank, so every rank must make the same calls, in the same
        order, after the pass's begin_pass (checked at each layer pass's first run:
        `recording_calls`). Plain memory here; symmetric memory on `symm`."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        """A layer pass (one forward or backward) starts: workspaces of the previous
        pass may be reused once every peer is done with them."""
        self.check()

    def check(self) -> None:
        """Raise the CommError a background watchdog diagnosed, if any."""

    @contextlib.contextmanager
    def recording_calls(self, what: str) -> Iterator[list[Call]]:
        """Every begin_pass() and workspace() made on this transport inside the block, in
        order (a layer pass's first run, `layers.agree`); a workspace() before any
        begin_pass() raises ContractError naming `what`. Instance-level wrappers for the
        block only: outside one the calls cost nothing extra."""
        calls: list[Call] = []
        saved = {k: self.__dict__[k] for k in ("workspace", "begin_pass") if k in self.__dict__}
        workspace, begin_pass = self.workspace, self.begin_pass

        def recorded_begin(name: str = "", comm_priority: int = 0) -> None:
            calls.append(Call(("begin_pass",), _caller()))
            begin_pass(name, comm_priority)

        def recorded_workspace(shape, dtype, device=None) -> torch.Tensor:
            call = Call(("workspace", tuple(int(d) for d in shape), str(dtype)), _caller())
            if not any(c.key[0] == "begin_pass" for c in calls):
                raise ContractError(
                    f"megatron_overlap[{self.name}]: {what}: {call.describe()} came before the "
                    f"pass called begin_pass(), so its workspace may overlap the previous "
                    f"pass's, which peers can still be writing. {OPEN_PASS_FIRST}")
            calls.append(call)
            return workspace(shape, dtype, device)

        self.begin_pass, self.workspace = recorded_begin, recorded_workspace
        try:
            yield calls
        finally:
            for k in ("workspace", "begin_pass"):
                if k in saved:
                    self.__dict__[k] = saved[k]
                else:
                    self.__dict__.pop(k, None)

    # -- CUDA-graph replay of whole passes (`overlap.replay`) ------------------------------
    @property
    def generation(self) -> int:
        """Changes whenever workspaces move (a graph captured before is then stale)."""
        return 0

    @contextlib.contextmanager
    def recording_waits(self) -> Iterator[list[str]]:
        """Collect what each wait enqueued inside the block waits for (during a capture)."""
        yield []

    def replay_diagnosis(self, name: str, waits: Sequence[str]) -> str:
        """What a replay of pass `name`, whose graph makes `waits`, is reported as if it
        never finishes (made once, at capture)."""
        return f"the CUDA-graph replay of '{name}'"

    def watch_replay(self, diagnosis: str) -> None:
        """A replay was just enqueued on the current stream; `diagnosis`: see above."""

    def start_untraced(self, kind: str, *args) -> Handle:
        """Start transfer `kind` ("exchange", "all_gather", "reduce_scatter", "all_reduce";
        the `_start_*` arguments, sends with their destinations) without the trace, the
        stats or the error wrapping: for a transport built from others (per peer), whose own
        public call already recorded it."""
        self.check()
        return getattr(self, f"_start_{kind}")(*args)

    # -- what a backend implements -------------------------------------------------------
    @abc.abstractmethod
    def _start_exchange(self, sends: Sequence[tuple[torch.Tensor, Peer, torch.Tensor]],
                        recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle: ...

    @abc.abstractmethod
    def _start_all_gather(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                          ) -> Handle: ...

    @abc.abstractmethod
    def _start_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, chunk: int
                              ) -> Handle: ...

    @abc.abstractmethod
    def _start_all_reduce(self, tensor: torch.Tensor, op: str, chunk: int) -> Handle: ...

    def describe(self) -> dict[str, object]:
        """What telemetry logs about this transport."""
        return {"transport": self.name, "tp_size": self.world_size}

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends that move this transport's bytes (several for a per-peer one)."""
        return (self.name,)

    @property
    def why_no_wait(self) -> str:
        """Why a GEMM that holds every SM but one while it waits for this transport's
        transfers (`overlap.wait_gemm`) could starve them ("" where it cannot): each
        backend's `BackendCaps.why_no_wait`."""
        from ..config.backends import REGISTRY

        for b in self.backends:
            why = REGISTRY[b].caps.why_no_wait if b in REGISTRY else (
                f"transport {b!r} is not known to move its transfers without SMs")
            if why:
                return f"{b}: {why}"
        return ""

    def via(self, peers: "str | tuple[tuple[int, ...], tuple[int, ...]]") -> str:
        """Which transport carries a transfer with these peers ("all ranks" for a
        collective): the trace's `via`. One transport carries everything here."""
        return self.name

    # -- helpers -------------------------------------------------------------------------
    def _no_fp8_sum(self, t: torch.Tensor, op: str) -> None:
        if t.dtype in FLOAT8:
            raise ContractError(f"megatron_overlap[{self.name}]: '{op}': a reduction of a {t.dtype} "
                                "tensor; FP8 is gathered, never summed: reduce the GEMM's "
                                "bf16 / fp32 output")

    def _started(self, handle: Handle, op: str, chunk: int, peers, nbytes: int) -> Handle:
        via = self.via(peers)
        stats.started(op, nbytes)
        trace.record("start", op, chunk, via)
        return _TracedHandle(handle, self, op, chunk, peers, via)

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world_size

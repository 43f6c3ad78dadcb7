"""A host thread that turns a GPU wait that never ends into a diagnosis.

GPU transports enqueue their waits (for a peer's signal, for a barrier) on a
stream and return at once, so a peer that never signals would hang the stream,
and with it the next synchronisation, silently. The watchdog records an event
behind every such wait; one still pending after the timeout is reported (rank,
layer pass, chunk, peer), its signal slots are released so the stream moves on,
and the transport raises `CommError` at its next call.

The release cannot reach the stuck stream under CUDA_DEVICE_MAX_CONNECTIONS=1
(Megatron's setting: one hardware queue, blocked behind the wait), so there it is
not tried: `symm`'s device-side timeout traps shortly after (the caller gets a
CUDA error, `check()` the diagnosis). Last resort, for every backend: a wait still
stuck `abort_after_s` after the diagnosis ends the process (exit code 124) with
the diagnosis, as NCCL's own watchdog does, rather than hang.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


_capture_seen = False  # a transport was called inside CUDA-graph capture, and no eager call since


def _relaxed_capture_mode() -> None:
    """Let this thread query events while another thread captures a CUDA graph in
    torch's default "global" mode (which otherwise forbids such calls from every
    thread and invalidates the capture). Needs cuda-python's runtime bindings; without
    them the pause on `_capture_seen` is the only guard."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return
    cudart.cudaThreadExchangeStreamCaptureMode(
        cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)


@dataclass
class _Pending:
    event: torch.cuda.Event
    since: float
    what: str
    release: Callable[[], None]  # lets the stuck stream move on
    released_at: float | None = None


class Watchdog:
    def __init__(self, timeout_s: float, on_failure: Callable[[str], None], poll_s: float = 0.05,
                 abort_after_s: float | None = None):
        self.timeout_s, self._on_failure, self._poll_s = timeout_s, on_failure, poll_s
        self.abort_after_s = abort_after_s
        # one hardware queue: a release enqueued on any stream waits behind the stuck wait
        self.can_release = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._device = torch.cuda.current_device()

    def watch(self, stream: torch.cuda.Stream, what: str, release: Callable[[], None]) -> None:
        """Watch everything enqueued on `stream` so far (not inside CUDA-graph capture:
        a captured wait has no event to poll; the device-side backstop covers it)."""
        global _capture_seen
        if torch.cuda.is_current_stream_capturing():
            _capture_seen = True  # stop polling until a capture is over (next eager watch)
            return
        _capture_seen = False
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._pending.append(_Pending(event, time.monotonic(), what, release))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megatron_overlap-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        torch.cuda.set_device(self._device)
        _relaxed_capture_mode()
        while True:
            time.sleep(self._poll_s)
            if _capture_seen:  # no CUDA calls of ours while a graph is being captured
                continue
            now = time.monotonic()
            with self._lock:
                live, expired = [], []  # expired: (pending, device error or None)
                for p in self._pending:
                    try:
                        if p.event.query():
                            continue
                    except RuntimeError as exc:  # the device failed (a trap): report, stop
                        expired.append((p, str(exc)))
                        continue
                    if p.released_at is not None:
                        self._maybe_abort(p, now)
                        live.append(p)
                    elif now - p.since > self.timeout_s:
                        expired.append((p, None))
                    else:
                        live.append(p)
                self._pending = live
            for p, device_error in expired:
                self._expire(p, now, device_error)

    def _expire(self, p: _Pending, now: float, device_error: str | None) -> None:
        if p.released_at is not None:  # diagnosed before; now the device trapped
            return
        msg = (f"{p.what} (the device reported an error meanwhile: {device_error})" if device_error
               else f"{p.what} (still pending after {self.timeout_s:g}s)")
        print(f"megatron_overlap watchdog: {msg}", file=sys.stderr, flush=True)
        self._on_failure(msg)
        if device_error:  # a dead context: nothing to release, the CUDA error reaches the caller
            return
        try:
            if self.can_release:
                p.release()
        except RuntimeError:  # the context died meanwhile
            return
        if self.abort_after_s is not None:
            p.released_at = now
            with self._lock:
                self._pending.append(p)

    def _maybe_abort(self, p: _Pending, now: float) -> None:
        if now - p.released_at > self.abort_after_s:
            print(f"megatron_overlap watchdog: {p.what}: still stuck {self.abort_after_s:g}s "
                  f"after the diagnosis (with CUDA_DEVICE_MAX_CONNECTIONS=1 no release can "
                  f"reach it); ending the process rather than hang", file=sys.stderr, flush=True)
            os._exit(124)

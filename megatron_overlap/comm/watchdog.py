"""A host thread that turns a GPU wait that never ends into a diagnosis.

GPU transports enqueue their waits (for a peer's signal, for a barrier) on a
stream and return at once, so a peer that never signals would hang the stream,
and with it the next synchronisation, silently. The watchdog records an event
behind every such wait; one still pending after the timeout is reported (rank,
layer pass, chunk, peer), its signal slots are released so the stream moves on,
and the transport raises `CommError` at its next call.

The release cannot reach the stuck stream under CUDA_DEVICE_MAX_CONNECTIONS=1
(Megatron's setting: one hardware queue, blocked behind the wait), so there it is
not tried: the transport's device-side timeout traps shortly after (the caller gets
a CUDA error). Last resort, for every backend: a wait still stuck `abort_after_s`
after the diagnosis ends the process (exit code 124) with the diagnosis, as NCCL's
own watchdog does, rather than hang.

The thread is Python: while the main thread blocks in a CUDA call that holds the
GIL behind the stuck wait (`.item()`, a first cuBLAS call), it cannot run. So the
diagnosis never depends on it alone: `poll()` also runs in the caller's thread
(the transport's `check()` calls it once a wait is overdue) and at interpreter
exit, where a wait whose event reports the device's error is named.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


_clock = time.monotonic  # (tests move their own clock)
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
    event: torch.cuda.Event  # or anything with its query()
    since: float
    what: str
    release: Callable[[], None]  # lets the stuck stream move on
    released_at: float | None = None
    reported: bool = False


class Watchdog:
    def __init__(self, timeout_s: float, on_failure: Callable[[str], None], poll_s: float = 0.05,
                 abort_after_s: float | None = None):
        self.timeout_s, self._on_failure, self._poll_s = timeout_s, on_failure, poll_s
        self.abort_after_s = abort_after_s
        # one hardware queue: a release enqueued on any stream waits behind the stuck wait
        self.can_release = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"
        self._pending: list[_Pending] = []
        self._spent: list = []  # events of finished waits, recorded again by later watches
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.captured: list[str] | None = None  # set: what waits captured in a graph wait for

    def watch(self, stream: torch.cuda.Stream, what: str, release: Callable[[], None],
              capturing: bool | None = None) -> None:
        """Watch everything enqueued on `stream` so far (not inside CUDA-graph capture:
        a captured wait has no event to poll; the device-side backstop covers it).
        `capturing`: whether the caller's stream is capturing, where it already asked."""
        global _capture_seen
        if torch.cuda.is_current_stream_capturing() if capturing is None else capturing:
            _capture_seen = True  # stop polling until a capture is over (next eager watch)
            if self.captured is not None:
                self.captured.append(what)
            return
        _capture_seen = False
        with self._lock:  # an event whose wait finished is recorded again: no create / destroy
            event = self._spent.pop() if self._spent else torch.cuda.Event()
        event.record(stream)
        self._add(event, what, release)

    def _add(self, event, what: str, release: Callable[[], None]) -> None:
        """Watch `event` (anything with a CUDA event's `query()`)."""
        with self._lock:
            self._pending.append(_Pending(event, _clock(), what, release))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="megatron_overlap-watchdog",
                                                daemon=True)
                self._thread.start()
                atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """A process ending on a CUDA error (a device-side timeout's trap, raised from
        wherever the main thread was) still says which wait never finished."""
        try:
            self.poll(exiting=True)
        except Exception:  # never mask the exit with an error of our own
            pass

    def _run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
            _relaxed_capture_mode()
        while True:
            time.sleep(self._poll_s)
            if not _capture_seen:  # no CUDA calls of ours while a graph is being captured
                self.poll()

    def overdue(self) -> bool:
        """Cheap (no CUDA call): is some watched wait older than the timeout?"""
        with self._lock:
            return bool(self._pending) and _clock() - self._pending[0].since > self.timeout_s

    def poll(self, exiting: bool = False) -> None:
        """Query the watched waits once: diagnose those past the timeout or failed on
        the device, release or abort as configured (`exiting`: only diagnose). Any
        thread may call it."""
        with self._lock:  # reentrant: one poll at a time, its reports in order
            now = _clock()
            live, expired, failed, device_error = [], [], [], None
            for p in self._pending:
                try:
                    if p.event.query():
                        if len(self._spent) < 256 and isinstance(p.event, torch.cuda.Event):
                            self._spent.append(p.event)
                        continue
                except RuntimeError as exc:  # the device failed (a trap): report, stop
                    failed.append(p)
                    device_error = device_error or str(exc).strip().splitlines()[0]
                    continue
                if p.released_at is not None:
                    if not exiting:
                        self._maybe_abort(p, now)
                    live.append(p)
                elif now - p.since > self.timeout_s:
                    expired.append(p)
                else:
                    live.append(p)
            self._pending = live
            for p in expired:
                self._expire(p, now, release=not exiting)
            if failed and not any(p.reported for p in failed):
                # A dead context fails every event query, so the one that never finished
                # cannot be told from those finished but not yet polled: name them all.
                for p in failed:
                    p.reported = True
                self._report(" | ".join(p.what for p in failed)
                             + f" (the device reported an error meanwhile: {device_error})")

    def _report(self, msg: str) -> None:
        print(f"megatron_overlap watchdog: {msg}", file=sys.stderr, flush=True)
        self._on_failure(msg)

    def _expire(self, p: _Pending, now: float, release: bool = True) -> None:
        p.reported = True
        self._report(f"{p.what} (still pending after {self.timeout_s:g}s)")
        if not release:
            return
        try:
            if self.can_release:
                p.release()
        except RuntimeError:  # the context died meanwhile
            return
        if self.abort_after_s is not None:
            p.released_at = now
            with self._lock:
                self._pending.insert(0, p)  # oldest first, as overdue() reads it

    def _maybe_abort(self, p: _Pending, now: float) -> None:
        if now - p.released_at > self.abort_after_s:
            print(f"megatron_overlap watchdog: {p.what}: still stuck {self.abort_after_s:g}s "
                  f"after the diagnosis (with CUDA_DEVICE_MAX_CONNECTIONS=1 no release can "
                  f"reach it); ending the process rather than hang", file=sys.stderr, flush=True)
            os._exit(124)

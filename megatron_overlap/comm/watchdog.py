"""A host thread that turns a GPU wait that never ends into a diagnosis.

GPU transports enqueue their waits (for a peer's signal, for a barrier) on a
stream and return at once, so a peer that never signals would hang the stream,
and with it the next synchronisation, silently. The watchdog records an event
behind every such wait; one still pending after the timeout is reported (rank,
layer pass, chunk, peer), its signal slots are released so the stream moves on,
and the transport raises `CommError` at its next call.

Where the release cannot reach the stuck stream (CUDA_DEVICE_MAX_CONNECTIONS=1:
one hardware queue, blocked behind the wait), `symm`'s device-side timeout traps
shortly after: the caller gets a CUDA error and `check()` the diagnosis. A backend
without a device-side timeout (`nvshmem`) passes `abort_after_s`: a wait still
stuck that long after its release ends the process with the diagnosis, as NCCL's
own watchdog does, rather than hang.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


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
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._device = torch.cuda.current_device()

    def watch(self, stream: torch.cuda.Stream, what: str, release: Callable[[], None]) -> None:
        """Watch everything enqueued on `stream` so far (not inside CUDA-graph capture:
        a captured wait has no event to poll; the device-side backstop covers it)."""
        if torch.cuda.is_current_stream_capturing():
            return
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
        while True:
            time.sleep(self._poll_s)
            now = time.monotonic()
            with self._lock:
                live, expired = [], []
                for p in self._pending:
                    try:
                        if p.event.query():
                            continue
                    except RuntimeError:  # the device trapped (backstop): report, stop watching
                        expired.append(p)
                        continue
                    if p.released_at is not None:
                        self._maybe_abort(p, now)
                        live.append(p)
                    else:
                        (expired if now - p.since > self.timeout_s else live).append(p)
                self._pending = live
            for p in expired:
                self._expire(p, now)

    def _expire(self, p: _Pending, now: float) -> None:
        msg = f"{p.what} (still pending after {self.timeout_s:g}s)"
        print(f"megatron_overlap watchdog: {msg}", file=sys.stderr, flush=True)
        self._on_failure(msg)
        try:
            p.release()
        except RuntimeError:  # a dead context: the CUDA error reaches the caller
            return
        if self.abort_after_s is not None:
            p.released_at = now
            with self._lock:
                self._pending.append(p)

    def _maybe_abort(self, p: _Pending, now: float) -> None:
        if now - p.released_at > self.abort_after_s:
            print(f"megatron_overlap watchdog: {p.what}: the wait is still stuck "
                  f"{self.abort_after_s:g}s after its release (one hardware queue, "
                  f"CUDA_DEVICE_MAX_CONNECTIONS=1, queues the release behind it); ending the "
                  f"process rather than hang", file=sys.stderr, flush=True)
            os._exit(124)

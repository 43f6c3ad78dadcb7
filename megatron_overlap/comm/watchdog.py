"""A host thread that turns a GPU wait that never ends into a diagnosis.

GPU transports enqueue their waits (for a peer's signal, for a barrier) on a
stream and return at once, so a peer that never signals would hang the stream,
and with it the next synchronisation, silently. The watchdog records an event
behind every such wait; one still pending after the timeout is reported (rank,
layer pass, chunk, peer), its signal slots are released so the stream moves on,
and the transport raises `CommError` at its next call.
"""

from __future__ import annotations

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


class Watchdog:
    def __init__(self, timeout_s: float, on_failure: Callable[[str], None], poll_s: float = 0.05):
        self.timeout_s, self._on_failure, self._poll_s = timeout_s, on_failure, poll_s
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
                    if p.event.query():
                        continue
                    (expired if now - p.since > self.timeout_s else live).append(p)
                self._pending = live
            for p in expired:
                msg = f"{p.what} (still pending after {self.timeout_s:g}s)"
                print(f"megatron_overlap watchdog: {msg}", file=sys.stderr, flush=True)
                self._on_failure(msg)
                p.release()

"""A record of what a schedule did, in order: transfers started and waited on,
and GEMM chunks run. Tests read it to prove the overlap is real (a transfer is
in flight while a GEMM runs), not a collective followed by a GEMM."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Event:
    kind: str  # "start" | "wait" | "gemm"
    op: str  # what moved or computed: "ag", "rs", "ar", "ring", "fprop", "dgrad", "wgrad", ...
    chunk: int  # the schedule's step or chunk index
    via: str = ""  # transfers: the transport that carried it ("torch_p2p", "inter:torch_p2p", ...)


_current: ContextVar[list[Event] | None] = ContextVar("megatron_overlap_trace", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[Event]]:
    """Collect the events of every schedule run inside the block."""
    events: list[Event] = []
    token = _current.set(events)
    try:
        yield events
    finally:
        _current.reset(token)


def active() -> bool:
    """Whether something is recording (checked once before replaying many events)."""
    return _current.get() is not None


def record(kind: str, op: str, chunk: int, via: str = "") -> None:
    events = _current.get()
    if events is not None:
        events.append(Event(kind, op, chunk, via))

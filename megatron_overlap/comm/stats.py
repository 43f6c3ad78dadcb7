"""Per-operation communication counters: transfers started, bytes sent, and time
the host spent blocked in `wait()` (on CPU that is the exposed communication; on
a GPU the wait only orders streams, so it stays near zero and device-side timing
belongs to the benchmarks). Telemetry reads and resets them once per step."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterator


@dataclass
class OpStats:
    transfers: int = 0
    bytes: int = 0
    wait_s: float = 0.0


_stats: defaultdict[str, OpStats] = defaultdict(OpStats)


def started(op: str, nbytes: int, transfers: int = 1) -> None:
    s = _stats[op]
    s.transfers += transfers
    s.bytes += nbytes


def forget(counts: dict[str, tuple[int, int]]) -> None:
    """Take back {op: (transfers, bytes)} counted for work that did not run (a CUDA-graph
    capture: its replays count it)."""
    for op, (transfers, nbytes) in counts.items():
        s = _stats[op]
        s.transfers -= transfers
        s.bytes -= nbytes


def waited(op: str, seconds: float) -> None:
    _stats[op].wait_s += seconds


def snapshot(reset: bool = True) -> dict[str, dict[str, float]]:
    """{op: {"transfers", "bytes", "wait_s"}} since the last reset."""
    out = {op: asdict(s) for op, s in sorted(_stats.items())}
    if reset:
        _stats.clear()
    return out


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """Counters of what runs inside the block go nowhere (the cost model runs schedules
    on a modelled transport: nothing moved that telemetry should report)."""
    global _stats
    saved, _stats = _stats, defaultdict(OpStats)
    try:
        yield
    finally:
        _stats = saved

"""Side-by-side timing across ranks.

A sample is one arm's call (or `inner` back-to-back calls) started by all ranks
together after a barrier; its time is the slowest rank's (a collective is done
when its last rank is). Arms are interleaved repetition by repetition, so drift
(clocks, temperature, other tenants) hits every arm alike; figures are medians.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from .launch import barrier


def sample(fn: Callable[[], object], device: torch.device, inner: int = 1) -> tuple[float, float]:
    """(seconds per call, host seconds per call to issue it) on this rank: CUDA events
    on a GPU (device time from the first launch to the last kernel), wall time on CPU."""
    barrier(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        dt = (time.perf_counter() - t0) / inner
        return dt, dt
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    host = (time.perf_counter() - t0) / inner
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner, host


def balanced_orders(n: int) -> list[list[int]]:
    """The rounds of a Williams design over `n` arms: a Latin square (each arm takes each
    position once) in which, within the rounds, each arm also runs right after each other
    arm equally often (once for even n; for odd n the square and its mirror, 2n rounds,
    twice). An arm's time depends on what ran before it (the GPU's clock and power state:
    after a memory-bound arm it can boost), which a plain rotation keeps fixed: there the
    same arm almost always precedes it."""
    if n <= 1:
        return [[0]] if n == 1 else [[]]
    first, lo, hi = [0], 1, n - 1
    for i in range(1, n):
        first.append(lo if i % 2 else hi)
        lo, hi = (lo + 1, hi) if i % 2 else (lo, hi - 1)
    rounds = [[(x + r) % n for x in first] for r in range(n)]
    return rounds + [row[::-1] for row in rounds] if n % 2 else rounds


def rotated(names: Sequence[str], rep: int) -> list[str]:
    """The arm order of repetition `rep`, a round of `balanced_orders`: over whole designs
    each arm takes each position equally often and, within the rounds, follows each other
    arm equally often, so none always runs right after a slow one (or first, on a cold
    cache). Rounds run back to back add one pair at each boundary."""
    rounds = balanced_orders(len(names))
    return [names[i] for i in rounds[rep % len(rounds)]]


def serial_order(n: int) -> list[int]:
    """`n` arms in a sequence of n * (n - 1) calls, each arm n - 1 times, in which, read
    as a cycle (so repeating it keeps the property), each arm runs right after each other
    arm exactly once and never right after itself: an Eulerian circuit of the complete
    directed graph on the arms (Hierholzer's algorithm). For calls that alternate one by
    one (`tune.measure.time_interleaved`), where rounds run back to back would repeat
    pairs at their boundaries (for two arms: 0 1 | 1 0 | 0 1 runs each twice in a row)."""
    if n <= 1:
        return [0] * n
    left = {a: [b for b in range(n - 1, -1, -1) if b != a] for a in range(n)}  # edges to take
    stack, circuit = [0], []
    while stack:
        if left[stack[-1]]:
            stack.append(left[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]  # the circuit returns to 0: its last call is the first again


def gather_max(per_rank: dict[str, list[float]]) -> tuple[dict[str, list[float]], list[dict[str, list[float]]]]:
    """Every rank's samples -> (per sample, the slowest rank's time; every rank's samples)."""
    from ..comm.exchange import all_gather_object

    everyone = all_gather_object(per_rank, None, "benchmark samples")
    worst = {k: [max(r[k][i] for r in everyone) for i in range(len(v))] for k, v in per_rank.items()}
    return worst, everyone


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and quartiles (seconds)."""
    if not samples:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    if len(samples) == 1:
        return {"median": samples[0], "q1": samples[0], "q3": samples[0], "n": 1}
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return {"median": statistics.median(samples), "q1": q[0], "q3": q[2], "n": len(samples)}


def hidden_fraction(baseline: float, overlapped: float, floor: float) -> float | None:
    """(baseline - overlapped) / (baseline - floor): 1 = all communication hidden, 0 =
    none (as slow as not overlapping), < 0 = slower than not overlapping. None when
    the baseline is not slower than the floor (nothing to hide was measured)."""
    exposed = baseline - floor
    if not exposed > 0:
        return None
    return (baseline - overlapped) / exposed


def graphed(fn: Callable[[], torch.Tensor], warmup: int = 3) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """fn captured in a CUDA graph: (replay, the output tensor every replay rewrites).
    Warm-up calls run on a side stream first, as torch requires; collectives inside
    must be capturable (NCCL, symmetric memory; not gloo)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay, out

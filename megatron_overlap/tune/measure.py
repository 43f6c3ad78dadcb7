"""Timing on one GPU: the compute side of an overlapped schedule (its chunk
GEMMs, order and waits, on the null transport: chunks already resident,
nothing moved) against one monolithic cuBLAS GEMM of the same size, eager
against eager and CUDA-graph replay against replay, plus host time per call.

benchmarks/compute_side.py and the tuner's one-GPU mode both time through here
(the tuner its trials' layer passes, `measure_pass`). A monolithic GEMM is timed in
the operand layout it is asked for (`gemm_operands`; a pass's is
`PassSpec.gemm_layout`): cuBLAS may pick another kernel for NT, NN and TN.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..comm import NullTransport
from ..overlap.pass_fn import pass_fn
from ..overlap.streams import ChunkStreams
from ..simulate.shapes import GEMM_LAYOUTS, check_gemm_layout


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 5) -> float:
    """Median of per-call device times (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def interleaved_samples(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2,
                        queued: bool = False) -> dict[str, tuple[list[float], list[float]]]:
    """Per name, every call's device ms (CUDA events) and host µs to issue it, the calls of
    all `fns` alternating one by one in a serially balanced order (`ab.timing.serial_order`:
    each name right after each other name equally often, never after itself; `reps`
    rounded up to whole cycles of it), so that the GPU's clock and power drift, which moves
    one GEMM by up to ~10% within seconds on an H200, and the state the previous call left
    it in hit every one alike: the way to compare arms a few percent apart.

    `queued`: each cycle's calls are queued back to back and synced once at its end, as a
    training step queues eager work (the host may run ahead; a call's time is its span on
    the GPU, any wait for the host included). Otherwise every call is synced (graph
    replays: a launch each)."""
    from ..ab.timing import serial_order

    names = list(fns)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    cycle = [names[i] for i in serial_order(len(names))]
    per_cycle = max(len(names) - 1, 1)
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for _ in range(-(-reps // per_cycle)):
        pending = []
        for n in cycle:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            fns[n]()
            times[n][1].append((time.perf_counter() - t0) * 1e6)
            b.record()
            if not queued:
                b.synchronize()
            pending.append((n, a, b))
        pending[-1][2].synchronize()
        for n, a, b in pending:
            times[n][0].append(a.elapsed_time(b))
    return times


def time_interleaved(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2
                     ) -> dict[str, float]:
    """Per name, the median of per-call device times, the calls alternating one by one and
    each synced (`interleaved_samples`)."""
    return {n: statistics.median(d) for n, (d, _) in interleaved_samples(fns, reps, warmup).items()}


def time_b2b(fn: Callable[[], Any], reps: int, warmup: int = 5) -> tuple[float, float]:
    """(device ms, host us) per call with `reps` calls queued back to back and one sync
    at the end, as a training step queues them (the host may run ahead of the GPU)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / reps
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps, host


def host_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host time to issue one call (launch cost), device drained between calls."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured in a CUDA graph after a warm-up on a side stream (`ab.timing.graphed`);
    returns its replay."""
    from ..ab.timing import graphed as capture

    return capture(fn)[0]


def measure_schedule(m: int, k: int, n: int, op: str, tp: int, method: str, splits: int, *,
                     reps: int = 50, dtype: torch.dtype = torch.bfloat16, gemm_streams: int = 1,
                     aggregate: bool = False, name: str = "schedule") -> dict[str, Any]:
    """Monolithic GEMM and the schedule's compute side, eager and graphed, side by side.
    Times in ms, host times in us; ratios = monolithic / schedule. The schedules multiply
    x @ w.t(), the forward pass's layout, which `layout` in the result names."""
    layout = GEMM_LAYOUTS["fprop"]
    x, wt = gemm_operands(m, k, n, layout, device="cuda", dtype=dtype)
    w = wt.t()  # the [n, k] weight the schedules take
    mono = lambda: torch.matmul(x, wt)  # noqa: E731
    streams = ChunkStreams(n=gemm_streams)
    local = x[: x.shape[0] // tp] if op == "ag" else x  # ag gathers a 1/tp block of the rows
    sched, replayed = (pass_fn(local, w, NullTransport(tp), op, method, splits, name=name,
                               streams=streams, aggregate=aggregate, replay=r) for r in (False, True))
    t_mono, t_sched = time_ms(mono, reps), time_ms(sched, reps)
    (b_mono, hb_mono), (b_sched, hb_sched) = time_b2b(mono, reps), time_b2b(sched, reps)
    b_replay, hb_replay = time_b2b(replayed, reps)
    g_mono, g_sched = graphed(mono), graphed(sched)
    tg_mono, tg_sched = time_ms(g_mono, reps), time_ms(g_sched, reps)
    out = dict(mono_ms=t_mono, sched_ms=t_sched, eager_ratio=t_mono / t_sched,
               mono_b2b_ms=b_mono, sched_b2b_ms=b_sched, b2b_ratio=b_mono / b_sched,
               replay_b2b_ms=b_replay, replay_ratio=b_mono / b_replay,
               mono_graph_ms=tg_mono, sched_graph_ms=tg_sched, graph_ratio=tg_mono / tg_sched,
               mono_tflops=2 * m * k * n / t_mono / 1e9, host_us_sched=host_us(sched, reps),
               host_us_mono=host_us(mono, reps), host_us_replay=host_us(replayed, reps),
               host_us_b2b_sched=hb_sched, host_us_b2b_replay=hb_replay, host_us_b2b_mono=hb_mono,
               layout=layout)
    del g_mono, g_sched
    return out


def measure_pass(fn: Callable[[], Any], m: int, k: int, n: int, layout: str, *,
                 reps: int = 50, dtype: torch.dtype = torch.bfloat16,
                 out_dtype: torch.dtype = torch.bfloat16,
                 fast_accum: bool = False) -> dict[str, float]:
    """A whole pass (a closure, e.g. a layer pass on the null transport) against one
    monolithic GEMM of its size (`dtype` operands, `measure_gemm`; FP8 accumulated fast
    with `fast_accum`, as the pass's GEMMs) in its operand layout
    (`PassSpec.gemm_layout`): device times eager and graphed, host time per call."""
    mono = measure_gemm(m, k, n, layout, reps=reps, dtype=dtype, out_dtype=out_dtype,
                        fast_accum=fast_accum)
    g_sched = graphed(fn)
    t_sched, tg_sched = time_ms(fn, reps), time_ms(g_sched, reps)
    del g_sched
    return dict(**mono, sched_ms=t_sched, eager_ratio=mono["mono_ms"] / t_sched,
                sched_graph_ms=tg_sched, graph_ratio=mono["mono_graph_ms"] / tg_sched,
                host_us_sched=host_us(fn, reps))


def gemm_operands(m: int, k: int, n: int, layout: str, *, device: Any = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands (a [m, k], b [k, n]) of a GEMM in operand `layout` (one letter per
    operand, `simulate.shapes.GEMM_LAYOUTS`): N, the tensor itself, contiguous; T, a
    transposed view of a contiguous tensor (a = [k, m].t(), b = [n, k].t()), as the
    layer's passes hand theirs to matmul (x @ weight.t(), g @ weight, g.t() @ x)."""
    a_t, b_t = (letter == "T" for letter in check_gemm_layout(layout))
    a = torch.randn(k, m, device=device, dtype=dtype).t() if a_t else \
        torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if b_t else \
        torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def mono_gemm(m: int, k: int, n: int, layout: str, *, device: Any = "cuda",
              dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
              fast_accum: bool = False) -> Callable[[], torch.Tensor]:
    """One monolithic GEMM [m, k] x [k, n] on random operands, as a closure: in operand
    `layout` (`gemm_operands`; a pass's is `PassSpec.gemm_layout`). FP8 `dtype`: the scaled
    GEMM (`overlap.fp8.ScaledGemm`, the second operand e4m3, output `out_dtype`) in the
    one layout cuBLAS multiplies FP8 in (row-major x column-major), whatever `layout`
    says: the layer makes its FP8 operands so before its GEMMs; `fast_accum` as
    `ScaledGemm`'s."""
    if dtype.itemsize == 1:
        from ..overlap.fp8 import ScaledGemm

        one = torch.ones((), device=device)
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        gemm = ScaledGemm(one, one, out_dtype, fast_accum=fast_accum)
        out = torch.empty(m, n, device=device, dtype=out_dtype)
        return lambda: gemm(a, b, out, op="mono")
    a, b = gemm_operands(m, k, n, layout, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b)


def measure_gemm(m: int, k: int, n: int, layout: str, *, reps: int = 50,
                 dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.bfloat16,
                 fast_accum: bool = False) -> dict[str, float]:
    """`mono_gemm` on the GPU, graphed (device time) and eager."""
    mono = mono_gemm(m, k, n, layout, dtype=dtype, out_dtype=out_dtype, fast_accum=fast_accum)
    return dict(mono_ms=time_ms(mono, reps), mono_graph_ms=time_ms(graphed(mono), reps))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

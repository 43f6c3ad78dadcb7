"""One graphed replay of a benchmark arm's step, profiled: where a graphed step's time
goes. The kernels' summed times (torch.profiler over eager steps) say what each kernel
costs, not what the step waits on: with the chunk GEMMs on several streams, copies,
casts and other GEMMs run beside them. Here each arm's step is captured as one CUDA
graph, each replay profiled alone (exported as a chrome trace, its kernel, memcpy and
memset events read back), and the median replay is split by kernel group into time run
beside a GEMM and time run alone. Used by fp8_layer.py (--profile) and attention_layer.py
(--timeline)."""

from __future__ import annotations

import torch

KERNEL_GROUPS = (("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas")),
                 ("attention", ("flash", "fmha", "attn", "cudnn")),
                 ("compiled (triton)", ("triton",)), ("copy", ("copy", "memcpy", "memset")),
                 ("reduction", ("reduce", "norm")))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def _union(spans: list) -> list:
    """Intervals [(start, end)] merged into disjoint ones, in order."""
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(spans: list) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list, cover: list) -> float:
    """How long disjoint `spans` run outside disjoint `cover`."""
    inside, j = 0.0, 0
    for a, b in spans:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            inside += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return _length(spans) - inside


def replay_timeline(events: list) -> dict:
    """One graph replay's device activity (chrome-trace events: ts, dur in us, stream,
    name): its span, the kernels' summed time, the time some kernel ran (their union),
    the time the GEMMs ran, and per group of kernels (`kernel_group`) its summed time and
    how long it ran while no GEMM did: what the step waits on beside its GEMMs."""
    t0 = min(ev["ts"] for ev in events)
    span = max(ev["ts"] + ev["dur"] for ev in events) - t0
    by_group: dict = {}
    for ev in events:
        by_group.setdefault(kernel_group(ev["name"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    gemm = _union(by_group.get("gemm", []))
    streams = sorted({ev["stream"] for ev in events})
    return {"span_us": span, "kernel_sum_us": sum(ev["dur"] for ev in events),
            "busy_us": _length(_union([s for v in by_group.values() for s in v])),
            "gemm_busy_us": _length(gemm), "streams": len(streams),
            "groups": {g: {"sum_us": _length(v),
                           "outside_gemm_us": _minus(_union(v), gemm) if g != "gemm" else 0.0}
                       for g, v in sorted(by_group.items())},
            "kernels": [[streams.index(ev["stream"]), round(ev["ts"] - t0, 1), round(ev["dur"], 1),
                         ev["name"][:80]] for ev in sorted(events, key=lambda ev: ev["ts"])]}


def graph_timelines(arms, e, names: tuple[str, ...], replays: int = 3) -> dict:
    """The step of each arm named in `names` captured as one CUDA graph (as
    layer_compute.time_shape graphs it), each replay profiled alone (torch.profiler's CUDA
    activity, exported as a chrome trace): per arm the median replay's `replay_timeline`.
    Where the graphed ratio differs from the kernel times' (`kernel_times`, eager), this
    shows which kernels run beside the GEMMs (on other streams) and which hold the step
    up. A diagnostic: where it fails, {"error": ...}, and the run keeps its timings."""
    try:
        return _timelines([a for a in arms if a.name in names], e, replays)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _timelines(arms, e, replays: int) -> dict:
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.tune.measure import graphed

    out = {}
    for arm in arms:
        replay = graphed(lambda arm=arm: arm.step(e))
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
        runs = []
        for _ in range(replays):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                replay()
                torch.cuda.synchronize()
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                with open(f.name) as g:
                    trace = json.load(g)["traceEvents"]
            events = [{"ts": float(ev["ts"]), "dur": float(ev["dur"]), "name": ev["name"],
                       "stream": ev.get("args", {}).get("stream", -1)} for ev in trace
                      if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            if events:
                runs.append(replay_timeline(events))
        del replay
        torch.cuda.synchronize()
        if runs:
            runs.sort(key=lambda r: r["span_us"])
            out[arm.name] = {**runs[len(runs) // 2], "spans_us": [r["span_us"] for r in runs]}
    return out


def timeline_lines(timeline: dict | None) -> list[str]:
    """graph_timelines' result (or {"error": ...}): per arm the span, busy and GEMM time,
    and each group's time outside the GEMMs."""
    if not timeline:
        return []
    if "error" in timeline:
        return [f"{'':18s} graphed replay's timeline failed: {timeline['error']}"]
    lines = [f"{'':18s} one graphed replay (torch.profiler): span / kernels summed / busy / GEMMs "
             f"busy, us; per group: us outside the GEMMs (of its sum)"]
    for a, t in timeline.items():
        lines.append(f"{'':18s}   {a} {t['span_us']:.0f} / {t['kernel_sum_us']:.0f} / {t['busy_us']:.0f} / "
                     f"{t['gemm_busy_us']:.0f} on {t['streams']} streams; " + ", ".join(
                         f"{g} {v['outside_gemm_us']:.0f} ({v['sum_us']:.0f})"
                         for g, v in t["groups"].items() if g != "gemm"))
    return lines

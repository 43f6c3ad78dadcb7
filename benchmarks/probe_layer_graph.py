"""Where a whole-layer arm's time and memory go, kernel by kernel: a diagnostic probe for
`attention_layer.py`'s arms at one shape (one GPU).

Per arm (the same build, weights and input as attention_layer.py):
- memory (attention_layer's `memory`): a steady-state step's peak (per layer), what the
  arm keeps once per process, its pass graphs' pool;
- eager and graphed ms (as attention_layer.py times them, fewer repeats);
- one profiled replay of the whole-layer graph and one profiled eager step: kernel count,
  the sum of kernel times, the span from the first kernel's start to the last one's end,
  the time two or more kernels ran at once, per-stream totals, and the top kernels.

    python benchmarks/probe_layer_graph.py [--shape 70b_tp8_s4096_b2] [--arms sdpa_ref ours]

Writes <out>/probe_layer_graph_<tag>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attention_layer as al  # noqa: E402
import layer_compute as lc  # noqa: E402


def kernels(fn, steps: int = 1) -> list[dict]:
    """The CUDA kernels `fn` runs (profiled), from the profiler's chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [dict(name=e["name"], ts=float(e["ts"]), dur=float(e.get("dur", 0)),
                 stream=e.get("args", {}).get("stream"))
            for e in events if e.get("cat") == "kernel"]


def summarize(ks: list[dict], top: int = 12) -> dict:
    """Count, sum, span and concurrency of a kernel list (µs)."""
    if not ks:
        return {"kernels": 0}
    start, end = min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks)
    edges = sorted([(k["ts"], 1) for k in ks] + [(k["ts"] + k["dur"], -1) for k in ks])
    busy = overlap = 0.0
    depth, last = 0, edges[0][0]
    for t, d in edges:
        if depth >= 1:
            busy += t - last
        if depth >= 2:
            overlap += t - last
        depth, last = depth + d, t
    by_name, by_stream = defaultdict(lambda: [0, 0.0]), defaultdict(float)
    for k in ks:
        by_name[k["name"][:90]][0] += 1
        by_name[k["name"][:90]][1] += k["dur"]
        by_stream[str(k["stream"])] += k["dur"]
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(ks), "sum_us": sum(k["dur"] for k in ks), "span_us": end - start,
            "busy_us": busy, "concurrent_us": overlap, "idle_us": (end - start) - busy,
            "per_stream_us": dict(by_stream),
            "top": [dict(name=n, count=c, total_us=t) for n, (c, t) in tops]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    al.layer_options(p)  # what attention_layer's build_arms reads, with its defaults
    p.add_argument("--shape", default="70b_tp8_s4096_b2")
    p.add_argument("--arms", nargs="+", default=list(al.ARMS[1:]))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="gpu")
    p.add_argument("--fill-mpu", action="store_true",
                   help="fill Megatron's global gather buffer with normal values after the warm-up")
    p.add_argument("--null-zeros", action="store_true", help="zero the transport's workspaces")
    p.add_argument("--timing", choices=("mirror", "null"), default="mirror")
    return p


def main(argv=None) -> int:
    from megatron_overlap.tune.measure import graphed, time_b2b, time_ms

    args = parser().parse_args(argv)
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    lc.init_process(device, args.seed)
    shape = al.shape_of(args.shape)
    doc = {"shape": args.shape, "timing": args.timing, "arms": {}}
    with lc.last_rank(shape, args, dtype, device, al.build_arms) as (emu, arms, e):
        arms = [a for a in arms if a.name in args.arms]
        null = lc.timing_transport(emu, args.timing)
        for arm in arms:
            # attention_layer's measure (a fresh transport of its own), then this run's
            row = doc["arms"][arm.name] = al.memory(emu, [arm], e, args.timing)[arm.name]
            emu.use(null, [a.layer for a in arms])
            if args.fill_mpu:
                from megatron.core.parallel_state import get_global_memory_buffer

                for t in get_global_memory_buffer().buffer.values():
                    t.normal_()
            if args.null_zeros:
                for t in null.buffers():
                    t.zero_()
            fn = lambda arm=arm: arm.step(e)  # noqa: E731
            row["eager_ms"] = time_b2b(fn, args.reps, warmup=2)[0]
            g = graphed(fn)
            row["graph_ms"] = time_ms(g, args.reps, warmup=2)
            row["graph_kernels"] = summarize(kernels(g))
            row["eager_kernels"] = summarize(kernels(fn))
            del g
            torch.cuda.synchronize()
        doc["null_workspaces"] = [dict(key=f"{t.device} buffer {i}", gib=t.numel() / 2**30)
                                  for i, t in enumerate(null.buffers())]
    path = os.path.join(args.out, f"probe_layer_graph_{args.tag}.json")
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    for n, r in doc["arms"].items():
        print(f"{n}: eager {r['eager_ms']:.3f} graph {r['graph_ms']:.3f} ms; memory GiB: step {r['step']:.3f} "
              f"kept {r['kept']:.3f} pools {r['pools']:.3f} (first steps {r['first']:.3f})")
        for mode in ("graph_kernels", "eager_kernels"):
            k = r[mode]
            print(f"  {mode}: {k['kernels']} kernels, sum {k['sum_us']:.0f} span {k['span_us']:.0f} "
                  f"busy {k['busy_us']:.0f} concurrent {k['concurrent_us']:.0f} idle {k['idle_us']:.0f} µs; "
                  f"streams {({s: round(v) for s, v in k['per_stream_us'].items()})}")
            for t in k["top"][:8]:
                print(f"    {t['count']:4d} {t['total_us']:8.0f} µs  {t['name']}")
    print("null workspaces:", ", ".join(f"{w['key']} {w['gib']:.3f} GiB" for w in doc["null_workspaces"]))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compute side of the overlapped schedules on one GPU: each reference shape's
schedule run on the `null` transport (the same chunk GEMMs, order and waits;
chunks already resident; nothing moved) against one monolithic cuBLAS GEMM of
the same size, measured side by side in one run:

- eager, first call: the device drained before each call (launch latency);
- eager, back to back: calls queued as a training step queues them, one sync at
  the end (`b2b`);
- replayed, back to back: the schedule as the layers run it on a replayable
  transport (captured once, replayed: `overlap.replay`);
- CUDA graph replay against graph replay;
plus host time per call.

    python benchmarks/compute_side.py [--reps 50] [--shapes all|short|NAME,...] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

# the timing code lives in the package, where the tuner's one-GPU mode uses it too
from megatron_overlap.tune.measure import graphed, host_us, measure_schedule, time_ms  # noqa: F401

from megatron_overlap.ab.shapes import Shape, parse as parse_shapes


def schedules(op: str, tp: int):
    """(name, method, num_splits, GEMM streams, aggregate) at the layer's TE-default
    chunking, with 2 GEMM streams and (AG, TP > 2) aggregate beside it."""
    if op == "ag":
        out = [("ring", "ring_exchange", tp, 1, False), ("ring/2s", "ring_exchange", tp, 2, False)]
        if tp > 2:
            out.append(("ring+agg", "ring_exchange", tp, 1, True))
        return out
    return [("pipeline4", "pipeline", 4, 1, False), ("pipeline4/2s", "pipeline", 4, 2, False),
            ("ring", "ring_exchange", tp, 1, False), ("ring/2s", "ring_exchange", tp, 2, False)]


def run(shapes: list[Shape], reps: int, dtype: torch.dtype) -> list[dict]:
    rows = []
    for sh in shapes:
        for label, method, splits, nstreams, agg in schedules(sh.op, sh.tp):
            rows.append(dict(
                shape=sh.name, m=sh.m, k=sh.k, n=sh.n, op=sh.op, tp=sh.tp, schedule=label,
                chunks=splits, gemm_streams=nstreams, aggregate=agg,
                **measure_schedule(sh.m, sh.k, sh.n, sh.op, sh.tp, method, splits, reps=reps,
                                   dtype=dtype, gemm_streams=nstreams, aggregate=agg,
                                   name=sh.name)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3, help="whole-table repeats; medians reported")
    ap.add_argument("--shapes", default="all", help="all (reference) | short | NAME,... (ab/shapes.py)")
    ap.add_argument("--out", default="benchmarks/results/compute_side.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compute_side.py needs a CUDA GPU: it times cuBLAS GEMMs and CUDA graphs")
    torch.backends.cuda.matmul.allow_tf32 = True
    shapes = parse_shapes(args.shapes)
    runs = [run(shapes, args.reps, getattr(torch, args.dtype)) for _ in range(args.repeat)]
    keys = ("mono_ms", "sched_ms", "eager_ratio", "mono_b2b_ms", "sched_b2b_ms", "b2b_ratio",
            "replay_b2b_ms", "replay_ratio", "mono_graph_ms", "sched_graph_ms", "graph_ratio",
            "mono_tflops", "host_us_sched", "host_us_mono", "host_us_replay", "host_us_b2b_sched",
            "host_us_b2b_replay", "host_us_b2b_mono")
    table = []
    for i, row in enumerate(runs[0]):
        med = {k: statistics.median(r[i][k] for r in runs) for k in keys}
        spread = {f"{k}_range": (min(r[i][k] for r in runs), max(r[i][k] for r in runs))
                  for k in ("eager_ratio", "b2b_ratio", "replay_ratio", "graph_ratio")}
        table.append({**row, **med, **spread})
    # ring_rs: the ring reduce-scatter timed here sums its partials once (simulate.calibration)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=args.dtype,
                ring_rs="sum",
                reps=args.reps, repeat=args.repeat, host=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": table, "runs": runs}, f, indent=1)
    print(f"{meta['device']}  torch {meta['torch']}  {args.dtype}  median of {args.repeat} runs x {args.reps} reps")
    print(f"{'shape':19s} {'schedule':12s} {'mono ms':>8s} {'TFLOP/s':>7s} {'1st':>6s} "
          f"{'b2b':>6s} {'replay':>6s} {'graph':>6s} {'host us: 1st':>12s} {'b2b':>5s} {'replay':>6s}")
    for r in table:
        print(f"{r['shape']:19s} {r['schedule']:12s} {r['mono_ms']:8.3f} {r['mono_tflops']:7.0f} "
              f"{r['eager_ratio']:6.3f} {r['b2b_ratio']:6.3f} {r['replay_ratio']:6.3f} "
              f"{r['graph_ratio']:6.3f} {r['host_us_sched']:12.0f} {r['host_us_b2b_sched']:5.0f} "
              f"{r['host_us_b2b_replay']:6.0f}")
    print("ratios = monolithic GEMM time / schedule time, each pair measured the same way "
          "(1st: eager, device drained before each call = first-call latency; b2b: eager, back "
          "to back; replay: back to back as the layers run it, captured once and replayed; "
          f"graph: both CUDA-graph replays); full results: {args.out}")


if __name__ == "__main__":
    main()

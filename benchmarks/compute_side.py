"""Compute side of the overlapped schedules on one GPU: each reference shape's
schedule run on the `null` transport (the same chunk GEMMs, order and waits;
chunks already resident; nothing moved) against one monolithic cuBLAS GEMM of
the same size, measured side by side in one run, eager against eager and CUDA
graph replay against replay; plus host time per call.

    python benchmarks/compute_side.py [--reps 50] [--out benchmarks/results/compute_side.json]
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

# DESIGN.md's reference shapes: tokens M (sequence x micro-batch), per-rank K and N.
SHAPES = [("70B_tp8_qkv", 8192, 8192, 1280, "ag", 8), ("70B_tp8_fc1", 8192, 8192, 7168, "ag", 8),
          ("70B_tp8_proj", 8192, 1024, 8192, "rs", 8), ("70B_tp8_fc2", 8192, 3584, 8192, "rs", 8),
          ("8B_tp4_fc1", 8192, 4096, 7168, "ag", 4), ("8B_tp4_fc2", 8192, 3584, 4096, "rs", 4),
          ("8B_tp2_qkv", 4096, 4096, 3072, "ag", 2)]


def schedules(op: str, tp: int):
    """(name, method, num_splits, GEMM streams) at the layer's TE-default chunking."""
    if op == "ag":
        return [("ring", "ring_exchange", tp, 1), ("ring/2s", "ring_exchange", tp, 2)]
    return [("pipeline4", "pipeline", 4, 1), ("pipeline4/2s", "pipeline", 4, 2),
            ("ring", "ring_exchange", tp, 1), ("ring/2s", "ring_exchange", tp, 2)]


def run(reps: int, dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, m, k, n, op, tp in SHAPES:
        for label, method, splits, nstreams in schedules(op, tp):
            rows.append(dict(
                shape=name, m=m, k=k, n=n, op=op, tp=tp, schedule=label, chunks=splits,
                gemm_streams=nstreams,
                **measure_schedule(m, k, n, op, tp, method, splits, reps=reps, dtype=dtype,
                                   gemm_streams=nstreams, name=name)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3, help="whole-table repeats; medians reported")
    ap.add_argument("--out", default="benchmarks/results/compute_side.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compute_side.py needs a CUDA GPU: it times cuBLAS GEMMs and CUDA graphs")
    torch.backends.cuda.matmul.allow_tf32 = True
    runs = [run(args.reps, getattr(torch, args.dtype)) for _ in range(args.repeat)]
    keys = ("mono_ms", "sched_ms", "eager_ratio", "mono_graph_ms", "sched_graph_ms", "graph_ratio",
            "mono_tflops", "host_us_sched", "host_us_mono")
    table = []
    for i, row in enumerate(runs[0]):
        med = {k: statistics.median(r[i][k] for r in runs) for k in keys}
        spread = {f"{k}_range": (min(r[i][k] for r in runs), max(r[i][k] for r in runs))
                  for k in ("eager_ratio", "graph_ratio")}
        table.append({**row, **med, **spread})
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=args.dtype,
                reps=args.reps, repeat=args.repeat, host=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": table, "runs": runs}, f, indent=1)
    print(f"{meta['device']}  torch {meta['torch']}  {args.dtype}  median of {args.repeat} runs x {args.reps} reps")
    print(f"{'shape':14s} {'schedule':14s} {'chunks':>6s} {'mono ms':>8s} {'TFLOP/s':>8s} "
          f"{'eager':>6s} {'graph':>6s} {'host us':>8s}")
    for r in table:
        print(f"{r['shape']:14s} {r['schedule']:14s} {r['chunks']:6d} {r['mono_ms']:8.3f} "
              f"{r['mono_tflops']:8.0f} {r['eager_ratio']:6.3f} {r['graph_ratio']:6.3f} "
              f"{r['host_us_sched']:8.0f}")
    print(f"ratios = monolithic time / schedule time (1.0 = the schedule costs nothing extra); "
          f"full results: {args.out}")


if __name__ == "__main__":
    main()

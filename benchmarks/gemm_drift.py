"""How far one GPU's time for the same GEMM drifts within one script, and with what.

A tuner measures a pass's monolithic GEMM once and a check times the pass minutes
later; if the GPU's speed for the same GEMM moves between the two, so does their
ratio. This times one shape in each operand layout with three operand sets (random
normal, random x 0.02, zeros), in `--rounds` turns (each a median of `--reps` graphed
calls, `tune.measure`'s timers), and prints each turn: what stays with one set of
tensors from turn to turn, and what differs between sets. On the H200 the sets differed
by up to ~16% while each repeated within 1-9% (docs/results.md), in an order that another
run did not reproduce.

    python benchmarks/gemm_drift.py --m 8192 --k 7168 --n 8192 --rounds 3 --out benchmarks/results/gemm_drift_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_overlap.tune.measure import gemm_operands, graphed, time_ms

VALUES = {"randn": 1.0, "randn x0.02": 0.02, "zeros": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layouts", nargs="+", default=["NN", "NT", "TN"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/gemm_drift.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_drift.py times GPU GEMMs: no CUDA GPU here")
    cases, operands = {}, []  # a graph reads its operands by address: keep them alive
    for layout in args.layouts:
        a, b = gemm_operands(args.m, args.k, args.n, layout, dtype=torch.bfloat16)
        for name, scale in VALUES.items():
            sa, sb = a * scale, b * scale  # the same layout: a scaled T view stays a T view
            operands.append((sa, sb))
            cases[f"{layout} {name}"] = graphed(lambda sa=sa, sb=sb: torch.matmul(sa, sb))
    turns: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):  # every case once per turn: drift shows across turns
        for c, fn in cases.items():
            turns[c].append(time_ms(fn, args.reps))
    flops = 2 * args.m * args.k * args.n
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  [{args.m}, {args.k}] x "
          f"[{args.k}, {args.n}] bf16, graphed, ms per call, {args.rounds} turns of {args.reps}")
    print(f"{'case':18s} {'turns':>26s} {'median':>7s} {'max/min':>7s} {'TFLOP/s':>8s}")
    for c, v in turns.items():
        med = statistics.median(v)
        print(f"{c:18s} {' '.join(f'{t:.3f}' for t in v):>26s} {med:7.3f} {max(v) / min(v):7.3f} "
              f"{flops / med / 1e9:8.0f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "m": args.m, "k": args.k, "n": args.n, "reps": args.reps,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "turns_ms": turns}, f, indent=1)
    print(f"full results: {args.out}")


if __name__ == "__main__":
    main()

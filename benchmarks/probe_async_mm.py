"""Whether torch's persistent all-gather consumer GEMM could replace our chunked GEMMs.

The column layers' all-gather passes run one GEMM per arriving chunk (`ring_exchange`:
one per rank); on one GPU, where there is nothing to hide, those chunks cost 3-8% of the
whole layer against one monolithic GEMM (docs/results.md, "why the chunked GEMMs lose").
torch ships one fused consumer, `torch.ops.symm_mem._async_input_mm(a, b, signals,
pivot)`: a CUTLASS persistent GEMM (Hopper, bf16, tile 128x256x64) whose tile scheduler
starts at chunk `pivot` and waits on `signals[i]` before it reads chunk i's rows, so one
kernel consumes rows as they arrive. torch's own async-TP uses it only for 2048 < M <=
4096 rows. This probe times it with every signal already set (the compute side, as our
timing transports measure) against the monolithic `torch.matmul` and the ring schedule's
chunked GEMMs on the `null` transport, graphed and interleaved, at the column forward
shapes of the reference models; and checks its result against the monolithic GEMM.

    python benchmarks/probe_async_mm.py [--reps 30] [--out DIR]

Prints a table and writes <out>/probe_async_mm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_overlap.comm import NullTransport  # noqa: E402
from megatron_overlap.overlap.pass_fn import pass_fn  # noqa: E402
from megatron_overlap.tune.measure import graphed, time_interleaved  # noqa: E402

# name: (tokens M, K, N, TP): column forwards x @ W.t() at one rank's share of N
SHAPES = {"70b_tp8_qkv_s8192": (8192, 8192, 1280, 8), "70b_tp8_fc1_s8192": (8192, 8192, 7168, 8),
          "8b_tp4_qkv_s8192": (8192, 4096, 1536, 4), "8b_tp4_fc1_s8192": (8192, 4096, 7168, 4),
          "70b_tp8_qkv_s16384": (16384, 8192, 1280, 8), "70b_tp8_fc1_s16384": (16384, 8192, 7168, 8),
          "70b_tp8_qkv_s4096": (4096, 8192, 1280, 8)}


def probe(m: int, k: int, n: int, tp: int, reps: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    signals = torch.ones(tp, dtype=torch.uint32, device="cuda")
    mono = lambda: torch.matmul(x, w.t())  # noqa: E731
    fused = lambda: torch.ops.symm_mem._async_input_mm(x, w.t(), signals, tp - 1)  # noqa: E731
    ref = mono()
    row = {"m": m, "k": k, "n": n, "tp": tp}
    try:
        got = fused()
        row["fused_max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
    except RuntimeError as e:
        row["fused_error"] = str(e).splitlines()[0][:200]
        fused = None
    fns = {"mono": graphed(mono)}
    if fused is not None:
        try:
            fns["fused"] = graphed(fused)
        except RuntimeError as e:
            row["fused_graph_error"] = str(e).splitlines()[0][:200]
    ring = pass_fn(x[: m // tp], w, NullTransport(tp), "ag", "ring_exchange", tp, name="qkv_fprop")
    fns["ring"] = graphed(ring)
    times = time_interleaved(fns, reps)
    row.update({f"{a}_ms": t for a, t in times.items()})
    row.update({f"{a}_ratio": times["mono"] / t for a, t in times.items() if a != "mono"})
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args(argv)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "has_op": hasattr(torch.ops.symm_mem, "_async_input_mm"), "shapes": {}}
    print(f"torch {result['torch']}, {result['device']}; ratio = monolithic ms / arm ms")
    print(f"{'shape':22} {'mono ms':>8} {'fused ms':>9} {'fused x':>8} {'ring ms':>8} {'ring x':>7}  notes")
    for name, (m, k, n, tp) in SHAPES.items():
        r = probe(m, k, n, tp, args.reps)
        result["shapes"][name] = r
        note = r.get("fused_error") or r.get("fused_graph_error") or \
            f"fused vs mono max rel diff {r.get('fused_max_rel_diff', float('nan')):.1e}"
        print(f"{name:22} {r['mono_ms']:8.3f} {r.get('fused_ms', float('nan')):9.3f} "
              f"{r.get('fused_ratio', float('nan')):8.3f} {r['ring_ms']:8.3f} {r['ring_ratio']:7.3f}  {note}")
    with open(os.path.join(args.out, "probe_async_mm.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

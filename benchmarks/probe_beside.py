"""Whether memory-bound work on a second stream runs beside an FP8 GEMM on this GPU: what
`overlap.streams.beside` can win. The GEMM is a 8B TP=4 fc1 dgrad (g [8192, 7168] e5m2 @
W [7168, 4096] e4m3, `torch._scaled_mm`, bf16 out); beside it, the wgrad's transposed copy
of the gathered input ([8192, 4096] FP8 bytes, `overlap.fp8.transposed`), or a copy of the
same bytes (`copy_`, which the copy engines run, no SM).

Each arm is one CUDA graph, timed with CUDA events (median of --reps replays, arms
interleaved):

- gemm, transpose, copy: each alone;
- serial: the GEMM, then the transpose, on one stream;
- beside: the transpose on a side stream forked before the GEMM, joined after it (the
  GEMM launched first);
- beside_first_high: the transpose launched first, on a high-priority side stream;
- beside_margin: beside, the GEMM held 16 SMs short (`set_sm_margin`'s carve-out,
  `overlap.streams.ChunkStreams`; left out where torch has no carve-out);
- copy_beside: the copy on a side stream beside the GEMM.

`saved` = serial - beside (the transpose's time hidden; 0: none).

    python benchmarks/probe_beside.py [--reps 30] [--out DIR]

Writes <out>/probe_beside.json and prints a table. Needs a CUDA GPU with FP8 GEMMs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

M, K, N = 8192, 7168, 4096  # the dgrad GEMM; the gathered input is [M, N]
MARGIN = 16


def _graph(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (cuBLAS, Triton)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def arms() -> dict:
    from megatron_overlap.overlap.fp8 import transposed
    from megatron_overlap.overlap.streams import ChunkStreams

    dev = torch.device("cuda")
    g8 = torch.randn(M, K, device=dev).to(torch.float8_e5m2)
    w8t = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)  # the GEMM reads w8t.t()
    one = torch.ones((), device=dev)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    full = torch.randn(M, N, device=dev).to(torch.float8_e4m3fn)
    full_t = torch.empty(N, M, dtype=full.dtype, device=dev)
    copy = torch.empty_like(full)
    low, high = torch.cuda.Stream(), torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])

    def gemm():
        torch._scaled_mm(g8, w8t.t(), one, one, out_dtype=torch.bfloat16, out=out)

    def transpose():
        transposed(full, out=full_t)

    def copy_bytes():
        copy.copy_(full)

    def on(stream, work, work_first=False):
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        if not work_first:
            gemm()
        with torch.cuda.stream(stream):
            work()
        if work_first:
            gemm()
        main.wait_stream(stream)

    def margin():  # the layers' own carve-out (set_sm_margin's)
        with ChunkStreams(n=1, sm_margin=MARGIN):
            on(low, transpose)

    out = {"gemm": gemm, "transpose": transpose, "copy": copy_bytes,
           "serial": lambda: (gemm(), transpose()),
           "beside": lambda: on(low, transpose),
           "beside_first_high": lambda: on(high, transpose, work_first=True),
           "copy_beside": lambda: on(low, copy_bytes)}
    if hasattr(torch._C, "_set_sm_carveout_experimental"):  # (else no margin to measure)
        out["beside_margin"] = margin
    return out


def time_graphs(graphs: dict, reps: int) -> dict:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict = {k: [] for k in graphs}
    for _ in range(reps):
        for name, g in graphs.items():  # interleaved
            g.replay()
            start.record()
            for _ in range(5):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / 5)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_beside: needs a CUDA GPU")
        return 2
    graphs = {k: _graph(fn) for k, fn in arms().items()}
    us = time_graphs(graphs, args.reps)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gemm_mkn": [M, K, N], "margin_sms": MARGIN, "reps": args.reps, "us": us,
           "saved_us": {k: us["serial"] - us[k] for k in ("beside", "beside_first_high",
                                                           "beside_margin") if k in us},
           "copy_saved_us": us["gemm"] + us["copy"] - us["copy_beside"]}
    print(f"probe_beside: {doc['gpu']}, GEMM {M}x{K}x{N} FP8, median of {args.reps} (us)")
    for k, v in us.items():
        print(f"  {k:18s} {v:8.1f}")
    print("  saved vs serial: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["saved_us"].items())
          + f"; copy beside saved {doc['copy_saved_us']:.1f} of {us['copy']:.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_beside.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

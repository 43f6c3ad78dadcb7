"""Delayed scaling's per-tensor work on one GPU, piece by piece, against current scaling's:
what `overlap.fp8.delayed_quantize` and `update_scale` cost at a 70B TP=8 layer's tensor
shapes, and the variants they were chosen from.

- `tensorwise`: current scaling's quantization (amax, scale, cast: `amax`, `scale_for`,
  `quantize`);
- `delayed`: `delayed_quantize` (torch's amax reduction, then the compiled cast);
- `delayed_fused_amax`: the cast and the amax compiled as one function (what
  `delayed_quantize` did before: inductor makes the amax a reduction of its own);
- `update_compiled` / `update_eager`: `update_scale` as a GPU runs it (compiled when the
  results of 2026-12-05 were taken; the Triton kernel `delayed_update` since), and its
  function eagerly, for histories of 16 and 1024.

    python benchmarks/probe_fp8_delayed.py --out $OUT [--reps 50]

Microseconds per call (CUDA events over --reps calls back to back, after a warm-up that
compiles, each shape in turn, median of 5), and each variant's kernels (torch.profiler);
<out>/probe_fp8_delayed.json holds both.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import torch

from megatron_overlap.overlap import fp8 as f

# [rows, cols] of the tensors a 70B TP=8 layer quantizes (seq 4096 x micro-batch 2, SP):
# the gathered inputs of qkv / fc1 and of proj / fc2, weights, output gradients
SHAPES = [(8192, 8192), (8192, 1024), (8192, 3584), (1280, 8192), (7168, 8192), (8192, 7168)]
E4M3 = torch.float8_e4m3fn


def _fused_amax(saturate, x, scale, used, amax_out, out):
    used.copy_(scale)
    f._amax_into(x, amax_out)
    return f._cast_by(saturate, x, f.scale_value(used), out)


def variants(x: torch.Tensor) -> dict:
    """name -> a function of no arguments doing one quantization (or update) of `x`."""
    st = f.AmaxHistory(16, x.device)
    used, a = f.scale_pair(x.device), torch.empty((), device=x.device)
    out = torch.empty(x.shape, dtype=E4M3, device=x.device)
    fused = functools.partial(_fused_amax, f._ao().to_fp8_saturated)

    def tensorwise():
        f.quantize(x, f.scale_for(f.amax(x), E4M3, out=used), E4M3, out=out)

    def delayed():
        f.delayed_quantize(x, st, E4M3, used, a, out=out)

    def delayed_fused_amax():
        assert f._run_compiled(("probe_fused_amax", x.dtype, E4M3), fused, x.view(-1),
                               st.scale, used, a, out.view(-1))
    return {"tensorwise": tensorwise, "delayed": delayed,
            "delayed_fused_amax": delayed_fused_amax}


def updates(device: torch.device) -> dict:
    out = {}
    for n in (16, 1024):
        st = f.AmaxHistory(n, device)
        a = torch.full((), 3.0, device=device)
        fn = functools.partial(f._update_by, True, float(torch.finfo(E4M3).max), 0)
        out[f"update_compiled_h{n}"] = functools.partial(f.update_scale, st, a, E4M3, 0, "max")
        out[f"update_eager_h{n}"] = functools.partial(fn, st.history, a, st.scale)
    return out


def time_us(fn, reps: int) -> float:
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def kernels(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [[e.name[:90], round(e.device_time, 1)] for e in prof.events()
            if e.device_type.name == "CUDA"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) for s in SHAPES]
    per = [variants(x) for x in xs]
    for v in per:  # compile every variant at every shape first (dynamic shapes: once each)
        for fn in v.values():
            fn()
    rows = []
    for shape, v in zip(SHAPES, per):
        row = {"shape": list(shape)}
        for name, fn in v.items():
            row[name] = {"us": time_us(fn, args.reps), "kernels": kernels(fn)}
        rows.append(row)
    ups = updates(dev)
    for fn in ups.values():
        fn()
    up = {name: {"us": time_us(fn, args.reps), "kernels": kernels(fn)} for name, fn in ups.items()}
    names = list(per[0])
    print(f"probe_fp8_delayed: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"us per call, median of 5 x {args.reps}")
    print(f"{'shape':>12} " + " ".join(f"{n:>19}" for n in names))
    for r in rows:
        print(f"{'x'.join(map(str, r['shape'])):>12} " + " ".join(f"{r[n]['us']:>19.1f}" for n in names))
    for n, r in up.items():
        print(f"{n:>20} {r['us']:8.1f} us  {len(r['kernels'])} kernels")
    for n in names:
        print(f"  {n} at {SHAPES[0]}: {rows[0][n]['kernels']}")
    for n, r in up.items():
        print(f"  {n}: {r['kernels']}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_fp8_delayed.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "reps": args.reps, "rows": rows, "updates": up}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

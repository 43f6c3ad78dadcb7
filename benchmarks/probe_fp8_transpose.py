"""FP8's transposed copies on one GPU: the library's Triton kernels
(overlap/fp8_kernels.py) against the compiled kernels they replaced, at every tensor a
layer transposes (70B TP=8 and 8B TP=4, seq 4096 x micro-batch 2, a step's first
micro-batch).

A layer's FP8 work transposes 12 tensors. 8 are cast on this rank (the 4 weights, the row
layers' inputs, the column layers' output gradients): their cast writes both layouts in
one kernel (`kernel`: `quantize(..., out_t=)`), where the compiled cast wrote FP8 and a
compiled transpose read it back (`compiled`). Under delayed scaling the same kernel also
reduces the amax, which was a pass of its own before the cast (`delayed_kernel`:
`delayed_quantize`; `delayed_compiled`: torch's amax, the compiled cast, the compiled
transpose). The other 4 follow a gather (the column layers' inputs, the row layers' output
gradients): only their FP8 bytes are transposed (`transposed`: the kernel, or compiled).
`cast_only`: the compiled cast alone, what the transposed layout adds to. Current
scaling's amax of each of the 12 (of a gathered tensor, this rank's block, 1/TP of its
rows): torch's reduction (`amax_torch`) against the Triton kernel (`amax_kernel`:
`amax`), each the memset of its scalar and one kernel.

    python benchmarks/probe_fp8_transpose.py --out $OUT [--reps 30]

Microseconds per call: each arm captured in a CUDA graph of --inner calls, the arms' graph
replays alternating (`tune.measure.time_interleaved`), median of --reps. Every arm's bytes
are checked equal to the compiled arm's first. Writes <out>/probe_fp8_transpose.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

from dataclasses import replace

import torch

from megatron_overlap.overlap import fp8 as f
from megatron_overlap.simulate.shapes import PRESETS
from megatron_overlap.tune.measure import graphed, time_interleaved

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MODELS = {"70b_tp8": ("70b", 8), "8b_tp4": ("8b", 4)}  # seq 4096 x micro-batch 2


def tensors(model: str) -> list[tuple[str, int, int, torch.dtype, bool]]:
    """(name, rows, cols, FP8 dtype, cast on this rank) of the 12 tensors a layer's FP8 work
    transposes, from the layer's per-rank linears (simulate.shapes): each weight [n, k]; a
    column layer's gathered input [m, k] and its output gradient [m, n]; a row layer's
    input [m, k] and its gathered output gradient [m, n]."""
    preset, tp = MODELS[model]
    dims = replace(PRESETS[preset], seq_length=4096, micro_batch=2)
    out = []
    for sh in dims.shapes(preset.upper(), tp):
        out += [(f"w_{sh.buffer}", sh.n, sh.k, E4M3, True),
                (f"x_{sh.buffer}", sh.m, sh.k, E4M3, not sh.column),
                (f"dy_{sh.buffer}", sh.m, sh.n, E5M2, sh.column)]
    return out


def arms(m, n, dt, local, amax_rows, g):
    """name -> (function of no arguments, the tensors it writes: each arm its own, checked
    against the compiled arm's, the delayed arms' and the amax arms' against each other).
    `amax_rows`: the rows of x whose amax this rank takes (all, or its block of a tensor
    gathered)."""
    dev = torch.device("cuda")
    x = torch.randn(m, n, generator=g, device=dev, dtype=torch.bfloat16) * 3
    scale = f.scale_for(f.amax(x), dt)  # (a pair; the compiled cast takes its value)
    saturate = f._ao().to_fp8_saturated
    fp8 = lambda *shape: torch.empty(*shape, dtype=dt, device=dev)  # noqa: E731
    scalar = lambda: torch.empty((), device=dev)  # noqa: E731
    src, a1, a2 = x[:amax_rows], scalar(), scalar()
    amaxes = {"amax_torch": (lambda: f._amax_into(src, a1), (a1,)),
              "amax_kernel": (lambda: f.amax(src, out=a2), (a2,))}

    def compiled_t(src, dst):  # the compiled transpose the kernel replaced
        assert f._call_compiled(("transpose",), f._transpose_into,
                                (src.view(torch.uint8), dst.view(torch.uint8)), True,
                                torch.cuda.is_current_stream_capturing())
    if not local:
        o = f.quantize(x, scale, dt)
        ot, ot2 = fp8(n, m), fp8(n, m)
        return {"compiled": (lambda: compiled_t(o, ot), (ot,)),
                "transposed": (lambda: f.transposed(o, out=ot2), (ot2,)), **amaxes}
    (o, ot), (o1,), (o2, ot2) = (fp8(m, n), fp8(n, m)), (fp8(m, n),), (fp8(m, n), fp8(n, m))
    st = f.AmaxHistory(16, dev)
    st.scale.copy_(scale)
    o3, ot3, used3, a3 = fp8(m, n), fp8(n, m), f.scale_pair(dev), scalar()
    o4, ot4, used4, a4 = fp8(m, n), fp8(n, m), f.scale_pair(dev), scalar()
    cast = functools.partial(f._delayed_cast_by, saturate)

    def delayed_compiled():
        f._amax_into(x, a3)  # (torch's reduction, as before the kernels)
        assert f._run_compiled(("delayed_cast", x.dtype, dt), cast, x.view(-1), st.scale, used3,
                               o3.view(-1))
        compiled_t(o3, ot3)
    return {"compiled": (lambda: (f._fused_cast(x, f.scale_value(scale), o), compiled_t(o, ot)), (o, ot)),
            "cast_only": (lambda: f._fused_cast(x, f.scale_value(scale), o1), (o1,)),
            "kernel": (lambda: f.quantize(x, scale, dt, out=o2, out_t=ot2), (o2, ot2)),
            "delayed_compiled": (delayed_compiled, (o3, ot3, a3, used3)),
            "delayed_kernel": (lambda: f.delayed_quantize(x, st, dt, used4, a4, out=o4, out_t=ot4),
                               (o4, ot4, a4, used4)), **amaxes}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (FP8 as bytes)."""
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=10, help="calls per captured graph")
    ap.add_argument("--models", default="70b_tp8,8b_tp4")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, failed = [], 0
    for model in args.models.split(","):
        tp = MODELS[model][1]
        for name, m, n, dt, local in tensors(model):
            fns = arms(m, n, dt, local, m if local else m // tp, g)
            for fn, _ in fns.values():  # compile, and the check: every arm's bytes = compiled's
                fn()
            torch.cuda.synchronize()
            ref = fns["compiled"][1]
            ok = {arm: all(same_bytes(a, b) for a, b in zip(got, ref))
                  for arm, (fn, got) in fns.items()
                  if arm != "compiled" and not arm.startswith(("delayed", "amax"))}
            ok["amax_kernel"] = same_bytes(fns["amax_kernel"][1][0], fns["amax_torch"][1][0])
            if local:
                want = fns["delayed_compiled"][1]
                ok["delayed_kernel"] = all(same_bytes(a, b) for a, b in
                                           zip(fns["delayed_kernel"][1], want))
            failed += sum(not v for v in ok.values())

            def inner(fn):
                def run():
                    for _ in range(args.inner):
                        fn()
                return run
            replays = {arm: graphed(inner(fn)) for arm, (fn, _) in fns.items()}
            ms = time_interleaved(replays, args.reps)
            us = {arm: round(v * 1e3 / args.inner, 2) for arm, v in ms.items()}
            moved = m * n * (4 if local else 2)  # bf16 read, FP8 written twice | FP8 read + written
            rows.append({"model": model, "tensor": name, "shape": [m, n], "fp8": str(dt),
                         "cast_here": local, "us": us, "bytes_equal": ok,
                         "min_bytes_moved": moved})
            new = us["kernel" if local else "transposed"]
            delayed = (f"  delayed: compiled {us['delayed_compiled']:7.1f}, kernel "
                       f"{us['delayed_kernel']:7.1f}; the cast alone {us['cast_only']:6.1f}"
                       if local else "")
            differ = [k for k, v in ok.items() if not v]
            read = (m if local else m // tp) * n * 2  # the amax's bf16 bytes
            print(f"{model:8} {name:8} {m:5}x{n:<5} compiled {us['compiled']:7.1f}  kernel "
                  f"{new:7.1f} ({moved / new / 1e6:4.2f} TB/s){delayed}; amax torch "
                  f"{us['amax_torch']:6.1f}, kernel {us['amax_kernel']:6.1f} "
                  f"({read / us['amax_kernel'] / 1e6:4.2f} TB/s)"
                  + (f"  BYTES DIFFER: {differ}" if differ else ""))
    for model in args.models.split(","):
        rs = [r for r in rows if r["model"] == model]
        old = sum(r["us"]["compiled"] for r in rs)
        new = sum(r["us"]["kernel" if r["cast_here"] else "transposed"] for r in rs)
        d_old = sum(r["us"]["delayed_compiled" if r["cast_here"] else "compiled"] for r in rs)
        d_new = sum(r["us"]["delayed_kernel" if r["cast_here"] else "transposed"] for r in rs)
        a_old, a_new = (sum(r["us"][k] for r in rs) for k in ("amax_torch", "amax_kernel"))
        print(f"{model}: a layer's 12 (8 casts with their transposes, 4 transposes) tensorwise "
              f"{old:.0f} -> {new:.0f} us; delayed (its amaxes too) {d_old:.0f} -> {d_new:.0f} us; "
              f"tensorwise's 12 amaxes {a_old:.0f} -> {a_new:.0f} us")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_fp8_transpose.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "reps": args.reps, "inner": args.inner,
                   "rows": rows, "failed_checks": failed}, fh, indent=1)
    print(f"checks: {failed} failed")
    return 2 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

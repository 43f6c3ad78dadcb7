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
`cast_only`: the compiled cast alone, what the transposed layout adds to.

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

import torch

from megatron_overlap.overlap import fp8 as f
from megatron_overlap.tune.measure import graphed, time_interleaved

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOKENS = 8192
# (name, rows, cols, FP8 dtype, cast here: True; gathered FP8: False) per model
TENSORS = {
    "70b_tp8": [("w_qkv", 1280, 8192, E4M3, True), ("w_proj", 8192, 1024, E4M3, True),
                ("w_fc1", 7168, 8192, E4M3, True), ("w_fc2", 8192, 3584, E4M3, True),
                ("x_proj", TOKENS, 1024, E4M3, True), ("x_fc2", TOKENS, 3584, E4M3, True),
                ("dy_qkv", TOKENS, 1280, E5M2, True), ("dy_fc1", TOKENS, 7168, E5M2, True),
                ("x_qkv", TOKENS, 8192, E4M3, False), ("x_fc1", TOKENS, 8192, E4M3, False),
                ("dy_proj", TOKENS, 8192, E5M2, False), ("dy_fc2", TOKENS, 8192, E5M2, False)],
    "8b_tp4": [("w_qkv", 1536, 4096, E4M3, True), ("w_proj", 4096, 1024, E4M3, True),
               ("w_fc1", 7168, 4096, E4M3, True), ("w_fc2", 4096, 3584, E4M3, True),
               ("x_proj", TOKENS, 1024, E4M3, True), ("x_fc2", TOKENS, 3584, E4M3, True),
               ("dy_qkv", TOKENS, 1536, E5M2, True), ("dy_fc1", TOKENS, 7168, E5M2, True),
               ("x_qkv", TOKENS, 4096, E4M3, False), ("x_fc1", TOKENS, 4096, E4M3, False),
               ("dy_proj", TOKENS, 4096, E5M2, False), ("dy_fc2", TOKENS, 4096, E5M2, False)],
}
def arms(m, n, dt, local, g):
    """name -> (function of no arguments, the tensors whose bytes must equal the compiled arm's)."""
    dev = torch.device("cuda")
    x = torch.randn(m, n, generator=g, device=dev, dtype=torch.bfloat16) * 3
    scale = f.scale_for(f.amax(x), dt)
    saturate = f._ao().to_fp8_saturated
    o, ot = torch.empty(m, n, dtype=dt, device=dev), torch.empty(n, m, dtype=dt, device=dev)

    def compiled_t(src, dst):  # the compiled transpose the kernel replaced
        assert f._call_compiled(("transpose",), f._transpose_into, (src.view(torch.uint8),
                                dst.view(torch.uint8)), True, torch.cuda.is_current_stream_capturing())
    if not local:
        f.quantize(x, scale, dt, out=o)
        ot2 = torch.empty_like(ot)
        return {"compiled": (lambda: compiled_t(o, ot), (ot,)),
                "transposed": (lambda: f.transposed(o, out=ot2), (ot2,))}
    o2, ot2 = torch.empty_like(o), torch.empty_like(ot)
    st = f.AmaxHistory(16, dev)
    st.scale.copy_(scale)
    used, a = torch.empty((), device=dev), torch.empty((), device=dev)
    o3, ot3 = torch.empty_like(o), torch.empty_like(ot)
    used3, a3 = torch.empty((), device=dev), torch.empty((), device=dev)
    cast = functools.partial(f._delayed_cast_by, saturate)

    def delayed_compiled():
        f.amax(x, out=a)
        assert f._run_compiled(("delayed_cast", x.dtype, dt), cast, x.view(-1), st.scale, used,
                               o3.view(-1))
        compiled_t(o3, ot3)
    return {"compiled": (lambda: (f._fused_cast(x, scale, o), compiled_t(o, ot)), (o, ot)),
            "cast_only": (lambda: f._fused_cast(x, scale, o), (o,)),
            "kernel": (lambda: f.quantize(x, scale, dt, out=o2, out_t=ot2), (o2, ot2)),
            "delayed_compiled": (delayed_compiled, (o3, ot3, a, used)),
            "delayed_kernel": (lambda: f.delayed_quantize(x, st, dt, used3, a3, out=o2, out_t=ot2),
                               (o2, ot2, a3, used3))}


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
        for name, m, n, dt, local in TENSORS[model]:
            fns = arms(m, n, dt, local, g)
            for fn, _ in fns.values():  # compile, and the check: every arm's bytes = compiled's
                fn()
            torch.cuda.synchronize()
            ref = fns["compiled"][1]
            ok = {arm: all(same_bytes(a, b) for a, b in zip(got, ref))
                  for arm, (fn, got) in fns.items() if not arm.startswith("delayed")}
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
            print(f"{model:8} {name:8} {m:5}x{n:<5} compiled {us['compiled']:7.1f}  kernel {new:7.1f} "
                  f"({moved / new / 1e6:4.2f} TB/s)"
                  + (f"  delayed: compiled {us['delayed_compiled']:7.1f}, kernel "
                     f"{us['delayed_kernel']:7.1f}; the cast alone {us['cast_only']:6.1f}" if local else "")
                  + ("" if all(ok.values()) else f"  BYTES DIFFER: {[k for k, v in ok.items() if not v]}"))
    for model in args.models.split(","):
        rs = [r for r in rows if r["model"] == model]
        old = sum(r["us"]["compiled"] for r in rs)
        new = sum(r["us"]["kernel" if r["cast_here"] else "transposed"] for r in rs)
        d_old = sum(r["us"]["delayed_compiled" if r["cast_here"] else "compiled"] for r in rs)
        d_new = sum(r["us"]["delayed_kernel" if r["cast_here"] else "transposed"] for r in rs)
        print(f"{model}: a layer's 12 (8 casts with their transposes, 4 transposes) tensorwise "
              f"{old:.0f} -> {new:.0f} us; delayed (its amaxes too) {d_old:.0f} -> {d_new:.0f} us")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_fp8_transpose.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "reps": args.reps, "inner": args.inner,
                   "rows": rows, "failed_checks": failed}, fh, indent=1)
    print(f"checks: {failed} failed")
    return 2 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

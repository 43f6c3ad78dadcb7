"""Whether the cast-transpose Triton kernel (overlap/fp8_triton.py's `cast_t`) writes every
byte of both its outputs, over many launches, on the GPU suite's shapes: float32 and
bf16 inputs, e4m3 and e5m2, the cast with its transposed copy and the transpose of FP8
bytes alone. Each output starts as 0x7F bytes (a NaN in both formats, which no finite
input casts to), so a byte left unwritten never passes for a right one, as a reused
allocation's stale copy of the expected bytes once did in the suite.

`--old FILE`: also a previous version of the kernel module, e.g.
`git show bf9a1ea:megatron_overlap/overlap/fp8_triton.py > /tmp/old_fp8_triton.py`,
checked side by side (its flags as that version takes them). Every module is timed,
interleaved (CUDA events around a CUDA graph of 20 launches, median of 5), on a gathered fc1 output's
[8192, 7168] and a rank's sequence-parallel [2048, 4096], bf16 and float32: the cast
with its transposed copy, the same reducing delayed scaling's amax, and current scaling's
amax alone (`KINDS`; an old module timed must take the current kernels' flags).

    python benchmarks/probe_cast_t.py --reps 20 [--old /tmp/old_fp8_triton.py] [--out DIR]

Prints, per kernel, the launches with a wrong byte per case; writes
<out>/probe_cast_t.json. Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys

import torch

SHAPES = [(1024, 8192), (1000, 272), (8192, 1280)]
FP8S = (torch.float8_e4m3fn, torch.float8_e5m2)


def load_old(path: str):
    """The kernel module at `path`, its relative import of fp8_kernels made absolute."""
    src = open(path).read().replace("from . import fp8_kernels",
                                    "from megatron_overlap.overlap import fp8_kernels")
    tmp = os.path.join(os.path.dirname(path), "_probe_old_fp8_triton.py")  # Triton reads the source
    with open(tmp, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_fp8_triton", tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(mod, x, scale, o, ot, cast: bool) -> None:
    """One cast_t launch as overlap/fp8_kernels.py makes it (tiles of its BLOCK)."""
    from megatron_overlap.overlap.fp8_kernels import BLOCK

    (m, n), (bm, bn, warps) = x.shape, BLOCK
    flags = dict(CAST=cast, WRITE_T=True, AMAX=False, FROM_AMAX=False, NA=1, BM=bm, BN=bn,
                 FMAX=float(torch.finfo(o.dtype).max) if cast else 0.0)
    params = inspect.signature(mod.cast_t.fn).parameters
    if "T_FROM_O" in params:
        flags["T_FROM_O"] = cast and x.dtype == torch.float32
    sizes = (m, n, 1)
    if "CHUNK_MAJOR" in params:  # (a kernel that can write o chunk-major: here row-major)
        flags["CHUNK_MAJOR"], sizes = False, (m, n, 1, 1, 1)
    t = (x, scale, o, ot, scale, scale) if cast else (x, x, x, ot, x, x)
    mod.cast_t[(-(-m // bm), -(-n // bn))](*t, *sizes, num_warps=warps, **flags)


def unwritten(shape, fp8):
    return torch.full(tuple(shape), 0x7F, dtype=torch.uint8, device="cuda").view(fp8)


def check(mod, reps: int, gen: torch.Generator) -> dict:
    """Per case, the launches (of `reps`) with a wrong byte, and the first one's wrong rows
    of the transposed copy."""
    out = {}
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for fp8 in FP8S:
                for cast in (True, False) if dtype == torch.float32 else (True,):
                    case = f"{shape[0]}x{shape[1]} {str(dtype)[6:]} {str(fp8)[6:]} {'cast' if cast else 'bytes'}"
                    bad, rows = 0, None
                    for _ in range(reps):
                        x = (torch.randn(shape, device="cuda", generator=gen) * 40).to(dtype)
                        if not cast:
                            x = x.to(fp8)
                        fmax = torch.finfo(fp8).max
                        scale = (fmax / x.float().abs().amax()).reshape(())
                        o, ot = unwritten(shape, fp8), unwritten(shape[::-1], fp8)
                        launch(mod, x, scale, o, ot, cast)
                        want = ((x.float() * scale).clamp(-fmax, fmax).to(fp8) if cast else x).view(torch.uint8)
                        wrong_t = (ot.view(torch.uint8) != want.t()).any(1)
                        if (cast and not torch.equal(o.view(torch.uint8), want)) or wrong_t.any():
                            bad += 1
                            rows = rows or wrong_t.nonzero().flatten()[:8].tolist()
                    out[case] = {"wrong_launches": bad, "first_wrong_rows_t": rows}
    return out


KINDS = ("cast_t", "cast_t_amax", "amax")  # what `timed` launches, each as the layers do
TIMED_SHAPES = ((8192, 7168), (2048, 4096))  # a gathered fc1 output's; a rank's SP input


def launch_kind(mod, kind: str, x: torch.Tensor, bufs: dict) -> None:
    """One launch of `kind` as overlap/fp8_kernels.py makes it, on `mod`'s kernels: the
    cast with its transposed copy at a given scale (tensorwise once its scale is made),
    the same with delayed scaling's amax reduced in it, or current scaling's amax alone."""
    from megatron_overlap.overlap import fp8_kernels

    if kind == "cast_t":
        return launch(mod, x, bufs["scale"], bufs["o"], bufs["ot"], True)
    if kind == "amax":
        bufs["amax"].zero_()  # (as fp8_kernels.run does before it)
        args, kernel = (x, bufs["amax"]), mod.fp8_amax
        name = "amax"
    else:
        bufs["amax"].zero_()  # (as the layers zero it before a pass)
        args = (x, bufs["pair"], bufs["used"], bufs["amax"], bufs["o"], bufs["ot"])
        kernel, name = mod.cast_t, "delayed_cast_amax_t"
    ln = fp8_kernels._launch(name, args)
    kernel[ln.grid](*ln.tensors, *ln.sizes, num_warps=ln.warps, **ln.flags)


def launches_graphed(mod, kind: str, x: torch.Tensor, bufs: dict, inner: int):
    """`inner` launches of `kind` captured in one CUDA graph (compiled first): timed by
    replays, the host's launch cost (tens of us a Triton launch, more than a small
    tensor's kernel) stays out of the device time."""
    launch_kind(mod, kind, x, bufs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            launch_kind(mod, kind, x, bufs)
    g.replay()
    return g


def timed(kernels: dict, reps: int = 5, inner: int = 20) -> dict:
    """µs per launch, per shape, input dtype, kind (KINDS) and kernel module, the modules
    interleaved (CUDA events around a graph of `inner` launches, median of `reps`)."""
    res = {}
    for shape in TIMED_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            bufs = dict(scale=torch.tensor(3.0, device="cuda"),
                        pair=torch.tensor([1 / 3.0, 3.0], device="cuda"),
                        used=torch.zeros(2, device="cuda"), amax=torch.zeros((), device="cuda"),
                        o=unwritten(shape, FP8S[0]), ot=unwritten(shape[::-1], FP8S[0]))
            for kind in KINDS:
                ts = {k: [] for k in kernels}
                graphs = {k: launches_graphed(kernels[k], kind, x, bufs, inner) for k in kernels}
                for r in range(reps):
                    for name in (list(kernels) if r % 2 else list(kernels)[::-1]):
                        a = torch.cuda.Event(enable_timing=True)
                        b = torch.cuda.Event(enable_timing=True)
                        a.record()
                        graphs[name].replay()
                        b.record()
                        b.synchronize()
                        ts[name].append(a.elapsed_time(b) / inner * 1e3)
                key = f"{shape[0]}x{shape[1]} {str(dtype)[6:]} {kind}"
                res[key] = {k: statistics.median(v) for k, v in ts.items()}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--old", help="a previous fp8_triton.py to run beside the current one")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_cast_t: needs a CUDA GPU")
    from megatron_overlap.overlap import fp8_triton

    kernels = {"current": fp8_triton}
    if args.old:
        kernels["old"] = load_old(args.old)
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = {"reps": args.reps, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "checks": {k: check(m, args.reps, gen) for k, m in kernels.items()},
           "us_per_launch": timed(kernels)}
    for k, cases in doc["checks"].items():
        bad = {c: v for c, v in cases.items() if v["wrong_launches"]}
        print(f"{k}: {len(bad)} of {len(cases)} cases with a wrong byte (of {args.reps} launches each)")
        for c, v in bad.items():
            print(f"  {c}: {v['wrong_launches']} launches; transposed rows wrong first {v['first_wrong_rows_t']}")
    for case, t in doc["us_per_launch"].items():
        print(f"{case}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_cast_t.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

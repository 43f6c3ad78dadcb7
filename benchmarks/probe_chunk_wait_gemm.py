"""Would one GEMM that waits per chunk beat the ring's chunk GEMMs? A probe (one GPU).

A ring all-gather multiplies each arrived block by its own cuBLAS GEMM (`overlap.ag_gemm`),
and 1024-row chunk GEMMs of the small layers fill the chip poorly: at 70B TP=8 the qkv
forward and proj dgrad rings keep 0.70-0.75 of a whole GEMM in FP8. Flux's answer is one
persistent GEMM kernel over the whole gathered input whose tiles wait for their rows' chunk
to arrive (a flag per chunk). The library's is `overlap.wait_gemm` (the `wait_gemm` key).
This measures its compute side, every flag already set: each tile config of a sweep, the
kernel alone through TMA descriptors (`tma_i`) and through pointers (`ptr_i`), and the
library's whole schedule (`ring_wait`: the ring's pass through `pass_fn` on the `null`
transport, flags, side stream and all), against cuBLAS on the whole input and against the
ring's own chunk GEMMs (`pass_fn` on `null`, 1 and 3 streams), bf16 and FP8 (e4m3,
per-tensor scales), all captured in CUDA graphs and timed interleaved. The same two
schedules on the mirror transport (`ring_wait_mirror`, `ring_1_stream_mirror`) copy each
block as it would arrive (copy-engine copies, on one GPU), so the waiting tiles' polls
run beside transfers as in a layer. A dgrad's bf16 weight reaches the GEMM N-major (the
[K, N] weight as stored), a forward's K-major, as in the layer; FP8 weights K-major.

Predicted before measuring (METHOD.md): the Triton kernel at 0.80-0.95 of cuBLAS whole
(Triton's Hopper GEMMs trail cuBLAS by 5-20%), so ahead of the chunk GEMMs where those keep
under ~0.8 (N of 1024-1280) and behind them at fc1 (N 7168, chunks at ~0.93-0.97). Each
tile's wait is one acquire load of its chunk's flag: nothing measurable when set.

    python benchmarks/probe_chunk_wait_gemm.py [--reps 30] [--dtypes bf16 fp8]
    TRITON_INTERPRET=1 python benchmarks/probe_chunk_wait_gemm.py --device cpu   # the kernel's check, fp32

Writes <out>/probe_chunk_wait_gemm_<tag>.json and prints a table (ratio = cuBLAS whole ms /
arm ms). Needs Triton (on CPU its interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# (name, gathered rows M, K, N, TP): the passes whose FP8 chunk GEMMs miss 0.93 at the
# tuner's picks (docs/fp8.md), and fc1's forward, where the chunks keep ~0.95
SHAPES = [("70B_tp8_qkv_fprop", 8192, 8192, 1280, 8), ("70B_tp8_proj_dgrad", 8192, 8192, 1024, 8),
          ("70B_tp8_fc2_dgrad", 8192, 8192, 3584, 8), ("70B_tp8_fc1_fprop", 8192, 8192, 7168, 8),
          ("8B_tp2_qkv_fprop", 8192, 4096, 3072, 2), ("8B_tp2_proj_dgrad", 8192, 4096, 2048, 2)]
CPU_SHAPES = [("tiny", 512, 256, 256, 2)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M) per operand dtype
CONFIGS = {"bf16": [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 64, 4, 4, 8),
                    (128, 256, 64, 8, 4, 8)],
           "fp8": [(128, 256, 128, 8, 3, 8), (128, 128, 128, 8, 4, 8), (128, 128, 128, 4, 4, 8),
                   (128, 256, 128, 8, 4, 8)]}
# Triton's interpreter computes bf16 wrongly (numpy has no bf16): on CPU the check runs fp32
CPU_CONFIGS = {"fp32": [(128, 128, 64, 4, 1, 2)]}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16}  # fp8: from bf16


def probe_shape(name: str, m: int, k: int, n: int, tp: int, dtype: str, configs: list,
                device: torch.device, reps: int) -> dict:
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.layers.fp8 import quantized
    from megatron_overlap.overlap.fp8 import ScaledGemm
    from megatron_overlap.overlap.gemm import matmul
    from megatron_overlap.overlap.pass_fn import pass_fn
    from megatron_overlap.overlap.streams import ChunkStreams
    from megatron_overlap.overlap.wait_gemm import launch, tma

    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, DTYPES[dtype])
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, DTYPES[dtype])
    if "dgrad" in name and dtype != "fp8":  # the [K, N] weight as stored, viewed [N, K]
        w = w.t().contiguous().t()
    rows = m // tp
    ready = torch.ones(tp, dtype=torch.int32, device=device)  # every chunk arrived
    out = torch.empty(m, n, dtype=DTYPES[dtype], device=device)
    if dtype == "fp8":
        (xa, xs, _), (wa, ws, _) = (quantized(t, torch.float8_e4m3fn) for t in (x, w))
        # accumulated as the layer's pass would: fast in a forward (install()'s default)
        gemm = ScaledGemm(xs, ws, torch.bfloat16, fast_accum="fprop" in name)
        whole = lambda: gemm(xa, wa.t(), out=out, op="whole")  # noqa: E731
    else:
        xa, wa, gemm = x, w, matmul
        whole = lambda: torch.mm(xa, wa.t(), out=out)  # noqa: E731
    arms = {"cublas_whole": whole}

    def ring(tag, transport, **kw):
        return pass_fn(xa[(tp - 1) * rows:], wa, transport(tp, tp - 1), "ag", "ring_exchange", 1,
                       name=f"probe_{name}_{tag}", gemm=gemm, **kw)
    for n_streams in (1, 3):
        arms[f"ring_{n_streams}_stream"] = ring(n_streams, NullTransport,
                                                streams=ChunkStreams(n=n_streams))
    # the library's schedule: the ring on null (no transfers) with its one waiting GEMM
    arms["ring_wait"] = ring("wait", NullTransport, wait=True)
    arms["ring_1_stream_mirror"] = ring("mirror", MirrorTransport, streams=ChunkStreams(n=1))
    arms["ring_wait_mirror"] = ring("wait_mirror", MirrorTransport, wait=True)
    order = torch.arange(tp, dtype=torch.int32, device=device)
    kinds = ("tma", "ptr") if tma(xa, wa.t(), out) else ("ptr",)  # TMA: Hopper on
    for i, cfg in enumerate(configs):  # the kernel alone, each tile config, either kernel
        for kind in kinds:
            arms[f"{kind}_{i}"] = (lambda cfg=cfg, kind=kind: launch(
                xa, wa.t(), out, ready, order, rows, gemm, op="probe", timeout_s=60.0, cfg=cfg,
                descriptors=kind == "tma"))
    # the check: every arm's product against cuBLAS whole (a ring's rows are this rank's
    # block, repeated on `null`: compare the last rank's rows, which it computes from x);
    # the shared output is NaN before each arm, so one that writes nothing fails
    whole()
    want = out.float().clone()
    res: dict = {"shape": name, "m": m, "k": k, "n": n, "tp": tp, "dtype": dtype, "arms": {}}
    for arm, fn in list(arms.items()):
        out.fill_(float("nan"))
        try:
            got = fn() if arm.startswith("ring") else (fn(), out)[1]
        except Exception as e:  # noqa: BLE001  (a Triton config that does not compile here)
            if not arm.startswith(("tma", "ptr")):
                raise
            res["arms"][arm] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            del arms[arm]
            continue
        got = got.float()[-rows:] if arm.startswith("ring") else got.float()
        ref = want[-rows:] if arm.startswith("ring") else want
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        res["arms"][arm] = {"rel_err": err}
        if not err <= 2e-2:
            raise SystemExit(f"probe_chunk_wait_gemm: {name} {dtype} {arm}: max |diff| / max "
                             f"|cuBLAS| = {err:.3g}")
    if device.type != "cuda":
        return res
    from megatron_overlap.tune.measure import graphed, time_interleaved

    times = time_interleaved({a: graphed(fn) for a, fn in arms.items()}, reps)
    for arm, ms in times.items():
        res["arms"][arm].update(ms=ms, ratio=times["cublas_whole"] / ms,
                                tflops=2 * m * k * n / ms / 1e9)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=None,
                    help="default: bf16 fp8 on a GPU, fp32 on CPU")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shapes, configs = (SHAPES, CONFIGS) if device.type == "cuda" else (CPU_SHAPES, CPU_CONFIGS)
    rows = []
    for name, m, k, n, tp in shapes:
        for dtype in args.dtypes or (["bf16", "fp8"] if device.type == "cuda" else ["fp32"]):
            rows.append(probe_shape(name, m, k, n, tp, dtype, configs[dtype], device, args.reps))
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__,
           "configs": configs, "command": " ".join([sys.executable, *sys.argv]), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"probe_chunk_wait_gemm_{args.tag or device.type}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"probe_chunk_wait_gemm: {doc['device']}, torch {doc['torch']}, triton {doc['triton']}")
    for r in rows:
        a = r["arms"]
        if "ms" not in a["cublas_whole"]:
            print(f"{r['shape']:20s} {r['dtype']:4s} checked: " +
                  ", ".join(f"{k} {v['rel_err']:.1e}" for k, v in a.items()))
            continue
        def kernel(kind: str) -> str:
            tri = {k: v.get("ratio") for k, v in a.items() if k.startswith(kind)}
            ran = [k for k, v in tri.items() if v is not None]
            best = f"{tri[max(ran, key=tri.get)]:.3f}" if ran else "-"
            return f"{kind} best {best} (" + ", ".join(
                "failed" if v is None else f"{v:.3f}" for v in tri.values()) + ")"
        print(f"{r['shape']:20s} {r['dtype']:4s} cuBLAS whole {a['cublas_whole']['ms']:.3f} ms "
              f"({a['cublas_whole']['tflops']:.0f} TFLOP/s); ring 1 / 3 streams "
              f"{a['ring_1_stream']['ratio']:.3f} / {a['ring_3_stream']['ratio']:.3f}, waiting "
              f"{a['ring_wait']['ratio']:.3f}; mirror: ring 1 {a['ring_1_stream_mirror']['ratio']:.3f}, "
              f"waiting {a['ring_wait_mirror']['ratio']:.3f}; {kernel('tma')}; {kernel('ptr')}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

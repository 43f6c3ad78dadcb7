"""Compute side of each pass in FP8 against bf16, at the tuner's picks, on one GPU: for
every pass the tuner chose (its `--json`; by default the H200 picks in
benchmarks/results), four figures measured side by side (arms interleaved, CUDA-graph
replay, medians of --repeat rounds of --reps):

- bf16 whole: one bf16 GEMM of the pass's size in its operand layout (tune_check's
  reference, `tune.measure.gemm_operands`);
- bf16 chunked: the pass with the picked settings on the null transport, through the
  layer's own pass function (`tune.passes.trial_pass`);
- fp8 whole: one `torch._scaled_mm` of the pass's size (e4m3; the gradient e5m2 under
  'hybrid'), the whole-GEMM form every FP8 pass has (row-major x column-major), accumulated
  fast where the pass's GEMMs are (the forward's, the layers' default);
- fp8 chunked: the same pass in FP8 (`tune.passes.fp8_trial_pass`: FP8 operands with
  their scaled GEMM into the same pass function);
- fp8 whole + own work (wgrads and ring reduce-scatters): the whole FP8 GEMM with the
  work its pass does beside the GEMM, chunked or not, so that chunked / this is the
  chunking's own cost. A wgrad: the transposed copy of its gathered token-major operand
  (a column layer's input, a row layer's gradient), made as the pass makes it. A ring
  reduce-scatter (`gemm_rs.ring_exchange`): the sum of the TP partials of this rank's
  block, which the pass runs itself (one kernel) where a pipelined one leaves it to the
  collective (on the null transport: not run, so not timed); the same sum on the whole
  GEMM's output.

The FP8 operands are quantized before the timing: the layer quantizes each once per pass
(before any transfer), whole or chunked alike; so are the transposed copies its casts
write (the dgrad's weight; a wgrad's operand that is not gathered); a wgrad's gathered
operand is transposed in the pass, as the layer's wgrad transposes it. The whole layer
with its quantization is benchmarks/fp8_layer.py's; the FP8 work's bytes and kernels,
simulate/fp8_work.py's. Goal: fp8 chunked >= 0.93 of fp8 whole (graphed).

    python benchmarks/fp8_compute.py [--tune A.json B.json] [--reps 20] [--repeat 3]
    python benchmarks/fp8_compute.py --device cpu --shrink 64       # FUNCTIONAL ONLY

Writes <out>/fp8_compute_<tag>.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tune_check import _cpu_ms, chosen_trials  # noqa: E402  (the tuner's picks, read once)

from megatron_overlap.comm import NullTransport  # noqa: E402
from megatron_overlap.simulate.numerics import Numerics  # noqa: E402
from megatron_overlap.tune.measure import gemm_operands  # noqa: E402
from megatron_overlap.tune.passes import layout_nodes, precision_of, trial_pass  # noqa: E402

GOAL = 0.93
TUNE = [os.path.join(HERE, "results", f) for f in ("tune_compute_70b_tp8_h200_2026-12-04b.json",
                                                    "tune_compute_8b_tp2_h200_2026-12-04b.json")]
HYBRID = precision_of(Numerics(fp8="hybrid"))  # the layers' default: the fprop accumulates fast
ARMS = ("bf16_whole", "bf16_chunked", "fp8_whole", "fp8_chunked", "fp8_whole_own")


def shrink(trial, by: int):
    """The trial at M, K, N divided by `by` (multiples of 16 x TP kept): for a CPU."""
    s = trial.spec.shape
    unit = 16 * s.tp
    m = max(unit, s.m // by // unit * unit)
    kn = lambda v: max(16, v // by // 16 * 16)  # noqa: E731
    shape = dataclasses.replace(s, m=m, k=kn(s.k), n=kn(s.n))
    return dataclasses.replace(trial, spec=dataclasses.replace(trial.spec, shape=shape))


def fns(trial, device: str) -> dict:
    """The four arms' closures for one pass."""
    from megatron_overlap.overlap import fp8

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tp, nodes = NullTransport(trial.spec.shape.tp), layout_nodes(trial)
    m, k, n = trial.spec.gemm
    a, b = gemm_operands(m, k, n, trial.spec.gemm_layout, device=device, dtype=dtype)
    first = HYBRID.fwd if trial.spec.pass_name == "fprop" else HYBRID.grad

    def q(t, d):
        s = fp8.scale_for(fp8.amax(t), d)
        return fp8.quantize(t, s, d), s
    a8, sa = q(torch.randn(m, k, device=device), first)
    b8, sb = q(torch.randn(n, k, device=device), HYBRID.fwd)
    fast = HYBRID.fast_accum(trial.spec.pass_name)  # as the pass's own GEMMs
    whole8 = fp8.ScaledGemm(sa, sb, dtype, fast_accum=fast)
    out8 = torch.empty(m, n, device=device, dtype=dtype)
    arms = {"bf16_whole": lambda: torch.matmul(a, b),
            "bf16_chunked": trial_pass(trial, tp, device, dtype, nodes=nodes).run,
            "fp8_whole": lambda: whole8(a8, b8.t(), out8, op="whole"),
            "fp8_chunked": trial_pass(trial, tp, device, dtype, nodes=nodes, precision=HYBRID).run}
    if trial.spec.pass_name == "wgrad":  # the gathered operand token-major: [k, n] or [k, m]
        if trial.spec.shape.column:  # the gathered input (b); the gradient as its cast left it
            b_tok = fp8.transposed(b8)
            layout = lambda: whole8(a8, fp8.transposed(b_tok).t(), out8, op="whole")  # noqa: E731
        else:  # the gathered gradient (a); the input as its cast left it
            a_tok = fp8.transposed(a8)
            layout = lambda: whole8(fp8.transposed(a_tok), b8.t(), out8, op="whole")  # noqa: E731
        arms["fp8_whole_own"] = layout
    s = trial.candidate.settings
    if s.is_reduce_scatter and s.method == "ring_exchange" and not nodes:
        world = trial.spec.shape.tp
        red = torch.empty(m // world, n, device=device, dtype=dtype)

        def whole_sum():  # the GEMM, then the pass's one sum of the TP partials of a block
            whole8(a8, b8.t(), out8, op="whole")
            return torch.sum(out8.view(world, m // world, n), dim=0, out=red)
        arms["fp8_whole_own"] = whole_sum
    return arms


def measure(trial, device: str, reps: int, repeat: int) -> dict:
    """Median ms per arm (graphed on a GPU, perf_counter on CPU), arms interleaved."""
    from megatron_overlap.ab.timing import rotated

    f = fns(trial, device)
    if device == "cuda":
        from megatron_overlap.tune.measure import graphed, time_ms
        f = {k: graphed(v) for k, v in f.items()}
        timer = lambda fn: time_ms(fn, reps, warmup=2)  # noqa: E731
    else:
        timer = lambda fn: _cpu_ms(fn, reps)  # noqa: E731
    samples = {k: [] for k in f}
    for r in range(repeat):
        for k in rotated(list(f), r):
            samples[k].append(timer(f[k]))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    del f
    own = ms.get("fp8_whole_own", ms["fp8_whole"])  # the whole GEMM with the pass's own work
    return {**{f"{k}_ms": ms.get(k) for k in ARMS}, "samples": samples,
            "fp8_chunked_vs_whole": ms["fp8_whole"] / ms["fp8_chunked"],
            "fp8_chunked_vs_whole_own": own / ms["fp8_chunked"],
            "bf16_chunked_vs_whole": ms["bf16_whole"] / ms["bf16_chunked"],
            "fp8_speedup_whole": ms["bf16_whole"] / ms["fp8_whole"],
            "fp8_speedup_chunked": ms["bf16_chunked"] / ms["fp8_chunked"]}


def table(doc: dict) -> str:
    lines = [f"fp8_compute: {doc['meta']['device']}, torch {doc['meta']['torch']}, median of "
             f"{doc['config']['repeat']} x {doc['config']['reps']}, "
             + ("CUDA-graph replay" if doc["meta"]["device"] != "cpu" else "CPU: FUNCTIONAL ONLY"),
             f"{'pass':22s} {'pick':30s} {'bf16 whole':>10s} {'chunked':>8s} {'fp8 whole':>9s} "
             f"{'chunked':>8s} {'fp8 ch/wh':>9s} {'bf16 ch/wh':>10s} {'fp8 x whole':>11s} "
             f"{'x chunked':>9s} {'ch/wh+own':>10s}"]
    for r in doc["rows"]:
        lines.append(f"{r['shape'] + ' ' + r['pass']:22s} {r['pick'][:30]:30s} {r['bf16_whole_ms']:10.3f} "
                     f"{r['bf16_chunked_ms']:8.3f} {r['fp8_whole_ms']:9.3f} {r['fp8_chunked_ms']:8.3f} "
                     f"{r['fp8_chunked_vs_whole']:9.3f} {r['bf16_chunked_vs_whole']:10.3f} "
                     f"{r['fp8_speedup_whole']:11.2f} {r['fp8_speedup_chunked']:9.2f} "
                     f"{r['fp8_chunked_vs_whole_own']:10.3f}")
    g = doc["goal"]
    lines.append(f"goal: fp8 chunked >= {GOAL} of fp8 whole at every pick: "
                 f"{'met' if g['met'] else 'NOT MET'} (worst {g['worst']:.3f}, {g['worst_pass']}; "
                 f"median {g['median']:.3f}; {g['below']} of {len(doc['rows'])} below)")
    own = [r["fp8_chunked_vs_whole_own"] for r in doc["rows"]]
    lines.append(f"against the whole FP8 GEMM with the pass's own work (a wgrad's gathered operand transposed, a ring "
                 f"reduce-scatter's sum of partials): worst "
                 f"{min(own):.3f}, median {statistics.median(own):.3f}, {sum(v < GOAL for v in own)} "
                 f"of {len(own)} below {GOAL}")
    lines.append("ms per pass; ch/wh = whole ms / chunked ms (>= 1: chunking costs nothing); "
                 "fp8 x = bf16 ms / fp8 ms; ch/wh+own = the same against the whole FP8 GEMM "
                 "with a wgrad's transposed gathered operand, or a ring reduce-scatter's sum, in it (other passes: as ch/wh). FP8 operands quantized "
                 "beforehand (as the layer does once per pass, whole or chunked).")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_overlap.ab.results import write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", nargs="+", default=TUNE, help="the tuner's --json files")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--shrink", type=int, default=None, help="divide M, K, N (default: 1 on a GPU, 64 on CPU)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    by = args.shrink or (1 if device == "cuda" else 64)
    t0, rows = time.perf_counter(), []
    for path in args.tune:
        with open(path) as f:
            doc = json.load(f)
        for choice, trial in chosen_trials(doc):
            trial = shrink(trial, by) if by > 1 else trial
            m, k, n = trial.spec.gemm
            rows.append({"shape": choice["shape"], "pass": trial.spec.pass_name, "pick": choice["label"],
                         "settings": choice["settings"], "comm_moved": trial.comm_moved,
                         "gemm": [m, k, n], "tune_file": os.path.basename(path),
                         **measure(trial, device, args.reps, args.repeat)})
            print(f"  {choice['shape']} {trial.spec.pass_name}: fp8 chunked / whole "
                  f"{rows[-1]['fp8_chunked_vs_whole']:.3f}", flush=True)
    ratios = [r["fp8_chunked_vs_whole"] for r in rows]
    worst = min(range(len(rows)), key=lambda i: ratios[i])
    out = {"benchmark": "fp8_compute", "command": " ".join([sys.executable, *sys.argv]), "config": vars(args),
           "meta": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "shrink": by, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "wall_s": time.perf_counter() - t0,
                    "note": "graphed" if device == "cuda" else "CPU: FUNCTIONAL ONLY"},
           "rows": rows,
           "goal": {"goal": f"fp8 chunked >= {GOAL} x fp8 whole", "met": min(ratios) >= GOAL,
                    "worst": ratios[worst], "worst_pass": f"{rows[worst]['shape']} {rows[worst]['pass']}",
                    "median": statistics.median(ratios), "below": sum(r < GOAL for r in ratios)}}
    path = os.path.join(args.out, f"fp8_compute_{args.tag or device}.json")
    write_json(path, out)
    print(table(out))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

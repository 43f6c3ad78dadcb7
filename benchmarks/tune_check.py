"""The tuner's pick is what the layer runs: for every pass the tuner chose (its
`--json`), the tuner's predicted compute side (`compute_only_ms`: the pass's GEMM
side as the one-GPU tuner measured and modelled it) beside the same pass, with
exactly the picked settings (method, num_splits, aggregate, gemm_streams, ...),
timed here on the null transport through the layer's own pass function
(`tune.passes.trial_pass`, the code the tuner and the layers run) and the same
timers as benchmarks/compute_side.py (`tune.measure`): CUDA-graph replay (what
the layers' pass replay runs) and eager back to back. ratio = predicted / measured
in the tuner's launch mode (graph: the graphed time; eager: back to back). A pick
the tuner's layout runs in the hierarchical ring order (a TP group spanning nodes
of `gpus_per_node`) is timed in that order: the ranks per node the layer and the
tuner hand its pass (`tune.passes.layout_nodes`), not the flat ring.

On one H200 (< 3 minutes; tune files and the check land in $OUT):

    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; OUT=${OUT:-/tmp/tune_check}; mkdir -p $OUT && for m in "70b 8" "8b 2"; do set -- $m; python -m megatron_overlap.cli tune --model $1 --tp $2 --measure compute --reps 5 --yaml $OUT/tune_$1_tp$2.yaml --json $OUT/tune_$1_tp$2.json --no-cache --wandb off --no-progress || exit 1; done && python benchmarks/tune_check.py --tune $OUT/tune_70b_tp8.json $OUT/tune_8b_tp2.json --reps 20 --out $OUT/tune_check_h200.json

A tune made in FP8 (`tune --fp8 hybrid`: its shapes say so) is checked in FP8: each pass
through its FP8 trial pass, against the whole FP8 GEMM as the tuner timed it.

`--device cpu` runs the same passes on CPU (fp32, perf_counter): FUNCTIONAL ONLY.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from megatron_overlap.comm import NullTransport
from megatron_overlap.config import LayerSettings
from megatron_overlap.simulate import Candidate, Layout, PassSpec, Shape, Trial
from megatron_overlap.simulate.shapes import GEMM_LAYOUTS
from megatron_overlap.tune.measure import mono_gemm
from megatron_overlap.tune.passes import fast_accum_of, layout_nodes, precision_of, trial_pass


def chosen_trials(doc: dict[str, Any]) -> list[tuple[dict[str, Any], Trial]]:
    """(choice row, the Trial it names) for every pass the tuner chose in `doc`."""
    layout = Layout(**doc["layout"])
    shapes = {s.name: s for s in (Shape(**d) for d in doc["shapes"])}
    out = []
    for row in doc["chosen"]:
        keys = {k: v for k, v in row["settings"].items() if k != "runs"}
        s = dataclasses.replace(LayerSettings.default(row["pass"], keys["method"]), **keys)
        spec = PassSpec(shapes[row["shape"]], row["pass"].split("_")[1])
        out.append((row, Trial(spec, Candidate(s, layout), bool(row.get("comm_moved")))))
    return out


def _cpu_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(trial: Trial, device: str, reps: int, rounds: int = 3) -> dict[str, float]:
    """The trial's pass on the null transport, in the ring order its layout implies (as the
    tuner timed it): graphed and back-to-back eager ms per call; and the pass's
    monolithic GEMM in its operand layout (the tuner's reference), graphed, timed in turns
    with the graphed pass (`rounds` medians of `reps`, the median of those): this GPU's
    GEMM speed drifts by more than 10% with its power and thermal state (the same
    8192 x 7168 x 8192 GEMM 1.22-1.48 ms within one script on the H200), so a pass and its
    reference are compared only when timed side by side."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    precision = precision_of(trial.spec.shape.numerics)  # FP8 where the tune was (`tune --fp8`)
    run = trial_pass(trial, NullTransport(trial.spec.shape.tp), device, dtype,
                     nodes=layout_nodes(trial), precision=precision).run
    gemm_dtype = trial.spec.gemm_dtype if precision is not None else dtype
    mono = mono_gemm(*trial.spec.gemm, trial.spec.gemm_layout, device=device, dtype=gemm_dtype,
                     out_dtype=dtype, fast_accum=fast_accum_of(trial))
    if device != "cuda":
        ms = _cpu_ms(run, reps)
        return {"graph_ms": ms, "b2b_ms": ms, "mono_ms": _cpu_ms(mono, reps)}
    from megatron_overlap.tune.measure import graphed, time_b2b, time_ms

    g, gm = graphed(run), graphed(mono)
    turns = [(time_ms(g, reps), time_ms(gm, reps)) for _ in range(rounds)]
    out = {"graph_ms": statistics.median(t for t, _ in turns), "b2b_ms": time_b2b(run, reps)[0],
           "mono_ms": statistics.median(m for _, m in turns)}
    del g, gm
    return out


def tuner_mono_ms(doc: dict[str, Any], trial: Trial) -> float | None:
    """The tuner's monolithic GEMM for this pass: as its cost model takes it, the median of
    every timing the tune holds of that GEMM size in that operand layout (each chunked
    trial's measurement times it again); None for a model-only tune."""
    layout = trial.spec.gemm_layout
    times = [t["measured_mono_graph_ms"] for t in doc.get("trials", ())
             if t.get("measured_mono_graph_ms") and tuple(t["gemm"]) == tuple(trial.spec.gemm)
             and GEMM_LAYOUTS[t["pass"].rsplit("_", 1)[1]] == layout]
    return statistics.median(times) if times else None


def score(doc: dict[str, Any], row: dict[str, Any], trial: Trial, got: dict[str, float]) -> dict[str, Any]:
    """One chosen pass's result row from what `measure` got. ratio: predicted / measured;
    rel_ratio: the same with each side taken relative to its own monolithic GEMM (the
    tuner's, and the one timed here in turns with the pass), which leaves out the GPU's
    drift between the two runs (None where the tune file holds no monolithic timing: the
    model-only tuner; or in eager launch mode)."""
    mode = doc["layout"].get("mode", "graph")
    measured = got["graph_ms"] if mode == "graph" else got["b2b_ms"]
    t_mono = tuner_mono_ms(doc, trial)
    rel = (row["compute_only_ms"] / t_mono) / (got["graph_ms"] / got["mono_ms"]) \
        if t_mono and mode == "graph" else None
    return {"shape": row["shape"], "pass": row["pass"], "label": row["label"],
            "settings": row["settings"], "nodes": layout_nodes(trial),
            "tune_mode": doc["mode"], "launch": mode,
            "predicted_ms": row["compute_only_ms"], **{f"measured_{k}": v for k, v in got.items()},
            "measured_ms": measured, "ratio": row["compute_only_ms"] / measured,
            "tuner_mono_ms": t_mono, "rel_ratio": rel,
            "chunked": row["settings"]["method"] not in ("bulk", "external")}


def check(doc: dict[str, Any], device: str, reps: int, rounds: int = 3) -> list[dict[str, Any]]:
    """Every chosen pass of `doc` timed here (`measure`) and scored (`score`)."""
    return [score(doc, row, trial, measure(trial, device, reps, rounds))
            for row, trial in chosen_trials(doc)]


def rescore(doc: dict[str, Any], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of an earlier check of `doc`'s picks scored again from their measurements
    (no GPU needed): for a change in how they are compared, not in what was measured. A row
    counts only where it timed exactly `doc`'s pick (same shape, pass and settings); a pick
    with none is a ValueError (another tune's check, or a changed pick)."""
    by_pick = {(r["shape"], r["pass"], json.dumps(r["settings"], sort_keys=True)): r
               for r in earlier}
    rows = []
    for row, trial in chosen_trials(doc):
        r = by_pick.get((row["shape"], row["pass"], json.dumps(row["settings"], sort_keys=True)))
        if r is None:
            raise ValueError(f"tune_check --rescore: no earlier row timed {row['shape']} "
                             f"{row['pass']} with the picked settings ({row['label']})")
        got = {k[len("measured_"):]: v for k, v in r.items()
               if k.startswith("measured_") and k != "measured_ms"}
        rows.append(score(doc, row, trial, got))
    return rows


def report(rows: list[dict[str, Any]], head: str, out: str) -> None:
    print(head)
    print(f"{'shape':16s} {'pass':11s} {'picked':34s} {'predicted':>9s} {'measured':>9s} "
          f"{'ratio':>6s} {'graph':>8s} {'b2b':>8s} {'mono tuner':>10s} {'mono here':>9s} "
          f"{'rel ratio':>9s}")
    for r in rows:
        rel, tm = r["rel_ratio"], r["tuner_mono_ms"]
        print(f"{r['shape']:16s} {r['pass']:11s} {r['label'][:34]:34s} {r['predicted_ms']:9.3f} "
              f"{r['measured_ms']:9.3f} {r['ratio']:6.3f} {r['measured_graph_ms']:8.3f} "
              f"{r['measured_b2b_ms']:8.3f} {tm if tm else float('nan'):10.3f} "
              f"{r['measured_mono_ms']:9.3f} {rel if rel else float('nan'):9.3f}")
    for key, chunked, what in (
            ("ratio", None, "ratio = tuner's predicted compute side / measured (ms per call, the "
             "tuner's launch mode)"),
            ("rel_ratio", None, "rel ratio = the same, each relative to the monolithic GEMM timed "
             "beside it (the tuner's; here, in turns with the pass)"),
            ("rel_ratio", True, "rel ratio of the chunked passes alone (a bulk or external pass "
             "is its monolithic GEMM: its rel ratio is ~1 by construction)")):
        off = sorted(abs(r[key] - 1) for r in rows
                     if r[key] is not None and chunked in (None, r["chunked"]))
        if off:
            print(f"{what}: |{key} - 1| median {statistics.median(off):.3f}, max {off[-1]:.3f}; "
                  f"within 5%: {sum(o <= 0.05 for o in off)} of {len(off)}")
    print(f"full results: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune", nargs="+", required=True, help="JSON of `megatron-overlap tune`")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="turns of (pass, monolithic GEMM) timings, graphed")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="benchmarks/results/tune_check.json")
    ap.add_argument("--rescore", metavar="JSON", help="score an earlier --out file of these tune "
                    "files' picks again from its measurements (no GPU) and write it to --out")
    args = ap.parse_args()
    docs = []
    for path in args.tune:
        with open(path, encoding="utf-8") as f:
            docs.append((path, json.load(f)))
    sources = [{"file": p, "mode": d["mode"], "command": d.get("command"),
                "hardware": d.get("hardware")} for p, d in docs]
    if args.rescore:
        with open(args.rescore, encoding="utf-8") as f:
            earlier = json.load(f)
        rows = [r for _, d in docs for r in rescore(d, earlier["rows"])]
        meta = {**earlier["meta"], "rescored": time.strftime("%Y-%m-%d %H:%M:%S"),
                "rescored_from": args.rescore}
        head = f"{meta['device']}  rescored from {args.rescore} (measured {meta['date']})"
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("tune_check.py: no CUDA GPU here (--device cpu: functional only)")
        if args.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        rows = [r for _, d in docs for r in check(d, args.device, args.reps, args.rounds)]
        dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        meta = {"device": dev, "torch": torch.__version__, "reps": args.reps,
                "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "functional_only": args.device == "cpu"}
        head = f"{dev}  torch {torch.__version__}  {args.reps} reps"
        if args.device == "cpu":
            head = "FUNCTIONAL ONLY: CPU times say nothing about the GPU\n" + head
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "tune": sources, "rows": rows}, f, indent=1)
    report(rows, head, args.out)


if __name__ == "__main__":
    main()

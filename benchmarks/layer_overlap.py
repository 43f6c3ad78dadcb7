"""Per-layer overlap benchmark: AG->GEMM and GEMM->RS for DESIGN.md's reference
shapes, every way side by side in one run: Megatron's non-overlapped order
(`baseline`), our schedules per backend and method, torch's async-TP ops, and
each one's compute-only floor. Every output is checked against the baseline's
before anything is timed; repetitions interleave the arms; figures are medians
of the slowest rank's time. Hidden fraction = (baseline - arm) / (baseline - floor).

    python benchmarks/layer_overlap.py                            # all GPUs, one rank each (NCCL)
    python benchmarks/layer_overlap.py --tp 2 --scale 2           # one GPU: 2 shared ranks (functional)
    python benchmarks/layer_overlap.py --device cpu --scale 16 --kn-scale 16   # CPU, gloo
    torchrun --nproc-per-node 8 benchmarks/layer_overlap.py       # torchrun works too
    python benchmarks/layer_overlap.py --gpus-per-node 4          # 8 GPUs as 2 emulated nodes

Writes layer_overlap_<tag>.json (every sample, the machine) and .png to --out.
Exit status 2 when an output check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist

# Results, not megatron-core's and torch's import-time and deprecation notices.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

from megatron_overlap.ab import async_tp, backends as backend_sel
from megatron_overlap.ab.compare import rel_error
from megatron_overlap.ab.launch import default_world, emulate_nodes, init_dist, launch, plan_layout
from megatron_overlap.ab.layer_arms import (Arm, Method, baseline_arms, inputs, overlap_arms,
                                            parse_methods, torch_arm)
from megatron_overlap.ab.machine import machine_info
from megatron_overlap.ab.results import passed, stem, write_json
from megatron_overlap.ab.shapes import Shape, parse as parse_shapes, scaled
from megatron_overlap.ab.timing import gather_max, graphed, hidden_fraction, rotated, sample, summary

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DEFAULT_METHODS = "ring_exchange,ring_exchange+agg,pipeline:4"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all",
                    help="'all', or reference names (70B_tp8_fc1,...) and/or NAME:M:K:N:ag|rs")
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: GPU count if > 1, else 2)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--backends", default="auto", help="auto, or a comma list of symm,torch_p2p,nvshmem")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma list: ring_exchange[+agg], pipeline:N, bulk (the whole transfer, "
                         "then the GEMM: no overlap); '/2s' = chunk GEMMs on "
                         "2 streams (each shape runs the ones that apply to it)")
    ap.add_argument("--no-torch-async-tp", action="store_true", help="leave torch's fused ops out")
    ap.add_argument("--scale", type=int, default=1, help="divide M (tokens) by this")
    ap.add_argument("--kn-scale", type=int, default=1, help="divide K and N by this (CPU runs)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per arm (interleaved)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--inner", type=int, default=1, help="back-to-back calls per timed sample")
    ap.add_argument("--graphs", action="store_true",
                    help="time CUDA-graph replays (one rank per GPU; arms that cannot be captured "
                         "are reported, not timed)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="emulate nodes of this many ranks (LOCAL_WORLD_SIZE; on GPUs NCCL over "
                         "loopback sockets, no P2P / shared memory): the hierarchical schedules "
                         "across them against NCCL")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="file name tag (default: cpu | shared_gpu_tpN | gpu_tpN)")
    return ap.parse_args(argv)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return rel_error(a, b, dtype=torch.float32)


def _agree(local: dict[str, tuple[float | None, str | None]]) -> dict[str, tuple[float | None, str | None]]:
    """Per arm: the worst error over ranks and the first rank's failure, if any."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    out = {}
    for name in local:
        errs = [r[name][0] for r in everyone if r[name][0] is not None]
        fails = [f"rank {i}: {r[name][1]}" for i, r in enumerate(everyone) if r[name][1]]
        out[name] = (max(errs) if errs else None, fails[0] if fails else None)
    return out


def _try(arm: Arm, ref: torch.Tensor | None) -> tuple[float | None, str | None]:
    try:
        out = arm.fn()
        return (_rel(out, ref) if arm.check and ref is not None else None), None
    except Exception as exc:  # an arm that cannot run here is reported, not fatal
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def _capture(arms: list[Arm], status: dict, ref: torch.Tensor) -> None:
    """Replace every runnable arm by its CUDA-graph replay, checked again against the
    baseline (eager) output; an arm some rank cannot capture is reported, not run."""
    runnable = [a for a in arms if status[a.name][1] is None]
    replays, local = {}, {}
    for a in runnable:
        try:
            replays[a.name] = graphed(a.fn)[0]
            local[a.name] = (None, None)
        except Exception as exc:
            local[a.name] = (None, f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    captured = _agree(local)
    ok = [a for a in runnable if captured[a.name][1] is None]
    for a in runnable:
        if captured[a.name][1] is not None:
            status[a.name] = captured[a.name]
    for a in ok:
        a.fn = replays[a.name]
    replayed = _agree({a.name: (_rel(a.fn(), ref) if a.check else None, None) for a in ok})
    for a in ok:
        status[a.name] = replayed[a.name]


def _time(active: list[Arm], args: argparse.Namespace, device: torch.device
          ) -> tuple[dict[str, list[float]], list[dict], dict[str, list[float]]]:
    """Warm-up, then `reps` interleaved repetitions: (slowest rank per sample, every
    rank's samples, slowest rank's host issue time per sample), per arm."""
    for _ in range(args.warmup):
        for a in active:
            a.fn()
    times: dict[str, list[float]] = {a.name: [] for a in active}
    host: dict[str, list[float]] = {a.name: [] for a in active}
    fns = {a.name: a.fn for a in active}
    for rep in range(args.reps):
        for name in rotated(list(fns), rep):
            t, h = sample(fns[name], device, args.inner)
            times[name].append(t)
            host[name].append(h)
    worst, per_rank = gather_max(times)
    return worst, per_rank, gather_max(host)[0]


def _arm_result(a: Arm, shape: Shape, stats: dict, worst: dict, per_rank: list, host: dict) -> dict:
    """An arm's samples and medians, and how it compares with the baseline, its
    compute-only floor and torch's async-TP ops."""
    t = stats[a.name]
    r = {"time_s": t, "samples_s": worst[a.name], "per_rank_samples_s": [p[a.name] for p in per_rank],
         "host_s": summary(host[a.name]), "tflops": shape.flops / t["median"] / 1e12}
    base = stats.get("baseline")
    if base and a.kind != "baseline":
        r["speedup_vs_baseline"] = base["median"] / t["median"]
        if a.floor in stats:
            r["hidden_fraction"] = hidden_fraction(base["median"], t["median"], stats[a.floor]["median"])
    if "torch_async_tp" in stats and a.kind == "overlap":
        r["speedup_vs_torch_async_tp"] = stats["torch_async_tp"]["median"] / t["median"]
    return r


def bench_shape(shape: Shape, args: argparse.Namespace, dtype: torch.dtype, device: torch.device,
                group: dist.ProcessGroup, backends: list[str], methods: list[Method],
                async_reason: str | None) -> dict:
    """Every arm of one shape: built, checked against the baseline, timed side by side."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x, w = inputs(shape, world, rank, dtype, device, args.seed)
    skipped: dict[str, str] = {}
    arms = baseline_arms(shape, x, w, group) + overlap_arms(shape, x, w, group, backends, methods, skipped)
    if async_reason:
        skipped["torch_async_tp"] = async_reason
    else:
        arms.append(torch_arm(shape, x, w, group))
    ref = arms[0].fn()  # the baseline: every checked arm must give this
    status = _agree({a.name: _try(a, ref) for a in arms})
    if args.graphs:
        _capture(arms, status, ref)
    del ref
    tol = TOL[dtype]
    checks = {a.name: {"max_rel_err": status[a.name][0], "tol": tol,
                       "passed": status[a.name][0] is not None and status[a.name][0] <= tol}
              for a in arms if a.check and status[a.name][1] is None}
    active = [a for a in arms if status[a.name][1] is None and (not a.check or checks[a.name]["passed"])]
    worst, per_rank, host = _time(active, args, device)
    stats = {n: summary(v) for n, v in worst.items()}
    out_arms = {}
    for a in arms:
        error = status[a.name][1] or (None if a.name in stats else "output check failed: not timed")
        out_arms[a.name] = {"kind": a.kind, "backend": a.backend, "method": a.method, "floor": a.floor,
                            "check": checks.get(a.name), "error": error, **a.info,
                            **(_arm_result(a, shape, stats, worst, per_rank, host) if a.name in stats else {})}
    return {"shape": asdict(shape), "tp": world, "dtype": str(dtype).removeprefix("torch."),
            "arms": out_arms, "skipped": skipped,
            "checks_passed": all(c["passed"] for c in checks.values())}


def _table(results: list[dict], meta: dict) -> None:
    """One compact table: a section per shape, a row per arm; skip reasons below it."""
    from megatron_overlap.config.console import Column, lines, table

    head = [f"layer_overlap: {meta['gpu_name'] or meta['cpu']}, {meta['ranks']} ranks, "
            f"{meta['dist_backend']}, torch {meta['torch']}, {results[0]['dtype']}, {meta['date']}"]
    if meta["functional_only"]:
        head.append(meta["note"])
    columns = [Column(c, right=c not in ("shape (M K N)", "arm", "check"))
               for c in ("shape (M K N)", "arm", "ms", "IQR ms", "vs base", "hidden", "vs torch",
                         "check")]
    cells, rules = [], set()
    notes: dict[str, set[str]] = {}
    for res in results:
        s = res["shape"]
        label = f"{s['name']} {s['op'].upper()} ({s['m']} {s['k']} {s['n']})"
        rows = list(res["arms"].items())
        for i, (name, r) in enumerate(rows):
            ts, ck = r.get("time_s"), r.get("check")
            fmt = lambda k, f="{:.2f}": f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
            check = "-" if not ck else f"{'ok' if ck['passed'] else 'FAIL'} {ck['max_rel_err']:.0e}"
            if r.get("error"):
                check = r["error"][:48]
            cells.append((label if i == 0 else "", name, f"{ts['median'] * 1e3:.3f}" if ts else "-",
                          f"{ts['q1'] * 1e3:.3f}-{ts['q3'] * 1e3:.3f}" if ts else "-",
                          fmt("speedup_vs_baseline", "{:.2f}x"), fmt("hidden_fraction"),
                          fmt("speedup_vs_torch_async_tp", "{:.2f}x"), check))
        rules.add(len(cells) - 1)
        for k, why in res["skipped"].items():
            notes.setdefault(f"{k}: {why}", set()).add(s["name"])
    below = [f"skipped {note} ({len(where)} shape(s))" for note, where in notes.items()]
    below += [f"backend {b} left out: {why}" for b, why in meta["skipped_backends"].items()]
    below.append("vs base / vs torch: the other arm's median time over this arm's (> 1: faster); "
                 "hidden: (baseline - arm) / (baseline - its compute-only floor)")
    print(lines(*head[1:]) + table(head[0], columns, cells, rules_after=rules, width=140)
          + lines(*below), end="")


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    layout = plan_layout(world, args.device)
    device = init_dist(layout, rank)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cuda":  # fp32 checks at 1e-5 need full-precision GEMMs
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.graphs and layout.mode != "gpus":
        raise SystemExit("--graphs needs one rank per GPU: gloo collectives cannot be captured")
    group = dist.group.WORLD
    emulated = bool(args.gpus_per_node) and args.gpus_per_node < world
    backends, skipped_backends = backend_sel.select(args.backends, layout, emulated)
    backends, failed = backend_sel.usable(backends, group, device)
    skipped_backends.update(failed)
    methods = parse_methods(args.methods)
    async_reason = "left out (--no-torch-async-tp)" if args.no_torch_async_tp else async_tp.unavailable_reason(device)
    shapes = [scaled(s, world, args.scale, args.kn_scale) for s in parse_shapes(args.shapes)]
    lead = rank == 0
    results = []
    from megatron_overlap.extras import require

    track = require("rich.progress", "benchmarks/layer_overlap.py").track

    meta = machine_info(layout, device) if lead else {}
    meta.update(backends=backends, skipped_backends=skipped_backends,
                emulated_nodes=(f"{world // args.gpus_per_node} x {args.gpus_per_node} ranks"
                                if emulated else None),
                methods=[m.label for m in methods], scaled=args.scale > 1 or args.kn_scale > 1,
                timing=("CUDA events, slowest rank per sample" if device.type == "cuda"
                        else "wall clock, slowest rank per sample") + (", CUDA-graph replays" if args.graphs else ""))
    doc = {"benchmark": "layer_overlap", "command": " ".join([sys.executable, *sys.argv]),
           "config": vars(args), "meta": meta, "shapes": results, "complete": False}
    for shape in (track(shapes, description="layer_overlap", transient=True) if lead else shapes):
        results.append(bench_shape(shape, args, dtype, device, group, backends, methods, async_reason))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if lead:  # shape by shape: a run cut short (a timeout) keeps what it measured
            doc["all_checks_passed"] = all(r["checks_passed"] for r in results)
            write_json(stem(args.out, "layer_overlap", layout, args.tag) + ".json", doc)
    if lead:
        doc["complete"] = True
        write(doc, args, layout)
        _table(results, meta)
    dist.barrier()
    dist.destroy_process_group()


def write(doc: dict, args: argparse.Namespace, layout) -> None:
    from megatron_overlap.ab.plots import plot_layers

    path = stem(args.out, "layer_overlap", layout, args.tag)
    write_json(path + ".json", doc)
    m = doc["meta"]
    plot_layers(doc["shapes"], path + ".png",
                f"layer_overlap: {m['gpu_name'] or 'CPU'} x{m['ranks']} ({m['mode']}), {doc['shapes'][0]['dtype']}, "
                f"torch {m['torch']}, {m['date'][:10]}" + ("  [FUNCTIONAL ONLY]" if m["functional_only"] else ""))
    print(f"results: {path}.json\nplot:    {path}.png")


def main(argv=None) -> int:
    args = parse_args(argv)
    world = default_world(args.tp, args.device)
    if args.gpus_per_node and args.gpus_per_node < world:
        emulate_nodes(args.gpus_per_node, world, args.device)
    launch(worker, world, args, device=args.device)
    return passed(args.out, "layer_overlap", plan_layout(world, args.device), args.tag,
                  "all_checks_passed", "some output checks FAILED")


if __name__ == "__main__":
    sys.exit(main())

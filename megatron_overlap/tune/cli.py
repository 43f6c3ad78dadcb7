"""`megatron-overlap tune`: flags, picking how to measure on the machine at hand,
and the files it writes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from ..cli_args import FlagError, check_model, positive_int
from ..simulate import PRESETS, ModelDims
from .tuner import NOTES

MEASURES = ("auto", "model", "compute", "real")
def add_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("tune", help="search per-layer overlap settings and write ub_cfgs YAML",
                       description="Search method x num_splits x num_sm x use_ce x aggregate x "
                                   "gemm_streams "
                                   "(x ring order) per layer pass, measure on the hardware at hand "
                                   "and write a TE ub_cfgs YAML.")
    p.add_argument("--model", choices=sorted(PRESETS), help="a preset (Llama 3 dimensions)")
    p.add_argument("--hidden-size", type=positive_int)
    p.add_argument("--ffn-hidden-size", type=positive_int)
    p.add_argument("--num-attention-heads", type=positive_int)
    p.add_argument("--num-query-groups", type=positive_int)
    p.add_argument("--seq-length", type=positive_int)
    p.add_argument("--micro-batch-size", type=positive_int)
    p.add_argument("--no-swiglu", action="store_true", help="fc1 is not a gated (2x) projection")
    p.add_argument("--name", help="model name in the outputs (default: the preset, or 'custom')")
    common(p)
    p.add_argument("--measure", choices=MEASURES, default="auto",
                   help="auto: several GPUs under torchrun -> real, one GPU -> compute, CPU -> model")
    p.add_argument("--reps", type=positive_int, default=20, help="timed repetitions per measurement")
    p.add_argument("--yaml", default="overlap_tuned.yaml", help="ub_cfgs YAML to write")
    p.add_argument("--json", help="the whole search as JSON (default: YAML path + .json)")
    p.add_argument("--cache", help="measurement cache (default: YAML path + .cache.jsonl)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--wandb", choices=("off", "offline", "online"), default="offline")
    p.add_argument("--wandb-project", default="megatron-overlap-tune")
    p.add_argument("--wandb-dir", default="runs")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_tune)


_FLAGS = {"hidden": "--hidden-size", "ffn_hidden": "--ffn-hidden-size",
          "heads": "--num-attention-heads", "query_groups": "--num-query-groups",
          "seq_length": "--seq-length", "micro_batch": "--micro-batch-size"}


def model_dims(args: argparse.Namespace) -> tuple[str, ModelDims]:
    """The preset, with any dimension flag overriding it; or all flags given. Dimensions
    Megatron would refuse at --tp are a FlagError naming the flags (or the preset)."""
    given = {k: getattr(args, f[2:].replace("-", "_")) for k, f in _FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    flagged = set(given)

    def label(k: str) -> str:  # where a value came from, for messages
        if k in flagged or not args.model:
            return _FLAGS[k] if k in flagged else f"{_FLAGS[k]} (not given: default)"
        return f"--model {args.model}'s {_FLAGS[k][2:]}"

    if args.no_swiglu:
        given["swiglu"] = False
    if args.model:
        import dataclasses

        name, dims = args.name or args.model.upper(), dataclasses.replace(PRESETS[args.model], **given)
    else:
        missing = [_FLAGS[k] for k in ("hidden", "ffn_hidden", "heads") if k not in given]
        if missing:
            raise FlagError("give --model, or --hidden-size, --ffn-hidden-size and "
                            "--num-attention-heads (missing: " + ", ".join(missing) + ")")
        given.setdefault("query_groups", given["heads"])
        name, dims = args.name or "custom", ModelDims(**given)
    check_model(vars(dims), args.tp, label)
    return name, dims


def pick_measure(kind: str) -> str:
    if kind != "auto":
        return kind
    try:
        import torch
    except ImportError:
        return "model"
    if not torch.cuda.is_available():
        return "model"
    return "real" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "compute"


def _wandb_run(args: argparse.Namespace, config: dict[str, Any]):
    if args.wandb == "off":
        return None
    from ..extras import require

    wandb = require("wandb", f"megatron-overlap tune --wandb {args.wandb} (or --wandb off)")

    os.makedirs(args.wandb_dir, exist_ok=True)
    return wandb.init(mode=args.wandb, project=args.wandb_project, dir=args.wandb_dir,
                      job_type="tune", config=config,
                      settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))


def cmd_tune(args: argparse.Namespace, command: str) -> int:
    from .. import cli
    from .cache import Cache
    from .tuner import tune

    name, dims = model_dims(args)
    hw, layout, cal = cli._machine(args)
    numerics = cli.numerics_of(args)
    shapes = dims.shapes(name, args.tp, numerics)
    kind = pick_measure(args.measure)
    if kind != "model" and numerics.scaling == "rowwise":
        raise ValueError(f"--fp8-scaling rowwise with --measure {kind}: the tuner times FP8 "
                         "passes with per-tensor scales only (tensorwise or delayed); row-wise "
                         "is predicted by the cost model (--measure model)")
    if kind in ("compute", "real"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--measure {kind} needs CUDA GPUs and this machine has none; "
                             "use --measure model (the cost model only) or auto")
    rank, agree = 0, None
    if kind == "model":
        from .hooks import ModelMeasure

        measure = ModelMeasure(hw, layout, cal)
    elif kind == "compute":
        from .hooks import ComputeSideMeasure

        measure = ComputeSideMeasure(hw, layout, reps=args.reps, host=cal.host,
                                     dtype=numerics.params)
    else:
        if cal.host is not None:
            raise ValueError("--host-time applies to --measure model and compute; --measure real "
                             "times every pass for real, its host time included")
        measure, rank, agree = _distributed(args, layout, numerics)
    print(f"megatron-overlap tune: {NOTES[kind]} Precision: {numerics.label()}.", flush=True)
    if kind != "real":
        from ..simulate.passes import megatron_modelled_host_us

        print(f"megatron-overlap tune: "
              f"{cal.host_source(layout.mode, hw.eager_step_us, megatron_modelled_host_us(hw))}",
              flush=True)
    writer = rank == 0
    cache_path = None if args.no_cache or not writer else (args.cache or args.yaml + ".cache.jsonl")
    run = _wandb_run(args, {"command": command, "model": name, **vars(dims),
                            "precision": numerics.to_dict()}) if writer else None
    try:
        result = tune(shapes, layout, measure, cache=Cache(cache_path), rs_dgrad=args.rs_dgrad,
                      progress=writer and not args.no_progress, run=run, agree=agree,
                      note=NOTES[kind], command=command)
    finally:
        if run is not None:
            run.finish()
    if writer:
        result.write_yaml(args.yaml)
        json_path = args.json or args.yaml + ".json"
        result.write_json(json_path)
        print(summary(result))
        did = "predicted" if kind == "model" else "measured"
        print(f"{did} {result.measured}, from cache {result.cached}; "
              f"ub_cfgs: {args.yaml}; search: {json_path}"
              + (f"; cache: {cache_path}" if cache_path else ""))
        if any(t.candidate.settings.is_reduce_scatter and t.spec.pass_name == "dgrad"
               and t.spec.shape.column for c in result.chosen.values() for t in c.values()):
            print("note: the chosen qkv/fc1 dgrad reduce-scatters: run Megatron with "
                  "tp_comm_overlap_rs_dgrad=True")
    return 0


def summary(result) -> str:
    """The choice per pass, as a plain table; passes the non-overlapped path wins marked."""
    fmt = lambda v: f"{'-':>10s}" if v is None else f"{v:10.3f}"  # noqa: E731
    lines = [f"{'shape':16s} {'pass':11s} {'chosen':40s} {'time ms':>9s} {'non-ovl ms':>10s} "
             f"{'dflt ms':>10s}"]
    slower, totals = [], {"time_ms": 0.0, "baseline_ms": 0.0, "te_default_ms": 0.0}
    for r in result.choice_rows:
        base = r.get("baseline_ms")
        worse = not r.get("overlap", True)
        slower += [r["pass"]] if worse else []
        for k in totals:
            totals[k] = None if totals[k] is None or r.get(k) is None else totals[k] + r[k]
        label = ("do not overlap: " if worse else "") + r["label"] \
            + (" [host-bound]" if r.get("host_bound") else "")
        lines.append(f"{r['shape']:16s} {r['pass']:11s} {label[:40]:40s} "
                     f"{r['time_ms']:9.3f} {fmt(base)} {fmt(r.get('te_default_ms'))}"
                     + (" *" if worse else ""))
    lines.append(f"{'all passes':16s} {'':11s} {'(sum)':40s} {totals['time_ms']:9.3f} "
                 f"{fmt(totals['baseline_ms'])} {fmt(totals['te_default_ms'])}")
    if slower:
        lines.append("* do not overlap this pass: the non-overlapped path is faster (turn that "
                     "overlap off with Megatron's tp_comm_overlap_ag / _rs / tp_comm_bulk_dgrad / "
                     "_wgrad, or tp_comm_overlap_disable_qkv / _fc1); [host-bound]: the measured "
                     "host time per call exceeds the pass's GPU time")
    return "\n".join(lines)


def _distributed(args: argparse.Namespace, layout, numerics):
    """Several GPUs under torchrun: NCCL, the whole world as the TP group."""
    import torch
    import torch.distributed as dist

    from .hooks import DistributedMeasure

    if not dist.is_initialized():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    if dist.get_world_size() != layout.tp:
        sys.exit(f"--measure real: the TP group is the whole job ({dist.get_world_size()} ranks); "
                 f"--tp is {layout.tp}")
    rank = dist.get_rank()

    def agree(hit):
        from ..comm.exchange import broadcast_object

        return broadcast_object(hit, 0, None, "tuner cache hit")

    return (DistributedMeasure(backend=args.backend, reps=args.reps,
                               dtype=numerics.params), rank, agree)

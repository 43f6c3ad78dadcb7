"""`megatron-overlap`: the command-line tools.

    megatron-overlap simulate --shapes reference --tp 8 --json out.json
    megatron-overlap tune --model 70b --tp 8 --yaml ub_cfgs.yaml
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from .config.backends import BACKENDS
from .config.names import FAST_ACCUM_DEFAULT, FAST_ACCUMS
from .cli_args import FlagError, check_layout, model_spec, positive_int


def _common(p: argparse.ArgumentParser) -> None:
    """Layout and hardware flags both tools share."""
    p.add_argument("--tp", type=positive_int, required=True, help="TP size")
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="GPUs per node; a TP group larger than this spans nodes (default 8)")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph",
                   help="launch mode to model: CUDA-graph replay or eager Python (default graph)")
    p.add_argument("--backend", choices=BACKENDS, default="symm",
                   help="intra-node transport to model (default symm); inter-node goes over IB")
    p.add_argument("--calibration", metavar="FILE",
                   help="GEMM times measured by benchmarks/compute_side.py --out (default: roofline)")
    p.add_argument("--host-time", metavar="FILE",
                   help="host time per layer pass call measured by benchmarks/host_time.py "
                        "(replayed rows in graph mode, eager rows in eager mode): each pass then "
                        "costs max(host, GPU) and host-bound passes are named (default: graph "
                        "mode counts no host time, eager mode models it per schedule step)")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help="override a Hardware field, e.g. --hw ib_gbs=25 (repeatable)")
    p.add_argument("--rs-dgrad", action="store_true",
                   help="also consider reduce-scatter dgrads for qkv/fc1 (Megatron's "
                        "tp_comm_overlap_rs_dgrad)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="the parameters' dtype (default bf16); fp32 GEMMs run TF32")
    p.add_argument("--fp8", choices=("hybrid", "e4m3"),
                   help="the linears run FP8 (Megatron's --fp8-format): FP8 GEMMs, FP8 "
                        "gathers, reductions in --dtype")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "delayed"), default=None,
                   help="with --fp8: Megatron's --fp8-recipe, current scaling (default) or "
                        "delayed scaling (amax histories: no amax exchange before a gather, "
                        "one after each pass)")
    p.add_argument("--fp8-scaling", choices=("tensorwise", "rowwise"), default=None,
                   help="with --fp8: per-tensor scales (default) or per-row "
                        "(--megatron-overlap-fp8-scaling rowwise; wgrad in --dtype)")
    p.add_argument("--no-fp8-wgrad", action="store_true",
                   help="with --fp8: the wgrad GEMM in --dtype (Megatron's --no-fp8-wgrad)")
    p.add_argument("--fp8-fast-accum", choices=tuple(FAST_ACCUMS), default=None,
                   help="with --fp8: the FP8 GEMMs that accumulate fast (install(fp8_fast_accum=); "
                        "default fprop, as Transformer Engine and torchao run them)")


def numerics_of(args: argparse.Namespace):
    """The linears' precision from --dtype, --fp8, --fp8-recipe, --fp8-scaling,
    --no-fp8-wgrad, --fp8-fast-accum (FlagError naming the flags for a combination the
    layers do not run)."""
    from .simulate.numerics import Numerics

    recipe = getattr(args, "fp8_recipe", None)
    fast = getattr(args, "fp8_fast_accum", None)
    if args.fp8 is None and (args.fp8_scaling or args.no_fp8_wgrad or recipe or fast):
        given = ("--fp8-scaling" if args.fp8_scaling else "--fp8-recipe" if recipe
                 else "--fp8-fast-accum" if fast else "--no-fp8-wgrad")
        raise FlagError(f"{given} needs --fp8 hybrid or --fp8 e4m3")
    rowwise = args.fp8_scaling == "rowwise"
    if recipe == "delayed" and rowwise:
        raise FlagError("--fp8-recipe delayed --fp8-scaling rowwise: delayed scaling keeps one "
                        "amax history per tensor, not per row (as the layers refuse it); use "
                        "--fp8-recipe tensorwise for row-wise scales")
    try:
        return Numerics(args.dtype, args.fp8,
                        "delayed" if recipe == "delayed" else args.fp8_scaling or "tensorwise",
                        fp8_wgrad=not (args.no_fp8_wgrad or rowwise),
                        fast_accum=fast or FAST_ACCUM_DEFAULT)
    except ValueError as e:
        raise FlagError(f"--dtype {args.dtype} --fp8 {args.fp8} --fp8-scaling "
                        f"{args.fp8_scaling}: {e}") from None


def _machine(args: argparse.Namespace):
    from .simulate import Calibration, Hardware, Layout

    hw = Hardware(**Hardware.parse_overrides(args.hw))
    check_layout(args.tp, args.gpus_per_node)
    layout = Layout(tp=args.tp, gpus_per_node=args.gpus_per_node, mode=args.mode,
                    backend=args.backend)
    try:
        cal = Calibration.load(args.calibration) if args.calibration else Calibration()
    except OSError as e:
        raise FlagError(f"--calibration {args.calibration!r}: cannot read it: {e.strerror}") from None
    except ValueError as e:
        raise FlagError(f"--calibration: {e}") from None
    if args.host_time:
        from .simulate.host import HostTime

        try:
            cal.host = HostTime.load(args.host_time)
        except OSError as e:
            raise FlagError(f"--host-time {args.host_time!r}: cannot read it: {e.strerror}") from None
        except ValueError as e:
            raise FlagError(f"--host-time: {e}") from None
    return hw, layout, cal


def _layers(items: Sequence[tuple[str, int]]) -> dict[str, int]:
    return dict(items)


def cmd_simulate(args: argparse.Namespace, command: str) -> int:
    from .config import OverlapConfig
    from .simulate import parse_shapes, simulate
    from .simulate import report as rep

    hw, layout, cal = _machine(args)
    try:
        cfg = OverlapConfig.load(args.cfg, rs_dgrad=args.rs_dgrad) if args.cfg else None
    except ValueError as e:
        raise FlagError(f"--cfg: {e}") from None
    try:
        shapes = parse_shapes(args.shapes, args.tp, numerics_of(args))
    except ValueError as e:
        raise FlagError(f"--shapes {args.shapes!r}: {e}") from None
    report = simulate(shapes, hw, layout, cal, cfg,
                      rs_dgrad=args.rs_dgrad,
                      layers=_layers(args.layers), micro_batches=args.micro_batches)
    print(rep.console(report), end="")
    if args.json:
        rep.write_json(report, args.json, command)
        print(f"full results: {args.json}")
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(rep.markdown(report, command))
        print(f"markdown: {args.md}")
    if args.yaml:
        from .simulate.numerics import yaml_comment

        note = yaml_comment(shapes[0].numerics.label())
        for path, model in _yaml_paths(args.yaml, [s.model for s in report.models]):
            with open(path, "w", encoding="utf-8") as f:
                f.write(note + report.picked_config(model).to_yaml())
            print(f"picked settings for {model}: {path}")
    return 0


def _yaml_paths(path: str, models: list[str]) -> list[tuple[str, str]]:
    """One YAML per model: the path itself for one model, PATH_<model>.yaml for several."""
    if len(models) == 1:
        return [(path, models[0])]
    stem, dot, ext = path.rpartition(".")
    stem, ext = (stem, ext) if dot else (path, "yaml")
    return [(f"{stem}_{m}.{ext}", m) for m in models]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="predict overlapped times with the cost model",
                         description="Predict each TP layer pass's overlapped time, exposed "
                                     "communication and a step estimate, and pick settings.")
    sim.add_argument("--shapes", default="reference",
                     help="comma-separated: reference | a reference name (70B_tp8_qkv) | a preset "
                          "(70b, 8b) | MODEL_BUFFER=MxKxN; all are re-cut to --tp (default reference)")
    _common(sim)
    sim.add_argument("--cfg", metavar="YAML", help="ub_cfgs to predict (default: TE's defaults)")
    sim.add_argument("--layers", action="append", default=[], metavar="MODEL=N", type=model_spec,
                     help="transformer layers per model for the step estimate (70B=80, 8B=32 known)")
    sim.add_argument("--micro-batches", type=positive_int, default=1,
                     help="micro-batches per step for the step estimate (default 1)")
    sim.add_argument("--json", metavar="OUT", help="write the full results as JSON")
    sim.add_argument("--md", metavar="OUT", help="write the table as Markdown")
    sim.add_argument("--yaml", metavar="OUT", help="write the picked settings as ub_cfgs YAML")
    sim.set_defaults(func=cmd_simulate)

    from .tune.cli import add_parser as add_tune

    add_tune(sub, _common)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = "megatron-overlap " + shlex.join(argv)
    try:
        return args.func(args, command)
    except (ValueError, OSError, ImportError) as e:  # ImportError: extras.MissingExtra
        print(f"megatron-overlap {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

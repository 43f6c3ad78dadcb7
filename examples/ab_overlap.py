"""The A/B main job: a small GPT trained twice from the same weights, seed and
batches, stepped alternately: A on Megatron's plain TP path (NCCL on GPUs, gloo
on CPU), B with the overlap. Prints the per-layer overlap settings, the step
times and loss parity; writes one wandb offline run per arm (one group) and a
report (markdown + PNG).

    python examples/ab_overlap.py                      # CPU: TP=2 over gloo
    python examples/ab_overlap.py --tp 8 --steps 50    # GPUs: NCCL, one rank per GPU
    python examples/ab_overlap.py --save ckpt/ ; python examples/ab_overlap.py --load ckpt/

With GPUs it runs one rank per GPU over NCCL (ranks share a GPU over gloo when TP
exceeds the GPU count), or under torchrun if RANK is set: megatron_overlap.ab.launch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from megatron_overlap.ab.launch import launch, plan_layout
from megatron_overlap.extras import require
from megatron_overlap.ab.model import GPTSpec, batches, build_gpt, gpt_loss, init_megatron

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=None, help="TP size (default: GPU count, or 2 on CPU)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--ub-cfgs", default=None, help="TE-style overlap YAML (default: TE's defaults)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/ab_overlap", help="report and wandb runs go here")
    ap.add_argument("--project", default="megatron_overlap")
    ap.add_argument("--load", default=None, help="Megatron distributed checkpoint to start from")
    ap.add_argument("--save", default=None, help="save the overlap arm's model here at the end")
    return ap.parse_args(argv)


def _spec(args) -> GPTSpec:
    return GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                   micro_batch=args.micro_batch, vocab=args.vocab)


def _cpu_init(tp: int, seed: int) -> None:
    """megatron-core on CPU: the test suite's shims (they never enter the library)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from helpers.megatron_cpu import init

    init(tp, seed)


def _checkpoint(model, path: str, load: bool) -> None:
    """Megatron's distributed checkpoint format, model under "model" as Megatron-LM keeps it."""
    from megatron.core import dist_checkpointing, parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sharded = {"model": model.sharded_state_dict(metadata=meta)}
    if load:
        model.load_state_dict(dist_checkpointing.load(sharded, path)["model"], strict=False)
    else:
        os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(sharded, path)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    layout = plan_layout(world)
    device = init_megatron(layout, rank, world, args.seed, _cpu_init)
    cpu = device.type == "cpu"
    dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))

    import megatron_overlap as mo
    from megatron_overlap.ab import TrainArm, write_report
    from megatron_overlap.comm import stats
    from megatron_overlap.telemetry import OverlapTelemetry

    mo.install(ub_cfgs=args.ub_cfgs, backend=args.backend)
    plain, wrap_a = build_gpt(_spec(args), world, overlap=False, dtype=dtype, device=device)
    ours, wrap_b = build_gpt(_spec(args), world, overlap=True, dtype=dtype, device=device)
    if args.load:
        _checkpoint(plain, args.load, load=True)
    ours.load_state_dict(plain.state_dict())  # same weights in both arms
    optim = lambda ps: torch.optim.AdamW(ps, lr=args.lr)  # noqa: E731
    arms = {"A_megatron": TrainArm("A_megatron", wrap_a(plain), gpt_loss, optim),
            "B_overlap": TrainArm("B_overlap", wrap_b(ours), gpt_loss, optim)}

    lead = rank == 0
    runs = {}
    if lead:
        wandb = require("wandb", "the A/B demo")

        group = f"ab-{time.strftime('%Y%m%d-%H%M%S')}"
        for name in arms:
            runs[name] = wandb.init(
                project=args.project, group=group, name=name, dir=args.out, mode="offline",
                reinit="create_new", config={"arm": name, "tp": world, "dtype": args.dtype or str(dtype),
                                             **{k: v for k, v in vars(args).items() if k != "tp"}})
    telemetry = OverlapTelemetry(runs.get("B_overlap"), console=lead)

    track = require("rich.progress", "the A/B demo").track

    steps = list(batches(_spec(args), args.steps, args.seed, device))
    it = track(range(args.steps), description="A/B steps") if lead else range(args.steps)
    for i in it:
        for name, arm in arms.items():
            stats.snapshot()  # counters cover this arm's step only
            r = arm.step(steps[i])
            if name == "B_overlap" and i == 0:
                telemetry.log_settings(ours)  # after the first forward: buffer sizes are known
            metrics = {"loss": r.loss, "step_time_ms": r.step_time_s * 1e3}
            if name == "B_overlap":
                telemetry.log_step(i, metrics)
            elif lead:
                runs[name].log(metrics, step=i)
    if args.save:
        _checkpoint(ours, args.save, load=False)
    if not lead:
        return
    for run in runs.values():
        run.finish()
    md, png = write_report(
        {n: a.results for n, a in arms.items()}, args.out, baseline="A_megatron",
        title=f"A/B: Megatron TP vs megatron_overlap (TP={world}, {layout.note.split(':')[0]})",
        details={"model": f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
                          f"micro-batch {args.micro_batch}, {dtype}",
                 "transport": ours.decoder.layers[0].mlp.linear_fc1.transport.name,
                 "overlap settings": args.ub_cfgs or "TE defaults",
                 "wandb runs": ", ".join(r.dir for r in runs.values())})
    print(open(md).read())
    print(f"report: {md}\nplot:   {png}\nwandb:  {', '.join(r.dir for r in runs.values())}")


def main(argv=None) -> None:
    args = parse_args(argv)
    world = args.tp or int(os.environ.get("WORLD_SIZE", 0)) or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2)
    args.tp = world
    launch(worker, world, args)


if __name__ == "__main__":
    main()

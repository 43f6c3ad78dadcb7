"""The A/B main job: a small GPT trained twice from the same weights, seed and
batches, stepped alternately: A on Megatron's plain TP path (NCCL on GPUs, gloo
on CPU), B with the overlap. Prints the model and the arms, the overlap settings
(one line per linear and pass; --full-table for every key and reason), then the
loss parity and step times; writes one wandb offline run per arm (one group) and a
report (markdown + PNG, the full settings table and YAML, what the run can show).

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
import warnings

import torch

# Megatron's import-time notes (no Transformer Engine or apex here) and torch's renames of the
# collectives Megatron calls are not this demo's business: hidden, here and in every rank
# (spawned ranks import this file again). `python -W default` shows them.
if not sys.warnoptions:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")

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
    ap.add_argument("--full-table", action="store_true",
                    help="print the full settings table (every layer, every key, every reason); "
                         "it is always written to OUT/settings.txt")
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
    from megatron_overlap.ab.limits import what_it_shows
    from megatron_overlap.comm import stats
    from megatron_overlap.telemetry import OverlapTelemetry, attention_settings, attention_summary

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
    transport = ours.decoder.layers[0].mlp.linear_fc1.transport.name
    cfg = args.ub_cfgs or "TE's default settings"
    model = (f"GPT, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
             f"micro-batch {args.micro_batch}, vocab {args.vocab}, {str(dtype).split('.')[-1]}")
    # both arms are built under install(): the same core attention, so the A/B measures the overlap
    attention = {n: attention_summary(attention_settings(m)) for n, m in (("A", plain), ("B", ours))}
    attention = (f"A and B: {attention['A']}" if attention["A"] == attention["B"] else
                 f"A: {attention['A']}; B: {attention['B']} (they differ: the A/B measures more than the overlap)")
    if lead:
        print(f"megatron_overlap A/B demo: one GPT trained twice, same weights, seed and batches\n"
              f"  model       {model}; {args.steps} steps\n"
              f"  ranks       TP={world}: {layout.note}\n"
              f"  A_megatron  Megatron's own TP linears (local spec"
              f"{', sequence parallel' if world > 1 else ''}), its collectives over "
              f"{layout.dist_backend}\n"
              f"  B_overlap   the same after megatron_overlap.install(): the all-gathers and "
              f"reduce-scatters of qkv, proj, fc1, fc2 under their GEMMs, on {transport}, {cfg}\n"
              f"  attention   {attention}\n",
              flush=True)
    runs = {}
    if lead:
        wandb = require("wandb", "the A/B demo")

        group = f"ab-{time.strftime('%Y%m%d-%H%M%S')}"
        for name in arms:
            runs[name] = wandb.init(
                project=args.project, group=group, name=name, dir=args.out, mode="offline",
                reinit="create_new", config={"arm": name, "tp": world, "dtype": args.dtype or str(dtype),
                                             **{k: v for k, v in vars(args).items() if k != "tp"}})
    telemetry = OverlapTelemetry(runs.get("B_overlap"), console=False)

    track = require("rich.progress", "the A/B demo").track

    steps = list(batches(_spec(args), args.steps, args.seed, device))
    it = track(range(args.steps), description="A/B steps") if lead else range(args.steps)
    for i in it:
        for name, arm in arms.items():
            stats.snapshot()  # counters cover this arm's step only
            r = arm.step(steps[i])
            if name == "B_overlap" and i == 0:  # after the first forward: buffer sizes known
                rows = telemetry.log_settings(ours)
                if lead:
                    _settings(rows, args)
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
        details={"model": model, "transport": transport, "overlap settings": cfg, "core attention": attention,
                 "wandb runs": ", ".join(r.dir for r in runs.values())},
        sections=what_it_shows(layout))
    print(open(md).read())
    print(f"report:   {md}\nplot:     {png}\nsettings: {os.path.join(args.out, 'settings.txt')}, "
          f"settings.yaml\nwandb:    {', '.join(r.dir for r in runs.values())}")


def _settings(rows: list, args: argparse.Namespace) -> None:
    """The compact table on the console (or the full one with --full-table); the full
    table and the settings in force (TE ub_cfgs YAML) in the output folder."""
    from megatron_overlap.config import state
    from megatron_overlap.telemetry import compact_table, settings_table

    os.makedirs(args.out, exist_ok=True)
    full = settings_table(rows)
    with open(os.path.join(args.out, "settings.txt"), "w", encoding="utf-8") as f:
        f.write(full)
    state.current().settings.to_yaml(os.path.join(args.out, "settings.yaml"))
    print(full if args.full_table else compact_table(rows), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    world = args.tp or int(os.environ.get("WORLD_SIZE", 0)) or (
        torch.cuda.device_count() if torch.cuda.is_available() else 2)
    args.tp = world
    launch(worker, world, args)


if __name__ == "__main__":
    main()

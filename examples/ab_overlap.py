"""The A/B main job: a small GPT trained twice from the same weights, seed and
batches, stepped alternately: A on Megatron's plain TP path (NCCL on GPUs, gloo
on CPU), B with the overlap. Prints the per-layer overlap settings, the step
times and loss parity; writes one wandb offline run per arm (one group) and a
report (markdown + PNG).

    python examples/ab_overlap.py                      # CPU: TP=2 over gloo
    python examples/ab_overlap.py --tp 8 --steps 50    # GPUs: NCCL, one rank per GPU
    python examples/ab_overlap.py --save ckpt/ ; python examples/ab_overlap.py --load ckpt/

With GPUs it runs one process per GPU (or under torchrun, if RANK is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

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


def _init(rank: int, world: int, cpu: bool, seed: int) -> torch.device:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if cpu:  # megatron-core assumes CUDA in a few places: the test suite's shims cover them
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from helpers.megatron_cpu import init

        init(world, seed)
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return torch.device("cuda", torch.cuda.current_device())


def _build(args, overlap: bool, dtype: torch.dtype, cpu: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, tensor_model_parallel_size=args.tp,
        sequence_parallel=args.tp > 1, tp_comm_overlap=overlap, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=cpu, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="rope")
    if not cpu:
        model.cuda()
    return model, config, lambda m: DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)


def _batches(args, device):
    """Micro-batches drawn from a small pool of fixed sequences: learnable, so the
    loss curves show training, and identical in both arms."""
    g = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, args.vocab, (4 * args.micro_batch, args.seq + 1), generator=g)
    mask = torch.triu(torch.ones(args.seq, args.seq), diagonal=1).bool()[None, None].to(device)
    pos = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1).to(device)
    for _ in range(args.steps):
        t = pool[torch.randint(0, len(pool), (args.micro_batch,), generator=g)].to(device)
        yield t[:, :-1].contiguous(), pos, mask, t[:, 1:].contiguous()


def _forward(model, b):
    tokens, pos, mask, labels = b
    return model(tokens, pos, mask, labels=labels).float().mean()


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
    cpu = not torch.cuda.is_available()
    device = _init(rank, world, cpu, args.seed)
    dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))

    import megatron_overlap as mo
    from megatron_overlap.ab import TrainArm, write_report
    from megatron_overlap.comm import stats
    from megatron_overlap.telemetry import OverlapTelemetry

    mo.install(ub_cfgs=args.ub_cfgs, backend=args.backend)
    plain, _, wrap_a = _build(args, overlap=False, dtype=dtype, cpu=cpu)
    ours, _, wrap_b = _build(args, overlap=True, dtype=dtype, cpu=cpu)
    if args.load:
        _checkpoint(plain, args.load, load=True)
    ours.load_state_dict(plain.state_dict())  # same weights in both arms
    optim = lambda ps: torch.optim.AdamW(ps, lr=args.lr)  # noqa: E731
    arms = {"A_megatron": TrainArm("A_megatron", wrap_a(plain), _forward, optim),
            "B_overlap": TrainArm("B_overlap", wrap_b(ours), _forward, optim)}

    lead = rank == 0
    runs = {}
    if lead:
        import wandb

        group = f"ab-{time.strftime('%Y%m%d-%H%M%S')}"
        for name in arms:
            runs[name] = wandb.init(
                project=args.project, group=group, name=name, dir=args.out, mode="offline",
                reinit="create_new", config={"arm": name, "tp": world, "dtype": args.dtype or str(dtype),
                                             **{k: v for k, v in vars(args).items() if k != "tp"}})
    telemetry = OverlapTelemetry(runs.get("B_overlap"), console=lead)

    from rich.progress import track

    steps = list(_batches(args, device))
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
        title=f"A/B: Megatron TP vs megatron_overlap (TP={world}, {'CPU/gloo' if cpu else 'GPU/NCCL'})",
        details={"model": f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
                          f"micro-batch {args.micro_batch}, {dtype}",
                 "transport": ours.decoder.layers[0].mlp.linear_fc1.transport.name,
                 "overlap settings": args.ub_cfgs or "TE defaults",
                 "wandb runs": ", ".join(r.dir for r in runs.values())})
    print(open(md).read())
    print(f"report: {md}\nplot:   {png}\nwandb:  {', '.join(r.dir for r in runs.values())}")


def _spawn_entry(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), WANDB_MODE="offline", WANDB_SILENT="true",
                      CUDA_DEVICE_MAX_CONNECTIONS="1")
    worker(rank, world, args)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        args.tp = args.tp or int(os.environ["WORLD_SIZE"])
        return worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    args.tp = args.tp or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawn_entry, args=(args.tp, args, port), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()

"""End-to-end A/B: a megatron-core GPT training step, side by side in one run:
Megatron's own TP path (tp_comm_overlap=False; NCCL on GPUs), the overlap on each
backend, and compute-only (the overlap with its TP linears' transfers skipped).
Same seed, weights and batches for every arm; arms step alternately (order
rotated every step); loss parity of every overlap arm against Megatron's is
checked over the whole run; step times are medians after --warmup steps.
Hidden fraction = (megatron - overlap) / (megatron - compute_only).

    python benchmarks/step_ab.py                                   # all GPUs, one rank each
    python benchmarks/step_ab.py --tp 2                            # one GPU: shared ranks (functional)
    python benchmarks/step_ab.py --device cpu --hidden 64 --seq 32 --steps 6   # CPU, gloo
    torchrun --nproc-per-node 8 benchmarks/step_ab.py --layers 8 --hidden 4096 --heads 32 --seq 4096

Writes step_ab_<tag>.json (every step, the machine) and .png to --out. Exit
status 2 when loss parity failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

# Results, not megatron-core's and torch's import-time and deprecation notices.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: GPU count if > 1, else 2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the time medians")
    ap.add_argument("--backends", default="auto", help="auto, or a comma list of symm,torch_p2p,nvshmem")
    ap.add_argument("--no-compute-only", action="store_true")
    ap.add_argument("--ub-cfgs", default=None, help="TE-style overlap YAML (default: TE's defaults)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--loss-tol", type=float, default=None,
                    help="relative loss tolerance (default: 1e-5 float32, 1e-2 bfloat16)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="file name tag (default: cpu | shared_gpu_tpN | gpu_tpN)")
    return ap.parse_args(argv)


def _cpu_init(tp: int, seed: int) -> None:
    """megatron-core on CPU: the test suite's shims (they never enter the library)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from helpers.megatron_cpu import init

    init(tp, seed)


def build_arms(args: argparse.Namespace, spec, world: int, rank: int, dtype: torch.dtype,
               device: torch.device, backends: list[str]) -> dict[str, tuple]:
    """name -> (TrainArm, kind, backend, its core attention as attention_summary says); every
    model starts from the Megatron arm's weights.
    compute_only: an overlap model whose layers get the null transport in place of the one
    they would build lazily (their cached `_transport`), so every TP-linear transfer is skipped."""
    import megatron_overlap as mo
    from megatron_overlap.ab import TrainArm
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.ab.model import build_gpt, gpt_loss
    from megatron_overlap.telemetry import attention_settings, attention_summary

    def build(backend: str, overlap: bool):
        # install() also lets torch norms take sequence parallelism: Megatron's arm needs it too
        mo.install(ub_cfgs=args.ub_cfgs, backend=backend)
        try:
            return build_gpt(spec, world, overlap=overlap, dtype=dtype, device=device)
        finally:
            mo.uninstall()

    plain, wrap = build("auto", overlap=False)
    models = {"megatron": (plain, wrap, "megatron", "megatron")}
    variants = [(f"overlap_{b}", b, "overlap") for b in backends]
    if not args.no_compute_only:
        variants.append(("compute_only", backends[0] if backends else "torch_p2p", "compute_only"))
    for name, backend, kind in variants:
        model, w = build(backend, overlap=True)
        model.load_state_dict(plain.state_dict())
        if kind == "compute_only":  # every overlapped linear's transfers skipped
            floor = NullTransport(world, rank, seed=rank)
            for m in model.modules():
                if hasattr(m, "overlap_plan"):
                    m._transport = floor
        models[name] = (model, w, kind, "null" if kind == "compute_only" else backend)
    optim = lambda ps: torch.optim.AdamW(ps, lr=args.lr)  # noqa: E731
    # every arm is built under install(): the same core attention (named per arm in the results)
    return {n: (TrainArm(n, w(m), gpt_loss, optim), kind, b, attention_summary(attention_settings(m)))
            for n, (m, w, kind, b) in models.items()}


def parity(losses: list[float], ref: list[float], tol: float) -> dict:
    """Losses step by step against the reference arm's: equal within `tol` (relative)."""
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    rels = [d / max(abs(b), 1e-12) for d, b in zip(diffs, ref)]
    return {"max_abs_diff": max(diffs), "max_rel_diff": max(rels), "tol_rel": tol,
            "passed": all(r <= tol for r in rels)}


def summarize(arms: dict, worst: dict[str, list[float]], per_rank: list[dict], warmup: int,
              tol: float) -> dict[str, dict]:
    """Per arm: losses, step times (slowest rank; medians after `warmup`), loss parity
    against Megatron's arm, speedup and hidden fraction."""
    from megatron_overlap.ab.timing import hidden_fraction, summary

    ref = [r.loss for r in arms["megatron"][0].results]
    out = {}
    for n, (arm, kind, backend, attention) in arms.items():
        losses = [r.loss for r in arm.results]
        out[n] = {"kind": kind, "backend": backend, "losses": losses, "attention": attention,
                  "step_time_s": summary(worst[n][warmup:] or worst[n]), "step_times_s": worst[n],
                  "per_rank_step_times_s": [p[n] for p in per_rank],
                  "parity": parity(losses, ref, tol) if kind == "overlap" else None}
    base = out["megatron"]["step_time_s"]["median"]
    floor = out.get("compute_only", {}).get("step_time_s", {}).get("median")
    for a in out.values():
        if a["kind"] == "overlap":
            t = a["step_time_s"]["median"]
            a["speedup_vs_megatron"] = base / t
            a["hidden_fraction"] = hidden_fraction(base, t, floor) if floor is not None else None
    return out


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    from megatron_overlap.ab import backends as backend_sel
    from megatron_overlap.ab.launch import barrier, plan_layout
    from megatron_overlap.ab.machine import machine_info
    from megatron_overlap.ab.model import GPTSpec, batches, init_megatron
    from megatron_overlap.ab.timing import gather_max, rotated
    from megatron_overlap.extras import require

    track = require("rich.progress", "benchmarks/step_ab.py").track

    layout = plan_layout(world, args.device)
    device = init_megatron(layout, rank, world, args.seed, _cpu_init)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    if device.type == "cuda":  # fp32 parity at 1e-5 needs full-precision GEMMs
        torch.backends.cuda.matmul.allow_tf32 = False
    spec = GPTSpec(args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab, args.ffn)
    backends, skipped = backend_sel.select(args.backends, layout)
    backends, failed = backend_sel.usable(backends, parallel_state.get_tensor_model_parallel_group(), device)
    skipped.update(failed)
    arms = build_arms(args, spec, world, rank, dtype, device, backends)
    data = list(batches(spec, args.steps, args.seed, device))
    lead = rank == 0
    for i in (track(range(args.steps), description="step_ab", transient=True) if lead else range(args.steps)):
        for name in rotated(list(arms), i):  # side by side, each arm first in turn
            barrier(device)
            arms[name][0].step(data[i])
    worst, per_rank = gather_max({n: [r.step_time_s for r in a.results] for n, (a, *_) in arms.items()})
    if lead:
        tol = args.loss_tol or (1e-5 if dtype == torch.float32 else 1e-2)
        out = summarize(arms, worst, per_rank, args.warmup, tol)
        meta = machine_info(layout, device)
        meta.update(backends=backends, skipped_backends=skipped)
        doc = {"benchmark": "step_ab", "command": " ".join([sys.executable, *sys.argv]),
               "config": vars(args), "model": spec.__dict__, "dtype": str(dtype).removeprefix("torch."),
               "meta": meta, "arms": out,
               "compute_only_note": "overlap arm with every overlapped linear's transfers skipped "
                                    "(null transport); Megatron's other collectives (embedding, "
                                    "cross-entropy, norm-grad reductions) still run; its losses are "
                                    "not a model's losses",
               "parity_passed": all(a["parity"]["passed"] for a in out.values() if a["parity"])}
        _write(doc, args, layout)
        _table(doc)
    dist.barrier()
    dist.destroy_process_group()


def _table(doc: dict) -> None:
    from megatron_overlap.config.console import Column, lines, table

    m = doc["meta"]
    s = doc["model"]
    title = (f"step_ab: GPT {s['layers']}L h{s['hidden']} heads{s['heads']} seq{s['seq']} "
             f"mb{s['micro_batch']} {doc['dtype']}, TP={m['ranks']}, {m['gpu_name'] or 'CPU'}, "
             f"torch {m['torch']}, {m['date']}")
    columns = [Column(c, right=c not in ("arm", "parity"))
               for c in ("arm", "median step ms", "IQR ms", "vs megatron", "hidden", "final loss",
                         "max |loss diff|", "parity")]
    rows = []
    for n, a in doc["arms"].items():
        st, p = a["step_time_s"], a["parity"]
        rows.append((n, f"{st['median'] * 1e3:.2f}", f"{st['q1'] * 1e3:.2f}-{st['q3'] * 1e3:.2f}",
                     f"{a['speedup_vs_megatron']:.3f}x" if "speedup_vs_megatron" in a else "-",
                     f"{a['hidden_fraction']:.2f}" if a.get("hidden_fraction") is not None else "-",
                     f"{a['losses'][-1]:.6f}", f"{p['max_abs_diff']:.2e}" if p else "-",
                     ("ok" if p["passed"] else "FAIL") + f" (rel {p['max_rel_diff']:.1e} <= {p['tol_rel']:g})"
                     if p else ("reference" if a["kind"] == "megatron" else "n/a (compute-only)")))
    if m["functional_only"]:
        print(m["note"])
    kinds = {a.get("attention") for a in doc["arms"].values()}
    attention = (f"core attention, every arm: {kinds.pop()}" if len(kinds) == 1 else
                 "core attention differs between arms: " + "; ".join(
                     f"{n}: {a.get('attention')}" for n, a in doc["arms"].items()))
    print(table(title, columns, rows, width=150)
          + lines(attention, *(f"skipped {b}: {why}" for b, why in m["skipped_backends"].items())), end="")


def _write(doc: dict, args, layout) -> None:
    from megatron_overlap.ab.plots import plot_steps
    from megatron_overlap.ab.results import stem, write_json

    path = stem(args.out, "step_ab", layout, args.tag)
    write_json(path + ".json", doc)
    m, s = doc["meta"], doc["model"]
    plot_steps(doc["arms"], path + ".png",
               f"step_ab: GPT {s['layers']}L h{s['hidden']} seq{s['seq']} mb{s['micro_batch']} {doc['dtype']}, "
               f"TP={m['ranks']} {m['gpu_name'] or 'CPU'} ({m['mode']}), torch {m['torch']}, {m['date'][:10]}"
               + ("  [FUNCTIONAL ONLY]" if m["functional_only"] else ""), args.warmup)
    print(f"results: {path}.json\nplot:    {path}.png")


def main(argv=None) -> int:
    from megatron_overlap.ab.launch import default_world, launch, plan_layout
    from megatron_overlap.ab.results import passed

    args = parse_args(argv)
    world = default_world(args.tp, args.device)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    launch(worker, world, args, device=args.device)
    return passed(args.out, "step_ab", plan_layout(world, args.device), args.tag,
                  "parity_passed", "loss parity FAILED")


if __name__ == "__main__":
    sys.exit(main())

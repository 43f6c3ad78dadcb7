"""A small megatron-core GPTModel trained in FP8 and in bf16, side by side: the same
initial weights, batches and optimizer, built after install() with TP + SP
(`tp_comm_overlap=True`: our linears); the FP8 arm with Megatron's own fields
(fp8='hybrid', fp8_recipe='tensorwise'). Each step runs both arms, each first in turn.
On one GPU the TP ranks share it (gloo, `symm`); on CPU (gloo, fp32 params) it is
functional only.

    python benchmarks/fp8_train.py                        # GPU: 200 steps, ~1 minute on an H200
    python benchmarks/fp8_train.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 32 \\
        --micro-batch 2 --vocab 128 --steps 6              # CPU: functional only

Writes <out>/fp8_train_<tag>.json (both loss curves, step times, the gap), a text table
<out>/fp8_train_<tag>.txt and, where matplotlib imports, <out>/fp8_train_<tag>.png.
The gap: mean loss of the last --last steps, FP8 against bf16 (relative).

Also, per arm: how its layer passes ran (replayed from CUDA graphs, captured, eager);
before the first step, with both arms, their agreement (`agreement`: FP8 against bf16 on
the same weights and batch, the logits and every parameter's gradient); after training
two causality checks and the loss on sequences never trained on (memorizing the training
pool cannot bring it below about log(vocab); a look-ahead leak does). `future_leak`: each
position's loss on a batch, then with every token after the middle replaced; a causal
model's loss before the middle cannot change, but FP8's per-tensor scales see every
position, so there it may move by their rounding (~1e-2 on CPU). It cannot see a leak of
the next two tokens (the changed ones start three positions after the last it compares);
`lookahead` can: the logits at j-1, j-2, j-3 when token j alone changes. Then each
arm's weights scored on the training pool by both arms' models (`crossover`: where a low
loss lives, in the weights or in a forward) and the parameters TP does not split compared
across the ranks (`replica_spread`); `--agree-every N` repeats the agreement check on the
FP8 arm's current weights every N steps. `--data markov` trains on a random Markov chain
(a distribution to learn, its loss floor log 4) instead of the pool to memorize. `--arms fp8`
trains one arm alone (no state shared with another). `--tp 1`, `--no-sp`, `--attention`,
`--fp8-scaling`, `--no-fp8-wgrad`, `--eager-kernels` change one thing each (diagnostics).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import warnings

import torch
import torch.distributed as dist

from megatron_overlap.ab.model import MARKOV_BRANCHING

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
HERE = os.path.dirname(os.path.abspath(__file__))
FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise")


def build_parser() -> argparse.ArgumentParser:
    """The flags (benchmarks/probe_fp8_tp.py adds its own to them)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--last", type=int, default=20, help="steps whose mean loss is the gap's")
    ap.add_argument("--agree-every", type=int, default=10,
                    help="with both arms: the agreement check on the FP8 arm's current weights "
                         "every N steps (0: before the first step only)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="the parameters' (default: bfloat16 on a GPU, float32 on CPU)")
    ap.add_argument("--backend", default="auto",
                    help="install()'s transport (auto: symm where ranks share a GPU, gloo on CPU)")
    ap.add_argument("--arms", default="bf16,fp8", help="the arms to train (comma-separated)")
    ap.add_argument("--eager-kernels", action="store_true",
                    help="FP8 casts and transposes as torch's eager kernels (overlap.fp8.set_fused)")
    ap.add_argument("--attention", choices=("torch", "megatron"), default="torch",
                    help="install()'s core attention (megatron: DotProductAttention, its mask explicit)")
    ap.add_argument("--fp8-scaling", choices=("tensorwise", "rowwise"), default="tensorwise",
                    help="install()'s fp8_scaling (rowwise: no amax exchange; sets fp8_wgrad=False)")
    ap.add_argument("--no-sp", action="store_true",
                    help="TP without sequence parallelism (no gathers: all-reduces of bf16 partials)")
    ap.add_argument("--data", choices=("pool", "markov"), default="pool",
                    help="pool: 16 random sequences to memorize (a plateau, then a fall: when "
                         "each arm falls decides the gap); markov: a random Markov chain of "
                         f"{MARKOV_BRANCHING} successors a token to learn (the loss falls towards "
                         f"log {MARKOV_BRANCHING})")
    ap.add_argument("--cpu-init", action="store_true",
                    help="Megatron's use_cpu_initialization: whole weights drawn, then split, so "
                         "every TP size starts from the same model (the default draws each "
                         "rank's shard on the GPU: another model at each TP size)")
    ap.add_argument("--no-fp8-wgrad", action="store_true",
                    help="the FP8 arm's wgrad GEMMs in bf16 (Megatron's fp8_wgrad=False)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None)
    return ap


def parse_args(argv=None, ap: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    ap = ap or build_parser()
    args = ap.parse_args(argv)
    if args.seq < 8:  # the look-ahead check compares three positions before its first probe
        ap.error(f"--seq {args.seq}: at least 8")
    if args.agree_every < 0:
        ap.error(f"--agree-every {args.agree_every}: 0 (off) or a number of steps")
    return args


def _cpu_init(tp: int, seed: int) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the test suite's CPU shims
    from helpers.megatron_cpu import init

    init(tp, seed)


def future_leak(model, spec, seed: int, device: torch.device) -> dict:
    """Per-position loss of one batch, then of the same batch with every token after the
    middle replaced: |change| before the middle (max, mean) and after it (mean). Forward
    and backward, as training runs them (replays included); the grads are dropped."""
    from megatron_overlap.ab.model import batches

    tokens, pos, mask, labels = next(batches(spec, 1, seed + 1, device))
    half = spec.seq // 2
    g = torch.Generator().manual_seed(seed + 2)
    changed = torch.cat([tokens, labels[:, -1:]], 1).cpu()
    changed[:, half + 1:] = torch.randint(0, spec.vocab, changed[:, half + 1:].shape, generator=g)
    changed = changed.to(device)

    def per_position(t, y):
        out = model(t, pos, mask, labels=y)
        out.float().sum().backward()
        model.zero_grad_buffer()
        return out.float().detach().cpu()

    a = per_position(tokens, labels)
    b = per_position(changed[:, :-1].contiguous(), changed[:, 1:].contiguous())
    early, late = (a - b)[:, :half - 1].abs(), (a - b)[:, half:].abs()
    # the batch comes from a pool never trained on (another seed): memorizing the training
    # pool cannot bring its loss below about log(vocab); a look-ahead leak does
    return {"before_middle_max": float(early.max()), "before_middle_mean": float(early.mean()),
            "after_middle_mean": float(late.mean()), "unseen_loss": float(a.mean())}


def lookahead(model, spec, seed: int, device: torch.device, probes: int = 4) -> dict:
    """Which logits move when one token changes: for positions j through the sequence, the
    token of batch element 0 at j is replaced and the largest |logit change| (this rank's
    vocabulary shard) is taken at j - 1, j - 2, j - 3 (a causal model: rounding of FP8's
    per-tensor scales only), further before, at j and after (the change itself), and in the
    other batch elements (none may move but by the scales). Unlike `future_leak`, which
    compares losses (whose labels move with the tokens), this sees a leak of the very next
    token, the one that is the label. Forward only."""
    from megatron_overlap.ab.model import batches

    tokens, pos, mask, _ = next(batches(spec, 1, seed + 3, device))
    rows = {k: [] for k in ("j-1", "j-2", "j-3", "before", "at_after", "other_rows")}
    with torch.no_grad():
        base = model(tokens, pos, mask).float()
        for j in torch.linspace(max(4, spec.seq // 8), spec.seq - 1, probes).long().tolist():
            t = tokens.clone()
            t[0, j] = (t[0, j] + 1) % spec.vocab
            d = (model(t, pos, mask).float() - base).abs().amax(-1).cpu()  # [b, s]
            for k, v in (("j-1", d[0, j - 1]), ("j-2", d[0, j - 2]), ("j-3", d[0, j - 3]),
                         ("before", d[0, :j - 3].max()), ("at_after", d[0, j:].mean()),
                         ("other_rows", d[1:].max() if len(d) > 1 else torch.tensor(0.0))):
                rows[k].append(float(v))
    return {k: max(v) for k, v in rows.items()}


def weights_of(ddp_model) -> dict:
    """A copy of the model's state (the DDP wrapper's module's), to load back later."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in ddp_model.module.state_dict().items()}


def agreement_on_fp8_weights(arms: dict, batch) -> dict:
    """`agreement` on the FP8 arm's weights as they are now (the bf16 arm's model given
    them for the while): where FP8 training goes apart from bf16's, whether FP8's
    gradients stay what its rounding makes them (about as apart as before the first step)
    or a pass starts computing something else (they move apart by more as training goes)."""
    saved = weights_of(arms["bf16"].model)
    arms["bf16"].model.module.load_state_dict(weights_of(arms["fp8"].model))
    try:
        return agreement(arms, batch)
    finally:
        arms["bf16"].model.module.load_state_dict(saved)


def crossover(arms: dict, spec, seed: int, device: torch.device, data, batches_n: int = 4
              ) -> dict:
    """Each arm's trained weights evaluated by each arm's model on the training pool (forward
    only, mean loss of `batches_n` batches of `data`, the training batches' source):
    {"<weights> weights, <model> model": loss}.
    An arm that learned its weights has about its own loss under the other arm's math too;
    one whose low loss lives in its own forward (a path that computes something else) loses
    it there. The models are left with their own weights."""
    from megatron_overlap.ab.model import gpt_loss

    saved = {k: weights_of(a.model) for k, a in arms.items()}
    pool = list(data(spec, batches_n, seed, device))
    out = {}
    try:
        for w, weights in saved.items():
            for m, a in arms.items():
                a.model.module.load_state_dict(weights)
                with torch.no_grad():
                    out[f"{w} weights, {m} model"] = statistics.fmean(
                        gpt_loss(a.model, b).item() for b in pool)
    finally:
        for k, a in arms.items():
            a.model.module.load_state_dict(saved[k])
    out["restored"] = all(torch.equal(v, saved[k][n]) for k, a in arms.items()
                          for n, v in a.model.module.state_dict().items()
                          if isinstance(v, torch.Tensor))
    return out


def replica_spread(model) -> dict:
    """The parameters TP does not split (norms, the row layers' biases) are one tensor held
    by every TP rank and must stay equal: how many were compared, the largest |difference|
    from TP rank 0's copy (a NaN counts as inf) and the parameter it is in (None where
    every copy is equal). A rank that trains its copy apart has more parameters than the
    model it claims to be. Collective over the TP group (gloo: CPU copies; NCCL: on the
    device)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    n = dist.get_world_size(group)
    seen = []
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        mine = p.detach().float()
        mine = mine.cpu() if dist.get_backend(group) == "gloo" else mine.contiguous()
        theirs = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(theirs, mine, group=group)
        d = max(float(torch.nan_to_num((t - theirs[0]).abs(), nan=float("inf")).max())
                for t in theirs)
        seen.append((d, name))
    worst, name = max(seen, default=(0.0, None))
    return {"compared": len(seen), "max_abs": worst, "param": name if worst > 0 else None}


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||, in fp32 (`ab.compare.rel_error`: a model's gradients on a GPU)."""
    from megatron_overlap.ab.compare import rel_error as rel

    return rel(got, ref, dtype=torch.float32)


def agreement(arms: dict, batch) -> dict:
    """Both arms on the same weights and batch (before the first step; during training
    through `agreement_on_fp8_weights`): the FP8 arm's logits (this
    rank's vocabulary shard) and each parameter's gradient (this rank's shard, main_grad
    after Megatron's finalisation) against the bf16 arm's, as ||fp8 - bf16|| / ||bf16||.
    FP8's rounding moves every tensor a little (a few %); a pass that computes the wrong thing moves its own tensors far more, and
    the worst parameters name the layer and the GEMM (weight: the wgrad; the layer
    before it: the dgrad). The grads are dropped after."""
    from megatron_overlap.overlap import replay

    tokens, pos, mask, _ = batch
    seen = {}
    # nothing of it may show in training: no pass sighted or captured for replay, and the
    # layers' first-micro-batch flags (the FP8 weight cache's) as a step will find them
    replayed = replay.set_enabled(False)
    layers = [m for a in arms.values() for m in a.model.modules()
              if hasattr(m, "is_first_microbatch")]
    flags = {m: m.is_first_microbatch for m in layers}
    caches = {m: dict(vars(m._fp8_cache)) for m in layers if getattr(m, "_fp8_cache", None)}
    try:
        for k, a in arms.items():
            with torch.no_grad():
                logits = a.model(tokens, pos, mask).float()
            a.gradients(batch)
            seen[k] = (logits, {n: p.main_grad.float().clone() for n, p in a.model.named_parameters()
                                if p.requires_grad})
            a.model.zero_grad_buffer()
    finally:
        replay.set_enabled(replayed)
        for m, flag in flags.items():
            m.is_first_microbatch = flag
        for m, state in caches.items():
            vars(m._fp8_cache).clear()
            vars(m._fp8_cache).update(state)
    (l16, g16), (l8, g8) = seen["bf16"], seen["fp8"]
    grads = {n.replace("module.", ""): rel_error(g8[n], g16[n]) for n in g16}
    worst = sorted(grads.items(), key=lambda kv: -kv[1])
    return {"logits_rel": rel_error(l8, l16), "grad_rel_median": statistics.median(grads.values()),
            "grad_rel_worst": worst[:6], "grad_rel": grads}


def gap(bf16: list[float], fp8: list[float], last: int) -> dict:
    """Mean loss of the last `last` steps of each arm, and FP8's relative to bf16's."""
    a, b = statistics.fmean(bf16[-last:]), statistics.fmean(fp8[-last:])
    return {"last_steps": min(last, len(bf16)), "bf16_mean": a, "fp8_mean": b,
            "fp8_minus_bf16": b - a, "relative": (b - a) / abs(a)}


def text_table(doc: dict, every: int = 10) -> str:
    """The curves as text, every `every` steps and the last; then the gap."""
    arms, g = doc["arms"], doc["gap"]
    n = len(next(iter(arms.values()))["losses"])
    lines = [f"fp8_train: {doc['title']}", f"{'step':>5s} " + " ".join(f"{k + ' loss':>10s}" for k in arms)]
    for i in sorted(set(range(0, n, every)) | {n - 1}):
        lines.append(f"{i:5d} " + " ".join(f"{a['losses'][i]:10.4f}" for a in arms.values()))
    if g:
        lines.append(f"mean loss of the last {g['last_steps']} steps: bf16 {g['bf16_mean']:.4f}, fp8 "
                     f"{g['fp8_mean']:.4f} (fp8 - bf16 = {g['fp8_minus_bf16']:+.4f}, "
                     f"{100 * g['relative']:+.2f}%)")
    lines.append("median step ms: " + ", ".join(
        f"{k} {a['step_time_s']['median'] * 1e3:.1f}" for k, a in arms.items())
        + (" (ranks share one GPU: host-bound, not FP8's speed)" if doc["meta"]["mode"] == "shared_gpu" else ""))
    lines.append("precision: " + "; ".join(f"{k}: {a['precision']}" for k, a in arms.items()))
    lines.append("layer passes (calls / replayed / captured): " + "; ".join(
        f"{k} {a['passes']['calls']} / {a['passes']['replays']} / {a['passes']['captures']}"
        for k, a in arms.items()))
    lines.append("loss change before the middle when the tokens after it change, max (mean); "
                 "after it, mean: " + "; ".join(
                     f"{k} {a['future_leak']['before_middle_max']:.2e} "
                     f"({a['future_leak']['before_middle_mean']:.2e}); "
                     f"{a['future_leak']['after_middle_mean']:.2e}" for k, a in arms.items()))
    lines.append(f"loss on sequences never trained on (log vocab = {math.log(doc['model']['vocab']):.2f}): "
                 + ", ".join(f"{k} {a['future_leak']['unseen_loss']:.3f}" for k, a in arms.items()))
    if doc.get("agreement"):
        ag = doc["agreement"]
        lines.append(f"fp8 vs bf16 before the first step (same weights, batch; ||fp8 - bf16|| / "
                     f"||bf16||): logits {ag['logits_rel']:.3f}, grads median "
                     f"{ag['grad_rel_median']:.3f}, worst " + ", ".join(
                         f"{n} {r:.3f}" for n, r in ag["grad_rel_worst"][:4]))
    if doc.get("agreement_along"):
        lines.append("the same on the FP8 arm's weights as it trains (step: logits, grads median, "
                     "worst): " + "; ".join(
                         f"{a['step']}: {a['logits_rel']:.3f}, {a['grad_rel_median']:.3f}, "
                         f"{a['grad_rel_worst'][0][0]} {a['grad_rel_worst'][0][1]:.3f}"
                         for a in doc["agreement_along"]))
    lines.append("max |logit change| when one token j changes, at j-1 / j-2 / j-3 / before / "
                 "at and after (mean) / other batch rows: " + "; ".join(
                     f"{k} " + " / ".join(f"{v:.2e}" for v in a["lookahead"].values())
                     for k, a in arms.items()))
    lines.append("the training pool's loss, each arm's weights in each arm's model: " + ", ".join(
        f"{k} {v:.3f}" for k, v in doc["crossover"].items() if k != "restored"))
    lines.append("TP-replicated parameters, largest difference between ranks: " + "; ".join(
        f"{k} {a['replica_spread']['max_abs']:.2e} over {a['replica_spread']['compared']}"
        + (f" (in {a['replica_spread']['param']})" if a["replica_spread"]["param"] else "")
        for k, a in arms.items()))
    return "\n".join(lines)


def transports(arms: dict) -> str:
    """The transports the arms' overlapped linears ran on ('symm', 'torch_p2p', ...)."""
    names = {type(m._transport).__name__ for a in arms.values() for m in a.model.modules()
             if getattr(m, "_transport", None) is not None}
    return "transport " + "/".join(sorted(names)) if names else "no overlapped linear"


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    import megatron_overlap as mo
    from megatron_overlap.ab import TrainArm
    from megatron_overlap.ab.launch import barrier, plan_layout
    from megatron_overlap.ab.machine import machine_info
    from megatron_overlap.ab.model import (GPTSpec, batches, build_gpt, gpt_loss, init_megatron,
                                           markov_batches)
    from megatron_overlap.ab.results import write_json
    from megatron_overlap.ab.timing import rotated, summary
    from megatron_overlap.overlap import replay

    layout = plan_layout(world, args.device)
    if args.backend != "auto":  # refused where it cannot run here (ab.backends: the reason)
        from megatron_overlap.ab.backends import select

        why = select(args.backend, layout)[1].get(args.backend)
        if why:
            raise SystemExit(f"fp8_train: --backend {args.backend} cannot run here: {why}")
    device = init_megatron(layout, rank, world, args.seed, _cpu_init)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    spec = GPTSpec(args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab, None)
    mo.install(backend=args.backend, attention=args.attention, fp8_scaling=args.fp8_scaling)
    if args.eager_kernels:
        from megatron_overlap.overlap import fp8

        fp8.set_fused(False)
    names = [a for a in args.arms.split(",") if a]
    if not names or set(names) - {"bf16", "fp8"}:
        raise SystemExit(f"fp8_train: --arms {args.arms!r}: bf16, fp8 or both")
    fp8_extra = ({"fp8_wgrad": False} if args.no_fp8_wgrad or args.fp8_scaling == "rowwise"
                 else {})
    common = {"sequence_parallel": False} if args.no_sp else {}  # both arms' config
    if args.cpu_init:
        common["use_cpu_initialization"] = True
    try:  # both built, so that either arm alone starts from the same weights
        models = {"bf16": build_gpt(spec, world, True, dtype, device, **common),
                  "fp8": build_gpt(spec, world, True, dtype, device, **FP8, **fp8_extra, **common)}
    finally:
        mo.uninstall()
    models["fp8"][0].load_state_dict(models["bf16"][0].state_dict())
    models = {k: models[k] for k in names}
    precision = {k: sorted({x.precision.describe() for x in m.modules() if hasattr(x, "precision")})
                 for k, (m, _) in models.items()}
    arms = {k: TrainArm(k, wrap(m), gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=args.lr))
            for k, (m, wrap) in models.items()}
    passes = {k: dict.fromkeys(("calls", "replays", "captures"), 0) for k in arms}
    data = batches if args.data == "pool" else markov_batches
    floor = f" (loss floor log {MARKOV_BRANCHING} = {math.log(MARKOV_BRANCHING):.3f})"
    agreed = (agreement(arms, next(data(spec, 1, args.seed, device)))
              if len(arms) == 2 else None)
    along = []  # (step, agreement on the FP8 arm's weights then)
    for i, b in enumerate(data(spec, args.steps, args.seed, device)):
        if agreed and args.agree_every and i and i % args.agree_every == 0:
            along.append((i, agreement_on_fp8_weights(arms, b)))
        for name in rotated(list(arms), i):
            barrier(device)
            before = replay.totals()
            arms[name].step(b)
            after = replay.totals()
            for k in passes[name]:
                passes[name][k] += after[k] - before[k]
        if rank == 0 and (i + 1) % 25 == 0:  # progress, so a run cut short says how far it got
            print(f"step {i + 1}/{args.steps}: " + ", ".join(
                f"{k} loss {a.results[-1].loss:.4f} ({a.results[-1].step_time_s * 1e3:.0f} ms)"
                for k, a in arms.items()), flush=True)
    leaks = {k: future_leak(a.model, spec, args.seed, device) for k, a in arms.items()}
    looks = {k: lookahead(a.model, spec, args.seed, device) for k, a in arms.items()}
    crossed = crossover(arms, spec, args.seed, device, data)
    spread = {k: replica_spread(a.model) for k, a in arms.items()}
    if rank == 0:
        losses = {k: [r.loss for r in a.results] for k, a in arms.items()}
        meta = machine_info(layout, device)
        doc = {"benchmark": "fp8_train", "command": " ".join([sys.executable, *sys.argv]),
               "config": vars(args), "model": spec.__dict__, "dtype": str(dtype)[6:], "meta": meta,
               "title": (f"GPT {args.layers}L h{args.hidden} seq{args.seq} mb{args.micro_batch} "
                         f"vocab {args.vocab}, {args.data} data"
                         f"{floor if args.data == 'markov' else ''}, TP={world}{' + SP' if world > 1 and not args.no_sp else ''}, {meta.get('gpu_name') or 'CPU'}, "
                         f"{args.steps} steps, AdamW lr {args.lr}, seed {args.seed}, "
                         f"{transports(arms)}{', eager FP8 kernels' if args.eager_kernels else ''}, "
                         f"{args.attention} attention, fp8 scaling {args.fp8_scaling}"
                         f"{', CPU initialization' if args.cpu_init else ''}"
                         f"{', fp8_wgrad off' if 'fp8_wgrad' in fp8_extra else ''}, "
                         f"pass replay {'on' if replay.enabled() and device.type == 'cuda' else 'off'}"),
               "arms": {k: {"losses": losses[k], "precision": ", ".join(precision[k]),
                            "step_time_s": summary([r.step_time_s for r in a.results][3:] or
                                                   [r.step_time_s for r in a.results]),
                            "passes": passes[k], "future_leak": leaks[k],
                            "lookahead": looks[k], "replica_spread": spread[k]}
                        for k, a in arms.items()},
               "agreement": agreed, "crossover": crossed,
               "agreement_along": [{"step": i, **{k: a[k] for k in ("logits_rel", "grad_rel_median",
                                                                   "grad_rel_worst")}}
                                   for i, a in along],
               "gap": gap(losses["bf16"], losses["fp8"], args.last) if len(arms) == 2 else None}
        tag = args.tag or ("cpu" if device.type == "cpu" else f"{layout.mode}_tp{world}")
        path = os.path.join(args.out, f"fp8_train_{tag}")
        write_json(path + ".json", doc)
        table = text_table(doc)
        with open(path + ".txt", "w") as f:
            f.write(table + "\n")
        print(table)
        print(f"results: {path}.json, {path}.txt")
        try:
            from megatron_overlap.ab.plots import plot_steps

            plot_steps(doc["arms"], path + ".png", f"fp8_train: {doc['title']}", 3)
            print(f"plot:    {path}.png")
        except ImportError as exc:  # the device may lack matplotlib: plot later from the JSON
            print(f"no plot ({exc}); the curves are in {path}.json")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    from megatron_overlap.ab.launch import launch

    args = parse_args(argv)
    launch(worker, args.tp, args, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

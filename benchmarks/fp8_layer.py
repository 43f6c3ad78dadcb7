"""A whole transformer layer in FP8 against the same layer in bf16, forward + backward, at
one TP rank's dimensions on one GPU, side by side in one run (benchmarks/layer_compute.py's
set-up and timing: one process plays the last rank of the TP group, every arm on the
mirror transport so that each GEMM and each amax gets a training step's data
(`layer_compute.timing_transport`; on `null` a gathered amax is read from a gather that
moved nothing), the pass replay on).

Every arm is the layer install() builds (our overlapped linears, its core attention:
torch's fused attention), from the same weights and input; the fp8 arms with Megatron's
own fields (fp8='hybrid', fp8_recipe='tensorwise': e4m3 inputs and weights, e5m2
gradients, all three GEMMs of each linear in FP8, quantization included). fp8_eager_kernels
is the fp8 layer with its FP8 casts and transposes as torch's eager kernels instead of the
compiled ones (`overlap.fp8.set_fused(False)`): what those win. fp8_later_micro is the fp8
layer at a step's later micro-batches under Megatron's schedules, its FP8 weights (and
their dgrad transposes) made at the step's first and reused (`is_first_microbatch`): what
a step of several micro-batches mostly runs. fp8_delayed is Megatron's default recipe,
delayed scaling (the largest of 1024 amaxes, TP reduction), primed by two steps: its casts
read no amax first. The fp8 arm's forward GEMMs accumulate fast (`install(fp8_fast_accum=)`'s
default, as Transformer Engine's recipes and torchao run them); fp8_accum_none accumulates
none fast (as the layers ran before), fp8_accum_all every FP8 GEMM (dgrad and wgrad too).
Every FP8 arm's SwiGLU writes fc2's FP8 input and fc1's FP8 output gradient itself
(install(fp8_fused_activation=True), the default: megatron/mlp.py); fp8_unfused_act and
fp8_delayed_unfused_act are the fp8 and fp8_delayed arms with Megatron's SwiGLU (bf16,
then each linear's cast), what the fused kernels win. fp8_eager_kernels and
fp8_later_micro compute the fp8 arm's numbers (1e-2 relative at most: the attention
backward's own run-to-run differences). Measured: eager
(calls queued back to back, the arms alternating call by call) and graphed (medians of
--repeat samples of --reps calls; ratio = bf16 ms /
fp8 ms), memory per arm (attention_layer's `memory`: per step, kept, pools). Before timing, the fp8 arm
against the bf16 arm on the mirror transport: output, input grad and every parameter
grad within FP8's rounding, relative (norm) <= 0.25 (e4m3 keeps 3 mantissa bits, e5m2 2:
a gradient through two FP8 GEMMs measured 0.07-0.11 on CPU at the tiny shape; a wrong
scale or operand is off by a factor, >= 0.5). Goal: the fp8 layer at least 1.35x faster than bf16.

    python benchmarks/fp8_layer.py [--shapes all] [--reps 10] [--repeat 5] [--profile 12]
    python benchmarks/fp8_layer.py --shapes tiny --device cpu      # the check only

--fusions (default megatron_lm): the layer's elementwise fusions, the same in every arm
(layer_compute.FUSIONS). megatron_lm is what pretrain_gpt.py runs for a SwiGLU model
without Transformer Engine: megatron-core's compiled SwiGLU and dropout-add. off gives
every elementwise op its own kernels, as the runs before 2026-12-06 measured; the work
around the GEMMs, which FP8 does not speed up, is then larger in both arms.

--profile N (default 12; 0: off): after timing, each arm's kernels over eager steps
(torch.profiler), in groups (GEMM, attention, compiled, copy, reduction, other) and the fp8
arm's N largest: where FP8's time goes, beside benchmarks/layer_ledger.py's byte counts.
On a GPU it then profiles one graphed replay of the bf16, fp8 and fp8_delayed arms: each
group's time outside the GEMMs (kernels on the chunk GEMMs' other streams run beside them),
where a graphed step's time goes, which the summed kernel times do not say.

Writes <out>/fp8_layer_<tag>.json and prints a table; exit status 2 when a check failed.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attention_layer as al  # noqa: E402  (its shapes, memory measure and command line)
import graph_timeline as gt  # noqa: E402  (kernel groups, a graphed replay's timeline)
import layer_compute as lc  # noqa: E402  (the layer set-up and timing)

FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
# Megatron's default recipe as Transformer Engine users set it: the largest of 1024 amaxes
DELAYED = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
               fp8_amax_compute_algo="max", tp_only_amax_red=True)
# the fp8 arm with other FP8 GEMMs accumulating fast (install(fp8_fast_accum=); the fp8
# arm: the forward's, Transformer Engine's and torchao's default): none, as the layers ran
# before; all, the dgrad and wgrad too
FAST_ACCUM_ARMS = {"fp8_accum_none": "none", "fp8_accum_all": "all"}
# the fp8 and fp8_delayed arms with Megatron's SwiGLU (install(fp8_fused_activation=False)):
# its output and its backward's written in bf16, then cast by fc2 and fc1; in every other
# FP8 arm the SwiGLU writes them in FP8 itself (megatron/mlp.py)
UNFUSED_ACT_ARMS = {"fp8_unfused_act": "fp8", "fp8_delayed_unfused_act": "fp8_delayed"}
ARMS = ("bf16", "fp8", "fp8_eager_kernels", "fp8_later_micro", "fp8_delayed", *FAST_ACCUM_ARMS,
        *UNFUSED_ACT_ARMS)
SHAPES = ("70b_tp8_s4096_b2", "8b_tp4_s4096_b2")
GOAL, TOL, TOL_KERNELS = 1.35, 0.25, 1e-2
TIMELINE_ARMS = ("bf16", "fp8", "fp8_delayed")  # each one graphed replay profiled (--profile)


def arms_of(args) -> tuple[str, ...]:
    """ARMS, and with --wait-arm `fp8_wait`: the fp8 arm with the ring all-gathers named
    running one waiting GEMM (`wait_gemm`; attention_layer's `wait_cfgs`)."""
    return ARMS + (("fp8_wait",) if getattr(args, "wait_arm", None) is not None else ())


def build_arms(shape: lc.LayerShape, args, dtype, device):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    import megatron_overlap as mo
    from megatron_overlap.config.names import FAST_ACCUM_DEFAULT

    config = {"bf16": {}, "fp8_delayed": DELAYED, "fp8_delayed_unfused_act": DELAYED}
    layers: dict = {}
    # (accumulation, SwiGLU fused with the casts) of each arm: one install per pair
    knobs = {a: (FAST_ACCUM_ARMS.get(a, FAST_ACCUM_DEFAULT), a not in UNFUSED_ACT_ARMS)
             for a in ARMS}
    for fast, fused in dict.fromkeys(knobs.values()):  # in ARMS' order
        # each layer's transport is replaced by mirror / null
        mo.install(args.ub_cfgs, backend="torch_p2p", fp8_fast_accum=fast,
                   fp8_fused_activation=fused)
        try:
            layers.update({a: lc.build_layer(shape, True, dtype, device, args.fusions,
                                             **config.get(a, FP8))
                           for a in ARMS if knobs[a] == (fast, fused)})
        finally:
            mo.uninstall()
    layers = {a: layers[a] for a in ARMS}
    names = arms_of(args)
    if "fp8_wait" in names:  # FP8 with the ring all-gathers' one waiting GEMM (--wait-arm)
        mo.install(al.wait_cfgs(args.ub_cfgs, tuple(args.wait_arm)), backend="torch_p2p")
        try:
            layers["fp8_wait"] = lc.build_layer(shape, True, dtype, device, args.fusions, **FP8)
        finally:
            mo.uninstall()
    for a in names[1:]:
        got = layers[a].load_state_dict(layers["bf16"].state_dict(), strict=True)
        assert not got.missing_keys and not got.unexpected_keys, got
    d = shape.dims
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(d.seq_length // shape.tp, d.micro_batch, d.hidden, generator=gen).to(device, dtype)
    g = torch.randn(x.shape, generator=gen).to(device, dtype)
    rope = RotaryEmbedding(kv_channels=d.hidden // d.heads, rotary_percent=1.0,
                           rotary_base=500000)(d.seq_length).to(device)
    mask = None if device.type == "cuda" else torch.ones(d.seq_length, d.seq_length).triu(1).bool()[None, None]
    kinds = {"fp8_eager_kernels": EagerKernelsArm, "fp8_later_micro": LaterMicroArm,
             "fp8_delayed": DelayedArm, "fp8_delayed_unfused_act": DelayedArm}
    arms = [kinds.get(a, lc.Arm)(a, layers[a], x.clone().requires_grad_(True), True) for a in names]
    return arms, lc.Extras(g, rope, mask)


class LaterMicroArm(lc.Arm):
    """The FP8 layer at a step's later micro-batches under Megatron's schedules: its FP8
    weights made at the step's first (is_first_microbatch, as Megatron sets it) and reused
    (layers/fp8.py `Fp8WeightCache`); the weights do not change while timed. Its first
    call runs two first micro-batches before its own (the second shows a schedule drives
    the flag), on whatever transport the arms then run on."""

    primed = False

    def step(self, e: lc.Extras) -> torch.Tensor:
        if not self.primed:
            self.primed = True
            for _ in range(2):
                for m in self.layer.modules():
                    if getattr(m, "_fp8_cache", None) is not None:
                        m.is_first_microbatch = True
                super().step(e)
            self.layer.zero_grad(set_to_none=True)
            self.x.grad = None
            caches = [m._fp8_cache for m in self.layer.modules() if getattr(m, "_fp8_cache", None)]
            assert caches and all(c.driven for c in caches), "fp8_later_micro: no weight cache in use"
        return super().step(e)


class DelayedArm(lc.Arm):
    """The layer under delayed scaling (`DELAYED`): its first call runs two steps first,
    so that its scales come from amaxes, not the new histories' scale of 1."""

    primed = False

    def step(self, e: lc.Extras) -> torch.Tensor:
        if not self.primed:
            self.primed = True
            for _ in range(2):
                super().step(e)
            self.layer.zero_grad(set_to_none=True)
            self.x.grad = None
        return super().step(e)


class EagerKernelsArm(lc.Arm):
    """The FP8 layer with its casts and transposes as torch's eager kernels (`overlap.fp8.
    set_fused(False)`, around every call, its captures included): what the compiled
    kernels win, measured beside them."""

    def step(self, e: lc.Extras) -> torch.Tensor:
        from megatron_overlap.overlap import fp8

        before = fp8.set_fused(False)
        try:
            return super().step(e)
        finally:
            fp8.set_fused(before)


def check(emu, arms, e) -> dict:
    """The fp8 arm against the bf16 arm on the mirror transport, relative (norm)."""
    from megatron_overlap.ab.compare import rel_error
    from megatron_overlap.config.names import FAST_ACCUM_DEFAULT, FAST_ACCUMS, fast_accum_label

    got = lc.mirrored_results(emu, arms, e)[0]
    rel = lambda a, b: rel_error(a, b, dtype=torch.float32)  # noqa: E731
    errs = {k: rel(got["fp8"][k], v) for k, v in got["bf16"].items()}
    delayed = {k: rel(got["fp8_delayed"][k], v) for k, v in got["bf16"].items()}
    # another accumulation, Megatron's SwiGLU: as far from bf16 as the fp8 arm, not its bits
    accum = {a: max(rel(got[a][k], v) for k, v in got["bf16"].items()) for a in FAST_ACCUM_ARMS}
    unfused = {a: max(rel(got[a][k], v) for k, v in got["bf16"].items()) for a in UNFUSED_ACT_ARMS}
    # the MLP each arm built: the SwiGLU fused with the casts in every FP8 arm but those
    mlp = {a.name: type(a.layer.mlp).__name__ for a in arms}
    mlp_ok = all(v == ("MLP" if k == "bf16" or k in UNFUSED_ACT_ARMS else "OverlapMLP")
                 for k, v in mlp.items())
    # the compiled kernels compute the eager ones' bits and the reused FP8 weight is the one
    # made: the FP8 arms agree but for the attention backward's own run-to-run differences
    kernels = max(rel(got[a][k], v) for a in ("fp8_eager_kernels", "fp8_later_micro")
                  for k, v in got["fp8"].items())
    precision = {a.name: sorted({m.precision.describe() for m in a.layer.modules() if hasattr(m, "precision")})
                 for a in arms}
    # the waiting GEMM sums each tile's products in its own order, cuBLAS in its: as far
    # from bf16 as the fp8 arm is, not bit-equal to it
    wait = max((rel(got["fp8_wait"][k], v) for k, v in got["bf16"].items()), default=0.0) \
        if "fp8_wait" in got else None
    return {"tol_rel_norm": TOL, "rel_err": errs, "max_rel_err": max(errs.values()),
            "worst": max(errs, key=errs.get), "precision": precision,
            "delayed_max_rel_err": max(delayed.values()), "accum_max_rel_err": accum,
            "fp8_arms_max_rel": kernels, "tol_kernels": TOL_KERNELS, "wait_max_rel_err": wait,
            "mlp": mlp, "unfused_act_max_rel_err": unfused,
            "passed": mlp_ok and max(errs.values()) <= TOL and max(unfused.values()) <= TOL and max(delayed.values()) <= TOL
            and max(accum.values()) <= TOL
            and all(f"{fast_accum_label(FAST_ACCUMS[v])})" in precision[a][0]
                    for a, v in {"fp8": FAST_ACCUM_DEFAULT, **FAST_ACCUM_ARMS}.items())
            and (wait is None or (wait <= TOL and precision["fp8_wait"][0].startswith("fp8 tensorwise")))
            and precision["fp8"][0].startswith("fp8 tensorwise")
            and precision["fp8_delayed"][0].startswith("fp8 delayed")
            and precision["bf16"] == ["bf16"] and kernels <= TOL_KERNELS}


def kernel_times(arms, e, top: int, steps: int = 3) -> dict:
    """Each arm's device time per kernel over eager fwd+bwd steps (torch.profiler, CUDA
    activity; per step): where the FP8 layer's time goes, beside benchmarks/
    layer_ledger.py's byte counts of the same code."""
    from torch.profiler import ProfilerActivity, profile

    cuda = arms[0].x.is_cuda  # (on CPU: the aten ops' host time, functional only)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    for arm in arms:
        arm.step(e)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                arm.step(e)
            sync()
        us = (lambda ev: ev.self_device_time_total) if cuda else (lambda ev: ev.self_cpu_time_total)
        rows = [{"kernel": ev.key, "calls": ev.count / steps, "us": us(ev) / steps}
                for ev in prof.key_averages() if us(ev) > 0]
        rows.sort(key=lambda r: -r["us"])
        groups: dict = {}
        for r in rows:
            g = groups.setdefault(gt.kernel_group(r["kernel"]), {"calls": 0.0, "us": 0.0})
            g["calls"] += r["calls"]
            g["us"] += r["us"]
        out[arm.name] = {"total_us": sum(r["us"] for r in rows), "groups": groups, "top": rows[:top],
                         "kernels": len(rows)}
    return out


def run_shape(shape: lc.LayerShape, args, dtype, device) -> dict:
    with lc.last_rank(shape, args, dtype, device, build_arms) as (emu, arms, extras):
        row = {**lc.shape_row(shape), "check": check(emu, arms, extras),
               "attention": {a.name: type(a.layer.self_attention.core_attention).__name__ for a in arms}}
        row["wait_fell_back"] = al.wait_fell_back(arms)
        if device.type == "cuda":
            row["memory_gib"] = al.memory(emu, arms, extras, "mirror")
            row["arms"] = lc.time_shape(emu, arms, extras, args, lc.timing_transport(emu, "mirror"),
                                        ref="bf16")
            row["goals"] = {f"{mode}: fp8 vs bf16 >= {GOAL}": (row["arms"]["fp8"][f"{mode}_ratio"],
                                                             (row["arms"]["fp8"][f"{mode}_ratio"] or 0) >= GOAL)
                            for mode in ("graph", "eager")}
            if args.profile:
                row["kernels"] = kernel_times(arms, extras, args.profile)
                row["timeline"] = gt.graph_timelines(arms, extras, TIMELINE_ARMS)
        else:
            row["skipped"] = "timing and memory: CPU (the check ran; times and peaks need a GPU)"
            if args.profile:
                row["kernels"] = kernel_times(arms, extras, args.profile)
        del arms
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_lines(r: dict, what: str) -> list[str]:
    """kernel_times' result: per arm, the total and the groups (us, calls); fp8's largest."""
    if "kernels" not in r:
        return []
    k = r["kernels"]
    names = sorted({g for a in k.values() for g in a["groups"]})
    lines = [f"{'':18s} {what}:"]
    for a, v in k.items():
        lines.append(f"{'':18s}   {a} {v['total_us']:.0f} = " + ", ".join(
            f"{g} {v['groups'][g]['us']:.0f} ({v['groups'][g]['calls']:.0f})" for g in names
            if g in v["groups"]))
    lines += [f"{'':18s}   fp8 {t['us']:8.1f} us {t['calls']:5.1f}x  {t['kernel'][:90]}" for t in k["fp8"]["top"]]
    return lines


def table(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"fp8_layer: one TransformerLayer fwd+bwd per TP rank, bf16 params, {m.get('gpu_name') or 'CPU'}, "
             f"torch {m['torch']}, {m['date']}; median of {doc['config']['repeat']} x {doc['config']['reps']} calls; "
             f"fusions {doc['config']['fusions']}",
             f"{'shape':18s} {'arm':17s} {'eager ms':>9s} {'x bf16':>7s} {'graph ms':>9s} {'x bf16':>7s} "
             f"{'GiB step':>9s} {'kept':>6s}"]
    f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in doc["rows"]:
        c = r["check"]
        check = (f"check {'ok' if c['passed'] else 'FAIL'}: fp8 vs bf16 max rel {c['max_rel_err']:.3f} "
                 f"({c['worst']}) <= {c['tol_rel_norm']}; the other fp8 arms vs fp8 "
                 f"{c['fp8_arms_max_rel']:.1e} <= {c['tol_kernels']:g}")
        if "arms" not in r:
            lines.append(f"{r['shape']:18s} {check}; {r['skipped']}")
            lines += profile_lines(r, "host us per step (CPU: aten ops, functional only)")
            continue
        for a in r["arms"]:
            t = r["arms"][a]
            lines.append(f"{r['shape']:18s} {a:17s} {f(t['eager_ms'], 2):>9s} {f(t['eager_ratio'], 2):>7s} "
                         f"{f(t['graph_ms'], 2):>9s} {f(t['graph_ratio'], 2):>7s} "
                         f"{f(r['memory_gib'][a]['step'], 3):>9s} {f(r['memory_gib'][a]['kept'], 3):>6s}")
            if t.get("graph_error"):
                lines.append(f"{'':18s} {a}: the CUDA-graph capture failed: {t['graph_error'][:200]}")
        lines.append(f"{'':18s} {check}")
        for goal, (value, met) in r["goals"].items():
            lines.append(f"{'':18s} goal {goal}: {f(value, 3)} {'met' if met else 'NOT MET'}")
        lines += profile_lines(r, "kernel us per step (eager, torch.profiler)")
        lines += gt.timeline_lines(r.get("timeline")) + al.wait_lines(r)
    lines.append("x bf16 = bf16 ms / arm ms, same mode. eager: calls queued back to back, arms alternating; graph: the layer's "
                 "fwd+bwd in one CUDA graph. GiB step: a steady-state step's peak beyond what the arm keeps; kept: "
                 "buffers kept once per process. Every arm on the mirror transport.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = al.arguments(__doc__, SHAPES, fusions="megatron_lm")
    ap.add_argument("--profile", type=int, default=12, metavar="N",
                    help="each arm's kernels per step (torch.profiler), the fp8 arm's N largest "
                         "printed, and on a GPU one graphed replay's timeline per arm (0: neither; "
                         "on CPU: aten ops, functional only)")
    args = ap.parse_args(argv)
    if args.streams_arm is not None:
        ap.error("--streams-arm: fp8_layer runs no ours_streamsN arm (attention_layer.py does)")
    return al.run("fp8_layer", args, SHAPES, run_shape, table, torch.bfloat16)  # FP8 against bf16, on CPU too


if __name__ == "__main__":
    sys.exit(main())

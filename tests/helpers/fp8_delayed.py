"""Delayed scaling (fp8_recipe 'delayed') in our layers, step after step, against the FP8
reference (helpers/fp8_layers.reference) quantizing each tensor with the scale
Transformer Engine's rule gives, worked out here from the whole tensors' amaxes of the
steps before: scale = fp8 max / amax / 2^margin (in float64, to float32), the amax the
newest ('most_recent') or the largest of the last `history` ('max'); 1 before any.
Every rank's tensors of one role share that scale (the amaxes are the TP group's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from helpers import fp8_ref as ref
from helpers.fp8_layers import Fp8Case, _whole, build, config, one_step, reference
from helpers.layers import VARIANTS

FACTORS = (1.0, 8.0, 0.125, 2.0)  # each step's tensors scaled so: the amaxes move, both ways


@dataclass(frozen=True)
class DelayedCase:
    layer: Fp8Case
    history: int = 1
    algo: str = "most_recent"
    margin: int = 0
    micros: int = 1  # micro-batches per step

    @property
    def id(self) -> str:
        return f"{self.layer.id}-h{self.history}-{self.algo}-m{self.margin}-x{self.micros}"


def next_scale(amaxes: list[float], prev: float, dtype: torch.dtype, case: DelayedCase) -> float:
    """The scale after these amaxes (oldest first), TE's rule, on Python floats."""
    a = max(amaxes[-case.history:]) if case.algo == "max" else amaxes[-1]
    if not (a > 0 and math.isfinite(a)):
        return prev
    return float(torch.tensor(torch.finfo(dtype).max / a / 2.0 ** case.margin,
                              dtype=torch.float64).to(torch.float32))


def _step_tensors(case: DelayedCase, tp: int, dtype: torch.dtype, step: int, micro: int = 0,
                  micros: int = 1):
    """Micro-batch `micro` of `step`: the step's weight and bias, the micro-batch's input and
    gradient, scaled by FACTORS in turn (the amaxes move, both ways)."""
    f = FACTORS[(step * micros + micro) % len(FACTORS)]
    w, b, _, _ = _whole(case.layer, tp, dtype, seed=step)
    _, _, x, dy = _whole(case.layer, tp, dtype, seed=100 * step + micro)
    return w * (1 + step / 4), b, x * f, dy / f  # the weight changes too, as training does


def _layer(case: DelayedCase, tp: int, dtype: torch.dtype):
    import megatron_overlap as mo

    c = case.layer
    overrides, flags = VARIANTS[c.kind][c.variant]
    mo.install(ub_cfgs=overrides)
    try:
        return build(c.kind, config(tp, c.sp, dtype, flags, fp8=c.fp8, fp8_recipe="delayed",
                                    fp8_wgrad=c.fp8_wgrad, fp8_amax_history_len=case.history,
                                    fp8_amax_compute_algo=case.algo, fp8_margin=case.margin,
                                    tp_only_amax_red=True,
                                    gradient_accumulation_fusion=c.main_grad))
    finally:
        mo.uninstall()


def _compared(got: dict, want: dict, case: DelayedCase) -> dict:
    out = {}
    for k, v in got.items():
        v, r = v.reshape(want[k].shape), want[k]
        out[k] = {"equal": torch.equal(v, r.to(v.dtype)), "rel": ref.rel(v, r)}
    return out


def _held(layer) -> dict[str, float]:
    """The scales the layer's histories hold now (what its next quantizations use)."""
    from megatron_overlap.overlap.fp8 import scale_value

    return {r: float(scale_value(st.scale)) for r, st in layer._fp8_delayed._states.items()}


def run_case(case: DelayedCase, rank: int, tp: int, steps: int = len(FACTORS),
             device: str = "cpu", micros: int = 1) -> dict:
    """`steps` steps of `micros` forward + backward micro-batches of the case's layer, with
    `is_first_microbatch` set as Megatron's schedules set it (the FP8 weight cache: the
    weight quantized, and its amax recorded, at a step's first micro-batch, and at every
    micro-batch of the first step, before a schedule is seen driving the flag), against the
    reference with the delayed scales; then a layer built anew from the first one's state
    dict takes one more step beside it, and, given the state dict again once it has
    histories of its own (loaded in place), another. {'steps': [per micro-batch, per
    result: equal, rel], 'scales': what the reference used, 'held': [per micro-batch the
    layer's scales after it], 'want_held': [the rule's], 'restored': [fresh, in place]:
    whether the next results are bit-equal, 'extra': the state's keys, 'history': the
    input's history, 'precision'}. `device`: where the layers run (the reference on CPU)."""
    c = case.layer
    dtype = getattr(torch, c.dtype)
    grad8 = ref.E5M2 if c.fp8 == "hybrid" else ref.E4M3
    kinds = {"input": ref.E4M3, "weight": ref.E4M3, "grad": grad8}
    layer = _layer(case, tp, dtype).to(device)
    amaxes = {r: [] for r in kinds}
    scales = {r: 1.0 for r in kinds}
    per_step, used, held, want_held = [], [], [], []
    for step in range(steps):
        for m in range(micros):
            whole = _step_tensors(case, tp, dtype, step, m, micros)
            made = m == 0 or step == 0  # the weight quantized at this micro-batch
            s = dict(scales) if made else {**scales, "weight": used[-1]["weight"]}
            layer.is_first_microbatch = m == 0
            got = one_step(layer, c, rank, tp, whole, device, set_weights=m == 0)
            per_step.append(_compared(got, reference(c, rank, tp, *whole, scales={
                r: torch.tensor(v, dtype=torch.float32) for r, v in s.items()}), case))
            used.append(s)
            w, _, x, dy = whole
            for role, t in (("input", x), ("weight", w), ("grad", dy)):
                if role != "weight" or made:
                    amaxes[role].append(float(t.abs().max().float()))
                    scales[role] = next_scale(amaxes[role], scales[role], kinds[role], case)
            held.append(_held(layer))
            want_held.append(dict(scales))
    state = layer.state_dict()
    again = _layer(case, tp, dtype).to(device)
    again.load_state_dict(state)  # into histories not made yet: at their first use
    restored = []
    for extra in range(2):
        whole = _step_tensors(case, tp, dtype, steps + extra)
        layer.is_first_microbatch = again.is_first_microbatch = True
        a, b = (one_step(m, c, rank, tp, whole, device) for m in (layer, again))
        restored.append(all(torch.equal(a[k], b[k]) for k in a))
        again.load_state_dict(layer.state_dict())  # into its own histories, in place
    extra = state["_extra_state"]
    return {"steps": per_step, "scales": used, "held": held, "want_held": want_held,
            "precision": layer.precision.describe(), "restored": restored,
            "extra": sorted(extra["amax_history"]) if isinstance(extra, dict) else extra,
            "history": [float(v) for v in extra["amax_history"]["input"]]}


def run_cases(rank: int, world: int, cases: list[DelayedCase]) -> dict:
    from helpers.megatron_cpu import init

    init(world)
    return {c.id: run_case(c, rank, world, micros=c.micros) for c in cases}

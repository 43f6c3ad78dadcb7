"""Build a Megatron TP linear and our drop-in on the same weights, run both on the
same input and upstream gradient, and measure how far apart they land."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from megatron_overlap.ab.compare import rel_error


@dataclass(frozen=True)
class Case:
    kind: str  # column | row
    sp: bool
    dtype: str  # float32 | bfloat16
    bias: bool
    skip_bias_add: bool
    variant: str  # which schedule, see VARIANTS
    seq: int = 4  # local sequence length per rank under SP (full sequence otherwise)
    batch: int = 2

    @property
    def id(self) -> str:
        return "-".join(f"{k}={v}" for k, v in asdict(self).items())


# name -> (ub_cfgs overrides, Megatron config flags)
VARIANTS = {
    "column": {
        "ring": ({"qkv_fprop": {"method": "ring_exchange"}}, {}),
        "ring_aggregate": ({"qkv_fprop": {"method": "ring_exchange", "aggregate": 1}}, {}),
        "no_bulk_bwd": ({}, {"tp_comm_bulk_dgrad": False, "tp_comm_bulk_wgrad": False}),
        "rs_dgrad_pipeline1": ({"qkv_dgrad": {"method": "pipeline", "num_splits": 1}},
                               {"tp_comm_overlap_rs_dgrad": True}),
        "rs_dgrad_pipeline2": ({"qkv_dgrad": {"method": "pipeline", "num_splits": 2}},
                               {"tp_comm_overlap_rs_dgrad": True}),
        "rs_dgrad_pipeline4": ({"qkv_dgrad": {"method": "pipeline", "num_splits": 4}},
                               {"tp_comm_overlap_rs_dgrad": True}),
        "rs_dgrad_ring": ({"qkv_dgrad": {"method": "ring_exchange"}},
                          {"tp_comm_overlap_rs_dgrad": True}),
        "ag_off": ({}, {"tp_comm_overlap_ag": False}),
    },
    "row": {
        "pipeline1": ({"proj_fprop": {"method": "pipeline", "num_splits": 1}}, {}),
        "pipeline2": ({"proj_fprop": {"method": "pipeline", "num_splits": 2}}, {}),
        "pipeline4": ({"proj_fprop": {"method": "pipeline", "num_splits": 4}}, {}),
        "ring": ({"proj_fprop": {"method": "ring_exchange"}}, {}),
        "ring_dgrad_aggregate": ({"proj_dgrad": {"method": "ring_exchange", "aggregate": 1}}, {}),
        "rs_off": ({}, {"tp_comm_overlap_rs": False, "tp_comm_overlap_ag": False}),
    },
}

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def all_cases(tp: int) -> list[Case]:
    cases = []
    for kind, variants in VARIANTS.items():
        for sp, dtype, variant, (bias, skip) in itertools.product(
                (True, False) if tp > 1 else (False,), TOL, variants,
                [(True, False), (True, True), (False, False)]):
            cases.append(Case(kind, sp, dtype, bias, skip, variant))
    return cases


def build(case: Case, tp: int, overlap: bool, ub_cfgs=None, flags=None, name_in=16, name_out=24, **cfg):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, sequence_parallel=case.sp, use_cpu_initialization=True,
        params_dtype=getattr(torch, case.dtype), tp_comm_overlap=overlap, **(flags or {}), **cfg)
    init = lambda w: torch.nn.init.normal_(w, std=0.5)  # noqa: E731
    if case.kind == "column":
        cls = OverlapColumnParallelLinear if overlap else ColumnParallelLinear
        return cls(name_in, name_out, config=config, init_method=init, bias=case.bias,
                   gather_output=False, skip_bias_add=case.skip_bias_add, tp_comm_buffer_name="qkv")
    cls = OverlapRowParallelLinear if overlap else RowParallelLinear
    return cls(name_out, name_in, config=config, init_method=init, bias=case.bias,
               input_is_parallel=True, skip_bias_add=case.skip_bias_add, tp_comm_buffer_name="proj")


def make_input(case: Case, rank: int, tp: int, layer, seq: int | None = None, seed: int = 0):
    """The same global tensors on every rank; each rank takes its part."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    seq = seq or case.seq
    if case.kind == "column":
        full = torch.randn(seq * tp if case.sp else seq, case.batch, layer.input_size, generator=g)
        x = full.chunk(tp)[rank] if case.sp else full
    else:
        full = torch.randn(seq * tp if case.sp else seq, case.batch, layer.input_size, generator=g)
        x = full.chunk(tp, dim=-1)[rank]
    return x.to(dtype).contiguous().requires_grad_(True)


def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    return rel_error(a, b)


def run_pair(ref, ours, x: torch.Tensor, seed: int = 1) -> dict[str, float]:
    """Forward + backward through both; relative errors of everything autograd produces."""
    results = {}
    outs = []
    for layer in (ref, ours):
        xi = x.detach().clone().requires_grad_(True)
        for p in layer.parameters():
            p.grad = None
        y, b = layer(xi)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + y.shape[0])).to(y.dtype)
        y.backward(dy)
        outs.append((y.detach(), b, xi.grad, layer.weight.grad,
                     None if layer.bias is None else layer.bias.grad))
    for name, a, b in zip(("output", "returned_bias", "input_grad", "weight_grad", "bias_grad"), outs[1], outs[0]):
        results[name] = rel(a, b)
    return results


def build_pair(case: Case, tp: int, overrides, flags, **sizes):
    """Megatron's layer (random bias) and ours with `overrides` installed, same weights;
    `sizes`: `build`'s name_in / name_out."""
    import megatron_overlap as mo

    ref = build(case, tp, overlap=False, **sizes)
    with torch.no_grad():
        if ref.bias is not None:
            ref.bias.normal_()
    mo.install(ub_cfgs=overrides)
    try:
        ours = build(case, tp, overlap=True, flags=flags, **sizes)
    finally:
        mo.uninstall()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def compare_case(case: Case, rank: int, tp: int) -> dict[str, float]:
    overrides, flags = VARIANTS[case.kind][case.variant]
    ref, ours = build_pair(case, tp, overrides, flags)
    # Every flag that applies off: Megatron's own forward runs.
    expect_overlap = not (case.variant == "rs_off" or (not case.sp and case.variant == "no_bulk_bwd"))
    assert ours.overlap_plan.enabled == expect_overlap, f"{case.id}: plan {ours.overlap_plan}"
    errs = {}
    # Successive micro-batches of different lengths through the same layers.
    for seq in (case.seq, 2 * case.seq, case.seq // 2):
        x = make_input(case, rank, tp, ref, seq=seq, seed=seq)
        for k, v in run_pair(ref, ours, x).items():
            errs[k] = max(errs.get(k, 0.0), v)
    return errs


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, float]]:
    from helpers.megatron_cpu import init

    init(world)
    return {case.id: compare_case(case, rank, world) for case in cases}


# -- frozen weights and the last-dim gathers (tests/test_frozen_gather.py) ------------------
# mode -> how both layers and the input are set up. Each runs our overlapped path, never
# Megatron's fallback, against Megatron's own layer on the same weights.
MODES = {
    "frozen": {"weight": False},  # LoRA-style: the base weight frozen, the bias trains
    "frozen_bias": {"weight": False, "bias": False},  # nothing of the layer trains
    "frozen_no_input_grad": {"weight": False, "input_grad": False},  # only the bias (if any)
    "gather_output": {"gather": "attribute"},  # column: gather_output=True
    "runtime_gather": {"gather": "runtime"},  # column: forward(runtime_gather_output=True)
    "gather_frozen": {"gather": "attribute", "weight": False},
    "unsplit_input": {"unsplit": True},  # row: input_is_parallel=False (its grad gathered)
}
# (kind, sp, variant) a mode runs on: a representative subset of VARIANTS
FROZEN_VARIANTS = [("column", True, "ring"), ("column", True, "rs_dgrad_pipeline2"),
                   ("column", True, "rs_dgrad_ring"), ("column", True, "no_bulk_bwd"),
                   ("column", False, "ring_aggregate"), ("row", True, "pipeline2"),
                   ("row", True, "ring_dgrad_aggregate"), ("row", False, "ring")]


def mode_cases() -> list[tuple[str, Case]]:
    cases = [(m, Case(k, sp, "float32", True, False, v)) for k, sp, v in FROZEN_VARIANTS
             for m in ("frozen", "frozen_bias", "frozen_no_input_grad")]
    cases.append(("frozen", Case("column", True, "float32", True, True, "rs_dgrad_pipeline2")))
    cases.append(("frozen", Case("row", False, "float32", False, False, "pipeline2")))
    for sp in (True, False):
        cases += [(m, Case("column", sp, "float32", True, False, "ring"))
                  for m in ("gather_output", "runtime_gather", "gather_frozen")]
    cases.append(("unsplit_input", Case("row", False, "float32", True, False, "pipeline2")))
    return cases


def mode_id(mode: str, case: Case) -> str:
    return f"{mode}-{case.kind}-{'sp' if case.sp else 'nosp'}-{case.variant}" + (
        "-skip_bias_add" if case.skip_bias_add else "") + ("" if case.bias else "-no_bias")


def _run_mode(layer, x: torch.Tensor, mode: dict, seed: int) -> dict:
    xi = x.detach().clone().requires_grad_(mode.get("input_grad", True))
    for p in layer.parameters():
        p.grad = None
    kw = {"runtime_gather_output": True} if mode.get("gather") == "runtime" else {}
    y, b = layer(xi, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    if y.requires_grad:
        y.backward(dy)
    return {"output": y.detach(), "input_grad": xi.grad, "weight_grad": layer.weight.grad,
            "bias_grad": None if layer.bias is None else layer.bias.grad, "dy": dy,
            "y_requires_grad": y.requires_grad}


def compare_mode(mode_name: str, case: Case, rank: int, tp: int) -> dict:
    """Ours against Megatron's layer in `mode`: relative errors, and which grads are None.
    The reference bias grad is Megatron's trainable-weight layer's: Megatron's frozen path
    (LinearWithFrozenWeight) returns no grad for a bias it adds inside (a column layer
    without skip_bias_add), so there the bias grad would not train at all."""
    mode = MODES[mode_name]
    overrides, flags = VARIANTS[case.kind][case.variant]
    ref, ours = build_pair(case, tp, overrides, flags)
    assert ours.overlap_plan.enabled, case.id
    trained_ref = None
    if "weight" in mode and case.bias and mode.get("bias", True):
        trained_ref = build(case, tp, overlap=False)
        trained_ref.load_state_dict(ref.state_dict())
    for layer in (ref, ours, trained_ref):
        if layer is None:
            continue
        layer.weight.requires_grad_(mode.get("weight", True) or layer is trained_ref)
        if layer.bias is not None:
            layer.bias.requires_grad_(mode.get("bias", True))
        if mode.get("gather") == "attribute":
            layer.gather_output = True
        if mode.get("unsplit"):
            layer.input_is_parallel = False
    if mode.get("unsplit"):  # the full input, the same on every rank
        g = torch.Generator().manual_seed(5)
        x = torch.randn(case.seq, case.batch, ref.input_size, generator=g)
    else:
        x = make_input(case, rank, tp, ref, seed=5).detach()
    ours_uses_megatron = ours._use_megatron
    a, b = _run_mode(ref, x, mode, 2), _run_mode(ours, x, mode, 2)
    out = {"ours_uses_megatron": ours_uses_megatron, "errors": {}, "none": {}}
    for k in ("output", "input_grad", "weight_grad", "bias_grad"):
        out["none"][k] = (a[k] is None, b[k] is None)
    out["y_requires_grad"] = (a["y_requires_grad"], b["y_requires_grad"])
    ref_bias = a["bias_grad"]
    if trained_ref is not None and mode.get("bias", True):
        ref_bias = _run_mode(trained_ref, x, {**mode, "weight": True}, 2)["bias_grad"]
        out["none"]["bias_grad"] = (ref_bias is None, b["bias_grad"] is None)
    for k, ra in (("output", a["output"]), ("input_grad", a["input_grad"]),
                  ("bias_grad", ref_bias)):
        out["errors"][k] = rel(b[k], ra) if not (ra is None and b[k] is None) else 0.0
    out["output_shape"] = (tuple(a["output"].shape), tuple(b["output"].shape))
    return out


def run_modes(rank: int, world: int, cases: list[tuple[str, Case]]) -> dict:
    from helpers.megatron_cpu import init

    init(world)
    return {mode_id(m, c): compare_mode(m, c, rank, world) for m, c in cases}

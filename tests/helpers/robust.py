"""Rank functions of tests/test_robust_layers.py: inputs at the layer's door, each
layer kind against Megatron's own layer on the same weights."""

from __future__ import annotations

import torch

from helpers.layers import VARIANTS, Case, build_pair, rel

# (kind, sequence parallel, schedule variant): the variants put a pipelined GEMM->RS
# with num_splits=2 on a pass, so num_splits is checked against the rows too.
KINDS = [("column", True, "rs_dgrad_pipeline2"), ("column", False, "ring"),
         ("row", True, "pipeline2"), ("row", False, "pipeline2")]


def kind_id(kind: str, sp: bool) -> str:
    return f"{kind}-{'sp' if sp else 'nosp'}"


def pair(kind: str, sp: bool, variant: str, tp: int):
    case = Case(kind, sp, "float32", True, False, variant)
    overrides, flags = VARIANTS[kind][variant]
    return build_pair(case, tp, overrides, flags)


def width(layer) -> int:
    """The input width a layer takes (row layers here take parallel input)."""
    return layer.input_size if hasattr(layer, "gather_output") else layer.input_size_per_partition


def global_input(layer, rank: int, tp: int, s: int, b: int, seed: int) -> torch.Tensor:
    """Every rank draws the same full tensor and keeps its part: the local sequence
    block for a column layer with SP, its hidden slice for a row layer."""
    g = torch.Generator().manual_seed(seed)
    if hasattr(layer, "gather_output"):
        sp = layer.sequence_parallel
        full = torch.randn(s * (tp if sp else 1), b, layer.input_size, generator=g)
        return full.chunk(tp)[rank].contiguous() if sp else full
    full = torch.randn(s, b, layer.input_size, generator=g)
    return full.chunk(tp, dim=-1)[rank].contiguous()


def run(layer, x: torch.Tensor, backward: bool = True, no_grad: bool = False, seed: int = 7):
    """Output, input grad, weight grad and bias grad of one call."""
    for p in layer.parameters():
        p.grad = None
    xi = x.detach()
    if x.requires_grad:
        xi.requires_grad_(True)
    if no_grad:
        with torch.no_grad():
            y, _ = layer(xi)
        return y, None, None, None
    y, _ = layer(xi)
    if backward:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
        y.backward(dy)
    bias = None if layer.bias is None else layer.bias.grad
    return y.detach(), xi.grad, layer.weight.grad, bias


def compare(ref, ours, x: torch.Tensor, **kw) -> dict:
    """Shapes and largest relative error of ours against Megatron's on the same call."""
    a, b = run(ref, x, **kw), run(ours, x, **kw)
    shapes = [(None if t is None else tuple(t.shape)) for t in a]
    same = shapes == [(None if t is None else tuple(t.shape)) for t in b]
    err = max((rel(u, v) for u, v in zip(b, a)), default=0.0) if same else float("inf")
    return {"shapes": shapes, "same_shapes": same, "err": err}


def accepted_inputs(layer, rank: int, tp: int):
    """Inputs Megatron's layer takes (and ours must treat alike): name -> (x, run kwargs)."""
    x = global_input(layer, rank, tp, 4, 2, seed=3)
    yield "non_contiguous", x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), {}
    yield "2d", x.reshape(-1, x.shape[-1]).requires_grad_(), {}
    yield "input_without_grad", x, {}
    yield "no_grad", x, {"no_grad": True}
    yield "empty_sequence", x[:0].clone().requires_grad_(), {}
    yield "empty_2d", x.reshape(-1, x.shape[-1])[:0].clone().requires_grad_(), {}
    yield "forward_only", x.clone().requires_grad_(), {"backward": False}


def refused_inputs(layer, kind: str, sp: bool, rank: int, tp: int):
    """Inputs our layer must refuse at the door: name -> x."""
    h = width(layer)
    x = global_input(layer, rank, tp, 4, 2, seed=5)
    yield "1d", torch.randn(h)
    yield "4d", torch.randn(2, 2, 2, h)
    yield "hidden", torch.randn(4, 2, h + 1)
    yield "dtype", x.double()
    yield "device", torch.empty(4, 2, h, device="meta")
    yield "not_a_tensor", x.tolist()
    if kind == "row" and sp:
        yield "sequence_vs_tp", global_input(layer, rank, tp, 4 * tp + 1, 2, seed=5)
    if kind == "row" or sp:  # a pipelined GEMM->RS over 2 splits, and 1 row per rank
        yield "num_splits", global_input(layer, rank, tp, tp if kind == "row" and sp else 1, 1, 5)


def door(rank: int, world: int) -> dict:
    """Per layer kind: every accepted input against Megatron; every refused input's
    message, and Megatron equality of the valid call that follows each refusal (the
    first refusal comes before the layer's first transfer)."""
    from helpers.megatron_cpu import init

    init(world)
    out: dict = {}
    for kind, sp, variant in KINDS:
        ref, ours = pair(kind, sp, variant, world)
        k = kind_id(kind, sp)
        good = global_input(ref, rank, world, 4, 2, seed=11).requires_grad_()
        for name, x in refused_inputs(ours, kind, sp, rank, world):
            try:
                ours(x)
                out[(k, "refused", name)] = None
            except Exception as e:  # noqa: BLE001 - the test reads type and message
                out[(k, "refused", name)] = f"{type(e).__name__}: {e}"
            out[(k, "after", name)] = compare(ref, ours, good)
        for name, x, kw in accepted_inputs(ref, rank, world):
            out[(k, "accepted", name)] = compare(ref, ours, x, **kw)
    return out


def one_rank_refused(rank: int, world: int) -> dict:
    """Only rank 0 makes a bad call (before the first forward, and again later); the
    others go straight on: the next valid call still matches Megatron on every rank."""
    from helpers.megatron_cpu import init

    init(world)
    out = {}
    for kind, sp, variant in (KINDS[0], KINDS[2]):
        ref, ours = pair(kind, sp, variant, world)
        good = global_input(ref, rank, world, 4, 2, seed=13).requires_grad_()
        for step in ("first", "later"):
            if rank == 0:
                try:
                    ours(torch.randn(4, 2, width(ours) + 3))
                except Exception as e:  # noqa: BLE001
                    out[(kind_id(kind, sp), step, "message")] = str(e)
            out[(kind_id(kind, sp), step)] = compare(ref, ours, good)
    return out

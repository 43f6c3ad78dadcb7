"""Rank functions and case tables of the door checks (tests/test_robust_layers.py on
CPU, tests/gpu/test_faults_symm.py on CUDA): inputs at the layer's door, each layer
kind against Megatron's own layer on the same weights, on the device given."""

from __future__ import annotations

import torch

from helpers.layers import VARIANTS, Case, build_pair, rel

# (kind, sequence parallel, schedule variant): the variants put a pipelined GEMM->RS
# with num_splits=2 on a pass, so num_splits is checked against the rows too.
KINDS = [("column", True, "rs_dgrad_pipeline2"), ("column", False, "ring"),
         ("row", True, "pipeline2"), ("row", False, "pipeline2")]


def kind_id(kind: str, sp: bool) -> str:
    return f"{kind}-{'sp' if sp else 'nosp'}"


def init(world: int, device: str = "cpu") -> None:
    """Megatron's TP groups over gloo: on the CPU (helpers.megatron_cpu), or with every
    rank on GPU 0 (ranks sharing it through torch symmetric memory, helpers.gpu)."""
    if device == "cpu":
        from helpers.megatron_cpu import init as cpu_init

        cpu_init(world)
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from helpers import gpu

    gpu.init(per_gpu=False)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def on(device: str, *layers):
    """The layers (built on the CPU, as helpers.layers does) moved to `device`."""
    return tuple(layer.to(device) for layer in layers)


def pair(kind: str, sp: bool, variant: str, tp: int, device: str = "cpu"):
    """Megatron's layer and ours; `variant` may carry modifiers: "+frozen" (weights
    frozen), "+gather" (a column layer with gather_output=True)."""
    variant, *mods = variant.split("+")
    case = Case(kind, sp, "float32", True, False, variant)
    overrides, flags = VARIANTS[kind][variant]
    layers = on(device, *build_pair(case, tp, overrides, flags))
    for layer in layers:
        if "frozen" in mods:
            layer.weight.requires_grad_(False)
        if "gather" in mods:
            layer.gather_output = True
    return layers


def width(layer) -> int:
    """The input width a layer takes (row layers here take parallel input)."""
    return layer.input_size if hasattr(layer, "gather_output") else layer.input_size_per_partition


def global_input(layer, rank: int, tp: int, s: int, b: int, seed: int) -> torch.Tensor:
    """Every rank draws the same full tensor and keeps its part: the local sequence
    block for a column layer with SP, its hidden slice for a row layer; on the
    layer's device."""
    g = torch.Generator().manual_seed(seed)
    dev = layer.weight.device
    if hasattr(layer, "gather_output"):
        sp = layer.sequence_parallel
        full = torch.randn(s * (tp if sp else 1), b, layer.input_size, generator=g)
        return (full.chunk(tp)[rank].contiguous() if sp else full).to(dev)
    full = torch.randn(s, b, layer.input_size, generator=g)
    return full.chunk(tp, dim=-1)[rank].contiguous().to(dev)


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
        y.backward(dy.to(y.device))
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
    """Inputs our layer must refuse at the door: name -> x (on the layer's device but
    for "device", which is on `other_device`)."""
    h = width(layer)
    dev = layer.weight.device
    x = global_input(layer, rank, tp, 4, 2, seed=5)
    yield "1d", torch.randn(h, device=dev)
    yield "4d", torch.randn(2, 2, 2, h, device=dev)
    yield "hidden", torch.randn(4, 2, h + 1, device=dev)
    yield "dtype", x.double()
    yield "device", torch.empty(4, 2, h, device=other_device(layer))
    yield "not_a_tensor", x.tolist()
    if kind == "row" and sp:
        yield "sequence_vs_tp", global_input(layer, rank, tp, 4 * tp + 1, 2, seed=5)
    if kind == "row" or sp:  # a pipelined GEMM->RS over 2 splits, and 1 row per rank
        yield "num_splits", global_input(layer, rank, tp, tp if kind == "row" and sp else 1, 1, 5)


def other_device(layer) -> str:
    """A device the layer's weights are not on: meta beside the CPU, the CPU beside a GPU."""
    return "cpu" if layer.weight.is_cuda else "meta"


def door(rank: int, world: int, device: str = "cpu") -> dict:
    """Per layer kind: every accepted input against Megatron; every refused input's
    message, and Megatron equality of the valid call that follows each refusal (the
    first refusal comes before the layer's first transfer)."""
    init(world, device)
    out: dict = {}
    for kind, sp, variant in KINDS:
        ref, ours = pair(kind, sp, variant, world, device)
        out["devices"] = (str(ours.weight.device), other_device(ours))
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


def one_rank_refused(rank: int, world: int, device: str = "cpu") -> dict:
    """Only rank 0 makes a bad call (before the first forward, and again later); the
    others go straight on: the next valid call still matches Megatron on every rank."""
    init(world, device)
    out = {}
    for kind, sp, variant in (KINDS[0], KINDS[2]):
        ref, ours = pair(kind, sp, variant, world, device)
        good = global_input(ref, rank, world, 4, 2, seed=13).requires_grad_()
        for step in ("first", "later"):
            if rank == 0:
                try:
                    ours(torch.randn(4, 2, width(ours) + 3, device=ours.weight.device))
                except Exception as e:  # noqa: BLE001
                    out[(kind_id(kind, sp), step, "message")] = str(e)
            out[(kind_id(kind, sp), step)] = compare(ref, ours, good)
    return out


# -- what the results must say (the CPU and the GPU test files check with these) -----------
LAYER = {"column": "'qkv (column)'", "row": "'proj (row)'"}
WIDTH = {"column": 16, "row": 12}  # input_size 16; row: 24 / TP
# refusal -> what its message must say (expected, got, fix); {h}: the layer's input width,
# {dev}: the weights' device, {other}: the device the "device" input is on
SAYS = {
    "1d": ["expected a 3-D [sequence, batch, {h}] or 2-D [tokens, {h}] input", "got 1-D ({h},)",
           "reshape it to [s, b, h]"],
    "4d": ["expected a 3-D", "got 4-D (2, 2, 2, {h})", "reshape it"],
    "hidden": ["expected a last (hidden) dimension of {h}", "got (4, 2, {h1})",
               "give the layer inputs of width {h}"],
    "dtype": ["input dtype torch.float64 does not match the weights' torch.float32",
              "cast the input with .to(torch.float32)"],
    "device": ["input is on {other}, the weights on {dev}", "move the input with .to('{dev}')"],
    "not_a_tensor": ["expected a torch.Tensor input, got list"],
    "sequence_vs_tp": ["reduce-scatters the sequence over TP=2", "sequence length 9",
                       "not a multiple of 2", "pad the sequence to a multiple of 2"],
    "num_splits": ["num_splits=2 does not divide the 1 rows per rank",
                   "pick a num_splits that divides 1"],
}
REFUSED = [(kind, sp, name) for kind, sp, _ in KINDS for name in SAYS
           if (name != "sequence_vs_tp" or (kind == "row" and sp))
           and (name != "num_splits" or kind == "row" or sp)]
ACCEPTED = ["non_contiguous", "2d", "input_without_grad", "no_grad", "empty_sequence", "empty_2d",
            "forward_only"]
TOL = 1e-5  # fp32 (TF32 off on a GPU): ours against Megatron's layer


def check_refused(per_rank: list[dict], kind: str, sp: bool, name: str) -> None:
    """Every rank refused `name` with a message naming the layer, what was expected,
    what came and the fix; the valid call after it equals Megatron's."""
    for rank, got in enumerate(per_rank):
        msg = got[(kind_id(kind, sp), "refused", name)]
        assert msg is not None, f"rank {rank}: {kind} sp={sp} took the {name} input"
        assert msg.startswith(f"LayerInputError: megatron_overlap: layer {LAYER[kind]}: "), msg
        h = WIDTH[kind]
        dev, other = got["devices"]
        for part in SAYS[name]:
            part = part.format(h=h, h1=h + 1, dev=dev, other=other)
            assert part in msg, f"{part!r} not in {msg!r}"
        after = got[(kind_id(kind, sp), "after", name)]
        assert after["same_shapes"] and after["err"] <= TOL, f"rank {rank}, call after: {after}"


def check_accepted(per_rank: list[dict], kind: str, sp: bool, name: str) -> None:
    for rank, got in enumerate(per_rank):
        r = got[(kind_id(kind, sp), "accepted", name)]
        assert r["same_shapes"], f"rank {rank}: shapes differ: {r}"
        assert r["err"] <= TOL, f"rank {rank}: {name}: relative error {r['err']} ({r['shapes']})"
        if name.startswith("empty"):
            assert r["shapes"][0][0] == 0  # Megatron's empty output


def check_one_rank_refused(per_rank: list[dict], kind: str, sp: bool) -> None:
    for step in ("first", "later"):
        assert "expected a last (hidden) dimension" in per_rank[0][(kind_id(kind, sp), step, "message")]
        for rank, got in enumerate(per_rank):
            r = got[(kind_id(kind, sp), step)]
            assert r["same_shapes"] and r["err"] <= TOL, f"rank {rank} {step}: {r}"

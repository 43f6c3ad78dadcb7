"""Rank functions for tests/test_tune.py (spawned gloo ranks import them from here)."""

from __future__ import annotations

import time


def layers_with_tuned_yaml(rank: int, world: int, yaml_path: str) -> dict:
    """install(ub_cfgs=the tuner's YAML), build our column (qkv) and row (proj) layers
    with SP, and run them against Megatron's own on the same weights and inputs."""
    import megatron_overlap as mo
    from helpers.layers import Case, build, make_input, run_pair
    from helpers.megatron_cpu import init

    init(world)
    out = {}
    for kind, buffer in (("column", "qkv"), ("row", "proj")):
        case = Case(kind, sp=True, dtype="float32", bias=True, skip_bias_add=False,
                    variant="tuned", seq=16)
        ref = build(case, world, overlap=False)
        mo.install(ub_cfgs=yaml_path)
        try:
            ours = build(case, world, overlap=True)
        finally:
            mo.uninstall()
        ours.load_state_dict(ref.state_dict())
        errors = run_pair(ref, ours, make_input(case, rank, world, ref))
        plan = ours.overlap_plan
        out[buffer] = {"fprop": plan.fprop, "dgrad": plan.dgrad, "wgrad": plan.wgrad,
                       "rows": ours.overlap_rows(), "errors": errors}
    return out


def _cpu_timer(fn) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def distributed_measure(rank: int, world: int, local: int) -> list[dict]:
    """The several-GPU hook, on gloo CPU ranks (LOCAL_WORLD_SIZE=local emulates nodes):
    every trial of two small layers, measured for real with a CPU timer."""
    import torch.distributed as dist

    from megatron_overlap.simulate import Layout, Shape, trials
    from megatron_overlap.tune import DistributedMeasure

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measure = DistributedMeasure(backend="torch_p2p", timer=_cpu_timer)
        layout = Layout(tp=world, gpus_per_node=local, backend="torch_p2p")
        out = []
        for shape in (Shape("T", "qkv", 16, 8, 12, world), Shape("T", "proj", 16, 6, 8, world)):
            for t in trials(shape, layout, rs_dgrad=True):
                out.append({"pass": t.name, "label": t.candidate.label(),
                            "runs": t.candidate.ring_order, "comm_moved": t.comm_moved,
                            **measure(t)})
        return out
    finally:
        dist.destroy_process_group()


def _layer_run(trial, world: int, rank: int):
    """Our layer built with the trial's settings for its pass (install(ub_cfgs=...)), run
    forward and backward on random data; its tensors and the trace of that pass."""
    import torch

    import megatron_overlap as mo
    from helpers.layers import Case, build
    from megatron_overlap.comm import trace

    shape, s = trial.spec.shape, trial.candidate.settings
    rs_dgrad = shape.column and (trial.comm_moved or (trial.spec.pass_name == "dgrad"
                                                      and s.is_reduce_scatter))
    case = Case("column" if shape.column else "row", True, "float32", False, False, "tuned")
    cfg = {} if trial.comm_moved else {trial.name: s.to_dict()}
    mo.install(ub_cfgs=cfg)
    try:
        layer = build(case, world, overlap=True,
                      flags={"tp_comm_overlap_rs_dgrad": True} if rs_dgrad else {})
    finally:
        mo.uninstall()
    g = torch.Generator().manual_seed(7 + rank)
    width = layer.input_size if shape.column else layer.input_size // world
    seq = case.seq * (1 if shape.column else world)  # a row layer takes the whole sequence
    x = torch.randn(seq, case.batch, width, generator=g).requires_grad_()
    with trace.recording() as events:
        y, _ = layer(x)
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
    return layer, x, y, dy, events


def _gather(t):
    """`t` of every rank, concatenated (FP8 moved as bytes: gloo has no float8 type)."""
    import torch
    import torch.distributed as dist

    b = t.contiguous().view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t.contiguous()
    out = [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(out, b)
    return torch.cat(out).view(t.dtype)


def tuner_pass_matches_layer(rank: int, world: int) -> list[dict]:
    """Every trial of a small column (qkv) and row (proj) layer: the tuner's timed pass,
    fed the inputs our layer saw with the same settings, against that layer's forward /
    backward. Per trial: the relative error of each output, and whether the pass made
    the same transfers, waits and GEMM chunks, in the same order, as inside the layer."""
    import torch

    from helpers.layers import rel
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import trace
    from megatron_overlap.simulate import Layout, Shape, trials
    from megatron_overlap.tune import DistributedMeasure
    from megatron_overlap.tune.passes import trial_pass

    init(world)
    measure = DistributedMeasure(backend="torch_p2p", timer=_cpu_timer)
    layout = Layout(tp=world, gpus_per_node=world, backend="torch_p2p")
    m = 4 * 2 * world  # the helpers' layers: 4 tokens x batch 2 per rank
    out = []
    for shape in (Shape("T", "qkv", m, 16, 24 // world, world),
                  Shape("T", "proj", m, 24 // world, 16, world)):
        for trial in trials(shape, layout, rs_dgrad=True):
            layer, x, y, dy, layer_events = _layer_run(trial, world, rank)
            timed = trial_pass(trial, measure.transport, "cpu", torch.float32)
            t, p = timed.tensors, trial.spec.pass_name
            flat = lambda v: v.detach().reshape(-1, v.shape[-1])  # noqa: E731
            x2, g2, w = flat(x), flat(dy), layer.weight.detach()
            t["weight"].copy_(w)
            expect: dict = {}
            if p == "fprop":
                t["x"].copy_(x2)
                expect["out"] = flat(y)
            elif p == "dgrad" and shape.column:
                t["g"].copy_(g2)
                t["x"].copy_(x2)
                if trial.candidate.settings.is_reduce_scatter:
                    expect["grad_in"] = flat(x.grad)
            elif p == "dgrad":
                t["g"].copy_(g2)
                expect["grad_in"] = flat(x.grad)
            elif shape.column:  # wgrad, on the gathered input and the unreduced dgrad
                t["g"].copy_(g2)
                t["inp"].copy_(_gather(x2))
                expect["grad_w"] = layer.weight.grad
                if "pending" in t:
                    t["pending"].copy_(g2 @ w)
                    expect["grad_in"] = flat(x.grad)
            else:
                t["g_full"].copy_(_gather(g2))
                t["x"].copy_(x2)
                expect["grad_w"] = layer.weight.grad
            with trace.recording() as events:
                returned = timed.run()
            errors = {k: rel(t[k], v) for k, v in expect.items()}
            if p == "dgrad" and shape.column and returned[1] is not None:  # bulk: not reduced
                errors["gathered input"] = rel(returned[0], _gather(x2))
                errors["dgrad"] = rel(returned[1], g2 @ w)
            mine = [e for e in events if e.op == timed.op]
            theirs = [e for e in layer_events if e.op == timed.op]
            out.append({"pass": trial.name, "label": trial.candidate.label(),
                        "moved": trial.comm_moved, "errors": errors, "events": len(mine),
                        "transfers": sum(e.kind == "start" for e in mine),
                        "same_trace": mine == theirs})
    return out


def fp8_trial_passes_match_reference(rank: int, world: int) -> list[dict]:
    """Every trial of a small column (qkv) and row (proj) layer run in FP8
    (`tune.passes.fp8_trial_pass`) on gloo ranks, against the independent FP8 reference
    (helpers/fp8_ref.py) of the same FP8 operands gathered from every rank: per trial, the
    relative error of each output the pass writes (with its kind: a sum over ranks or not)."""
    import torch

    from helpers import fp8_ref as ref
    from helpers.megatron_cpu import init
    from megatron_overlap.layers.precision import Precision
    from megatron_overlap.overlap import fp8
    from megatron_overlap.simulate import Layout, Shape, trials
    from megatron_overlap.tune import DistributedMeasure
    from megatron_overlap.tune.passes import trial_pass

    init(world)
    tp = DistributedMeasure(backend="torch_p2p", timer=_cpu_timer).transport
    p8 = Precision("tensorwise", ref.E4M3, ref.E5M2, True)
    layout = Layout(tp=world, gpus_per_node=world, backend="torch_p2p")
    m, mine = 16 * world, slice(16 * rank, 16 * (rank + 1))
    out = []
    for shape in (Shape("T", "qkv", m, 32, 48, world), Shape("T", "proj", m, 48, 32, world)):
        for trial in trials(shape, layout, rs_dgrad=True):
            timed = trial_pass(trial, tp, "cpu", torch.float32, precision=p8)
            t, p = timed.tensors, trial.spec.pass_name
            sf, sg = fp8.scale_value(t["scale_fwd"]), fp8.scale_value(t["scale_grad"])
            w8 = t["weight"]
            returned = timed.run()
            every = lambda v: [v] if world == 1 else _gather(v[None]).unbind(0)  # noqa: E731
            errors: dict = {}
            if p == "fprop" and shape.column:
                errors["out"] = (ref.rel(t["out"], ref.mm(_gather(t["x"]), sf, w8.t(), sf, torch.float32)), False)
            elif p == "fprop":  # the rows of this rank of the sum of every rank's product
                total = sum(ref.mm(x, sf, w.t(), sf, torch.float32).double()
                            for x, w in zip(every(t["x"]), every(w8)))
                errors["out"] = (ref.rel(t["out"], total[mine]), True)
            elif p == "dgrad" and shape.column:
                if returned[1] is None:  # reduce-scattered into grad_in
                    total = sum(ref.mm(g, sg, w, sf, torch.float32).double()
                                for g, w in zip(every(t["g"]), every(w8)))
                    errors["grad_in"] = (ref.rel(t["grad_in"], total[mine]), True)
                else:  # bulk: this rank's product, the FP8 input gathered beside it
                    errors["dgrad"] = (ref.rel(returned[1], ref.mm(t["g"], sg, w8, sf,
                                                                    torch.float32)), False)
                    errors["gathered"] = (0.0 if torch.equal(returned[0].view(torch.uint8),
                                                             _gather(t["x"]).view(torch.uint8)) else 1.0, False)
            elif p == "dgrad":
                errors["grad_in"] = (ref.rel(t["grad_in"], ref.mm(_gather(t["g"]), sg, w8, sf,
                                                                  torch.float32)), False)
            else:  # wgrad: g^T @ input, both whole (gathered)
                x = t["inp"] if shape.column else t["x"]
                errors["grad_w"] = (ref.rel(t["grad_w"], ref.mm(t["g"].t(), sg, x, sf, torch.float32)), False)
            out.append({"pass": trial.name, "label": trial.candidate.label(), "moved": trial.comm_moved,
                        "errors": errors, "fp8": t["weight"].dtype == ref.E4M3})
    return out


def fp8_distributed_measure(rank: int, world: int, fp8: str, fp8_wgrad: bool) -> list[dict]:
    """The several-GPU hook on gloo CPU ranks (torch_p2p) for FP8 shapes (`Shape.numerics`):
    every trial of a small column and row layer timed for real with a CPU timer; per trial,
    its result and how many of its timed passes ran as FP8 (`fp8_trial_pass`)."""
    import torch.distributed as dist

    from megatron_overlap.simulate import Layout, Shape, trials
    from megatron_overlap.simulate.numerics import Numerics
    from megatron_overlap.tune import DistributedMeasure
    from megatron_overlap.tune import passes as P

    dist.init_process_group("gloo", rank=rank, world_size=world)
    fp8_runs: list = []
    real = P.fp8_trial_pass

    def counted(*args, **kwargs):
        fp8_runs.append(args[0].name)
        return real(*args, **kwargs)

    P.fp8_trial_pass = counted
    try:
        import torch

        measure = DistributedMeasure(backend="torch_p2p", timer=_cpu_timer, dtype=torch.float32)
        layout = Layout(tp=world, gpus_per_node=world, backend="torch_p2p")
        num = Numerics("bf16", fp8, fp8_wgrad=fp8_wgrad)
        out = []
        for shape in (Shape("T", "qkv", 16 * world, 32, 48, world, numerics=num),
                      Shape("T", "proj", 16 * world, 48, 32, world, numerics=num)):
            for t in trials(shape, layout, rs_dgrad=True):
                fp8_runs.clear()
                result = measure(t)
                out.append({"pass": t.name, "fp8_passes": len(fp8_runs), **result})
        return out
    finally:
        P.fp8_trial_pass = real
        dist.destroy_process_group()

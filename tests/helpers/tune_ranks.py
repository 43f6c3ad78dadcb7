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
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


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

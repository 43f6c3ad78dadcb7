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

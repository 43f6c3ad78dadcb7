"""Rank functions of tests/test_robust_disagree.py: TP ranks that call one layer
differently (token counts, settings, one rank without install())."""

from __future__ import annotations

import time

from helpers.faults import leave_together
from helpers.layers import Case, build_pair
from helpers.robust import compare, global_input


def disagree_case(rank: int, world: int, what: str) -> dict:
    import torch.distributed as dist

    from helpers.megatron_cpu import init

    init(world)
    out: dict = {}
    try:
        case = Case("row", True, "float32", True, False, "pipeline2")
        splits = 4 if (what == "settings" and rank == 1) else 2
        ref, ours = build_pair(case, world, {"proj_fprop": {"method": "pipeline",
                                                            "num_splits": splits}}, {})
        seq = 6 if (what == "tokens" and rank == 1) else 4
        if what == "no_install":  # column without SP: Megatron's forward moves nothing
            case = Case("column", False, "float32", True, False, "ring")
            ref, ours = build_pair(case, world, {}, {})
            if rank == 1:
                ours = ref
        x = global_input(ours, rank, world, seq, 2, seed=1).requires_grad_()
        dist.barrier()
        t0 = time.monotonic()
        try:
            ours(x)
            out["result"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            out["result"] = f"{type(e).__name__}: {e}"
        out["elapsed"] = time.monotonic() - t0
        if what == "tokens":  # agreeing again: works, equal to Megatron's layer
            out["after"] = compare(ref, ours, global_input(ours, rank, world, 4, 2, seed=2)
                                   .requires_grad_())
        return out
    finally:
        leave_together(rank, world)

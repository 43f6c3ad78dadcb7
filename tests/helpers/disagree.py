"""Rank functions of tests/test_robust_disagree.py: TP ranks that call one layer
differently (token counts, settings, one rank without install()), and schedules
that break the transport contract (an extra workspace on one rank, no begin_pass)."""

from __future__ import annotations

import time

from helpers.faults import leave_together
from helpers.layers import Case, build_pair
from helpers.robust import compare, global_input


def _inject(what: str, rank: int):
    """Patch the row fprop's schedule as `what` asks; returns the undo."""
    import torch

    from megatron_overlap.layers import functions

    if what == "workspace" and rank == 1:  # one extra workspace, on this rank only
        real = functions.matmul_reduce_scatter

        def uneven(x, w, tp, *args, **kw):
            tp.workspace((3,), torch.float32, x.device)
            return real(x, w, tp, *args, **kw)
        functions.matmul_reduce_scatter = uneven
        return lambda: setattr(functions, "matmul_reduce_scatter", real)
    if what == "no_begin_pass":  # every rank: the pass never opens the transport's pass
        real = functions.begin
        functions.begin = lambda tp, s, fallback: (s.name if s else fallback, None)
        return lambda: setattr(functions, "begin", real)
    return lambda: None


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
        undo = _inject(what, rank)
        dist.barrier()
        t0 = time.monotonic()
        try:
            ours(x)
            out["result"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            out["result"] = f"{type(e).__name__}: {e}"
        finally:
            undo()
        out["elapsed"] = time.monotonic() - t0
        if what in ("tokens", "workspace", "no_begin_pass"):  # agreeing again: works, equal
            # to Megatron's layer (a contract check that failed is made again, and passes)
            out["after"] = compare(ref, ours, global_input(ours, rank, world, 4, 2, seed=2)
                                   .requires_grad_())
        return out
    finally:
        leave_together(rank, world)


def audit_once(rank: int, world: int) -> dict:
    """Exchanges and recordings per call: the first forward + backward of a shape, the
    next two of the same shape, then a new shape (column with SP and a ring, row)."""
    import torch.distributed as dist

    from helpers.megatron_cpu import init
    from megatron_overlap.comm import exchange
    from megatron_overlap.layers import agree

    init(world)
    made: list[str] = []
    real = exchange.all_gather_object

    def counted(obj, group, what, *a, **kw):
        made.append(what)
        return real(obj, group, what, *a, **kw)
    try:
        agree.all_gather_object = counted
        out: dict = {}
        for kind, variant in (("column", "ring"), ("row", "pipeline2")):
            case = Case(kind, True, "float32", True, False, variant)
            ref, ours = build_pair(case, world, *_variant(kind, variant))
            calls = []
            for seq in (4, 4, 4, 8):
                del made[:]
                got = compare(ref, ours, global_input(ours, rank, world, seq, 2, seed=seq)
                              .requires_grad_())
                calls.append({"exchanges": list(made), "err": got["err"],
                              "patched": sorted(k for k in ("workspace", "begin_pass")
                                                if k in vars(ours.transport))})
            out[kind] = calls
        dist.barrier()
        return out
    finally:
        agree.all_gather_object = real
        leave_together(rank, world)


def _variant(kind: str, variant: str):
    from helpers.layers import VARIANTS

    return VARIANTS[kind][variant]

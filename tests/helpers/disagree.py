"""Rank functions of the disagreement cases (tests/test_robust_disagree.py on CPU,
tests/gpu/test_faults_symm.py on CUDA): TP ranks that call one layer differently
(token counts, settings, one rank without install()), and what every rank must see."""

from __future__ import annotations

import time

from helpers.faults import leave_together
from helpers.layers import Case, build_pair
from helpers.robust import compare, global_input, init, on

WHAT = ("tokens", "settings", "no_install")


def disagree_case(rank: int, world: int, what: str, device: str = "cpu") -> dict:
    import torch.distributed as dist

    init(world, device)
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
        ref, ours = on(device, ref, ours)
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


def check(what: str, per_rank: list, t: float, slack: float = 4.0) -> None:
    """Different token counts or settings: DisagreementError on every rank, naming the
    ranks and what differs, found by the exchange (well before the timeout), and the
    next agreeing call equals Megatron's. A rank without install(): the others get a
    bounded diagnosis naming that possible cause."""
    bad = {r: v for r, v in enumerate(per_rank) if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}: {v}" for r, (s, v) in bad.items())
    results = [v for _, v in per_rank]
    if what == "no_install":
        survivor, plain = results
        assert plain["result"] == "no error"  # Megatron's own column forward moves nothing
        assert survivor["result"].startswith(
            f"CommError: megatron_overlap: rank 0/2 waited for 'layer agreement (shape and "
            f"settings)' chunk 0 (from all ranks) {t:g}s and group ranks 1 (global 1) never "
            f"arrived"), survivor
        assert "a rank without install()" in survivor["result"]
        assert t * 0.9 <= survivor["elapsed"] <= t + slack
        return
    for got in results:
        assert got["elapsed"] < t  # found by the exchange, not by a timeout
        if what == "tokens":
            assert got["result"] == (
                "DisagreementError: megatron_overlap: layer 'proj (row)': the TP ranks disagree, "
                "so no transfer was started: input shape: rank 0: (4, 2, 12); rank 1: (6, 2, 12). "
                "Give every rank of the TP group the same micro-batch shapes and the same "
                "install() settings."), got
            assert got["after"]["same_shapes"] and got["after"]["err"] <= 1e-5, got["after"]
        else:
            assert got["result"].startswith("DisagreementError: megatron_overlap: layer 'proj "
                                            "(row)': the TP ranks disagree"), got
            assert ("proj_fprop: rank 0: 'method=pipeline num_splits=2 aggregate=0 "
                    "ring_order=auto'; rank 1: 'method=pipeline num_splits=4 aggregate=0 "
                    "ring_order=auto'") in got["result"]
            assert "input shape" not in got["result"]

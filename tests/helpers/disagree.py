"""Rank functions of the disagreement cases (tests/test_robust_disagree.py on CPU,
tests/gpu/test_faults_symm.py on CUDA): TP ranks that call one layer differently
(token counts, settings, one rank without install()), schedules that break the
transport contract (an extra workspace on one rank, no begin_pass), and what every
rank must see."""

from __future__ import annotations

import time

from helpers.faults import leave_together
from helpers.layers import Case, build_pair
from helpers.robust import compare, global_input, init, on

WHAT = ("tokens", "settings", "no_install", "frozen")


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
        functions.begin = lambda tp, plan, pass_name: (plan.op_name(pass_name), None)
        return lambda: setattr(functions, "begin", real)
    return lambda: None


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
        if what == "frozen" and rank == 1:  # its backward would skip the wgrad's transfers
            ours.weight.requires_grad_(False)
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
            f"CommError: megatron_overlap: layer 'qkv (column)': rank 0/2 waited for 'layer "
            f"agreement (shape and settings)' chunk 0 (from all ranks) {t:g}s and group ranks 1 "
            f"(global 1) never arrived"), survivor
        assert "a rank without install()" in survivor["result"]
        assert t * 0.9 <= survivor["elapsed"] <= t + slack
        return
    for got in results:
        assert got["elapsed"] < t  # found by the exchange, not by a timeout
        if what == "tokens":
            assert got["result"] == (
                "DisagreementError: megatron_overlap: layer 'proj (row)': the TP ranks disagree, "
                "so no transfer was started: input shape: rank 0: (4, 2, 12); rank 1: (6, 2, 12). "
                "Give every rank of the TP group the same micro-batch shapes, the same "
                "install() settings and the same frozen weights and gather_output."), got
            assert got["after"]["same_shapes"] and got["after"]["err"] <= 1e-5, got["after"]
        elif what == "frozen":
            assert got["result"] == (
                "DisagreementError: megatron_overlap: layer 'proj (row)': the TP ranks disagree, "
                "so no transfer was started: weight trainable: rank 0: True; rank 1: False. "
                "Give every rank of the TP group the same micro-batch shapes, the same "
                "install() settings and the same frozen weights and gather_output."), got
        else:
            assert got["result"].startswith("DisagreementError: megatron_overlap: layer 'proj "
                                            "(row)': the TP ranks disagree"), got
            assert ("proj_fprop: rank 0: 'method=pipeline num_splits=2 aggregate=0 "
                    "ring_order=auto'; rank 1: 'method=pipeline num_splits=4 aggregate=0 "
                    "ring_order=auto'") in got["result"]
            assert "input shape" not in got["result"]


def audit_once(rank: int, world: int) -> dict:
    """Exchanges and recordings per call: the first forward + backward of a shape, the
    next two of the same shape, then a new shape (column with SP and a ring, row)."""
    import torch.distributed as dist

    from megatron_overlap.comm import exchange
    from megatron_overlap.layers import agree

    init(world, "cpu")
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


def new_mode_after_replays(rank: int, world: int) -> list[str]:
    """A column layer (SP, ring) whose passes are replayed (a stand-in graph: the tensors
    keep their addresses, as in steady state), then called with the same shape in a new
    mode (gather_output, then a frozen weight): the new mode's agreement audit must run
    its passes eagerly, not as the replay of the graph already captured (which makes no
    host-side calls to record). Per call: 'ok <output checksum>' or the error."""
    import megatron_overlap
    from helpers.layers import VARIANTS, build, make_input
    from megatron_overlap.overlap import replay

    init(world, "cpu")

    class _NoGraph:
        def replay(self) -> None:
            pass

    saved = {k: getattr(replay.PassGraphs, k) for k in ("_usable", "_key", "_capture")}
    replay.PassGraphs._usable = lambda self, tp, tensors: True
    replay.PassGraphs._key = lambda self, tp, tensors, static: static
    replay.PassGraphs._capture = lambda self, tp, body: (body(), replay._Graph(_NoGraph(), (), (), ""))[1]
    out = []
    try:
        case = Case("column", True, "float32", True, False, "ring")
        ub, flags = VARIANTS["column"]["ring"]
        megatron_overlap.install(ub_cfgs=ub)
        layer = build(case, world, True, flags=flags)
        x = make_input(case, rank, world, layer)
        for mode in ("", "", "", "gather_output", "frozen"):
            if mode == "frozen":
                layer.weight.requires_grad_(False)
            try:
                y = layer(x, runtime_gather_output=True)[0] if mode == "gather_output" else layer(x)[0]
                out.append(f"ok {float(y.detach().double().sum()):.6e}")
            except Exception as e:  # noqa: BLE001 - reported to the test
                out.append(f"{type(e).__name__}: {e}")
        out.append(f"replays {sum(g.replays for g in layer.pass_graphs.values())}")
        return out
    finally:
        for k, v in saved.items():
            setattr(replay.PassGraphs, k, v)
        megatron_overlap.uninstall()
        leave_together(rank, world)

"""The overlap is real: through the transport contract's trace, each schedule
starts a transfer before the GEMM it hides under and waits on it only after.
Also: the schedules' results against plain collectives + GEMM, and a peer that
never answers gives a diagnosed timeout, not a hang."""

import pytest

from helpers import dist


def _setup(rank, world):
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_overlap.comm import TorchP2PTransport

    torch.manual_seed(0)
    return TorchP2PTransport(tdist.group.WORLD)


def _traces(rank, world):
    """Run every schedule once with the trace on; return events and max errors."""
    import torch
    import torch.distributed as tdist

    from megatron_overlap.comm import trace
    from megatron_overlap.overlap import all_gather_matmul, matmul_reduce_scatter
    from megatron_overlap.ab.compare import rel_error
    from megatron_overlap.overlap import hide, matmul as gemm

    tp = _setup(rank, world)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(world * 8, 16, generator=g)
    w = torch.randn(12, 16, generator=g)
    x_local = x_full[rank * 8:(rank + 1) * 8]
    out, errs = {}, {}
    ref_ag = x_full @ w.t()
    for name, kw in [("ring", dict(method="ring_exchange")),
                     ("ring_aggregate", dict(method="ring_exchange", aggregate=True)),
                     ("bulk", dict(method="bulk"))]:
        with trace.recording() as ev:
            y, gathered = all_gather_matmul(x_local, w, tp, op="ag", **kw)
        out[f"ag_{name}"] = [(e.kind, e.chunk) for e in ev]
        errs[f"ag_{name}"] = max(rel_error(y, ref_ag), rel_error(gathered, x_full))
    # GEMM->RS: every rank has different partial inputs; the reference sums them.
    xp = torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(10 + rank))
    parts = [torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(10 + r)) @ w.t()
             for r in range(world)]
    ref_rs = sum(parts)[rank * 8:(rank + 1) * 8]
    for name, kw in [("pipeline4", dict(method="pipeline", num_splits=4)),
                     ("pipeline1", dict(method="pipeline", num_splits=1)),
                     ("ring", dict(method="ring_exchange", num_splits=1))]:
        with trace.recording() as ev:
            y = matmul_reduce_scatter(xp, w, tp, op="rs", **kw)
        out[f"rs_{name}"] = [(e.kind, e.chunk) for e in ev]
        errs[f"rs_{name}"] = rel_error(y, ref_rs)
    # bf16: the ring's partials summed in fp32 and rounded once. Sums of `world` bf16 values
    # are exact in fp32 here, so that is the reference's bits whatever the order; running
    # sums rounded to bf16 at each add (for world > 2) are not
    wb = w.bfloat16()
    blocks = [torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(10 + r)
                          ).bfloat16()[rank * 8:(rank + 1) * 8] @ wb.t() for r in range(world)]
    once = torch.stack(blocks).float().sum(0).bfloat16()
    running = blocks[0].clone()
    for b in blocks[1:]:
        running += b
    y = matmul_reduce_scatter(xp.bfloat16(), wb, tp, op="rs_bf16", method="ring_exchange",
                              num_splits=1)
    out["rs_ring_bf16"] = {"equal_once": torch.equal(y, once),
                           "once_is_running": torch.equal(once, running)}
    with trace.recording() as ev:
        buf = torch.empty(world * 8, 16)
        hide(lambda: tp.all_gather(buf, x_local, op="ag"), lambda: gemm(x_local, w.t(), op="dgrad"),
             overlap=True)
    out["bulk_hide"] = [(e.kind, e.op) for e in ev]
    tdist.destroy_process_group()
    return out, errs


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"tp{w}")
def traced(request):
    world = request.param
    return world, dist.run(_traces, world)


def _expected_ring_ag(steps):
    ev = []
    for i, blocks in enumerate(steps):
        if i + 1 < len(steps):
            ev.append(("start", i + 1))
        ev.append(("gemm", i))  # one GEMM a step, over its adjacent blocks
        if i + 1 < len(steps):
            ev.append(("wait", i + 1))
    return ev


def test_schedules_compute_the_collective_result(traced):
    world, per_rank = traced
    for rank, (_, errs) in enumerate(per_rank):
        assert all(v < 1e-5 for v in errs.values()), (rank, errs)


def test_ring_allgather_starts_next_chunk_before_gemm_and_waits_after(traced):
    from megatron_overlap.overlap import ring_steps

    world, per_rank = traced
    for rank, (ev, _) in enumerate(per_rank):
        # transfer of chunk i+1 started before GEMM of chunk i, waited on only after it
        assert ev["ag_ring"] == _expected_ring_ag(ring_steps(rank, world, False))
        assert ev["ag_ring_aggregate"] == _expected_ring_ag(ring_steps(rank, world, True))
        assert len(ring_steps(rank, world, True)) == world // 2 + 1
        # bulk is the plain order: the gather completes before the single GEMM
        assert ev["ag_bulk"] == [("start", 0), ("wait", 0), ("gemm", 0)]


def test_ring_reduce_scatter_sends_each_partial_under_the_next_gemms(traced):
    """TE's order: each partial's send starts right after its GEMM and runs under the
    GEMMs after it; the waits come after the last GEMM (this rank's own block), then the
    one sum (the schedules' results above are the collective's)."""
    world, per_rank = traced
    expected = []
    for s in range(world - 1):
        expected += [("gemm", s), ("start", s)]
    expected += [("gemm", world - 1)] + [("wait", s) for s in range(world - 1)]
    for ev, _ in per_rank:
        assert ev["rs_ring"] == expected


def test_ring_reduce_scatter_accumulates_in_fp32_and_rounds_once(traced):
    world, per_rank = traced
    for ev, _ in per_rank:
        assert ev["rs_ring_bf16"]["equal_once"]
    if world > 2:  # (the test can tell: bf16 running sums give other bits)
        assert not all(ev["rs_ring_bf16"]["once_is_running"] for ev, _ in per_rank)


def _hierarchical_bf16(rank, world):
    """Per layout of emulated nodes: does the hierarchical reduce-scatter's bf16 result
    equal each node's partials summed in fp32 and rounded once, then the node partials
    likewise; and would bf16 running sums have given those bits."""
    import torch
    import torch.distributed as tdist

    from megatron_overlap.overlap import matmul_reduce_scatter

    tp = _setup(rank, world)
    wb = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    xs = [torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(10 + r)).bfloat16()
          for r in range(world)]
    blocks = [x[rank * 8:(rank + 1) * 8] @ wb.t() for x in xs]
    res = {}
    for nodes in (((0, 1), (2, 3)), ((0,), (1,), (2,), (3,))):
        node_parts = [torch.stack([blocks[r] for r in m]).float().sum(0).bfloat16() for m in nodes]
        twice = torch.stack(node_parts).float().sum(0).bfloat16()
        running = node_parts[0].clone()
        for p in node_parts[1:]:
            running += p
        y = matmul_reduce_scatter(xs[rank], wb, tp, op="rs", method="ring_exchange",
                                  num_splits=1, nodes=nodes)
        res[len(nodes)] = (torch.equal(y, twice), torch.equal(twice, running))
    tdist.destroy_process_group()
    return res


def test_hierarchical_reduce_scatter_sums_each_level_in_fp32():
    """Across nodes (TP=4 as 2 nodes x 2 and 4 nodes x 1): each node's partials in one fp32
    sum, rounded once, then the node partials likewise. At 4 nodes of one rank that is the
    whole sum rounded once, where node partials added in bf16 one after the other, as the
    order did before, round at each add (the test tells them apart on some rank)."""
    per_rank = dist.run(_hierarchical_bf16, 4)
    for res in per_rank:
        assert res[2][0] and res[4][0], res
    assert not all(res[4][1] for res in per_rank)


def test_pipeline_reduces_each_chunk_under_the_next_gemm(traced):
    _, per_rank = traced
    for ev, _ in per_rank:
        seq = ev["rs_pipeline4"]
        for i in range(3):
            assert seq.index(("start", i)) < seq.index(("gemm", i + 1)) < seq.index(("wait", i))
        assert seq.index(("gemm", 0)) < seq.index(("start", 0))
        assert ev["rs_pipeline1"] == [("gemm", 0), ("start", 0), ("wait", 0)]


def test_bulk_overlap_hides_collective_under_unrelated_gemm(traced):
    _, per_rank = traced
    for ev, _ in per_rank:
        assert ev["bulk_hide"] == [("start", "ag"), ("gemm", "dgrad"), ("wait", "ag")]


def _silent_peer(rank, world):
    import time

    import torch

    from megatron_overlap.comm import CommError

    tp = _setup(rank, world)
    if rank == 1:
        time.sleep(6)  # alive but never sends: rank 0 must time out, not hang
        return "silent"
    buf = torch.empty(4)
    handle = tp.exchange([(torch.ones(4), 1)], [(buf, 1)], op="qkv_fprop", chunk=1)
    try:
        handle.wait()
    except CommError as exc:
        return str(exc)
    return "no error"


def test_peer_that_never_answers_times_out_with_diagnostic():
    msg, _ = dist.run(_silent_peer, 2, env={"MEGATRON_OVERLAP_TIMEOUT_S": "2"})
    assert "rank 0/2" in msg and "'qkv_fprop' chunk 1" in msg and "from 1" in msg, msg
    assert "MEGATRON_OVERLAP_TIMEOUT_S=2s" in msg, msg

"""Per-rank work for the emulated-node tests: gloo ranks with LOCAL_WORLD_SIZE set,
so a TP group spans "nodes" and runs the hierarchical orders on per-peer transports.
Each function runs many checks in one set of processes (starting 8 ranks that
import Megatron costs more than the checks) and returns plain data to assert on."""

from __future__ import annotations

from typing import Any

import torch

from megatron_overlap.ab.compare import rel_error

INTER, INTRA = "inter:torch_p2p", "intra:torch_p2p"
# name -> (ub_cfgs overrides, Megatron flags): every pass that runs a ring
CASES = {
    "column-ring": ("column", {"qkv_fprop": {"method": "ring_exchange"}}, {}),
    "column-rs_dgrad_ring": ("column", {"qkv_dgrad": {"method": "ring_exchange"}},
                             {"tp_comm_overlap_rs_dgrad": True}),
    "column-rs_dgrad_pipeline2": ("column", {"qkv_dgrad": {"method": "pipeline", "num_splits": 2}},
                                  {"tp_comm_overlap_rs_dgrad": True}),
    "row-pipeline2": ("row", {"proj_fprop": {"method": "pipeline", "num_splits": 2}}, {}),
    "row-ring": ("row", {"proj_fprop": {"method": "ring_exchange"}}, {}),
}
# which passes of a case run a hierarchical all-gather / reduce-scatter
HIER_PASSES = {
    "column-ring": {"qkv_fprop": "ag"},
    "column-rs_dgrad_ring": {"qkv_fprop": "ag", "qkv_dgrad": "rs"},
    "column-rs_dgrad_pipeline2": {"qkv_fprop": "ag", "qkv_dgrad": "rs"},
    "row-pipeline2": {"proj_fprop": "rs", "proj_dgrad": "ag"},
    "row-ring": {"proj_fprop": "rs", "proj_dgrad": "ag"},
}


# -- the design, restated (the expected traces) -------------------------------------------------
def expected_ag(nodes, rank: int, inter: str = INTER, intra: str = INTRA) -> list[tuple]:
    """Inter starts; the local ring (start(t+1) -> gemm(t) -> wait(t+1)); the inter
    waits, after the node's L GEMMs; the ring over the remote blocks."""
    from megatron_overlap.overlap.hierarchical import partners

    n = next(i for i, m in enumerate(nodes) if rank in m)
    size, others = len(nodes[0]), partners(n, len(nodes))
    per_step = [1] * size + [len(others)] * size
    first = [sum(per_step[:t]) for t in range(2 * size)]
    ev = [("start", size + i, inter) for i in range(len(others))]
    for t in range(2 * size):
        if t == size:
            ev += [("wait", size + i, inter) for i in range(len(others))]
        nxt = t + 1 if t + 1 < 2 * size and t + 1 != size else None
        if nxt is not None:
            ev += [("start", first[nxt] + j, intra) for j in range(per_step[nxt])]
        ev += [("gemm", first[t] + j, "") for j in range(per_step[t])]
        if nxt is not None:
            ev += [("wait", first[nxt] + j, intra) for j in range(per_step[nxt])]
    return ev


def expected_rs(nodes, rank: int, inter: str = INTER, intra: str = INTRA) -> list[tuple]:
    """Per round (other nodes first, the own node last) the point-to-point reduce-scatter
    over the local ranks: each step's GEMM, its partial sent at once (all but the last),
    the round's arrivals waited on after its last GEMM; a round for another node ends by
    sending its node partial over the inter link; those are waited on at the end."""
    n_nodes, size = len(nodes), len(nodes[0])
    ev, t = [], 0
    for k in range(n_nodes):
        for s in range(size):
            ev.append(("gemm", t, ""))
            if s + 1 < size:
                ev.append(("start", t, intra))
            t += 1
        ev += [("wait", k * size + s, intra) for s in range(size - 1)]
        if k + 1 < n_nodes:
            ev.append(("start", t - 1, inter))
    return ev + [("wait", k * size + size - 1, inter) for k in range(n_nodes - 1)]


def contains(seq: list, part: list) -> bool:
    """`part` occurs in `seq` as a contiguous run."""
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def _events(ev, op: str | None = None) -> list[tuple]:
    return [(e.kind, e.chunk, e.via) for e in ev if op is None or e.op == op]




# -- pieces --------------------------------------------------------------------------------------
def topology_checks(rank: int, world: int, groups: list[list[int]]) -> dict[str, Any]:
    """The world's topology, and that of every group in `groups` this rank is in (every
    rank creates every group: new_group is collective over the world)."""
    import torch.distributed as dist

    from megatron_overlap import comm
    from megatron_overlap.overlap.hierarchical import choose

    def info(t):
        return dict(node=t.node, domain=t.domain, local=t.local, nodes=t.nodes,
                    hierarchical=t.is_hierarchical, uniform=t.uniform, describe=t.describe())

    out: dict[str, Any] = {"world": info(comm.topology(dist.group.WORLD))}
    cpu = torch.device("cpu")
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank not in ranks:
            continue
        t = comm.topology(g, cpu)
        backend = comm.resolve_backend("auto", g, cpu)
        tp = comm.transport_for(g, "auto", cpu)
        # the flat ring over whatever transports auto picked: right in rank order
        x = torch.full((2, 3), float(tp.rank))
        from megatron_overlap.overlap import all_gather_matmul
        y, gathered = all_gather_matmul(x, torch.eye(3), tp, "ring_exchange", op="ag")
        want = torch.arange(len(ranks)).repeat_interleave(2)[:, None].float().expand(-1, 3)
        order = choose("auto", t)
        out[tuple(ranks)] = dict(info(t), backend=backend, peers=comm.describe_peers(tp),
                                 order=order.order, note=order.note,
                                 flat_ok=bool(torch.equal(y, want) and torch.equal(gathered, want)))
    return out


def schedule_traces(rank: int, world: int, tp, layouts: dict[str, Any]) -> dict[str, Any]:
    """AG and RS (both methods), hierarchical over each layout, traced, with errors
    against plain collectives + GEMM; the flat ring and the all-reduce alongside."""
    from megatron_overlap.comm import trace
    from megatron_overlap.overlap import all_gather_matmul, matmul_reduce_scatter

    g = torch.Generator().manual_seed(1)
    x_full, w = torch.randn(world * 4, 16, generator=g), torch.randn(12, 16, generator=g)
    x_local = x_full[rank * 4:(rank + 1) * 4]
    xp = torch.randn(world * 4, 16, generator=torch.Generator().manual_seed(10 + rank))
    ref_rs = sum(torch.randn(world * 4, 16, generator=torch.Generator().manual_seed(10 + r)) @ w.t()
                 for r in range(world))
    out: dict[str, Any] = {}
    errs: dict[str, float] = {}
    for name, layout in layouts.items():
        for kind, kw in (("ag", {}), ("ag_aggregate", {"aggregate": True})):
            with trace.recording() as ev:
                y, gathered = all_gather_matmul(x_local, w, tp, "ring_exchange", op="ag",
                                                nodes=layout, **kw)
            out[f"{kind}/{name}"] = _events(ev)
            errs[f"{kind}/{name}"] = max(rel_error(y, x_full @ w.t()), rel_error(gathered, x_full))
        for method in ("ring_exchange", "pipeline"):
            for scatter in (True, False):
                with trace.recording() as ev:
                    y = matmul_reduce_scatter(xp, w, tp, method, 2, op="rs", nodes=layout,
                                              scatter=scatter)
                key = f"rs_{method}{'' if scatter else '_allreduce'}/{name}"
                out[key] = _events(ev)
                errs[key] = rel_error(y, ref_rs[rank * 4:(rank + 1) * 4] if scatter else ref_rs)
    return {"events": out, "errors": errs}


def layer_cases(rank: int, world: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Our layers against Megatron's (SP on) for (case name, dtype), three micro-batch
    lengths each, with the trace of every pass that should have run hierarchically."""
    from helpers.layers import Case, build_pair, make_input, run_pair
    from megatron_overlap.comm import trace

    out = {}
    for name, dtype in cases:
        kind, overrides, flags = CASES[name]
        case = Case(kind, True, dtype, True, False, name)
        ref, ours = build_pair(case, world, overrides, flags)
        errs: dict[str, float] = {}
        with trace.recording() as ev:
            for seq in (case.seq, 2 * case.seq, case.seq // 2):
                x = make_input(case, rank, world, ref, seq=seq, seed=seq)
                for k, v in run_pair(ref, ours, x).items():
                    errs[k] = max(errs.get(k, 0.0), v)
        nodes = ours.transport.topology.domains
        ran = {op: contains(_events(ev, op), (expected_ag if how == "ag" else expected_rs)(nodes, rank))
               for op, how in HIER_PASSES[name].items()}
        out[f"{name}-{dtype}"] = dict(errors=errs, hierarchical=ran, rows=ours.overlap_rows())
    return out


def gpt_pair(rank: int, world: int, variant: str) -> dict[str, Any]:
    """A GPTModel with overlapped linears against the plain TP path: five SGD steps on
    the same weights; which ring orders its layers chose; the traces of the passes."""
    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model, train
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import trace
    from megatron_overlap.telemetry import layer_settings, settings_table

    init(world)
    mo.install()
    try:
        plain, wrap_plain = make_model(make_config(world, variant, overlap=False))
        ours, wrap_ours = make_model(make_config(world, variant, overlap=True))
    finally:
        mo.uninstall()
    ours.load_state_dict(plain.state_dict())
    losses_plain = train(wrap_plain(plain))
    with trace.recording() as ev:
        losses_ours = train(wrap_ours(ours))
    rel = {n: rel_error(p.detach(), q.detach())
           for (n, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters())}
    layers = {n: {p: o.label for p, o in m.ring_orders.items()}
              for n, m in ours.named_modules() if hasattr(m, "ring_orders") and m.overlap_plan.enabled}
    nodes = next(m for m in ours.modules() if hasattr(m, "ring_orders")).transport.topology.domains
    ran = {op: contains(_events(ev, op), (expected_ag if how == "ag" else expected_rs)(nodes, rank))
           for op, how in (("qkv_fprop", "ag"), ("fc1_fprop", "ag"), ("proj_fprop", "rs"),
                           ("fc2_fprop", "rs"), ("proj_dgrad", "ag"), ("fc2_dgrad", "ag"))}
    rows = layer_settings(ours)
    return dict(losses=(losses_plain, losses_ours), param_err=rel, orders=layers, ran=ran,
                rows=rows, table=settings_table(rows))


def auto_pairs_across_nodes(rank: int, world: int) -> dict[str, Any]:
    """`aggregate: auto` on a column layer whose ring GEMM has AGGREGATE_MIN_N columns a
    rank, against Megatron's layer: pairs chosen at build (one node assumed), then, per
    ring order: flat (its ring spans nodes: the first forward puts it on the plain ring)
    and auto (the hierarchical order, which does not read the key)."""
    from helpers.layers import Case, build_pair, make_input, run_pair
    from megatron_overlap.comm import trace
    from megatron_overlap.config.names import AGGREGATE_MIN_N

    case, out = Case("column", True, "float32", True, False, "column-ring"), {}
    for order in ("flat", "auto"):
        ref, ours = build_pair(case, world, {"qkv_fprop": {"method": "ring_exchange",
                                                           "ring_order": order}}, {},
                               name_out=world * AGGREGATE_MIN_N)
        built = ours.overlap_plan.fprop.aggregate
        with trace.recording() as ev:  # the first forward's GEMMs: pairs run fewer
            errors = run_pair(ref, ours, make_input(case, rank, world, ref))
        out[order] = dict(built=built, ran=ours.overlap_plan.fprop.aggregate,
                          notes=ours.overlap_plan.notes, errors=errors,
                          gemms=sum(e[0] == "gemm" for e in _events(ev, "qkv_fprop")))
    return out


# -- what each emulated cluster runs ----------------------------------------------------------
def run_2x2(rank: int, world: int) -> dict[str, Any]:
    """TP=4 over 2 nodes x 2 (LOCAL_WORLD_SIZE=2)."""
    import torch.distributed as dist

    from helpers.megatron_cpu import init
    from megatron_overlap import comm

    init(world)
    # [3]: every rank belongs to as many groups as its node-mates (see comm.hierarchical)
    out: dict[str, Any] = {"topology": topology_checks(rank, world, [[0, 2], [1, 3], [0, 1, 2], [3]])}
    tp = comm.transport_for(dist.group.WORLD, "auto", torch.device("cpu"))
    nodes = tp.topology.domains
    out["transport"] = dict(name=tp.name, peers=tp.peer_map(), describe=comm.describe_peers(tp),
                            carried={p: tp.transport_for_peer(p).name for p in tp.peer_map()},
                            nodes=nodes)
    out["schedules"] = schedule_traces(rank, world, tp, {"nodes": nodes, "flat": None})
    plain = comm.TorchP2PTransport(dist.group.WORLD)
    out["layouts"] = schedule_traces(rank, world, plain, {"interleaved": ((0, 2), (1, 3)),
                                                          "singletons": ((0,), (1,), (2,), (3,))})
    out["layers"] = layer_cases(rank, world, [
        ("column-ring", "float32"), ("column-ring", "bfloat16"),
        ("column-rs_dgrad_ring", "float32"), ("column-rs_dgrad_pipeline2", "bfloat16"),
        ("row-pipeline2", "float32"), ("row-pipeline2", "bfloat16"), ("row-ring", "float32")])
    out["gpt"] = gpt_pair(rank, world, "gelu_bias")
    out["auto_pairs"] = auto_pairs_across_nodes(rank, world)
    return out


def run_2x4(rank: int, world: int) -> dict[str, Any]:
    """TP=8 over 2 nodes x 4 (LOCAL_WORLD_SIZE=4); and, on the same ranks, the
    schedules over 4 x 2 and (a 6-rank group) 3 x 2 layouts on one transport."""
    import torch.distributed as dist

    from helpers.megatron_cpu import init
    from megatron_overlap import comm

    init(world)
    out: dict[str, Any] = {"topology": topology_checks(rank, world, [])}
    plain = comm.TorchP2PTransport(dist.group.WORLD)
    out["layouts"] = schedule_traces(rank, world, plain, {"4x2": ((0, 1), (2, 3), (4, 5), (6, 7))})
    six = dist.new_group(list(range(6)))
    dist.new_group([6, 7])  # so every rank belongs to as many groups as its node-mates
    if rank < 6:
        out["layouts6"] = schedule_traces(rank, 6, comm.TorchP2PTransport(six),
                                          {"3x2": ((0, 1), (2, 3), (4, 5))})
    out["layers"] = layer_cases(rank, world, [
        ("column-ring", "float32"), ("column-rs_dgrad_ring", "bfloat16"),
        ("row-pipeline2", "bfloat16"), ("row-ring", "float32")])
    return out

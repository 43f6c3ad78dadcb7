"""Hierarchical ring orders for a TP group of N nodes x L local ranks.

The flat ring sends every block over every link in turn, so in a group that spans
nodes each step waits on the slowest link. These orders start the inter-node
transfers first and keep them in flight under the most compute:

- AG->GEMM: send the own block to its counterparts (same local index) on the other
  nodes; ring the node's own L blocks (GEMM each as it arrives); only then wait for
  the remote blocks, and ring those among the L local ranks (GEMM as they arrive).
- GEMM->RS: for each other node, reduce-scatter its L blocks' partials among the
  local ranks (point to point, each partial straight to the rank that sums it) and
  send the node-partial to the counterpart at once; then the own node's blocks
  (hiding those sends); finally sum the node-partials of the own block. Every sum is
  one reduction (fp32 accumulation, one rounding), as in the flat ring.

`nodes` is the ring layout: group ranks per node (per P2P domain), node-major, all
of one size. Results are in group-rank order, exactly as the flat ring returns them.
Inter-node exchanges follow a round-robin pairing, so both ends of a pair start it
in the same round: separately posted NCCL send/recv pairs cannot deadlock.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm.topology import Topology
from ..comm.transport import Handle, Transport
from .gemm import Gemm, matmul, out_dtype
from .gemm_rs import send_partials
from .streams import ChunkStreams, plain

Layout = Sequence[Sequence[int]]


@dataclass(frozen=True)
class RingOrder:
    """The ring order one layer pass runs, and why when it is not what was asked."""

    order: str  # "flat" | "hierarchical"
    nodes: tuple[tuple[int, ...], ...] | None = None
    note: str = ""

    @property
    def label(self) -> str:
        if self.nodes is None:
            return self.order
        return f"{self.order} ({len(self.nodes)}x{len(self.nodes[0])})"


def choose(requested: str, topo: Topology | None) -> RingOrder:
    """`auto`: hierarchical when the group spans nodes; `hierarchical`: whenever it
    spans P2P domains; either falls back to the flat ring, with a note, when the
    domains hold unequal numbers of the group's ranks."""
    if requested == "flat" or topo is None or topo.world_size == 1:
        return RingOrder("flat")
    if requested == "auto" and not topo.spans_nodes:
        return RingOrder("flat")
    if not topo.is_hierarchical:
        return RingOrder("flat", note="ring_order hierarchical: the TP group is inside one "
                                      "NVLink / P2P domain, where it is the flat ring")
    if not topo.uniform:
        return RingOrder("flat", note=f"ring_order {requested}: TP group over {topo.describe()}; "
                                      "the hierarchical order needs the same number of TP ranks "
                                      "in every node, so the flat ring runs")
    return RingOrder("hierarchical", topo.domains)


def pairing(n_nodes: int) -> list[list[int | None]]:
    """rounds[r][node]: the node it exchanges with in round r (None: sits out). Round
    robin (circle method): within a round, partners are mutual."""
    m = n_nodes + n_nodes % 2
    rounds = []
    for r in range(m - 1):
        row: list[int | None] = []
        for n in range(n_nodes):
            p = r if n == m - 1 else m - 1 if n == r else (2 * r - n) % (m - 1)
            row.append(p if p < n_nodes else None)
        rounds.append(row)
    return rounds


def partners(node: int, n_nodes: int) -> list[int]:
    """The other nodes in the order `node` exchanges with them."""
    return [row[node] for row in pairing(n_nodes) if row[node] is not None]


def _position(nodes: Layout, rank: int) -> tuple[int, int]:
    for n, members in enumerate(nodes):
        if rank in members:
            return n, list(members).index(rank)
    raise ValueError(f"rank {rank} is not in the ring layout {nodes}")


def _check_layout(nodes: Layout, world: int, op: str) -> None:
    sizes = {len(m) for m in nodes}
    if len(sizes) != 1 or sorted(r for m in nodes for r in m) != list(range(world)):
        raise ValueError(f"{op}: hierarchical ring layout {nodes} must hold each of the "
                         f"{world} TP ranks once, the same number per node; use ring_order flat")


def _ring(tp: Transport, g, o, wt, steps: list[list[int]], *, step: int, chunk: int,
          right: int, left: int, st: ChunkStreams, op: str, gemm: Gemm,
          arrived: Sequence[Handle] = ()) -> None:
    """Ring `steps` (the row blocks each step multiplies) around the node's ranks: while
    a step's GEMMs run, what it holds goes right and the next step's blocks come from
    the left. `step` / `chunk`: the first step's index (it picks the GEMM stream) and
    its first GEMM's chunk id; a transfer carries the chunk id of the GEMM that needs
    it. `arrived`: transfers the first step's blocks wait for; that wait, and the
    forwarding of what arrived, go on the first step's stream (the transport orders
    its copies after the stream that issues them)."""
    for t, blocks in enumerate(steps):
        nxt = steps[t + 1] if t + 1 < len(steps) else None
        pending: list[Handle] = []
        with st.chunk(step + t) if arrived and t == 0 else contextlib.nullcontext():
            for h in arrived if t == 0 else ():
                h.wait()
            for j, (a, b) in enumerate(zip(blocks, nxt or ())):
                pending.append(tp.exchange([(g[a], right)], [(g[b], left)], op=op,
                                           chunk=chunk + len(blocks) + j))
        with st.chunk(step + t):
            for j, b in enumerate(blocks):
                gemm(g[b], wt, o[b], op=op, chunk=chunk + j)
        if pending:
            with st.chunk(step + t + 1):
                for h in pending:
                    h.wait()
        chunk += len(blocks)


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, tp: Transport, nodes: Layout, *, op: str,
                      streams: ChunkStreams | None = None, out: torch.Tensor | None = None,
                      gemm: Gemm = matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """all_gather(x) @ w.T in the hierarchical order; returns (output, gathered input),
    both in rank order. GEMM chunk ids count GEMMs in the order they run."""
    world, rank, rows = tp.world_size, tp.rank, x.shape[0]
    _check_layout(nodes, world, op)
    me_n, me_l = _position(nodes, rank)
    mine, size = nodes[me_n], len(nodes[me_n])
    others = partners(me_n, len(nodes))
    gathered = tp.workspace((world * rows, x.shape[1]), x.dtype, x.device)
    out = x.new_empty(world * rows, w.shape[0], dtype=out_dtype(gemm, x)) if out is None else out
    g, o, wt = gathered.split(rows), out.split(rows), w.t()
    g[rank].copy_(x)
    ring = dict(right=mine[(me_l + 1) % size], left=mine[(me_l - 1) % size], op=op, gemm=gemm)
    with streams or plain() as st:
        # 1. The slow link first: the own block to every counterpart (the same local
        #    index on each other node), theirs back; in flight under everything below.
        inter = [tp.exchange([(g[rank], nodes[m][me_l])], [(g[nodes[m][me_l]], nodes[m][me_l])],
                             op=op, chunk=size + i) for i, m in enumerate(others)]
        # 2. The node's own blocks, one per step.
        _ring(tp, g, o, wt, [[mine[(me_l - s) % size]] for s in range(size)], step=0, chunk=0,
              st=st, **ring)
        # 3. The other nodes' blocks: wait for the counterparts', then ring them in the
        #    node, one block per other node per step.
        _ring(tp, g, o, wt, [[nodes[m][(me_l - s) % size] for m in others] for s in range(size)],
              step=size, chunk=size, st=st, arrived=inter, **ring)
    return out, gathered


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, tp: Transport, nodes: Layout, *,
                          op: str, streams: ChunkStreams | None = None,
                          out: torch.Tensor | None = None, gemm: Gemm = matmul) -> torch.Tensor:
    """reduce_scatter(x @ w.T) over row blocks in the hierarchical order: returns this
    rank's [rows, n] block summed over ranks. Each node's partials are summed in one
    reduction (fp32 accumulation, one rounding: torch's sum), and the node partials in
    another, so a bf16 result is rounded twice, whatever the sizes. GEMM chunk ids count
    GEMMs in order; a transfer's chunk id is that of the GEMM whose partial it carries
    (a node partial: the last GEMM of its round)."""
    world, rank, n = tp.world_size, tp.rank, w.shape[0]
    _check_layout(nodes, world, op)
    if x.shape[0] % world:
        raise ValueError(f"{op}: {x.shape[0]} rows do not split into {world} TP ranks; "
                         f"pick a sequence length so that it divides")
    rows, n_nodes = x.shape[0] // world, len(nodes)
    me_n, me_l = _position(nodes, rank)
    mine, size = nodes[me_n], len(nodes[me_n])
    blocks, wt = x.split(rows), w.t()
    dtype = out_dtype(gemm, x, out)  # the partials' (never FP8)
    # per round k, slot s < size - 1: the partial local rank me_l - s - 1 sent; the last:
    # this rank's own; node_in[m]: node m's partial of this rank's block (its own: here)
    node_slots = tp.workspace((n_nodes, size, rows, n), dtype, x.device)
    node_in = tp.workspace((n_nodes, rows, n), dtype, x.device)
    sent = x.new_empty(n_nodes, size - 1, rows, n, dtype=dtype)  # caller's stream
    node_out = x.new_empty(n_nodes - 1, rows, n, dtype=dtype)
    out = x.new_empty(rows, n, dtype=dtype) if out is None else out
    inter: list[Handle] = []
    with streams or plain() as st:
        # 1. Every other node's blocks, in pairing order: reduce-scatter them in this
        #    node (point to point, `send_partials`), then send the node's partial to its
        #    owner (the same local index there).
        # 2. The own node's blocks last, hiding those sends.
        order = partners(me_n, n_nodes) + [me_n]
        for k, m in enumerate(order):
            last = k * size + size - 1
            arriving = send_partials(tp, [blocks[r] for r in nodes[m]], wt, mine, me_l,
                                     node_slots[k], sent[k], chunk=k * size, st=st, op=op,
                                     gemm=gemm)
            with st.chunk(last):  # the stream of the round's last GEMM sums and sends
                for h in arriving:
                    h.wait()
                if m == me_n:
                    torch.sum(node_slots[k], dim=0, out=node_in[me_n])
                    continue
                torch.sum(node_slots[k], dim=0, out=node_out[k])
                inter.append(tp.exchange([(node_out[k], nodes[m][me_l], node_in[me_n])],
                                         [(node_in[m], nodes[m][me_l])], op=op, chunk=last))
        # 3. The node partials of the own block, summed in one reduction.
        with st.chunk(n_nodes * size - 1):
            for h in inter:
                h.wait()
            torch.sum(node_in, dim=0, out=out)
    return out

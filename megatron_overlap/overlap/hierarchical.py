"""Hierarchical ring orders for a TP group of N nodes x L local ranks.

The flat ring sends every block over every link in turn, so in a group that spans
nodes each step waits on the slowest link. These orders start the inter-node
transfers first and keep them in flight under the most compute:

- AG->GEMM: send the own block to its counterparts (same local index) on the other
  nodes; ring the node's own L blocks (GEMM each as it arrives); only then wait for
  the remote blocks, and ring those among the L local ranks (GEMM as they arrive).
- GEMM->RS: for each other node, ring-reduce-scatter its L blocks' partials among
  the local ranks and send the node-partial to the counterpart at once; then the
  own node's ring (hiding those sends); finally add the incoming node-partials in
  node order (the same order on every rank).

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
from .gemm import Gemm, matmul
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


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, tp: Transport, nodes: Layout, *, op: str,
                      streams: ChunkStreams | None = None, out: torch.Tensor | None = None,
                      gemm: Gemm = matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """all_gather(x) @ w.T in the hierarchical order; returns (output, gathered input),
    both in rank order. GEMM chunk ids count GEMMs in the order they run; a transfer's
    chunk id is that of the first GEMM that needs it."""
    world, rank, rows = tp.world_size, tp.rank, x.shape[0]
    _check_layout(nodes, world, op)
    n_nodes, size = len(nodes), len(nodes[0])
    me_n, me_l = _position(nodes, rank)
    mine = nodes[me_n]
    right, left = mine[(me_l + 1) % size], mine[(me_l - 1) % size]
    others = partners(me_n, n_nodes)
    gathered = tp.workspace((world * rows, x.shape[1]), x.dtype, x.device)
    out = x.new_empty(world * rows, w.shape[0]) if out is None else out
    g, o, wt = gathered.split(rows), out.split(rows), w.t()
    g[rank].copy_(x)
    local = [[mine[(me_l - s) % size]] for s in range(size)]
    remote = [[nodes[m][(me_l - s) % size] for m in others] for s in range(size)]
    steps = local + remote  # the blocks each step multiplies
    first = [sum(len(b) for b in steps[:t]) for t in range(len(steps))]  # chunk id of a step
    with streams or plain() as st:
        # The slow link first: the own block to every counterpart, theirs back.
        inter = [tp.exchange([(g[rank], nodes[m][me_l])], [(g[nodes[m][me_l]], nodes[m][me_l])],
                             op=op, chunk=first[size] + i) for i, m in enumerate(others)]
        pending: list[Handle] = []
        for t, blocks in enumerate(steps):
            nxt = t + 1 if t + 1 < len(steps) and t + 1 != size else None
            # The node's own blocks are done: wait for the remote ones, and forward them from
            # the stream that waited (the intra transport orders its copies after that stream).
            with st.chunk(t) if t == size else contextlib.nullcontext():
                if t == size:
                    for h in inter:
                        h.wait()
                if nxt is not None:  # forward what this step holds, receive the next step's
                    pending = [tp.exchange([(g[a], right)], [(g[b], left)], op=op,
                                           chunk=first[nxt] + j)
                               for j, (a, b) in enumerate(zip(blocks, steps[nxt]))]
            with st.chunk(t):
                for j, b in enumerate(blocks):
                    gemm(g[b], wt, o[b], op=op, chunk=first[t] + j)
            if nxt is not None:
                with st.chunk(nxt):
                    for h in pending:
                        h.wait()
    return out, gathered


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, tp: Transport, nodes: Layout, *,
                          op: str, streams: ChunkStreams | None = None,
                          out: torch.Tensor | None = None, gemm: Gemm = matmul) -> torch.Tensor:
    """reduce_scatter(x @ w.T) over row blocks in the hierarchical order: returns this
    rank's [rows, n] block summed over ranks. GEMM chunk ids count GEMMs in order; a
    transfer's chunk id is that of the GEMM whose (partial) sum it carries."""
    world, rank, n = tp.world_size, tp.rank, w.shape[0]
    _check_layout(nodes, world, op)
    if x.shape[0] % world:
        raise ValueError(f"{op}: {x.shape[0]} rows do not split into {world} TP ranks; "
                         f"pick a sequence length so that it divides")
    rows = x.shape[0] // world
    n_nodes, size = len(nodes), len(nodes[0])
    me_n, me_l = _position(nodes, rank)
    mine = nodes[me_n]
    right, left = mine[(me_l + 1) % size], mine[(me_l - 1) % size]
    rounds = partners(me_n, n_nodes) + [me_n]  # other nodes first, the own node last
    blocks, wt = x.split(rows), w.t()
    ring_in = tp.workspace((n_nodes * max(size - 1, 1), rows, n), x.dtype, x.device).unbind(0)
    node_in = tp.workspace((n_nodes, rows, n), x.dtype, x.device).unbind(0)  # by sending node
    out = x.new_empty(rows, n) if out is None else out
    # running sums on the caller's stream; with one node the last one is the result
    accs = [*x.new_empty(world - (n_nodes == 1), rows, n).unbind(0)] + ([out] if n_nodes == 1 else [])
    inter: list[Handle] = []
    t = 0
    with streams or plain() as st:
        for k, m in enumerate(rounds):
            handle = None
            for s in range(size):
                with st.chunk(t):
                    acc = accs[t]
                    gemm(blocks[nodes[m][(me_l - s - 1) % size]], wt, acc, op=op, chunk=t)
                    if handle is not None:
                        handle.wait()
                        acc += ring_in[k * (size - 1) + s - 1]
                    if s + 1 < size:
                        slot = ring_in[k * (size - 1) + s]
                        handle = tp.exchange([(acc, right, slot)], [(slot, left)], op=op, chunk=t)
                    elif m != me_n:  # node m's partial of block (m, me_l): off to its owner
                        peer = nodes[m][me_l]
                        inter.append(tp.exchange([(acc, peer, node_in[me_n])],
                                                 [(node_in[m], peer)], op=op, chunk=t))
                t += 1
        if n_nodes == 1:
            return out
        with st.chunk(t - 1):
            for h in inter:
                h.wait()
            parts = [accs[t - 1] if m == me_n else node_in[m] for m in range(n_nodes)]
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)
    return out

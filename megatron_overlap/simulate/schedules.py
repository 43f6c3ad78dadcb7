"""The overlap schedules as megatron_overlap.overlap runs them, replayed on a Sim.

- ring AG->GEMM: start(i+1), gemm(i), wait(i+1); a block is forwarded once it
  has arrived; `aggregate` runs both ring directions (two blocks a step, half
  the steps). Same step structure as overlap.ag_gemm.ring_steps.
- ring GEMM->RS: gemm(s), wait(s-1), add, send(s) to the right; the last step
  lands on the own block (overlap.gemm_rs.ring_exchange).
- pipeline GEMM->RS: chunk i's reduce-scatter (a collective) starts after its
  GEMM and runs under chunk i+1's GEMM; collectives queue on the links.
- bulk: one collective launched before a GEMM that does not need it.
- hierarchical (TP = nodes x local; overlap.hierarchical): AG sends the own
  block over IB to the same-local-index rank of every other node first, rings
  the node's blocks meanwhile, then rings the blocks that came over IB; RS
  ring-reduces, per other node, the partials bound there and sends each
  node-partial over IB, then ring-reduces the own node's blocks under that
  transfer and adds what arrived. A pipelined reduce-scatter over nodes runs
  this same hierarchical ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from .timeline import Sim
from ..overlap.ag_gemm import ring_steps  # the orders exactly as the code runs them
from ..overlap.hierarchical import partners


@dataclass(frozen=True)
class Work:
    """Per-step costs of one pass on this machine."""

    gemm_us: float  # one chunk's GEMM (a block of rows)
    block_bytes: float  # one rank's block of the communicated tensor
    step_us: float  # eager host time per chunk GEMM launched
    add_us: float = 0.0  # a reduce-scatter's `acc += incoming` of one block


def ring_ag(sim: Sim, members: list[int], work: Work, aggregate: bool,
            ready: list[float] | None = None, per_item: int = 1) -> None:
    """Ring all-gather + GEMM over `members` (ring order). Position p starts with item p,
    ready at ready[p]; an item is `per_item` blocks, each moved and multiplied on its own
    (the hierarchical order's remote ring holds one block per other node)."""
    size = len(members)
    steps = [ring_steps(p, size, aggregate) for p in range(size)]
    have = {(p, p): (ready[p] if ready else 0.0) for p in range(size)}
    for i in range(len(steps[0])):
        if i + 1 < len(steps[0]):
            for p in range(size):
                for _ in range(per_item * len(steps[p][i + 1])):
                    sim.launch_comm(members[p])
            for p in range(size):
                for b in steps[p][i + 1]:
                    from_left = b == (p - i - 1) % size
                    src = (p - 1) % size if from_left else (p + 1) % size
                    have[(p, b)] = max(sim.transfer(members[src], members[p], work.block_bytes,
                                                    after=have[(src, b)]) for _ in range(per_item))
        for p in range(size):
            r = members[p]
            for b in steps[p][i]:
                for _ in range(per_item):
                    sim.launch(r, work.step_us)
                    sim.compute(r, work.gemm_us, after=have[(p, b)])


def ring_rs(sim: Sim, members: list[int], work: Work) -> list[float]:
    """Ring GEMM + reduce-scatter over `members`; returns when each position's own
    (reduced over the members) block is complete."""
    size = len(members)
    arrived: dict[tuple[int, int], float] = {}
    done = [0.0] * size
    for s in range(size):
        for p in range(size):
            r = members[p]
            sim.launch(r, work.step_us)
            t = sim.compute(r, work.gemm_us)
            if s > 0:
                t = sim.compute(r, work.add_us, after=arrived[(p, s - 1)])
            if s + 1 < size:
                sim.launch_comm(r)
                right = (p + 1) % size
                arrived[(right, s)] = sim.transfer(r, members[right], work.block_bytes, after=t)
            done[p] = t
    return done


def node_members(sim: Sim) -> list[list[int]]:
    local = sim.layout.local
    return [list(range(n * local, (n + 1) * local)) for n in range(sim.layout.nodes)]


def hierarchical_ag(sim: Sim, work: Work) -> None:
    """The own block to every counterpart over IB first; the node's ring (one direction)
    meanwhile; then, once the remote blocks are in, a ring over them (one block per
    other node a step). overlap.hierarchical has no aggregate."""
    nodes, local = sim.layout.nodes, sim.layout.local
    arrival = [0.0] * sim.layout.tp  # when the last IB block a rank waits for lands
    for r in range(sim.layout.tp):
        n, l = divmod(r, local)
        for m in partners(n, nodes):
            sim.launch_comm(r)
            dst = m * local + l
            arrival[dst] = max(arrival[dst], sim.transfer(r, dst, work.block_bytes))
    groups = node_members(sim)
    for members in groups:
        ring_ag(sim, members, work, aggregate=False)
    for members in groups:
        ring_ag(sim, members, work, aggregate=False, ready=[arrival[r] for r in members],
                per_item=nodes - 1)


def hierarchical_rs(sim: Sim, work: Work) -> None:
    """Per other node (in pairing order) a ring reduce-scatter of the partials bound
    there, each node-partial sent over IB as soon as it is reduced; the own node's ring
    last; then the node-partials that arrived are added (nodes - 1 adds)."""
    nodes, local = sim.layout.nodes, sim.layout.local
    incoming: dict[int, float] = {}
    for n, members in enumerate(node_members(sim)):
        for target in partners(n, nodes):
            done = ring_rs(sim, members, work)
            for p, r in enumerate(members):
                sim.launch_comm(r)
                dst = target * local + p
                incoming[dst] = max(incoming.get(dst, 0.0),
                                    sim.transfer(r, dst, work.block_bytes, after=done[p]))
        ring_rs(sim, members, work)
    for r in range(sim.layout.tp):
        for _ in range(nodes - 1):
            sim.compute(r, work.add_us, after=incoming.get(r, 0.0))


def pipeline_rs(sim: Sim, work: Work, splits: int, chunk_block_bytes: float) -> None:
    """`splits` chunk GEMMs (work.gemm_us each, on every rank), each followed by its
    reduce-scatter collective (chunk_block_bytes per rank)."""
    for _ in range(splits):
        ends = []
        for r in range(sim.layout.tp):
            sim.launch(r, work.step_us)
            ends.append(sim.compute(r, work.gemm_us))
        for r in range(sim.layout.tp):
            sim.launch_comm(r)
        sim.collective(chunk_block_bytes, after=max(ends), sms=sim.engine.sms or None)


def bulk(sim: Sim, gemm_us: float, block_bytes: float) -> None:
    """A collective launched first, then one GEMM that runs beside it (two launches,
    no schedule loop: each costs the host what a collective launch does)."""
    for r in range(sim.layout.tp):
        sim.launch_comm(r)
    sim.collective(block_bytes, sms=sim.engine.sms or None)
    for r in range(sim.layout.tp):
        sim.launch_comm(r)
        sim.compute(r, gemm_us)

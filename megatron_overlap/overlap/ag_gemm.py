"""AG->GEMM: `all_gather(x) @ w.T` with the gather hidden under the GEMM.

`x` is this rank's row block ([rows, k]); the result has world_size row blocks in
rank order, like Megatron's all-gather along the sequence dimension. Both schedules
also return the gathered input, which the caller may keep (the backward of a
row-parallel layer reuses the gathered output gradient for its wgrad).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm.transport import Transport
from .gemm import Gemm, matmul, out_dtype
from . import wait_gemm
from .gemm_rs import spans_nodes
from .streams import ChunkStreams, plain


def ring_steps(rank: int, world: int, aggregate: bool) -> list[list[int]]:
    """The row blocks a rank multiplies at each ring step: one GEMM a step (a step's
    blocks are adjacent rows).

    One direction: step s holds block (rank - s); every block but the own one arrives
    from the left neighbour one step after that neighbour used it. `aggregate`
    (Transformer Engine's): the own block, then the pair partner's (rank ^ 1,
    exchanged meanwhile), then whole pairs [2q, 2q + 1], q = rank // 2 - s, each from
    rank - 2, which used it the step before: world / 2 + 1 GEMMs, all but the first two
    of twice the rows (which fill the chip better), for the same bytes moved. An even
    world only (pairs); world 2 is the plain ring."""
    if not aggregate or world <= 2:
        return [[(rank - s) % world] for s in range(world)]
    if world % 2:
        raise ValueError(f"aggregate pairs the ranks of a ring: TP size {world} is odd")
    pair, pairs = rank // 2, world // 2
    return [[rank], [rank ^ 1]] + [[2 * q, 2 * q + 1] for q in
                                   ((pair - s) % pairs for s in range(1, pairs))]


Moves = list[tuple[list[int], int]]  # (adjacent blocks, peer)


def rows_of(t: torch.Tensor, blocks: list[int], rows: int) -> torch.Tensor:
    """The rows of adjacent `blocks` of `t` (`rows` a block)."""
    return t[blocks[0] * rows:(blocks[-1] + 1) * rows]


def ring_moves(rank: int, world: int, aggregate: bool,
               steps: list[list[int]] | None = None) -> list[tuple[Moves, Moves]]:
    """Before each step but the first, what this rank sends and receives (blocks and
    peer) so that the step's blocks have arrived: the blocks it held the step before go
    on, as `ring_steps` says (`steps`: its result, when the caller has it). The plain ring
    forwards to the right and receives from the left; `aggregate` exchanges with its
    partner first, then forwards pairs to rank + 2 and receives from rank - 2."""
    steps = ring_steps(rank, world, aggregate) if steps is None else steps
    if not aggregate or world <= 2:
        return [([(steps[s - 1], (rank + 1) % world)], [(steps[s], (rank - 1) % world)])
                for s in range(1, world)]
    own_pair = sorted(steps[0] + steps[1])
    moves = [([(steps[0], rank ^ 1)], [(steps[1], rank ^ 1)])]
    for s in range(2, len(steps)):
        held = own_pair if s == 2 else steps[s - 1]
        moves.append(([(held, (rank + 2) % world)], [(steps[s], (rank - 2) % world)]))
    return moves


def ring_exchange(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str,
                  aggregate: bool = False, streams: ChunkStreams | None = None,
                  out: torch.Tensor | None = None, gemm: Gemm = matmul
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring all-gather, each step's GEMM run while the next step's blocks are on the
    wire: start(i+1) -> gemm(i) -> wait(i+1), the wait enqueued on the stream that runs
    gemm(i+1). Blocks land in a transport workspace ([world * rows, k], valid until the
    transport's next pass), which is returned. `aggregate`: `ring_steps`' pairs."""
    world, rank, rows = tp.world_size, tp.rank, x.shape[0]
    gathered = tp.workspace((world * rows, x.shape[1]), x.dtype, x.device)
    out = x.new_empty(world * rows, w.shape[0], dtype=out_dtype(gemm, x)) if out is None else out
    wt = w.t()
    gathered[rank * rows:(rank + 1) * rows].copy_(x)
    steps = ring_steps(rank, world, aggregate)
    moves = ring_moves(rank, world, aggregate, steps)

    def of(t: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        return rows_of(t, blocks, rows)
    with streams or plain() as st:
        for i, blocks in enumerate(steps):
            handle = None
            if i + 1 < len(steps):
                sends, recvs = moves[i]
                handle = tp.exchange([(of(gathered, b), peer) for b, peer in sends],
                                     [(of(gathered, b), peer) for b, peer in recvs],
                                     op=op, chunk=i + 1)
            with st.chunk(i):
                gemm(of(gathered, blocks), wt, of(out, blocks), op=op, chunk=i)
            if handle is not None:
                with st.chunk(i + 1):
                    handle.wait()
    return out, gathered


def ring_waiting(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str,
                 aggregate: bool = False, sm_margin: int = 0, out: torch.Tensor | None = None,
                 gemm: Gemm = matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's transfers (`ring_steps` / `ring_moves`, as `ring_exchange`) and one GEMM
    over the whole gathered input whose tiles wait for their block (`overlap.wait_gemm`).
    The transfers are issued from a side stream, which waits on each step's handle before
    the next step (whose sends forward what it received) and flags the step's blocks; then
    the GEMM is queued on the caller's stream, which joins the side stream after it. The
    caller checked `wait_gemm.why_not`."""
    world, rank, rows = tp.world_size, tp.rank, x.shape[0]
    gathered = tp.workspace((world * rows, x.shape[1]), x.dtype, x.device)
    out = x.new_empty(world * rows, w.shape[0], dtype=out_dtype(gemm, x)) if out is None else out
    steps = ring_steps(rank, world, aggregate)
    moves = ring_moves(rank, world, aggregate, steps)
    ready = wait_gemm.flags(x.device, world)
    order = wait_gemm.arrival_order(x.device, [b for blocks in steps for b in blocks])
    gathered[rank * rows:(rank + 1) * rows].copy_(x)
    ready.zero_()
    wait_gemm.set_flag(ready, rank)
    side = wait_gemm.FlagSide(x.device)
    with side:  # each step issued once the previous one has landed, then its blocks flagged
        for i, (sends, recvs) in enumerate(moves):
            tp.exchange([(rows_of(gathered, b, rows), peer) for b, peer in sends],
                        [(rows_of(gathered, b, rows), peer) for b, peer in recvs], op=op,
                        chunk=i + 1).wait()
            for b in steps[i + 1]:
                wait_gemm.set_flag(ready, b)
    wait_gemm.launch(gathered, w.t(), out, ready, order, rows, gemm, op=op,
                     timeout_s=tp.timeout.total_seconds(), sm_margin=sm_margin)
    side.join()
    return out, gathered


def bulk(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str,
         out: torch.Tensor | None = None, gemm: Gemm = matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather everything, then one GEMM: no overlap at all (the plain path, for layers
    where nothing else is there to hide the gather under). Not ub_cfgs' `bulk`, which
    exists only on the column backward and hides the whole collective under another
    GEMM (`overlap.bulk.hide`; `config.names.BULK_HIDES`)."""
    gathered = x.new_empty(tp.world_size * x.shape[0], x.shape[1])
    tp.all_gather(gathered, x, op=op).wait()
    if out is None:
        out = x.new_empty(gathered.shape[0], w.shape[0], dtype=out_dtype(gemm, x))
    gemm(gathered, w.t(), out, op=op)
    return out, gathered


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, tp: Transport, method: str, *,
                      op: str, aggregate: bool = False, streams: ChunkStreams | None = None,
                      nodes: Sequence[Sequence[int]] | None = None,
                      out: torch.Tensor | None = None, gemm: Gemm = matmul, wait: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on the layer's `method`; returns (output, gathered input). `nodes`: the
    group's ranks per node, for the hierarchical ring order (None or one node: flat).
    `out`: where the output goes ([world * rows, n]; new when None). `wait`: the ring's
    GEMM as one kernel that waits per block (`ring_waiting`), where it can run."""
    if method == "ring_exchange" and wait:
        why = ("the group spans nodes: its ring runs the hierarchical order" if spans_nodes(nodes)
               else "its output's rows are not contiguous" if out is not None and out.stride(-1) != 1
               else wait_gemm.why_not(x, w.t(), gemm, tp.why_no_wait, x.shape[0], tp.world_size))
        if why is None:
            return ring_waiting(x, w, tp, op=op, aggregate=aggregate, out=out, gemm=gemm,
                                sm_margin=streams.sm_margin if streams is not None else 0)
        wait_gemm.fall_back(op, why)
    if method == "ring_exchange" and spans_nodes(nodes):
        from . import hierarchical
        return hierarchical.all_gather_matmul(x, w, tp, nodes, op=op, streams=streams, out=out,
                                              gemm=gemm)
    if method == "ring_exchange":
        return ring_exchange(x, w, tp, op=op, aggregate=aggregate, streams=streams, out=out,
                             gemm=gemm)
    if method == "bulk":
        return bulk(x, w, tp, op=op, out=out, gemm=gemm)
    raise ValueError(f"{op}: method '{method}' cannot overlap an all-gather with a GEMM; "
                     f"use ring_exchange or bulk")

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
from .streams import ChunkStreams, plain


def ring_steps(rank: int, world: int, aggregate: bool) -> list[list[int]]:
    """The row blocks a rank multiplies at each ring step.

    One direction: step s holds block (rank - s); every block but the own one
    arrives from the left neighbour one step after that neighbour used it.
    `aggregate`: both directions at once, (rank - s) from the left and
    (rank + s) from the right, so two blocks per step and half the steps.
    """
    if not aggregate:
        return [[(rank - s) % world] for s in range(world)]
    steps, seen = [], set()
    for s in range(world // 2 + 1):
        blocks = [b for b in dict.fromkeys([(rank - s) % world, (rank + s) % world]) if b not in seen]
        seen.update(blocks)
        if blocks:
            steps.append(blocks)
    return steps


def ring_exchange(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str,
                  aggregate: bool = False, streams: ChunkStreams | None = None,
                  out: torch.Tensor | None = None, gemm: Gemm = matmul
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring all-gather, one block per step, each block's GEMM run while the next
    block is on the wire: start(i+1) -> gemm(i) -> wait(i+1), the wait enqueued on
    the stream that runs gemm(i+1). Blocks land in a transport workspace
    ([world * rows, k], valid until the transport's next pass), which is returned."""
    world, rank, rows = tp.world_size, tp.rank, x.shape[0]
    gathered = tp.workspace((world * rows, x.shape[1]), x.dtype, x.device)
    out = x.new_empty(world * rows, w.shape[0], dtype=out_dtype(gemm, x)) if out is None else out
    g_blocks, out_blocks, wt = gathered.split(rows), out.split(rows), w.t()  # views made once
    g_blocks[rank].copy_(x)
    steps = ring_steps(rank, world, aggregate)
    with streams or plain() as st:
        for i, blocks in enumerate(steps):
            handle = None
            if i + 1 < len(steps):
                sends, recvs = [], []
                for b in steps[i + 1]:  # what arrives next, and from which side
                    from_left = b == (rank - i - 1) % world
                    # The block this rank forwards in the same direction is the one it holds now.
                    fwd = (rank - i) % world if from_left else (rank + i) % world
                    sends.append((g_blocks[fwd], tp.right if from_left else tp.left))
                    recvs.append((g_blocks[b], tp.left if from_left else tp.right))
                handle = tp.exchange(sends, recvs, op=op, chunk=i + 1)
            with st.chunk(i):
                for b in blocks:
                    gemm(g_blocks[b], wt, out_blocks[b], op=op, chunk=i)
            if handle is not None:
                with st.chunk(i + 1):
                    handle.wait()
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
                      out: torch.Tensor | None = None, gemm: Gemm = matmul
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on the layer's `method`; returns (output, gathered input). `nodes`: the
    group's ranks per node, for the hierarchical ring order (None or one node: flat).
    `out`: where the output goes ([world * rows, n]; new when None)."""
    if method == "ring_exchange" and nodes is not None and len(nodes) > 1:
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

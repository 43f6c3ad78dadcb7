"""GEMM->RS: `reduce_scatter(x @ w.T)` over rows, with the reduction of one chunk
hidden under the GEMM of the next.

`x` holds all rows ([world * rows, k], row block r belongs to rank r after the
reduction); each rank gets back its own [rows, n] block summed over ranks, like
Megatron's reduce-scatter along the sequence dimension. With `scatter=False` the
reduction is an all-reduce of the whole [world * rows, n] output (tensor
parallelism without sequence parallelism).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..comm.transport import Handle, Transport
from .gemm import Gemm, matmul, out_dtype
from .streams import ChunkStreams, plain

def _check_rows(op: str, total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{op}: {total} rows do not split into {parts} {what}; "
                         f"pick num_splits / a sequence length so that it divides")
    return total // parts


def spans_nodes(nodes: Sequence[Sequence[int]] | None) -> bool:
    """Whether a TP group's ranks span nodes (`nodes`: its ranks per node, or None), where
    its rings and reduce-scatters run `overlap.hierarchical`'s order."""
    return nodes is not None and len(nodes) > 1


def flat_pipeline(method: str, scatter: bool, nodes: Sequence[Sequence[int]] | None) -> bool:
    """Whether `matmul_reduce_scatter` runs `pipeline` with `scatter`, whose chunks can
    read an input laid out chunk-major (`chunk_major=True`)."""
    return method == "pipeline" and scatter and not spans_nodes(nodes)


def pipeline(x: torch.Tensor, w: torch.Tensor, tp: Transport, num_splits: int, *, op: str,
             scatter: bool = True, streams: ChunkStreams | None = None,
             out: torch.Tensor | None = None, gemm: Gemm = matmul,
             chunk_major: bool = False) -> torch.Tensor:
    """num_splits GEMM chunks; each chunk's reduction starts as soon as its GEMM is
    issued and runs under the next chunk's GEMM: gemm(i) -> start(i) -> gemm(i+1) ...
    wait(all). With `scatter`, chunk i is the i-th slice of every rank's row block,
    so its reduce-scatter hands each rank a contiguous slice of its own block. Chunk
    GEMMs write into the transport's workspace, which a symmetric-memory transport
    reduces from without a staging copy. `chunk_major` (with `scatter`): x's rows come
    chunk by chunk ([num_splits, world, sub], `overlap.fp8.chunk_major`), so that each
    chunk is one plain GEMM over adjacent rows (an FP8 GEMM has no batched form)."""
    world, n = tp.world_size, w.shape[0]
    rows = _check_rows(op, x.shape[0], world, "TP ranks")
    wt = w.t()
    if scatter:
        sub = _check_rows(op, rows, num_splits, "pipeline chunks per rank")
        if chunk_major:  # chunk i = [world * sub, k], adjacent rows
            x_chunks = x.view(num_splits, world * sub, x.shape[1]).unbind(0)
            wt_batch = wt
        else:  # chunk i = [world, sub, k] strided view; one batched GEMM reads it in place
            x_chunks = x.view(world, num_splits, sub, x.shape[1]).unbind(1)
            wt_batch = wt.expand(world, *wt.shape)
    else:
        sub = _check_rows(op, x.shape[0], num_splits, "pipeline chunks")
        x_chunks = x.split(sub)
    dtype = out_dtype(gemm, x, out)  # the partial sums' (never FP8)
    out = x.new_empty(num_splits * sub, n, dtype=dtype) if out is None else out
    out_chunks = out.view(num_splits, sub, n).unbind(0)
    handles: list[Handle] = []
    with streams or plain() as st:
        for i in range(num_splits):
            with st.chunk(i):
                if scatter:
                    part = tp.workspace((world, sub, n), dtype, x.device)
                    gemm(x_chunks[i], wt_batch, part.view(world * sub, n) if chunk_major else part,
                         op=op, chunk=i)
                    handles.append(tp.reduce_scatter(out_chunks[i], part.view(world * sub, n),
                                                     op=op, chunk=i))
                else:
                    gemm(x_chunks[i], wt, out_chunks[i], op=op, chunk=i)
                    handles.append(tp.all_reduce(out_chunks[i], op=op, chunk=i))
        for h in handles:
            h.wait()
    return out


def send_partials(tp: Transport, blocks: Sequence[torch.Tensor], wt: torch.Tensor,
                  peers: Sequence[int], me: int, slots: torch.Tensor, sent: torch.Tensor, *,
                  chunk: int, st: ChunkStreams, op: str, gemm: Gemm) -> list[Handle]:
    """The steps of Transformer Engine's point-to-point reduce-scatter among `peers`
    (transport ranks; `blocks[j]`: the rows `peers[j]` reduces; this rank is `peers[me]`):
    step s < len(peers) - 1 computes the partial of block (me + s + 1) into `sent[s]` and
    sends it to that block's peer, into its `slots[s]`, in flight while the next step's
    GEMM runs; the last step computes this rank's own block's partial into `slots[-1]`.
    Returns the transfers into `slots` (the caller sums `slots` once all have arrived).
    GEMM and transfer chunk ids count from `chunk`."""
    size, handles = len(peers), []
    for s in range(size):
        with st.chunk(chunk + s):
            if s + 1 == size:
                gemm(blocks[me], wt, slots[s], op=op, chunk=chunk + s)
                continue
            to = (me + s + 1) % size
            gemm(blocks[to], wt, sent[s], op=op, chunk=chunk + s)
            handles.append(tp.exchange([(sent[s], peers[to], slots[s])],
                                       [(slots[s], peers[(me - s - 1) % size])], op=op,
                                       chunk=chunk + s))
    return handles


def ring_exchange(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str,
                  streams: ChunkStreams | None = None, out: torch.Tensor | None = None,
                  gemm: Gemm = matmul) -> torch.Tensor:
    """Transformer Engine's point-to-point reduce-scatter: at step s < world - 1 a rank
    computes its partial of block (rank + s + 1) and sends it to that block's owner,
    the send in flight while the next step's GEMM runs; the last step computes its own
    block's partial. Then one reduction sums the world partials of its block, landed
    side by side in one workspace: each element read once, accumulated in fp32 (torch's
    sum of a bf16 tensor), rounded once, where running sums forwarded round the ring
    would add world - 1 times, reading twice and rounding each time."""
    world, rank, n = tp.world_size, tp.rank, w.shape[0]
    rows = _check_rows(op, x.shape[0], world, "TP ranks")
    blocks, wt = x.split(rows), w.t()
    if world == 1:
        return gemm(x, wt, out, op=op, chunk=0)
    dtype = out_dtype(gemm, x, out)  # the partials' (never FP8)
    # slot s: the partial sent at step s by rank - s - 1; the last: this rank's own
    parts = tp.workspace((world, rows, n), dtype, x.device)
    sent = x.new_empty(world - 1, rows, n, dtype=dtype)
    with streams or plain() as st:
        handles = send_partials(tp, blocks, wt, range(world), rank, parts, sent, chunk=0,
                                st=st, op=op, gemm=gemm)
        for h in handles:
            h.wait()
    out = x.new_empty(rows, n, dtype=dtype) if out is None else out
    return torch.sum(parts, dim=0, out=out)


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, tp: Transport, method: str,
                          num_splits: int, *, op: str, scatter: bool = True,
                          streams: ChunkStreams | None = None,
                          nodes: Sequence[Sequence[int]] | None = None,
                          out: torch.Tensor | None = None, gemm: Gemm = matmul,
                          chunk_major: bool = False) -> torch.Tensor:
    """Dispatch on the layer's `method`. `nodes`: the group's ranks per node; with more
    than one, pipeline and ring_exchange reduce-scatters run the hierarchical order
    (an all-reduce, `scatter=False`, keeps its pipeline). `out`: where the result goes
    ([rows / world, n] with `scatter`, else [rows, n]; new when None). `chunk_major`: x
    laid out for the pipeline's chunks, only where `flat_pipeline` says it runs."""
    if chunk_major and not flat_pipeline(method, scatter, nodes):
        raise ValueError(f"{op}: an input laid out chunk-major needs the flat pipelined "
                         f"reduce-scatter, not method '{method}' (scatter={scatter})")
    if method in ("pipeline", "ring_exchange") and scatter and spans_nodes(nodes):
        from . import hierarchical
        return hierarchical.matmul_reduce_scatter(x, w, tp, nodes, op=op, streams=streams,
                                                  out=out, gemm=gemm)
    if method == "pipeline" or (method == "ring_exchange" and not scatter):
        return pipeline(x, w, tp, num_splits, op=op, scatter=scatter, streams=streams, out=out,
                        gemm=gemm, chunk_major=chunk_major)
    if method == "ring_exchange":
        return ring_exchange(x, w, tp, op=op, streams=streams, out=out, gemm=gemm)
    if method == "bulk":  # the GEMM, then the whole reduction: no overlap (see ag_gemm.bulk)
        if not scatter:
            full = gemm(x, w.t(), out, op=op)
            tp.all_reduce(full, op=op).wait()
            return full
        full = gemm(x, w.t(), op=op)
        red = full.new_empty(full.shape[0] // tp.world_size, full.shape[1]) if out is None else out
        tp.reduce_scatter(red, full, op=op).wait()
        return red
    raise ValueError(f"{op}: method '{method}' cannot overlap a GEMM with a reduce-scatter; "
                     f"use pipeline or ring_exchange")

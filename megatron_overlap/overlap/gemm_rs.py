"""GEMM->RS: `reduce_scatter(x @ w.T)` over rows, with the reduction of one chunk
hidden under the GEMM of the next.

`x` holds all rows ([world * rows, k], row block r belongs to rank r after the
reduction); each rank gets back its own [rows, n] block summed over ranks, like
Megatron's reduce-scatter along the sequence dimension. With `scatter=False` the
reduction is an all-reduce of the whole [world * rows, n] output (tensor
parallelism without sequence parallelism).
"""

from __future__ import annotations

import torch

from ..comm import trace
from ..comm.transport import Handle, Transport


def _gemm(a: torch.Tensor, w: torch.Tensor, op: str, chunk: int, out: torch.Tensor | None = None):
    trace.record("gemm", op, chunk)
    return torch.matmul(a, w.t(), out=out)


def _check_rows(op: str, total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{op}: {total} rows do not split into {parts} {what}; "
                         f"pick num_splits / a sequence length so that it divides")
    return total // parts


def pipeline(x: torch.Tensor, w: torch.Tensor, tp: Transport, num_splits: int, *, op: str,
             scatter: bool = True) -> torch.Tensor:
    """num_splits GEMM chunks; each chunk's reduction starts as soon as its GEMM is
    issued and runs under the next chunk's GEMM: gemm(i) -> start(i) -> gemm(i+1) ...
    wait(all). With `scatter`, chunk i is the i-th slice of every rank's row block,
    so its reduce-scatter hands each rank a contiguous slice of its own block."""
    world, n = tp.world_size, w.shape[0]
    rows = _check_rows(op, x.shape[0], world, "TP ranks")
    if scatter:
        sub = _check_rows(op, rows, num_splits, "pipeline chunks per rank")
        xs = x.view(world, num_splits, sub, x.shape[1])
        out = x.new_empty(num_splits, sub, n)
    else:
        sub = _check_rows(op, x.shape[0], num_splits, "pipeline chunks")
        out = x.new_empty(num_splits, sub, n)
    handles: list[Handle] = []
    for i in range(num_splits):
        if scatter:
            part = _gemm(xs[:, i], w, op, i).view(world * sub, n)
            handles.append(tp.reduce_scatter(out[i], part, op=op, chunk=i))
        else:
            _gemm(x[i * sub:(i + 1) * sub], w, op, i, out=out[i])
            handles.append(tp.all_reduce(out[i], op=op, chunk=i))
    for h in handles:
        h.wait()
    return out.view(-1, n)


def ring_exchange(x: torch.Tensor, w: torch.Tensor, tp: Transport, *, op: str) -> torch.Tensor:
    """Ring reduce-scatter: at step s a rank computes its partial of block
    (rank - s - 1), adds the running sum that arrived from the left, and sends it
    right; the last step lands on its own block. The send of step s is in flight
    while the GEMM of step s+1 runs: gemm(s+1) -> wait(s)."""
    world, rank, n = tp.world_size, tp.rank, w.shape[0]
    rows = _check_rows(op, x.shape[0], world, "TP ranks")
    block = lambda s: x[((rank - s - 1) % world) * rows:((rank - s - 1) % world + 1) * rows]  # noqa: E731
    handle, incoming, acc = None, None, None
    for s in range(world):
        acc = _gemm(block(s), w, op, s)
        if handle is not None:
            handle.wait()
            acc += incoming
        if s + 1 < world:
            incoming = x.new_empty(rows, n)
            handle = tp.exchange([(acc, tp.right)], [(incoming, tp.left)], op=op, chunk=s)
    return acc


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, tp: Transport, method: str,
                          num_splits: int, *, op: str, scatter: bool = True) -> torch.Tensor:
    """Dispatch on the layer's `method`."""
    if method == "pipeline" or (method == "ring_exchange" and not scatter):
        return pipeline(x, w, tp, num_splits, op=op, scatter=scatter)
    if method == "ring_exchange":
        return ring_exchange(x, w, tp, op=op)
    if method == "bulk":
        out = _gemm(x, w, op, 0)
        red = out.new_empty(out.shape[0] // tp.world_size, out.shape[1]) if scatter else out
        (tp.reduce_scatter(red, out, op=op) if scatter else tp.all_reduce(out, op=op)).wait()
        return red
    raise ValueError(f"{op}: method '{method}' cannot overlap a GEMM with a reduce-scatter; "
                     f"use pipeline or ring_exchange")

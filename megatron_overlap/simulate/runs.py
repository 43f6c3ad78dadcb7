"""A layer pass's overlap schedule as the layer runs it, for the cost model: the
schedule functions of `overlap` (and, for the backward's bulk overlaps and a
column dgrad under rs_dgrad, `overlap.hide` around them, in the order
`layers.functions` composes them), on one rank's transport and GEMM seam. The
model runs it on the modelled transport over meta tensors; tests run the same
thing on a real transport."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..comm.transport import Transport
from ..overlap import Gemm, all_gather_matmul, hide, matmul, matmul_reduce_scatter
from .transport import Event, meta_empty, record


@dataclass(frozen=True)
class Run:
    """One pass's schedule and shapes: all `run_schedule` reads. A Run issues the same
    events whatever the machine, so `recorded` makes them once."""

    name: str  # the layer pass (ub_cfgs name)
    schedule: str  # passes.schedule_of(): ag_ring | ag_hier | rs_* | bulk
    method: str
    comm: str  # the pass's collective: ag | rs
    tp: int
    local: int  # TP ranks per node
    gemm: tuple[int, int, int]  # the pass's GEMM (m, k, n)
    block: tuple[int, int]  # one rank's block of the communicated tensor (rows, width)
    aggregate: bool = False
    splits: int = 1
    gather: bool = False  # a column dgrad's input all-gather runs alongside (rs_dgrad)
    dtype: torch.dtype = torch.bfloat16  # outputs, partial sums, reductions
    a_dtype: torch.dtype | None = None  # the GEMM's first operand (AG->GEMM gathers it); None: dtype
    tail: int = 0  # bytes after each row of that operand (a row-wise FP8 scale)
    gather_dtype: torch.dtype | None = None  # a column dgrad's gather of the input (None: dtype)


def run_schedule(run: Run, tp: Transport, gemm: Gemm = matmul, device: str = "meta") -> None:
    """One rank's part of `run` on `tp` with `gemm`, on `device` tensors of the pass's
    shapes and dtypes (meta: no memory, no data)."""
    m, k, n = run.gemm
    world, op = tp.world_size, run.name
    a_dtype, tail = run.a_dtype or run.dtype, run.tail
    g_dtype = run.gather_dtype or run.dtype

    def empty(*shape: int, dtype: torch.dtype = run.dtype) -> torch.Tensor:
        if device == "meta":
            return meta_empty(*shape, dtype=dtype)
        return torch.randn(*shape, device=device).to(dtype)

    nodes = [list(range(i, i + run.local)) for i in range(0, world, run.local)] \
        if run.schedule.endswith("hier") else None
    rows, width = run.block
    moved = g_dtype if run.comm == "ag" or run.gather else run.dtype
    block, full = empty(rows, width, dtype=moved), empty(world * rows, width, dtype=moved)

    def gather():
        return tp.all_gather(full, block, op=op)

    def reduce_scatter():
        return tp.reduce_scatter(block, full, op=op)

    def gemm_rs():
        return matmul_reduce_scatter(empty(m, k + tail, dtype=a_dtype), empty(n, k, dtype=a_dtype),
                                     tp, run.method, run.splits, op=op, nodes=nodes, gemm=gemm)

    if run.schedule == "bulk":  # the backward's bulk overlap: the collective under the GEMM
        a, b = empty(m, k + tail, dtype=a_dtype), empty(k, n, dtype=a_dtype)
        hide(gather if run.comm == "ag" else reduce_scatter, lambda: gemm(a, b, op=op),
             overlap=True)
    elif run.schedule.startswith("ag"):
        all_gather_matmul(empty(m // world, k + tail, dtype=a_dtype), empty(n, k, dtype=a_dtype),
                          tp, run.method, op=op, aggregate=run.aggregate, nodes=nodes, gemm=gemm)
    elif run.gather:
        hide(gather, gemm_rs, overlap=True)
    else:
        gemm_rs()


@functools.lru_cache(maxsize=512)
def recorded(run: Run) -> tuple[tuple[Event, ...], ...]:
    """What every rank of `run` issues (simulate.transport.record)."""
    return tuple(tuple(events) for events in record(lambda tp, gemm: run_schedule(run, tp, gemm),
                                                     run.tp, run.dtype, run.tail))

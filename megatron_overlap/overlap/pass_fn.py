"""One layer pass run the way a layer runs it, for the tools that time or compare
schedules (the compute-side benchmark, the tuner's one-GPU mode, the per-layer
A/B arms): open the transport's pass, run the schedule into an output allocated
once, optionally captured once and replayed (`overlap.replay`, as the layers do on
a replayable transport). The one place those tools get a schedule from."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..comm.transport import Transport
from .ag_gemm import all_gather_matmul
from .gemm import Gemm, matmul, out_dtype
from .gemm_rs import matmul_reduce_scatter
from .replay import PassGraphs
from .streams import ChunkStreams


def pass_fn(x: torch.Tensor, w: torch.Tensor, tp: Transport, op: str, method: str, splits: int,
            *, name: str, streams: ChunkStreams | None = None, aggregate: bool = False,
            nodes: Sequence[Sequence[int]] | None = None, replay: bool = False,
            gemm: Gemm = matmul, wait: bool = False) -> Callable[[], torch.Tensor]:
    """A closure running one pass; returns its output (the same tensor every call).
    op "ag": `x` is this rank's row block, gathered under the GEMM; "rs": `x` holds all
    rows, reduce-scattered (`splits`: pipeline chunks). `nodes`: the ranks per node of
    the hierarchical order (None: flat). `gemm`: the GEMM seam (an FP8 one for FP8
    operands; the output then in its `out_dtype`). `wait`: a ring all-gather's one
    waiting GEMM (the `wait_gemm` key)."""
    rows = x.shape[0] * tp.world_size if op == "ag" else x.shape[0] // tp.world_size
    out = x.new_empty(rows, w.shape[0], dtype=out_dtype(gemm, x))

    def body() -> None:
        tp.begin_pass(name)
        if op == "ag":
            all_gather_matmul(x, w, tp, method, op=name, aggregate=aggregate, streams=streams,
                              nodes=nodes, out=out, gemm=gemm, wait=wait)
        else:
            matmul_reduce_scatter(x, w, tp, method, splits, op=name, streams=streams,
                                  nodes=nodes, out=out, gemm=gemm)

    if not replay:
        def run() -> torch.Tensor:
            body()
            return out
        return run
    graphs = PassGraphs(name)

    def replayed() -> torch.Tensor:
        graphs.run(tp, body, (x, w, out))
        return out
    replayed.graphs = graphs  # type: ignore[attr-defined]  # its replay count, for the benchmarks
    return replayed

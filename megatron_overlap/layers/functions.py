"""Autograd functions of the overlapped TP linears. Each pass calls one overlap
schedule (or the plain order when its plan says None); tensors are Megatron's
[sequence, batch, hidden], flattened to rows, with sequence blocks in rank order."""

from __future__ import annotations

import torch

from ..comm.transport import Transport
from ..config import LayerSettings
from ..config.effects import CAPS
from ..overlap import all_gather_matmul, gemm, hide, matmul_reduce_scatter
from ..overlap.streams import ChunkStreams
from .plan import LayerPlan
from .wgrad import weight_grad


def _gather(x: torch.Tensor, tp: Transport, op: str):
    out = x.new_empty(tp.world_size * x.shape[0], x.shape[1])
    return out, (lambda: tp.all_gather(out, x, op=op))


def _name(s, fallback: str) -> str:
    return s.name if s is not None else fallback


def _begin(tp: Transport, s: LayerSettings | None, fallback: str) -> tuple[str, ChunkStreams | None]:
    """Open the transport's pass for this layer pass; the GEMM streams its settings ask for."""
    name = _name(s, fallback)
    if s is None:
        tp.begin_pass(name)
        return name, None
    comm_p = gemm_p = 0
    if torch.cuda.is_available():
        comm_p, gemm_p = s.stream_priorities(*torch.cuda.Stream.priority_range())
    tp.begin_pass(name, comm_p)
    held = any(CAPS[b].sm_margin for b in tp.backends if b in CAPS)  # some link's kernels need SMs
    margin = s.num_sm if s.set_sm_margin and held else 0
    return name, ChunkStreams(priority=gemm_p, sm_margin=margin)


class ColumnParallelMatmul(torch.autograd.Function):
    """Y = gather_sp(X) @ W^T (+ b). X: [s/tp or s, b, k]. layouts: per pass, the
    hierarchical ring layout (ranks per node) or None for the flat ring."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, tp: Transport, fuse_wgrad: bool, allreduce_dgrad: bool,
                layouts: dict | None = None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad, ctx.allreduce_dgrad = plan, tp, fuse_wgrad, allreduce_dgrad
        ctx.layouts = layouts = layouts or {}
        ctx.use_bias = bias is not None
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        op, streams = _begin(tp, plan.fprop, "fprop")
        if plan.sequence_parallel and plan.fprop is not None:
            out, _ = all_gather_matmul(x2, weight, tp, plan.fprop.method, op=op,
                                       aggregate=plan.fprop.aggregate, streams=streams,
                                       nodes=layouts.get("fprop"))
        elif plan.sequence_parallel:
            full, start = _gather(x2, tp, op)
            start().wait()
            out = gemm(full, weight.t(), op=op)
        else:
            out = gemm(x2, weight.t(), op=op)
        if bias is not None:
            out = out + bias
        return out.view(out.shape[0] // x2.shape[0] * x.shape[0], *x.shape[1:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, tp = ctx.plan, ctx.tp
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dname, streams = _begin(tp, plan.dgrad, "dgrad")
        wname = _name(plan.wgrad, "wgrad")
        wgrad = lambda inp: weight_grad(weight, g, inp, ctx.fuse_wgrad,  # noqa: E731
                                        lambda a, b: gemm(a, b, op=wname))
        if plan.sequence_parallel and plan.rs_dgrad:
            # dgrad is a GEMM->RS; the input's all-gather for wgrad runs alongside it.
            full, start = _gather(x2, tp, dname)
            handle = start()
            grad_in = matmul_reduce_scatter(g, weight.t(), tp, plan.dgrad.method,
                                            plan.dgrad.splits(tp.world_size), op=dname,
                                            streams=streams, nodes=ctx.layouts.get("dgrad"))
            handle.wait()
            grad_w = wgrad(full)
        elif plan.sequence_parallel:
            full, start = _gather(x2, tp, dname)
            dgrad = hide(start, lambda: gemm(g, weight, op=dname), op=dname,
                         overlap=plan.dgrad is not None)
            grad_in = dgrad.new_empty(x2.shape)
            grad_w = hide(lambda: tp.reduce_scatter(grad_in, dgrad, op=wname), lambda: wgrad(full),
                          op=wname, overlap=plan.wgrad is not None)
        else:
            grad_in = gemm(g, weight, op=dname)
            start = (lambda: tp.all_reduce(grad_in, op=wname)) if ctx.allreduce_dgrad else None
            grad_w = hide(start, lambda: wgrad(x2), op=wname, overlap=plan.wgrad is not None)
        grad_b = g.sum(0) if ctx.use_bias else None
        return grad_in.view(x.shape), grad_w, grad_b, None, None, None, None, None


class RowParallelMatmul(torch.autograd.Function):
    """Y = reduce_sp(X @ W^T). X: [s, b, k/tp]; Y: [s/tp or s, b, n]."""

    @staticmethod
    def forward(ctx, x, weight, plan: LayerPlan, tp: Transport, fuse_wgrad: bool,
                layouts: dict | None = None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad = plan, tp, fuse_wgrad
        ctx.layouts = layouts = layouts or {}
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        (op, streams), sp = _begin(tp, plan.fprop, "fprop"), plan.sequence_parallel
        if plan.fprop is not None:
            s = plan.fprop
            out = matmul_reduce_scatter(x2, weight, tp, s.method, s.splits(tp.world_size),
                                        op=op, scatter=sp, streams=streams,
                                        nodes=layouts.get("fprop"))
        else:
            out = matmul_reduce_scatter(x2, weight, tp, "bulk", 1, op=op, scatter=sp)
        return out.view(out.shape[0] * x.shape[0] // x2.shape[0], *x.shape[1:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, tp = ctx.plan, ctx.tp
        g = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dname, streams = _begin(tp, plan.dgrad, "dgrad")
        if plan.sequence_parallel and plan.dgrad is not None:
            # g_full is the transport's workspace: used by the wgrad below, within this pass.
            grad_in, g_full = all_gather_matmul(g, weight.t(), tp, plan.dgrad.method, op=dname,
                                                aggregate=plan.dgrad.aggregate, streams=streams,
                                                nodes=ctx.layouts.get("dgrad"))
        elif plan.sequence_parallel:
            g_full, start = _gather(g, tp, dname)
            start().wait()
            grad_in = gemm(g_full, weight, op=dname)
        else:
            g_full, grad_in = g, gemm(g, weight, op=dname)
        # wgrad reuses the gathered gradient: no communication of its own ("external").
        wname = _name(plan.wgrad, "wgrad")
        grad_w = weight_grad(weight, g_full, x2, ctx.fuse_wgrad, lambda a, b: gemm(a, b, op=wname))
        return grad_in.view(x.shape), grad_w, None, None, None, None

"""Autograd functions of the overlapped TP linears. Tensors are Megatron's
[sequence, batch, hidden], flattened to rows, with sequence blocks in rank order.

Each pass (a forward; a backward: dgrad and wgrad together) is one function of
explicit tensors: its inputs, and outputs allocated here by the caller. A backward
is its dgrad pass then its wgrad pass (`column_dgrad`, `row_wgrad`, ...), each a
function of its own, which the tuner times one by one (`tune.passes`): no copy. It calls
one overlap schedule (or the plain order when its plan says None). Written that
way, a pass can run eagerly or as a replay of its CUDA graph (`overlap.replay`,
`graphs`: the layer's PassGraphs per pass, None for eager only); what autograd
gets back beyond those outputs is decided on the host, outside the pass.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..comm.transport import Transport
from ..config import LayerSettings
from ..config.effects import CAPS
from ..overlap import all_gather_matmul, hide, matmul, matmul_reduce_scatter
from ..overlap.replay import PassGraphs
from ..overlap.streams import ChunkStreams, plain
from .plan import LayerPlan
from .wgrad import grad_buffer, grad_for_autograd, main_grad_written, weight_grad

Graphs = Optional[dict[str, PassGraphs]]


def pass_streams(tp: Transport, s: LayerSettings) -> tuple[int, ChunkStreams]:
    """(communication stream priority, GEMM streams) of a pass with settings `s` on `tp`:
    priorities, stream count, and the SM margin only where some link's kernels need SMs.
    The tuner times candidates with exactly this."""
    comm_p = gemm_p = 0
    if torch.cuda.is_available():
        comm_p, gemm_p = s.stream_priorities(*torch.cuda.Stream.priority_range())
    held = any(CAPS[b].sm_margin for b in tp.backends if b in CAPS)
    margin = s.num_sm if s.set_sm_margin and held else 0
    return comm_p, ChunkStreams(n=s.gemm_streams or None, priority=gemm_p, sm_margin=margin)


def begin(tp: Transport, plan: LayerPlan, pass_name: str) -> tuple[str, ChunkStreams | None]:
    """Open the transport's pass for this layer pass; its name (`LayerPlan.op_name`) and
    the GEMM streams its settings ask for (None for a pass the plan leaves plain)."""
    name, s = plan.op_name(pass_name), getattr(plan, pass_name)
    if s is None:
        tp.begin_pass(name)
        return name, None
    comm_p, streams = pass_streams(tp, s)
    tp.begin_pass(name, comm_p)
    return name, streams


def _run(graphs: Graphs, key: str, tp: Transport, body, *tensors, static: tuple = (),
         audit=None) -> None:
    """Run pass `key` eagerly or as a replay; through `audit` (an `agree.PassAudit`,
    None in steady state) on its first run for a new shape."""
    if audit is not None and key in audit.todo:
        # always eager under the audit: it must see the pass's begin_pass / workspace calls on
        # every rank, and a replay makes none on the host (a shape seen before, with a new
        # frozen-weight or gather_output mode, gets a new audit while its graph exists)
        audit.run(key, tp, body if graphs is None or key not in graphs else
                  lambda: graphs[key].run_eagerly(tp, body, tensors, static))
    elif graphs is None or key not in graphs:
        body()
    else:
        graphs[key].run(tp, body, tensors, static)


def _gathered(x2: torch.Tensor, tp: Transport) -> torch.Tensor:
    return x2.new_empty(tp.world_size * x2.shape[0], x2.shape[1])


# -- the passes: every tensor they touch is an argument --------------------------------------
def column_fprop(x2, weight, bias, out, plan: LayerPlan, tp: Transport, nodes) -> None:
    """out = gather_sp(x2) @ weight^T (+ bias)."""
    op, streams = begin(tp, plan, "fprop")
    if plan.sequence_parallel and plan.fprop is not None:
        all_gather_matmul(x2, weight, tp, plan.fprop.method, op=op, aggregate=plan.fprop.aggregate,
                          streams=streams, nodes=nodes, out=out)
    elif plan.sequence_parallel:
        full = _gathered(x2, tp)
        tp.all_gather(full, x2, op=op).wait()
        matmul(full, weight.t(), out, op=op)
    else:
        matmul(x2, weight.t(), out, op=op)
    if bias is not None:
        out.add_(bias)


def column_dgrad(g, x2, weight, grad_in, plan: LayerPlan, tp: Transport, nodes, streams,
                 op: str, allreduce_dgrad: bool, wgrad: bool = True):
    """The column dgrad pass: g @ weight, with the input's all-gather (under SP, for the
    wgrad) hidden under it, or run beside its reduce-scatter into grad_in (rs_dgrad).
    Returns (the wgrad's input, what column_wgrad still reduces into grad_in or None).
    `wgrad=False` (frozen weight): the gather, which only feeds the wgrad, is skipped."""
    gather = plan.sequence_parallel and wgrad
    full = _gathered(x2, tp) if gather else x2
    start = (lambda: tp.all_gather(full, x2, op=op)) if gather else None
    if plan.sequence_parallel and plan.rs_dgrad:
        handle = start and start()
        matmul_reduce_scatter(g, weight.t(), tp, plan.dgrad.method, plan.dgrad.splits(tp.world_size),
                              op=op, streams=streams, nodes=nodes, out=grad_in)
        if handle is not None:
            handle.wait()
        return full, None
    if plan.sequence_parallel:
        with (streams or plain()).margin_only():  # bulk: num_sm SMs short where set_sm_margin acts
            dgrad = hide(start, lambda: matmul(g, weight, op=op), overlap=plan.dgrad is not None)
        return full, dgrad
    matmul(g, weight, grad_in, op=op)
    return x2, (grad_in if allreduce_dgrad else None)


def column_wgrad(g, inp, weight, grad_w, grad_in, pending, plan: LayerPlan, tp: Transport,
                 fuse: bool, wgrad: bool = True) -> None:
    """The column wgrad pass: grad_w = g^T @ inp (or into main_grad), the dgrad's reduction
    hidden under it: `pending` reduce-scattered into grad_in (SP), grad_in all-reduced
    (without SP, `pending` is grad_in), or nothing (None). `wgrad=False` (frozen weight):
    no GEMM to hide it under, so the reduction simply runs, named for the dgrad it
    finishes (a diagnosis then names the pass that actually ran)."""
    if not wgrad:
        if pending is not None:
            op = plan.op_name("dgrad")
            (tp.reduce_scatter(grad_in, pending, op=op) if plan.sequence_parallel
             else tp.all_reduce(grad_in, op=op)).wait()
        return
    op = plan.op_name("wgrad")
    start = None
    if pending is not None:
        start = ((lambda: tp.reduce_scatter(grad_in, pending, op=op)) if plan.sequence_parallel
                 else (lambda: tp.all_reduce(grad_in, op=op)))
    streams = pass_streams(tp, plan.wgrad)[1].margin_only() if plan.wgrad is not None else plain()
    with streams:  # bulk: the GEMM held num_sm SMs short where set_sm_margin acts
        hide(start, lambda: weight_grad(weight, g, inp, fuse, functools.partial(matmul, op=op),
                                        grad_w), overlap=plan.wgrad is not None)


def column_bwd(g, x2, weight, grad_in, grad_w, grad_b, plan: LayerPlan, tp: Transport, nodes,
               fuse: bool, allreduce_dgrad: bool, wgrad: bool = True) -> None:
    """grad_in (reduce-scattered under SP, all-reduced when asked), grad_w (or main_grad;
    neither when `wgrad` is False: a frozen weight), grad_b: the dgrad pass, then the
    wgrad pass, in one transport pass."""
    dname, streams = begin(tp, plan, "dgrad")
    inp, pending = column_dgrad(g, x2, weight, grad_in, plan, tp, nodes, streams, dname,
                                allreduce_dgrad, wgrad)
    column_wgrad(g, inp, weight, grad_w, grad_in, pending, plan, tp, fuse, wgrad)
    if grad_b is not None:
        torch.sum(g, 0, out=grad_b)


def row_fprop(x2, weight, bias, out, plan: LayerPlan, tp: Transport, nodes) -> None:
    """out = reduce_sp(x2 @ weight^T) (+ bias, after the reduction, as Megatron adds it):
    reduce-scattered under SP, all-reduced otherwise. The bias is added here, into the
    pass's own output, so the layer returns that tensor: an add outside the pass would
    allocate the result beside it and move the pass's output between calls (no replay)."""
    op, streams = begin(tp, plan, "fprop")
    s, sp = plan.fprop, plan.sequence_parallel
    if s is not None:
        matmul_reduce_scatter(x2, weight, tp, s.method, s.splits(tp.world_size), op=op,
                              scatter=sp, streams=streams, nodes=nodes, out=out)
    else:
        matmul_reduce_scatter(x2, weight, tp, "bulk", 1, op=op, scatter=sp, out=out)
    if bias is not None:
        out.add_(bias)


def row_dgrad(g, weight, grad_in, plan: LayerPlan, tp: Transport, nodes, streams, op: str):
    """The row dgrad pass: grad_in = gather_sp(g) @ weight, the gather hidden under it.
    Returns the gathered g, the wgrad's input (with overlap the transport's workspace:
    valid within this transport pass)."""
    if plan.sequence_parallel and plan.dgrad is not None:
        _, g_full = all_gather_matmul(g, weight.t(), tp, plan.dgrad.method, op=op,
                                      aggregate=plan.dgrad.aggregate, streams=streams,
                                      nodes=nodes, out=grad_in)
        return g_full
    if plan.sequence_parallel:
        g_full = _gathered(g, tp)
        tp.all_gather(g_full, g, op=op).wait()
        matmul(g_full, weight, grad_in, op=op)
        return g_full
    matmul(g, weight, grad_in, op=op)
    return g


def row_wgrad(g_full, x2, weight, grad_w, plan: LayerPlan, fuse: bool) -> None:
    """The row wgrad pass: grad_w = g_full^T @ x2 on the dgrad's gathered gradient; no
    communication of its own ("external")."""
    weight_grad(weight, g_full, x2, fuse, functools.partial(matmul, op=plan.op_name("wgrad")),
                grad_w)


def row_bwd(g, x2, weight, grad_in, grad_w, grad_b, plan: LayerPlan, tp: Transport, nodes,
            fuse: bool, wgrad: bool = True) -> None:
    """grad_in, grad_w and grad_b (this rank's rows of g, summed: under SP Megatron's
    finalize_model_grads sums the bias grad over the TP group): the dgrad pass, then the
    wgrad pass (none for a frozen weight, `wgrad=False`), in one transport pass."""
    dname, streams = begin(tp, plan, "dgrad")
    g_full = row_dgrad(g, weight, grad_in, plan, tp, nodes, streams, dname)
    if wgrad:
        row_wgrad(g_full, x2, weight, grad_w, plan, fuse)
    if grad_b is not None:
        torch.sum(g, 0, out=grad_b)


# -- autograd ------------------------------------------------------------------------------
def _save(ctx, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Save what the backward reads. The input feeds only the wgrad, so a frozen weight's
    layer keeps no activation (as Megatron's frozen path), only the input's shape."""
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.save_for_backward(x if weight.requires_grad else None, weight)


def _grad_in(ctx, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(ctx.x_shape, dtype=ctx.x_dtype)


def token_rows(t: torch.Tensor) -> int:
    """Rows of `t` flattened to [tokens, hidden] ([s, b, h] or [s, h] as Megatron takes)."""
    return t.numel() // t.shape[-1] if t.shape[-1] else 0


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1, t.shape[-1])  # (None: a frozen layer's input)


class ColumnParallelMatmul(torch.autograd.Function):
    """Y = gather_sp(X) @ W^T (+ b). X: [s/tp or s, b, k]. layouts: per pass, the
    hierarchical ring layout (ranks per node) or None for the flat ring. The passes
    flatten their inputs themselves, so a replay costs no host-side reshape."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, tp: Transport, fuse_wgrad: bool, allreduce_dgrad: bool,
                layouts: dict | None = None, graphs: Graphs = None, audit=None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad, ctx.allreduce_dgrad = plan, tp, fuse_wgrad, allreduce_dgrad
        ctx.layouts = layouts = layouts or {}
        ctx.graphs, ctx.use_bias, ctx.audit = graphs, bias is not None, audit
        _save(ctx, x, weight)
        # the output in its final shape (no host-side view after a replay): SP gathers the sequence
        seq = x.shape[0] * (tp.world_size if plan.sequence_parallel else 1)
        out = x.new_empty((seq, *x.shape[1:-1], weight.shape[0]))
        _run(graphs, "fprop", tp,
             lambda: column_fprop(_flat(x), weight, bias, _flat(out), plan, tp, layouts.get("fprop")),
             x, weight, bias, out, audit=audit)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, tp, fuse = ctx.plan, ctx.tp, ctx.fuse_wgrad
        need_in, wgrad, need_b = ctx.needs_input_grad[:3]
        if not (need_in or wgrad):  # frozen weight, input without grad: only a bias trains
            grad_b = _flat(grad_out).sum(0) if need_b else None
            return None, None, grad_b, None, None, None, None, None, None, None
        grad_in, grad_w = _grad_in(ctx, weight), grad_buffer(weight, grad_out, fuse, wgrad)
        grad_b = grad_out.new_empty(grad_out.shape[-1]) if ctx.use_bias else None
        # whether the wgrad runs changes what the pass issues: part of its replay key
        _run(ctx.graphs, "bwd", tp,
             lambda: column_bwd(_flat(grad_out), _flat(x), weight, _flat(grad_in), grad_w, grad_b,
                                plan, tp, ctx.layouts.get("dgrad"), fuse, ctx.allreduce_dgrad, wgrad),
             grad_out, x, weight, grad_in, grad_w, grad_b, main_grad_written(weight, fuse, wgrad),
             static=(ctx.allreduce_dgrad, wgrad), audit=ctx.audit)
        grad_w = grad_for_autograd(grad_w, weight, grad_in, wgrad)
        return grad_in, grad_w, grad_b, None, None, None, None, None, None, None


class RowParallelMatmul(torch.autograd.Function):
    """Y = reduce_sp(X @ W^T) (+ b). X: [s, b, k/tp]; Y: [s/tp or s, b, n]."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, tp: Transport, fuse_wgrad: bool,
                layouts: dict | None = None, graphs: Graphs = None, audit=None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad, ctx.graphs, ctx.audit = plan, tp, fuse_wgrad, graphs, audit
        ctx.use_bias = bias is not None
        ctx.layouts = layouts = layouts or {}
        _save(ctx, x, weight)
        # SP reduce-scatters the sequence (the layer's door checked that TP divides it)
        seq = x.shape[0] // (tp.world_size if plan.sequence_parallel else 1)
        out = x.new_empty((seq, *x.shape[1:-1], weight.shape[0]))
        _run(graphs, "fprop", tp,
             lambda: row_fprop(_flat(x), weight, bias, _flat(out), plan, tp, layouts.get("fprop")),
             x, weight, bias, out, audit=audit)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, tp, fuse = ctx.plan, ctx.tp, ctx.fuse_wgrad
        wgrad = ctx.needs_input_grad[1]  # (the input needs its grad, or there is no backward)
        grad_in, grad_w = _grad_in(ctx, weight), grad_buffer(weight, grad_out, fuse, wgrad)
        grad_b = grad_out.new_empty(grad_out.shape[-1]) if ctx.use_bias else None
        _run(ctx.graphs, "bwd", tp,
             lambda: row_bwd(_flat(grad_out), _flat(x), weight, _flat(grad_in), grad_w, grad_b, plan,
                             tp, ctx.layouts.get("dgrad"), fuse, wgrad),
             grad_out, x, weight, grad_in, grad_w, grad_b, main_grad_written(weight, fuse, wgrad),
             static=(wgrad,), audit=ctx.audit)
        grad_w = grad_for_autograd(grad_w, weight, grad_in, wgrad)
        return grad_in, grad_w, grad_b, None, None, None, None, None, None


# -- the last-dim gather / split around a layer (gather_output, a row's unsplit input) ----
def gather_last(t: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """`t` concatenated over the TP ranks along its last dim (Megatron's
    `_gather_along_last_dim`), through the transport's bounded all_gather, in a transport
    pass of its own (`op`): it runs after the layer's pass, replayed or not, so it must
    not take workspace that pass may still be using."""
    tp.begin_pass(op)
    rows = _flat(t).contiguous()
    full = _gathered(rows, tp)
    tp.all_gather(full, rows, op=op).wait()
    return full.view(tp.world_size, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], -1)


def split_last(t: torch.Tensor, tp: Transport) -> torch.Tensor:
    """This rank's block of `t`'s last dim (Megatron's `_split_along_last_dim`)."""
    return t.chunk(tp.world_size, dim=-1)[tp.rank].contiguous()


class GatherLastDim(torch.autograd.Function):
    """gather_output: forward gathers the column output's last dim, backward keeps this
    rank's slice (Megatron's _GatherFromModelParallelRegion, with a bounded gather)."""

    @staticmethod
    def forward(ctx, t, tp: Transport, op: str):
        ctx.tp = tp
        return gather_last(t, tp, op)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.tp), None, None


class ScatterLastDim(torch.autograd.Function):
    """A row layer's unsplit input (input_is_parallel=False): forward keeps this rank's
    slice, backward gathers the grad (Megatron's _ScatterToModelParallelRegion, with a
    bounded gather)."""

    @staticmethod
    def forward(ctx, t, tp: Transport, op: str):
        ctx.tp, ctx.op = tp, op
        return split_last(t, tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_last(grad, ctx.tp, ctx.op), None, None

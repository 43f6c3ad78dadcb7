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
from ..overlap.fp8 import row_input_chunks
from ..overlap.replay import PassGraphs
from ..overlap.streams import ChunkStreams, plain
from .fp8 import DelayedScales, Fp8Backward, Fp8Forward, col_major
from .fp8_act import Fp8Activation
from .plan import LayerPlan
from .precision import Precision
from .wgrad import accumulates, grad_buffer, grad_for_autograd, main_grad_written, weight_grad

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
    """Where a gather of `x2` lands: a new tensor (in a replayed pass, the graphs' scratch
    pool). Not the transport's workspace: on a symmetric heap that would add a gathered
    activation to the pass's high-water, which the heap keeps for the whole run."""
    return x2.new_empty(tp.world_size * x2.shape[0], x2.shape[1])


def gathered_input(x2: torch.Tensor, plan: LayerPlan, tp: Transport, wgrad: bool) -> Optional[torch.Tensor]:
    """The buffer the column backward gathers its input into (under SP, for the wgrad),
    allocated by the layer before the pass, or None where it gathers nothing. Allocated
    inside a replayed pass, this activation-sized gather would live in the graphs' scratch
    pool, which is held for the whole run (the largest layer's, beside the transport's
    workspace); from the caller it is an ordinary allocation, freed after the pass, as the
    eager pass's is (Megatron's linears gather into their global buffer, kept for the
    process, which the transport's workspace stands for here: the forward's gather lands
    there). Bound by address like the pass's other tensors."""
    return _gathered(x2, tp) if plan.sequence_parallel and wgrad else None


# -- the passes: every tensor they touch is an argument --------------------------------------
def column_fprop(x2, weight, bias, out, plan: LayerPlan, tp: Transport, nodes,
                 q: Fp8Forward | None = None, gemm=matmul) -> None:
    """out = gather_sp(x2) @ weight^T (+ bias). FP8 (`q`): x2 is quantized once, with the
    TP group's amax under SP, and the gather moves FP8. (x2 and weight already FP8, with
    `gemm` their scaled GEMM: the tools' FP8 trial passes.)"""
    op, streams = begin(tp, plan, "fprop")
    if q is not None:
        x2, weight, gemm = q.operands(x2, weight, tp, op, plan.sequence_parallel, out.dtype)
    if plan.sequence_parallel and plan.fprop is not None:
        all_gather_matmul(x2, weight, tp, plan.fprop.method, op=op, aggregate=plan.fprop.aggregate,
                          streams=streams, nodes=nodes, out=out, gemm=gemm,
                          wait=plan.fprop.wait_gemm)
    elif plan.sequence_parallel:
        full = _gathered(x2, tp)
        tp.all_gather(full, x2, op=op).wait()
        gemm(full, weight.t(), out, op=op)
    else:
        gemm(x2, weight.t(), out, op=op)
    if bias is not None:
        out.add_(bias)
    if q is not None:
        q.record(tp, op)


def column_dgrad(g, x2, weight, grad_in, plan: LayerPlan, tp: Transport, nodes, streams,
                 op: str, allreduce_dgrad: bool, wgrad: bool = True, gemm=matmul,
                 full: Optional[torch.Tensor] = None):
    """The column dgrad pass: g @ weight, with the input's all-gather (under SP, for the
    wgrad) hidden under it, or run beside its reduce-scatter into grad_in (rs_dgrad).
    Returns (the wgrad's input, what column_wgrad still reduces into grad_in or None).
    `wgrad=False` (frozen weight): the gather, which only feeds the wgrad, is skipped.
    FP8: g and weight are FP8 (weight column-major), `gemm` their scaled GEMM, and x2
    the forward's FP8 input when the wgrad runs in FP8 (then the gather moves FP8).
    Under SP the product the wgrad pass reduce-scatters is written into the transport's
    workspace (it is read within this transport pass only): a symmetric-memory transport's
    peers read it where the GEMM wrote it, without the staging copy, in the place that copy
    would have taken (the pass's workspace high-water unchanged). `full`: where the gather
    lands (`gathered_input`), given by a caller that allocates it outside a replayed pass;
    None: `gathered_input` here."""
    full = gathered_input(x2, plan, tp, wgrad) if full is None else full
    start = (lambda: tp.all_gather(full, x2, op=op)) if full is not None else None
    inp = x2 if full is None else full
    if plan.sequence_parallel and plan.rs_dgrad:
        handle = start and start()
        matmul_reduce_scatter(g, weight.t(), tp, plan.dgrad.method, plan.dgrad.splits(tp.world_size),
                              op=op, streams=streams, nodes=nodes, out=grad_in, gemm=gemm)
        if handle is not None:
            handle.wait()
        return inp, None
    if plan.sequence_parallel:
        with (streams or plain()).margin_only():  # bulk: num_sm SMs short where set_sm_margin acts
            dgrad = hide(start, lambda: gemm(g, weight, tp.workspace(
                (g.shape[0], weight.shape[-1]), grad_in.dtype, g.device), op=op),
                overlap=plan.dgrad is not None)
        return inp, dgrad
    gemm(g, weight, grad_in, op=op)
    return x2, (grad_in if allreduce_dgrad else None)


def column_wgrad(g, inp, weight, grad_w, grad_in, pending, plan: LayerPlan, tp: Transport,
                 fuse: bool, wgrad: bool = True, gemm=matmul, fp8: bool = False) -> None:
    """The column wgrad pass: grad_w = g^T @ inp (or into main_grad), the dgrad's reduction
    hidden under it: `pending` reduce-scattered into grad_in (SP), grad_in all-reduced
    (without SP, `pending` is grad_in), or nothing (None). `wgrad=False` (frozen weight):
    no GEMM to hide it under, so the reduction simply runs, named for the dgrad it
    finishes (a diagnosis then names the pass that actually ran). `fp8`: g and inp are
    FP8, `gemm` their scaled GEMM (the pass lays them out as the GEMM takes them)."""
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
        hide(start, lambda: weight_grad(weight, *(_wgrad_layout(g, inp) if fp8 else (g, inp)), fuse,
                                        functools.partial(gemm, op=op), grad_w),
             overlap=plan.wgrad is not None)


def _wgrad_layout(g: torch.Tensor, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 wgrad's operands as cuBLAS takes them (g^T row-major, the input
    column-major): a gathered operand transposed inside the wgrad pass that reads it; one
    this rank cast came column-major from its cast (`Fp8Forward`, `Fp8Backward.grad`)."""
    return col_major(g), col_major(inp)


def _wgrad_dtype(weight, grad_w, fuse: bool) -> torch.dtype:
    """What an FP8 wgrad GEMM outputs: main_grad's dtype where it accumulates there."""
    return weight.main_grad.dtype if accumulates(weight, fuse) else grad_w.dtype


def column_bwd(g, x2, weight, grad_in, grad_w, grad_b, plan: LayerPlan, tp: Transport, nodes,
               fuse: bool, allreduce_dgrad: bool, wgrad: bool = True,
               q: Fp8Backward | None = None, full: Optional[torch.Tensor] = None) -> None:
    """grad_in (reduce-scattered under SP, all-reduced when asked), grad_w (or main_grad;
    neither when `wgrad` is False: a frozen weight), grad_b: the dgrad pass, then the
    wgrad pass, in one transport pass. FP8 (`q`): g is this rank's own, so its own amax,
    and its cast writes the wgrad's layout too; the dgrad multiplies by the forward's FP8
    weight; the wgrad runs in FP8 on the gathered FP8 input (x2) when the recipe's
    fp8_wgrad says so. `full`: the input's gather buffer (`gathered_input`), or None."""
    dname, streams = begin(tp, plan, "dgrad")
    gd, wd, dgemm, gw, wgemm, fp8_w = g, weight, matmul, g, matmul, False
    if q is not None:
        fp8_w = q.p.wgrad and wgrad  # g column-major for it, from the cast's kernel
        gd, g_scale, g_col = q.grad(g, tp, dname, gathered=False, col=fp8_w)
        w8t, dgemm = q.dgrad(g_scale, grad_in.dtype)
        wd = w8t.t()
        if fp8_w:
            gw = g_col
            wgemm = q.wgrad(g_scale, _wgrad_dtype(weight, grad_w, fuse))
    inp, pending = column_dgrad(gd, x2, wd, grad_in, plan, tp, nodes, streams, dname,
                                allreduce_dgrad, wgrad, dgemm, full)
    column_wgrad(gw, inp, weight, grad_w, grad_in, pending, plan, tp, fuse, wgrad, wgemm, fp8_w)
    if grad_b is not None:
        torch.sum(g, 0, out=grad_b)
    if q is not None:
        q.record(tp, dname)


def row_input_order(plan: LayerPlan, tp: Transport, nodes, scaling: str | None
                    ) -> tuple[int, int] | None:
    """The (blocks, chunks) in which a row layer's FP8 input (`scaling`: its recipe's
    scales; None: not FP8) is laid out for its forward pass, `overlap.fp8.row_input_chunks`
    of the pass's settings; None: x's row order."""
    s = plan.fprop
    if s is None or scaling is None:
        return None
    return row_input_chunks(scaling, s.method, plan.sequence_parallel, nodes, tp.world_size,
                            s.splits(tp.world_size))


def row_fprop(x2, weight, bias, out, plan: LayerPlan, tp: Transport, nodes,
              q: Fp8Forward | None = None, gemm=matmul, scaling: str | None = None) -> None:
    """out = reduce_sp(x2 @ weight^T) (+ bias, after the reduction, as Megatron adds it):
    reduce-scattered under SP, all-reduced otherwise. The bias is added here, into the
    pass's own output, so the layer returns that tensor: an add outside the pass would
    allocate the result beside it and move the pass's output between calls (no replay).
    FP8 (`q`): x2 (this rank's own, never gathered) and the weight quantized, each with
    its own amax, the input cast in the order `row_input_order` gives; the partial
    products, and so the reduction, in out's dtype. (x2 and weight already FP8, with
    `gemm` their scaled GEMM and `scaling` their recipe's scales: the tools' FP8 trial
    passes, whose x2 comes laid out in that order.)"""
    op, streams = begin(tp, plan, "fprop")
    s, sp = plan.fprop, plan.sequence_parallel
    chunks = row_input_order(plan, tp, nodes, q.p.recipe if q is not None else scaling)
    if q is not None:
        x2, weight, gemm = q.operands(x2, weight, tp, op, False, out.dtype, chunks)
    if s is not None:
        matmul_reduce_scatter(x2, weight, tp, s.method, s.splits(tp.world_size), op=op,
                              scatter=sp, streams=streams, nodes=nodes, out=out, gemm=gemm,
                              chunk_major=chunks is not None)
    else:
        matmul_reduce_scatter(x2, weight, tp, "bulk", 1, op=op, scatter=sp, out=out, gemm=gemm)
    if bias is not None:
        out.add_(bias)
    if q is not None:
        q.record(tp, op)


def row_dgrad(g, weight, grad_in, plan: LayerPlan, tp: Transport, nodes, streams, op: str,
              gemm=matmul):
    """The row dgrad pass: grad_in = gather_sp(g) @ weight, the gather hidden under it.
    Returns the gathered g, the wgrad's input (with overlap the transport's workspace:
    valid within this transport pass). FP8: g and weight FP8 (weight column-major),
    `gemm` their scaled GEMM: the gather moves FP8."""
    if plan.sequence_parallel and plan.dgrad is not None:
        _, g_full = all_gather_matmul(g, weight.t(), tp, plan.dgrad.method, op=op,
                                      aggregate=plan.dgrad.aggregate, streams=streams,
                                      nodes=nodes, out=grad_in, gemm=gemm,
                                      wait=plan.dgrad.wait_gemm)
        return g_full
    if plan.sequence_parallel:
        g_full = _gathered(g, tp)
        tp.all_gather(g_full, g, op=op).wait()
        gemm(g_full, weight, grad_in, op=op)
        return g_full
    gemm(g, weight, grad_in, op=op)
    return g


def row_wgrad(g_full, x2, weight, grad_w, plan: LayerPlan, fuse: bool, gemm=matmul,
              fp8: bool = False) -> None:
    """The row wgrad pass: grad_w = g_full^T @ x2 on the dgrad's gathered gradient; no
    communication of its own ("external"). `fp8`: both FP8, `gemm` their scaled GEMM."""
    if fp8:
        g_full, x2 = _wgrad_layout(g_full, x2)
    weight_grad(weight, g_full, x2, fuse, functools.partial(gemm, op=plan.op_name("wgrad")),
                grad_w)


def row_bwd(g, x2, weight, grad_in, grad_w, grad_b, plan: LayerPlan, tp: Transport, nodes,
            fuse: bool, wgrad: bool = True, q: Fp8Backward | None = None) -> None:
    """grad_in, grad_w and grad_b (this rank's rows of g, summed: under SP Megatron's
    finalize_model_grads sums the bias grad over the TP group): the dgrad pass, then the
    wgrad pass (none for a frozen weight, `wgrad=False`), in one transport pass.
    FP8 (`q`): g quantized once, with the TP group's amax under SP (it is gathered); the
    wgrad reuses the gathered FP8 g with the forward's FP8 input (x2) when fp8_wgrad is
    on, else it runs in the parameters' dtype on g_full dequantized (what the dgrad saw)."""
    dname, streams = begin(tp, plan, "dgrad")
    if q is None:
        g_full = row_dgrad(g, weight, grad_in, plan, tp, nodes, streams, dname)
        if wgrad:
            row_wgrad(g_full, x2, weight, grad_w, plan, fuse)
    else:
        sp = plan.sequence_parallel  # g gathered; else its own, column-major from its cast
        g8, g_scale, g_col = q.grad(g, tp, dname, gathered=sp,
                                    col=not sp and wgrad and q.p.wgrad)
        w8t, dgemm = q.dgrad(g_scale, grad_in.dtype)
        g_full = row_dgrad(g8, w8t.t(), grad_in, plan, tp, nodes, streams, dname, dgemm)
        if wgrad and q.p.wgrad:
            row_wgrad(g_full if g_col is None else g_col, x2, weight, grad_w, plan, fuse,
                      q.wgrad(g_scale, _wgrad_dtype(weight, grad_w, fuse)), fp8=True)
        elif wgrad:
            row_wgrad(q.dequantized(g_full, g_scale, x2.dtype), x2, weight, grad_w, plan, fuse)
        q.record(tp, dname)
    if grad_b is not None:
        torch.sum(g, 0, out=grad_b)


# -- autograd ------------------------------------------------------------------------------
def _fp8_forward(precision: Optional[Precision], x: torch.Tensor, weight: torch.Tensor,
                 fp8_weight: Optional[tuple] = None, own_input: bool = False,
                 grad_mode: bool = True, delayed: Optional[DelayedScales] = None,
                 layer: str = "") -> Optional[Fp8Forward]:
    """The FP8 forward's operands; `fp8_weight`: (the layer's Fp8WeightCache, reuse) or None;
    `delayed`: the layer's DelayedScales (fp8_recipe 'delayed').
    `own_input`: the wgrad reads this rank's own input, not a gather of it (a row layer, a
    column layer without SP): its cast also writes the wgrad's layout when an FP8 wgrad
    will run. `grad_mode`: autograd was on at the call (inside the Function it never is),
    so a backward may follow; without one no layout for it is written (an uncached
    weight's neither). `x` an `Fp8Activation`: the input quantized for this pass already."""
    given = x if isinstance(x, Fp8Activation) else None
    if precision is None or not precision.fp8:
        if given is not None:
            raise ValueError(f"{layer}: an FP8 input (a fused SwiGLU's) reached a linear that "
                             "does not run FP8: run the MLP with "
                             "install(fp8_fused_activation=False)")
        return None
    input_t = own_input and precision.wgrad and weight.requires_grad and grad_mode
    return Fp8Forward(precision, _rows(x), weight, *(fp8_weight or (None, False)),
                      input_t=input_t, weight_t=grad_mode, delayed=delayed, given=given,
                      layer=layer)


def _fp8_static(q: Optional[Fp8Forward]) -> tuple:
    """What of an FP8 forward is decided on the host: whether it quantizes the weight."""
    return () if q is None else (q.quantize_weight,)


def _save(ctx, x: torch.Tensor, weight: torch.Tensor, q: Optional[Fp8Forward] = None) -> None:
    """Save what the backward reads. The input feeds only the wgrad, so a frozen weight's
    layer keeps no activation (as Megatron's frozen path), only the input's shape. FP8:
    the forward's FP8 weight (transposed, as the dgrad reads it) and scales, and its FP8
    input in place of the input when the wgrad runs in FP8 (half the bytes kept, and
    gathered, under SP; column-major where the wgrad reads it ungathered)."""
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.precision = None if q is None else q.p
    ctx.delayed = None if q is None else q.delayed
    keep = (q.kept_input() if q is not None and q.p.wgrad else x) if weight.requires_grad else None
    # (row-wise: the backward quantizes the weight again, per column, from the weight)
    extra = ((None,) * 3 if q is None or q.rowwise else (q.w8t, q.w_scale, q.x_scale))
    ctx.save_for_backward(keep, weight, *extra)


def _saved(ctx):
    """(input or FP8 input, weight, the backward's Fp8Backward or None)."""
    x, weight, w8t, w_scale, x_scale = ctx.saved_tensors
    q = None if ctx.precision is None else Fp8Backward(ctx.precision, w8t, w_scale, x_scale,
                                                        weight, ctx.delayed)
    return x, weight, q


def _forward(ctx, fprop, x: torch.Tensor, weight: torch.Tensor, bias, seq: int,
             plan: LayerPlan, tp: Transport, layouts: dict, graphs: Graphs, audit,
             q: Optional[Fp8Forward]) -> torch.Tensor:
    """Either layer's forward: what its backward reads saved, the output allocated in its
    final shape (`seq` long: no host-side view after a replay), and `fprop` (the layer's
    forward pass function) run as the transport pass 'fprop', replayed where it can be."""
    _save(ctx, x, weight, q)
    out = torch.empty((seq, *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    rows = _rows(x)  # (an Fp8Activation: its FP8 rows, which the pass reads)
    _run(graphs, "fprop", tp,
         lambda: fprop(rows, weight, bias, _flat(out), plan, tp, layouts.get("fprop"), q),
         rows, weight, bias, out, *(q.tensors() if q is not None else ()),
         static=_fp8_static(q), audit=audit)
    return out


def _grad_in(ctx, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(ctx.x_shape, dtype=ctx.x_dtype)


def token_rows(t: torch.Tensor) -> int:
    """Rows of `t` flattened to [tokens, hidden] ([s, b, h] or [s, h] as Megatron takes)."""
    return t.numel() // t.shape[-1] if t.shape[-1] else 0


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1, t.shape[-1])  # (None: a frozen layer's input)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`_flat(t)`; of an `Fp8Activation`, its FP8 rows (never its values dequantized)."""
    return t.fp8 if isinstance(t, Fp8Activation) else _flat(t)


def _given_grad(grad_out: torch.Tensor, q: Optional[Fp8Backward], bias: bool,
                layer: str) -> torch.Tensor:
    """The output gradient's rows; an `Fp8Activation` (quantized by the kernel that made
    it, `fp8_act`) handed to the FP8 backward `q`, its FP8 rows returned."""
    if not isinstance(grad_out, Fp8Activation):
        return _flat(grad_out)
    if q is None or bias:
        raise ValueError(f"{layer}: an FP8 gradient (a fused SwiGLU's) reached a linear whose "
                         "backward does not run FP8 or that sums it for its bias: run the MLP "
                         "with install(fp8_fused_activation=False)")
    q.given = grad_out
    return grad_out.fp8


class ColumnParallelMatmul(torch.autograd.Function):
    """Y = gather_sp(X) @ W^T (+ b). X: [s/tp or s, b, k]. layouts: per pass, the
    hierarchical ring layout (ranks per node) or None for the flat ring. The passes
    flatten their inputs themselves, so a replay costs no host-side reshape."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, tp: Transport, fuse_wgrad: bool, allreduce_dgrad: bool,
                layouts: dict | None = None, graphs: Graphs = None, audit=None,
                precision: Optional[Precision] = None, fp8_weight: Optional[tuple] = None,
                grad_mode: bool = True, delayed: Optional[DelayedScales] = None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad, ctx.allreduce_dgrad = plan, tp, fuse_wgrad, allreduce_dgrad
        ctx.layouts = layouts = layouts or {}
        ctx.graphs, ctx.use_bias, ctx.audit = graphs, bias is not None, audit
        q = _fp8_forward(precision, x, weight, fp8_weight, not plan.sequence_parallel, grad_mode,
                         delayed)
        seq = x.shape[0] * (tp.world_size if plan.sequence_parallel else 1)  # SP gathers it
        return _forward(ctx, column_fprop, x, weight, bias, seq, plan, tp, layouts, graphs, audit, q)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, q = _saved(ctx)
        plan, tp, fuse = ctx.plan, ctx.tp, ctx.fuse_wgrad
        need_in, wgrad, need_b = ctx.needs_input_grad[:3]
        if not (need_in or wgrad):  # frozen weight, input without grad: only a bias trains
            grad_b = _flat(grad_out).sum(0) if need_b else None
            return None, None, grad_b, *(None,) * 11
        g = _given_grad(grad_out, q, ctx.use_bias, plan.layer)  # (an Fp8Activation: given to q)
        grad_in = _grad_in(ctx, weight)
        grad_w = grad_buffer(weight, grad_in, fuse, wgrad)
        grad_b = grad_in.new_empty(grad_out.shape[-1]) if ctx.use_bias else None
        full = gathered_input(_flat(x), plan, tp, wgrad)
        # whether the wgrad runs changes what the pass issues: part of its replay key
        _run(ctx.graphs, "bwd", tp,
             lambda: column_bwd(g, _flat(x), weight, _flat(grad_in), grad_w, grad_b,
                                plan, tp, ctx.layouts.get("dgrad"), fuse, ctx.allreduce_dgrad, wgrad, q,
                                full),
             g, x, weight, grad_in, grad_w, grad_b, full, main_grad_written(weight, fuse, wgrad),
             *(q.tensors() if q is not None else ()), static=(ctx.allreduce_dgrad, wgrad),
             audit=ctx.audit)
        grad_w = grad_for_autograd(grad_w, weight, grad_in, wgrad)
        return grad_in, grad_w, grad_b, *(None,) * 11


class RowParallelMatmul(torch.autograd.Function):
    """Y = reduce_sp(X @ W^T) (+ b). X: [s, b, k/tp]; Y: [s/tp or s, b, n]."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LayerPlan, tp: Transport, fuse_wgrad: bool,
                layouts: dict | None = None, graphs: Graphs = None, audit=None,
                precision: Optional[Precision] = None, fp8_weight: Optional[tuple] = None,
                grad_mode: bool = True, delayed: Optional[DelayedScales] = None):
        ctx.plan, ctx.tp, ctx.fuse_wgrad, ctx.graphs, ctx.audit = plan, tp, fuse_wgrad, graphs, audit
        ctx.use_bias = bias is not None
        ctx.layouts = layouts = layouts or {}
        q = _fp8_forward(precision, x, weight, fp8_weight, True, grad_mode, delayed, plan.layer)
        # SP reduce-scatters the sequence (the layer's door checked that TP divides it)
        seq = x.shape[0] // (tp.world_size if plan.sequence_parallel else 1)
        return _forward(ctx, row_fprop, x, weight, bias, seq, plan, tp, layouts, graphs, audit, q)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, q = _saved(ctx)
        plan, tp, fuse = ctx.plan, ctx.tp, ctx.fuse_wgrad
        wgrad = ctx.needs_input_grad[1]  # (the input needs its grad, or there is no backward)
        grad_in, grad_w = _grad_in(ctx, weight), grad_buffer(weight, grad_out, fuse, wgrad)
        grad_b = grad_out.new_empty(grad_out.shape[-1]) if ctx.use_bias else None
        _run(ctx.graphs, "bwd", tp,
             lambda: row_bwd(_flat(grad_out), _flat(x), weight, _flat(grad_in), grad_w, grad_b, plan,
                             tp, ctx.layouts.get("dgrad"), fuse, wgrad, q),
             grad_out, x, weight, grad_in, grad_w, grad_b, main_grad_written(weight, fuse, wgrad),
             *(q.tensors() if q is not None else ()), static=(wgrad,), audit=ctx.audit)
        grad_w = grad_for_autograd(grad_w, weight, grad_in, wgrad)
        return grad_in, grad_w, grad_b, *(None,) * 10


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

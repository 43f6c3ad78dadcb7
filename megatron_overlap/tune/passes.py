"""One trial's pass, run by the layer's own code: the tuner allocates a pass's tensors
at the trial's shape, builds the plan a layer with the candidate's settings has, and
calls that pass's function in `layers.functions` (which opens the transport's pass
with the layer's priorities, GEMM streams and SM-margin rule). Nothing of a schedule
is written here, so what is timed is what the layer runs.

Which function a trial is (SP, as tp_comm_overlap needs):

| trial | function | with overlap=False (the baseline) |
|---|---|---|
| column fprop | `column_fprop` | the gather, then the GEMM |
| column dgrad | `column_dgrad` (bulk, or rs_dgrad) | the gather, then the GEMM |
| column wgrad | `column_wgrad` hiding the dgrad's reduce-scatter (none when it moved) | the reduce-scatter, then the GEMM |
| row fprop | `row_fprop` | the GEMM, then the reduce-scatter |
| row dgrad | `row_dgrad` | the gather, then the GEMM |
| row wgrad | `row_wgrad` (the GEMM) | the same |
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..comm.transport import Transport
from ..config import LayerSettings
from ..config.effects import ACTIVE
from ..config.names import FAST_ACCUMS
from ..layers import functions as F
from ..layers.plan import LayerPlan
from ..layers.precision import Precision
from ..simulate import Trial
from ..simulate.numerics import Numerics
from ..simulate.passes import as_run, ring_order_of


@dataclass
class TrialPass:
    """`run()` runs the pass once (returns what the layer's function returns); `tensors`:
    every tensor it reads or writes, by name; `op`: the name its transfers and GEMMs go
    under (the trace's op)."""

    run: Callable[[], Any]
    tensors: dict[str, torch.Tensor]
    op: str


def precision_of(numerics: Numerics) -> Precision | None:
    """The layers' Precision of a shape's numerics (None: the parameters' dtype)."""
    if not numerics.fp8:
        return None
    return Precision(numerics.scaling, numerics.fwd, numerics.grad, numerics.fp8_wgrad,
                     fast=FAST_ACCUMS[numerics.fast_accum])


def fast_accum_of(trial: Trial) -> bool:
    """Whether the trial's pass runs FP8 GEMMs that accumulate fast (as the layer would),
    and so the whole GEMM it is held to."""
    p = precision_of(trial.spec.shape.numerics)
    return p is not None and trial.spec.gemm_dtype.itemsize == 1 \
        and p.fast_accum(trial.spec.pass_name)


def trial_plan(trial: Trial, overlap: bool = True) -> LayerPlan:
    """The plan of a layer whose settings for this pass are the trial's (None: Megatron's
    plain order). A column wgrad whose reduce-scatter moved runs under an rs_dgrad plan,
    as it does in the layer (its GEMM then goes under the layer's plain wgrad name)."""
    spec, s = trial.spec, trial.candidate.settings
    column, p, buffer = spec.shape.column, spec.pass_name, spec.shape.buffer
    if trial.comm_moved and overlap:
        return LayerPlan(trial.name, "column", True, rs_dgrad=True, buffer=buffer)
    rs_dgrad = overlap and column and p == "dgrad" and s.is_reduce_scatter
    return LayerPlan(trial.name, "column" if column else "row", True, rs_dgrad=rs_dgrad,
                     buffer=buffer, **{p: s if overlap else None})


def trial_pass(trial: Trial, tp: Transport, device: Any, dtype: torch.dtype, *,
               overlap: bool = True, nodes: Sequence[Sequence[int]] | None = None,
               precision: Precision | None = None) -> TrialPass:
    """The trial's pass on `tp` (one rank's part), its tensors random (seeded by rank).
    nodes: the ranks per node of the hierarchical ring order (None: flat). A wgrad
    trial opens its transport pass with its own settings (in the layer the dgrad's
    opens it; they differ only in comm_priority, which the search does not vary).
    `precision` FP8: `fp8_trial_pass` (`dtype`: the outputs'), but for a wgrad that runs in
    the parameters' dtype (fp8_wgrad off)."""
    if precision is not None and precision.fp8 and (trial.spec.pass_name != "wgrad"
                                                    or precision.wgrad):
        return fp8_trial_pass(trial, tp, device, dtype, precision, overlap=overlap, nodes=nodes)
    shape, p = trial.spec.shape, trial.spec.pass_name
    m, k, n, w = shape.m, shape.k, shape.n, tp.world_size
    g = torch.Generator(device="cpu").manual_seed(1234 + tp.rank)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, dtype=torch.float32).to(device, dtype)

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(*size, device=device, dtype=dtype)

    plan = trial_plan(trial, overlap)
    op = plan.op_name(p)  # the layer's name for it
    t: dict[str, torch.Tensor] = {"weight": rand(n, k)}
    if shape.column and p == "fprop":
        t.update(x=rand(m // w, k), out=empty(m, n))
        body = lambda: F.column_fprop(t["x"], t["weight"], None, t["out"], plan, tp, nodes)  # noqa: E731
    elif shape.column and p == "dgrad":
        t.update(g=rand(m, n), x=rand(m // w, k), grad_in=empty(m // w, k))

        def body():
            _, streams = F.begin(tp, plan, "dgrad")
            return F.column_dgrad(t["g"], t["x"], t["weight"], t["grad_in"], plan, tp, nodes,
                                  streams, op, False)
    elif shape.column:  # wgrad: hides the dgrad's reduce-scatter, unless that moved
        t.update(g=rand(m, n), inp=rand(m, k), grad_w=empty(n, k), grad_in=empty(m // w, k))
        if not (trial.comm_moved and overlap):
            t["pending"] = rand(m, k)

        def body():
            F.begin(tp, plan, "wgrad")
            F.column_wgrad(t["g"], t["inp"], t["weight"], t["grad_w"], t["grad_in"],
                           t.get("pending"), plan, tp, False)
    elif p == "fprop":
        t.update(x=rand(m, k), out=empty(m // w, n))
        body = lambda: F.row_fprop(t["x"], t["weight"], None, t["out"], plan, tp, nodes)  # noqa: E731
    elif p == "dgrad":
        t.update(g=rand(m // w, n), grad_in=empty(m, k))

        def body():
            _, streams = F.begin(tp, plan, "dgrad")
            return F.row_dgrad(t["g"], t["weight"], t["grad_in"], plan, tp, nodes, streams, op)
    else:  # wgrad: the GEMM on the dgrad's gathered gradient
        t.update(g_full=rand(m, n), x=rand(m, k), grad_w=empty(n, k))

        def body():
            F.begin(tp, plan, "wgrad")
            F.row_wgrad(t["g_full"], t["x"], t["weight"], t["grad_w"], plan, False)
    return TrialPass(body, t, op)


RANDN_BOUND = 6.0  # the amax an FP8 trial's operands are scaled for


def fp8_trial_pass(trial: Trial, tp: Transport, device: Any, dtype: torch.dtype,
                   precision: Precision, *, overlap: bool = True,
                   nodes: Sequence[Sequence[int]] | None = None) -> TrialPass:
    """The trial's pass in FP8 (`precision`: its types; the wgrad in FP8): its operands
    quantized beforehand (the layer quantizes each once per pass, before any transfer, so
    chunking does not change that cost) and laid out as the layer hands them to the same
    pass function, with their scaled GEMM; outputs in `dtype`. The transposed copies the
    layer's casts write (the FP8 weight's; a column wgrad's gradient, a row wgrad's input)
    are made beforehand too, and so is a row layer's input laid out chunk-major where its
    cast writes it so (`layers.functions.row_input_order`; `tensors['x']` keeps its row
    order, `'x_in'` is what the pass reads); a wgrad's gathered operand is transposed
    inside the timed pass, where the layer's wgrad transposes it. The cost model adds what
    is made beforehand (simulate/fp8_work.py).
    Random operands, one scale per FP8 type (`tensors`: 'scale_fwd', 'scale_grad'), the
    same on every rank, so a gathered FP8 tensor has one scale, as in the layer. The column
    dgrad gathers the FP8 input where the wgrad is FP8, else the input in `dtype`.
    Per-tensor scales (row-wise: ValueError): current and delayed scaling's passes gather
    and multiply the same FP8 operands; how their scales are made (the amax exchange
    before a gather, or the histories' updates after the pass) the cost model adds."""
    from ..overlap import fp8
    from ..overlap.fp8 import transposed

    if precision.recipe not in ("tensorwise", "delayed"):
        raise ValueError(f"{trial.name}: the tuner times FP8 passes with per-tensor scales; "
                         f"{precision.recipe!r} scaling is predicted by the cost model only "
                         "(megatron-overlap tune --measure model)")

    shape, p = trial.spec.shape, trial.spec.pass_name
    m, k, n, w = shape.m, shape.k, shape.n, tp.world_size
    g = torch.Generator(device="cpu").manual_seed(1234 + tp.rank)
    bound = torch.tensor(RANDN_BOUND, device=device)  # randn beyond it saturates
    scales = {d: fp8.scale_for(bound, d) for d in (precision.fwd, precision.grad)}

    def q8(fp8_dtype: torch.dtype, *size: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randn(*size, generator=g, dtype=torch.float32).to(device)
        return fp8.quantize(t, scales[fp8_dtype], fp8_dtype), scales[fp8_dtype]

    def empty(*size: int) -> torch.Tensor:
        return torch.empty(*size, device=device, dtype=dtype)

    plan = trial_plan(trial, overlap)
    op = plan.op_name(p)
    w8, sw = q8(precision.fwd, n, k)
    t: dict[str, torch.Tensor] = {"weight": w8, "scale_fwd": scales[precision.fwd],
                                  "scale_grad": scales[precision.grad]}
    if p == "fprop":
        x8, sx = q8(precision.fwd, m // w if shape.column else m, k)
        t.update(x=x8, out=empty(m if shape.column else m // w, n))
        run = F.column_fprop if shape.column else F.row_fprop
        gemm = fp8.ScaledGemm(sx, sw, dtype, fast_accum=precision.fast_accum("fprop"))
        kw, t["x_in"] = {}, x8  # x (row order) for a reference; x_in as the pass reads it
        if not shape.column:  # a row layer's input as its cast lays it out
            kw = {"scaling": precision.recipe}
            order = F.row_input_order(plan, tp, nodes, precision.recipe)
            if order is not None:
                t["x_in"] = fp8.chunk_major(x8, *order)
        body = lambda: run(t["x_in"], t["weight"], None, t["out"], plan, tp, nodes, gemm=gemm, **kw)  # noqa: E731
    elif p == "dgrad":
        g8, sg = q8(precision.grad, m if shape.column else m // w, n)
        t.update(g=g8, wt=transposed(w8), grad_in=empty(m // w if shape.column else m, k))
        if shape.column:  # the input the wgrad gathers
            x8 = q8(precision.fwd, m // w, k)[0]
            t["x"] = x8 if precision.wgrad else x8.to(torch.float32).to(dtype)
        gemm = fp8.ScaledGemm(sg, sw, dtype, fast_accum=precision.fast_accum("dgrad"))

        def body():
            _, streams = F.begin(tp, plan, "dgrad")
            if shape.column:
                return F.column_dgrad(t["g"], t["x"], t["wt"].t(), t["grad_in"], plan, tp, nodes,
                                      streams, op, False, gemm=gemm)
            return F.row_dgrad(t["g"], t["wt"].t(), t["grad_in"], plan, tp, nodes, streams, op,
                               gemm=gemm)
    else:  # wgrad: g^T @ input, both FP8 (the gathered input, the gathered gradient)
        g8, sg = q8(precision.grad, m, n)
        x8, sx = q8(precision.fwd, m, k)
        gemm = fp8.ScaledGemm(sg, sx, dtype, fast_accum=precision.fast_accum("wgrad"))
        t["grad_w"] = empty(n, k)
        if shape.column:  # the gradient column-major, as its cast leaves it
            t.update(g=transposed(g8).t(), inp=x8, grad_in=empty(m // w, k))
            if not (trial.comm_moved and overlap):
                t["pending"] = empty(m, k).normal_()

            def body():
                F.begin(tp, plan, "wgrad")
                F.column_wgrad(t["g"], t["inp"], t["weight"], t["grad_w"], t["grad_in"],
                               t.get("pending"), plan, tp, False, gemm=gemm, fp8=True)
        else:  # the gathered gradient row-major; this rank's input column-major (its cast)
            t.update(g=g8, x=transposed(x8).t())

            def body():
                F.begin(tp, plan, "wgrad")
                F.row_wgrad(t["g"], t["x"], t["weight"], t["grad_w"], plan, False, gemm=gemm,
                            fp8=True)
    return TrialPass(body, t, op)


def as_timed(trial: Trial, tp: Transport) -> Trial:
    """The trial as its pass can run on `tp`: the candidate's settings with every key that
    cannot change what the pass runs there put back to TE's default for its method, namely
    keys config.effects says take no effect with this method on the layout's backend (the
    rule the search space varies keys by), and the SM-margin keys where `tp` holds no margin
    (`pass_streams` resolves none: the null transport, whose timings the cost model applies
    the margin to itself). Every other key (aggregate, gemm_streams, num_splits, the stream
    priorities, ring_order, ...) is kept, so it is applied when this trial is timed and is
    part of `timed_key`: time this trial, file the timing under `timed_key(it, tp)`."""
    s, layout = trial.candidate.settings, trial.candidate.layout
    default = as_run(trial.spec, LayerSettings.default(s.name, s.method), layout)
    effects = s.effects(layout.backend)
    keep = {f.name: getattr(s, f.name) if effects.get(f.name, ACTIVE) == ACTIVE
            else getattr(default, f.name) for f in dataclasses.fields(s)}
    s = LayerSettings(**keep)
    if not F.pass_streams(tp, s)[1].sm_margin:  # num_sm holds nothing back on tp
        s = dataclasses.replace(s, num_sm=default.num_sm, set_sm_margin=default.set_sm_margin)
    return dataclasses.replace(trial, candidate=dataclasses.replace(trial.candidate, settings=s))


def layout_nodes(trial: Trial) -> list[list[int]] | None:
    """The ranks per node of the trial's hierarchical ring order on its layout (None: flat),
    as the layer hands them to its pass (node-major ranks, `Layout.local` per node)."""
    layout = trial.candidate.layout
    if ring_order_of(trial.candidate.settings, layout) != "hierarchical":
        return None
    return [list(range(i, i + layout.local)) for i in range(0, layout.tp, layout.local)]


def timed_key(trial: Trial, tp: Transport) -> str:
    """What a timing of `trial`'s pass on `tp` depends on, as one string: the pass (its
    dimensions, which pass of which kind of layer, whether its communication moved), every
    field of the settings `as_timed` runs it with (taken from the settings object, not a
    list of names: a key added to LayerSettings joins the key by itself), what
    `pass_streams` resolves them to on `tp` (gemm_streams 0: the global default; the
    priorities; the SM margin) and the ring order's nodes."""
    t = as_timed(trial, tp)
    shape, s = t.spec.shape, t.candidate.settings
    comm_p, streams = F.pass_streams(tp, s)
    return json.dumps({
        "pass": [shape.m, shape.k, shape.n, shape.column, t.spec.pass_name, t.comm_moved],
        "numerics": dataclasses.asdict(shape.numerics),
        "world": tp.world_size, "transport": list(tp.backends), "settings": dataclasses.asdict(s),
        "streams": [streams.n, streams.priority, streams.sm_margin, comm_p],
        "nodes": layout_nodes(t)}, sort_keys=True)

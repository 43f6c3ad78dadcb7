"""The twelve layer passes of a transformer layer's TP linears (TE's ub_cfgs
names), what each multiplies and moves, and their predicted times.

With sequence parallelism (what tp_comm_overlap needs), per TP size W and
forward GEMM [M,K]x[K,N]:

| pass | GEMM (rows, inner, cols) | communication (one rank's block) |
|---|---|---|
| column fprop | M, K, N | all-gather of the input, (M/W) x K |
| column dgrad | M, N, K | all-gather of the saved input (bulk), or, with rs_dgrad, also the dgrad's reduce-scatter (M/W) x K |
| column wgrad | N, M, K | reduce-scatter of the dgrad output (bulk); nothing under rs_dgrad |
| row fprop | M, K, N | reduce-scatter of the output, (M/W) x N |
| row dgrad | M, N, K | all-gather of the output grad, (M/W) x N |
| row wgrad | N, M, K | none (reuses the dgrad's gathered grad: `external`) |

A pass's GEMM runs in its shape's `numerics` (FP8 or the parameters' dtype) and each
transfer moves the bytes of the dtype it carries (`numerics.py`: FP8 gathers one byte
per element, row-wise scale tails included; reductions the parameters' dtype). An FP8
pass also pays its memory-bound FP8 work (`fp8_work.py`: amaxes, casts, transposed
copies), on the GEMMs' stream, in both paths; launched from Python (eager) each of its
kernels costs `eager_kernel_us` of host time; a tensorwise amax exchange (before a
gather) costs one small collective's latency.

Each pass kind multiplies its operands in one layout (`PassSpec.gemm_layout`,
`shapes.GEMM_LAYOUTS`: fprop NT, dgrad NN, wgrad TN); a measured GEMM time applies to
its own layout only.

The non-overlapped path runs the GEMM and the NCCL collective one after the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..config import LayerSettings
from ..config.names import AGGREGATE_AUTO
from ..overlap import ring_steps
from ..overlap.fp8 import row_input_chunks
from .fp8_work import DELAYED_AMAXES, PassWork, Work, batched, gathered, pass_work
from .gemm import GemmModel
from .numerics import dtype_name
from .hardware import Hardware, Layout
from .play import Costs, play
from .runs import Run, recorded
from .shapes import GEMM_LAYOUTS, Shape
from .timeline import Engine, Sim

PASSES = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class PassSpec:
    shape: Shape
    pass_name: str

    @property
    def name(self) -> str:
        """The ub_cfgs layer name, e.g. qkv_fprop."""
        return f"{self.shape.buffer}_{self.pass_name}"

    @property
    def gemm(self) -> tuple[int, int, int]:
        s = self.shape
        return {"fprop": (s.m, s.k, s.n), "dgrad": (s.m, s.n, s.k), "wgrad": (s.n, s.m, s.k)}[
            self.pass_name]

    @property
    def gemm_layout(self) -> str:
        """The operand layout of `gemm` as the layer multiplies it (`shapes.GEMM_LAYOUTS`):
        NT (fprop), NN (dgrad), TN (wgrad)."""
        return GEMM_LAYOUTS[self.pass_name]

    @property
    def comm(self) -> str:
        """The collective of the non-overlapped path: ag | rs | none."""
        col = self.shape.column
        return {("fprop", True): "ag", ("dgrad", True): "ag", ("wgrad", True): "rs",
                ("fprop", False): "rs", ("dgrad", False): "ag", ("wgrad", False): "none"}[
            (self.pass_name, col)]

    @property
    def block_elems(self) -> int:
        """Elements of one rank's block of the communicated tensor."""
        s = self.shape
        width = s.k if s.column else s.n
        return s.m // s.tp * width

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The dtype the pass's GEMM multiplies in (its first operand's)."""
        return self.shape.numerics.gemm_dtype(self.pass_name)

    @property
    def moved(self) -> tuple[torch.dtype, int]:
        """(dtype, tail bytes per row) of the non-overlapped path's collective: an FP8
        gather carries FP8 (a column dgrad's gather of the input: what the wgrad takes),
        a reduction the parameters' dtype."""
        num = self.shape.numerics
        if self.comm != "ag":
            return num.params, 0
        if self.shape.column and self.pass_name == "dgrad":
            return num.input_gather, 0
        return self.gemm_dtype, num.tail(self.pass_name)

    @property
    def block_bytes(self) -> int:
        """Bytes of one rank's block of the communicated tensor, in the dtype it carries."""
        dtype, tail = self.moved
        rows = self.shape.m // self.shape.tp
        return self.block_elems * dtype.itemsize + rows * tail


def layer_passes(shape: Shape) -> list[PassSpec]:
    return [PassSpec(shape, p) for p in PASSES]


@dataclass
class PassResult:
    """Times in microseconds. hidden: (baseline - overlapped) / (baseline - compute_only),
    DESIGN.md's hidden fraction (None when nothing is there to hide)."""

    name: str
    shape: str
    model: str
    tp: int
    gemm: tuple[int, int, int]
    comm: str
    settings: dict[str, Any]
    ring_order: str
    gemm_us: float  # the monolithic GEMM on all SMs
    comm_us: float  # the non-overlapped path's collective(s)
    baseline_us: float  # GEMM then collective
    compute_only_us: float  # the overlapped schedule with communication skipped
    overlapped_us: float
    gemm_source: str = "roofline"
    host_us: float | None = None  # measured host time per call of the overlapped pass (host.py)
    host_bound: bool = False  # that host time exceeds the pass's GPU time
    gemm_dtype: str = "bf16"  # what the GEMM multiplies in (numerics.DTYPES' name)
    moved_bytes: int = 0  # one rank's block of the non-overlapped path's collective
    fp8_work_us: float = 0.0  # the FP8 work in every time above (fp8_work.py)
    fp8_weight_us: float = 0.0  # of which the weight's: once per step (the FP8 weight cache)
    later_saved_us: float = 0.0  # what a step's later micro-batch saves of overlapped_us
    later_saved_base_us: float = 0.0  # ... of baseline_us (none where host-bound)

    @property
    def exposed_us(self) -> float:
        return self.overlapped_us - self.compute_only_us

    @property
    def hidden(self) -> float | None:
        room = self.baseline_us - self.compute_only_us
        return (self.baseline_us - self.overlapped_us) / room if room > 1e-9 else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("gemm_us", "comm_us", "baseline_us", "compute_only_us", "overlapped_us",
                  "fp8_work_us", "fp8_weight_us", "later_saved_us", "later_saved_base_us"):
            out[k.replace("_us", "_ms")] = out.pop(k) / 1e3
        host = out.pop("host_us")
        out["host_ms"] = None if host is None else host / 1e3
        out["exposed_ms"] = self.exposed_us / 1e3
        out["hidden_fraction"] = self.hidden
        out["gemm"] = list(self.gemm)
        return out


def schedule_of(s: LayerSettings, layout: Layout) -> str:
    """What the layer runs for these settings on this layout, as overlap/ dispatches it:
    ag_ring | ag_hier | rs_pipeline | rs_ring | rs_hier | bulk | external. A TP group
    spanning nodes with ring_order auto or hierarchical runs the hierarchical order for
    ring exchanges and for pipelined reduce-scatters alike (num_splits then unused)."""
    if s.method in ("bulk", "external"):
        return s.method
    hier = layout.nodes > 1 and s.ring_order in ("auto", "hierarchical")
    if not s.is_reduce_scatter:
        return "ag_hier" if hier else "ag_ring"
    if hier:
        return "rs_hier"
    return "rs_pipeline" if s.method == "pipeline" else "rs_ring"


def ring_order_of(s: LayerSettings | None, layout: Layout) -> str:
    if s is None or s.method in ("bulk", "external"):
        return "-"
    return "hierarchical" if schedule_of(s, layout).endswith("hier") else "flat"


def engine_for(s: LayerSettings, schedule: str, backend: str, hw: Hardware) -> Engine:
    """Who moves the intra-node bytes, from what the backend honours (config.effects).
    NCCL (torch_p2p) runs SM kernels of its own size. Ring schedules move on copy engines
    unless use_ce takes effect and is off (then SM kernels on num_sm SMs). Pipeline and bulk
    collectives run SM kernels: on num_sm SMs where the margin reserves them, else
    NCCL-sized. With set_sm_margin in effect the GEMM is held num_sm SMs short."""
    if backend == "torch_p2p":
        return Engine("sm", hw.nccl_sms, hw.nccl_sms)
    eff = s.effects(backend)
    margin = s.num_sm if s.set_sm_margin and eff["num_sm"] == "active" else 0
    if schedule in ("ag_ring", "ag_hier", "rs_ring", "rs_hier"):
        if eff["use_ce"] != "active" or s.use_ce:
            return Engine("ce", 0, margin)
        return Engine("sm", s.num_sm, s.num_sm)
    sms = margin or hw.nccl_sms
    return Engine("sm", sms, sms)


_KIND = {"ag_ring": "ag_ring", "ag_hier": "ag_ring", "rs_ring": "rs_ring", "rs_hier": "rs_ring",
         "rs_pipeline": "rs_pipeline"}


def run_of(spec: PassSpec, s: LayerSettings, layout: Layout) -> Run:
    """What the layer runs for pass `spec` with settings `s` on `layout`. A ring's one
    waiting GEMM (`wait_gemm`) plays as the ring: the same transfers, each block's rows
    multiplied once the block has landed, as its waiting tiles are; its GEMM time is its
    own measured compute side where the tuner measured it (`tune.passes.timed_key` holds
    the key), else the chunk GEMMs' model, under which it never wins (candidates that tie
    keep the key off: `space.choose`)."""
    schedule, shape, tp = schedule_of(s, layout), spec.shape, layout.tp
    rows, num = shape.m // tp, shape.numerics
    return Run(spec.name, schedule, s.method, spec.comm, tp, layout.local, spec.gemm,
               (rows, spec.block_elems // rows), s.aggregates(spec.gemm[2], tp, layout.nodes),
               s.splits(tp),
               gather=spec.pass_name == "dgrad" and shape.column and s.is_reduce_scatter,
               dtype=num.params, a_dtype=spec.gemm_dtype, tail=num.tail(spec.pass_name),
               gather_dtype=num.input_gather)


def _schedule_end(spec: PassSpec, s: LayerSettings, hw: Hardware, layout: Layout,
                  gemm: GemmModel, engine: Engine, comm_moved: bool) -> float:
    """One run of the pass's overlapped schedule, the real one on every rank on the
    modelled clock (the compute-only floor when engine.free)."""
    m, k, n = spec.gemm
    ops, tp = spec.gemm_layout, layout.tp
    if spec.comm == "none" or comm_moved or tp == 1 or s.method == "external":  # the GEMM alone
        return gemm.mono_us(m, k, n, ops)
    sim = Sim(hw, layout, engine)
    run = run_of(spec, s, layout)
    kind = _KIND.get(run.schedule)
    chunks = run.splits if run.schedule == "rs_pipeline" else tp
    mode = layout.mode
    # a schedule timed eagerly already holds its host launch gaps
    eager_timed = gemm.measured_chunks(m, k, n, ops, chunks, kind, "eager")
    step_us = 0.0 if mode == "eager" and eager_timed else _step_us(hw, gemm)
    # a measured ring reduce-scatter (`compute_side.py`: the flat `gemm_rs.ring_exchange`,
    # whose timing the hierarchical order shares, `_KIND`) includes its reduction: taken
    # out of its chunk GEMMs (the hierarchical order's own sums are events)
    block = spec.block_elems * spec.shape.numerics.params.itemsize
    extra = gemm.ring_rs_extra_us(tp, block) if run.schedule in ("rs_ring", "rs_hier") else 0.0
    # a measured FP8 pipeline holds its chunks' row copies: fp8_work counts them
    extra += _batched_work(spec, s, layout).us(hw)
    sms = sim.gemm_sms

    def gemm_us(rows: int, kk: int, nn: int) -> float:
        if (kk, nn) != (k, n) or m % rows:
            raise ValueError(f"{spec.name}: the schedule ran a [{rows}, {kk}] x [{kk}, {nn}] GEMM, "
                             f"not a row chunk of the pass's [{m}, {k}] x [{k}, {n}]")
        if run.schedule == "ag_ring" and run.aggregate:  # the ring's timing, shared by rows
            return gemm.chunk_us(m, k, n, ops, chunks, kind, sms, extra, mode, rows=rows)
        return gemm.chunk_us(m, k, n, ops, m // rows, kind, sms, extra, mode)

    # bulk: two launches and no schedule loop, each what a collective launch costs the host
    launch = sim.comm_launch_us if run.schedule == "bulk" else step_us
    play(sim, recorded(run),
         Costs(gemm_us, launch, gemm.mem_us, engine.sms or None))
    return sim.end()


def _step_us(hw: Hardware, gemm: GemmModel) -> float:
    measured = gemm.calibration.eager_step_us() if gemm.calibration else None
    return measured if measured is not None else hw.eager_step_us


def baseline_us(spec: PassSpec, hw: Hardware, layout: Layout, gemm: GemmModel) -> tuple[float, float]:
    """(collective, GEMM + collective) of the non-overlapped path (NCCL, its own SMs)."""
    m, k, n = spec.gemm
    sim = Sim(hw, layout, Engine("sm", hw.nccl_sms))
    coll = 0.0 if spec.comm == "none" else sim.collective_us(spec.block_bytes)
    return coll, gemm.mono_us(m, k, n, spec.gemm_layout) + coll


def as_run(spec: PassSpec, s: LayerSettings | None, layout: Layout) -> LayerSettings | None:
    """Settings `s` as the layer runs them for `spec` on `layout`: `aggregate` resolved for
    the pass's GEMM ("auto": `LayerSettings.aggregates`, as `layers.plan` resolves it)."""
    return None if s is None else s.resolved(spec.gemm[2], layout.tp, layout.nodes)


def gemm_calls(spec: PassSpec, s: LayerSettings | None, layout: Layout) -> int:
    """How many GEMM calls the pass's schedule issues: one per ring step (every rank's
    block; an aggregate ring's `ring_steps`), one per pipeline chunk, else one."""
    if s is None or spec.comm == "none" or layout.tp == 1:
        return 1
    return chunk_gemms(as_run(spec, s, layout), layout)


def chunk_gemms(s: LayerSettings, layout: Layout) -> int:
    """How many chunk GEMMs settings `s` run on `layout` where the pass communicates (what
    `gemm_calls` counts)."""
    schedule = schedule_of(s, layout)
    if schedule == "rs_pipeline":
        return s.splits(layout.tp)
    if schedule == "ag_ring" and s.aggregate == AGGREGATE_AUTO:
        raise ValueError(f"{s.name}: aggregate auto is decided per pass (as_run) before its "
                         "GEMMs are counted")
    if schedule == "ag_ring" and s.aggregate:
        return len(ring_steps(0, layout.tp, layout.tp % 2 == 0))
    return layout.tp if schedule in ("ag_ring", "ag_hier", "rs_ring", "rs_hier") else 1


def _batched_work(spec: PassSpec, s: LayerSettings | None, layout: Layout) -> Work:
    """The row copies of an FP8 pipelined reduce-scatter's chunks (`fp8_work.batched`),
    where `s` runs one over more than one chunk; else nothing. A row layer's forward
    copies nothing where its input is cast chunk-major (`overlap.fp8.row_input_chunks`:
    per-tensor scales); a column dgrad's gradient is copied."""
    if (s is None or layout.tp == 1 or spec.gemm_dtype.itemsize != 1
            or schedule_of(s, layout) != "rs_pipeline" or s.splits(layout.tp) == 1
            or (spec.pass_name == "fprop" and row_input_chunks(
                spec.shape.numerics.scaling, s.method, True, None, layout.tp,
                s.splits(layout.tp)) is not None)):
        return Work()
    m, inner, _ = spec.gemm
    return batched(m, inner + spec.shape.numerics.tail(spec.pass_name), s.splits(layout.tp))


def fp8_work(spec: PassSpec, s: LayerSettings | None, layout: Layout,
             accumulates: bool = True) -> PassWork:
    """The pass's FP8 work (none in the parameters' dtype): `fp8_work.pass_work` (the
    wgrad into an fp32 main_grad where `accumulates`, Megatron-LM's default), and the row
    copies of an FP8 pipelined reduce-scatter's chunks where `s` runs one."""
    num, shape = spec.shape.numerics, spec.shape
    if not num.fp8:
        return PassWork()
    work = pass_work(spec.pass_name, shape.column, shape.m, shape.tp, shape.k, shape.n,
                     num.params.itemsize, num.scaling, num.fp8_wgrad,
                     gemm_calls(spec, s, layout), accumulates)
    return PassWork(work.activations + _batched_work(spec, s, layout), work.weight)


def amax_exchange_us(spec: PassSpec, hw: Hardware, layout: Layout) -> float:
    """An FP8 pass's exchange of the TP group's amaxes (a float or two a rank). Tensorwise:
    before the tensor it scales is gathered (a column forward's input, a row dgrad's
    gradient). Delayed: at the end of every pass that quantizes (forward: the input's and
    the weight's; dgrad: the gradient's), after its GEMMs, for the next scales."""
    num, shape = spec.shape.numerics, spec.shape
    if not num.fp8 or layout.tp == 1 or num.scaling == "rowwise":
        return 0.0
    floats = (DELAYED_AMAXES.get(spec.pass_name, 0) if num.scaling == "delayed"
              else int(gathered(spec.pass_name, shape.column)))
    return Sim(hw, layout, Engine("sm", hw.nccl_sms)).collective_us(4 * floats) if floats else 0.0


def megatron_modelled_host_us(hw: Hardware, comm: float | bool = True) -> float:
    """Megatron's path's host time per pass where no measurement of it is at hand: one
    schedule step, and one collective launch where the pass communicates."""
    return hw.eager_step_us + (hw.eager_comm_us if comm else 0.0)


def measured_host_us(spec: PassSpec, layout: Layout, gemm: GemmModel) -> float | None:
    """The calibration's measured host time per call of this pass (None: not measured)."""
    host = gemm.calibration.host if gemm.calibration is not None else None
    return None if host is None else host.pass_us(spec.shape.buffer, spec.pass_name, layout.tp,
                                                  layout.mode, spec.shape.column)


def simulate_pass(spec: PassSpec, s: LayerSettings | None, hw: Hardware, layout: Layout,
                  gemm: GemmModel, comm_moved: bool = False) -> PassResult:
    """Predicted times of one pass with settings `s` (None: not overlapped, Megatron's
    order). comm_moved: a column wgrad whose reduce-scatter moved into an rs_dgrad dgrad.

    With a measured host time per call (calibration.host), a pass queued back to back
    costs max(host, GPU): the schedule is timed on the device alone (no per-launch host
    gaps), then host-bound where the host takes longer. Megatron's path then pays its own
    linears' measured host time per call where the file has it (`chain_megatron`), else
    one step and one collective launch of modelled host time (hw.eager_step_us +
    eager_comm_us)."""
    if s is not None and s.name != spec.name:
        raise ValueError(f"settings of {s.name} given for pass {spec.name}")
    s = as_run(spec, s, layout)
    gemm = gemm.for_dtype(spec.gemm_dtype)
    host = measured_host_us(spec, layout, gemm)
    comm_us, base_us = baseline_us(spec, hw, layout, gemm)
    exchange = amax_exchange_us(spec, hw, layout)
    eager = layout.mode == "eager"
    # each FP8 kernel launched from Python costs host time: the pass's own where no host
    # time is measured (as eager mode counts every launch), else added to the measured one
    launch = lambda w: w.kernels * hw.eager_kernel_us if eager else 0.0  # noqa: E731
    device = lambda w: w.us(hw) + (launch(w) if host is None else 0.0)  # noqa: E731
    base_work = fp8_work(spec, None, layout)
    base_gpu, base_host = base_us + device(base_work.total) + exchange, None
    if host is not None:
        mcore = gemm.calibration.host.megatron_pass_us(  # type: ignore[union-attr]
            spec.pass_name, layout.tp, layout.mode, spec.shape.column)
        base_host = (megatron_modelled_host_us(hw, comm_us) if mcore is None else mcore) \
            + launch(base_work.total)
        layout = dataclasses.replace(layout, mode="graph")  # device time; the host apart
    base_us = max(base_gpu, base_host or 0.0)
    m, k, n = spec.gemm
    if s is None:
        work, over_gpu, over_host = base_work, base_gpu, base_host
        floor = base_us
    else:
        work = fp8_work(spec, s, layout)
        over_host = None if host is None else host + launch(work.total)
        fp8_us = device(work.total) + exchange
        engine = engine_for(s, schedule_of(s, layout), layout.backend, hw)
        over_gpu = _schedule_end(spec, s, hw, layout, gemm, engine, comm_moved) + fp8_us
        floor = _schedule_end(spec, s, hw, layout, gemm, Engine(free=True), comm_moved) + fp8_us
    over = max(over_gpu, over_host or 0.0)
    bound = s is not None and over_host is not None and over_host > over_gpu

    def later_saved(total: float, gpu: float, host_us: float | None, w: PassWork) -> float:
        """What a step's later micro-batch saves: the FP8 weights reused, their work and
        launches, unless the other side (host or device) still takes as long."""
        return total - max(gpu - device(w.weight),
                           0.0 if host_us is None else host_us - launch(w.weight))

    return PassResult(
        name=spec.name, shape=spec.shape.name, model=spec.shape.model, tp=layout.tp,
        gemm=spec.gemm, comm=spec.comm,
        settings=s.to_dict() if s is not None else {"method": "none"},
        ring_order=ring_order_of(s, layout),
        gemm_us=gemm.mono_us(m, k, n, spec.gemm_layout), comm_us=comm_us, baseline_us=base_us,
        compute_only_us=floor, overlapped_us=over,
        gemm_source=gemm.source(m, k, n, spec.gemm_layout),
        host_us=over_host if s is not None else None, host_bound=bound,
        gemm_dtype=dtype_name(spec.gemm_dtype),
        moved_bytes=0 if spec.comm == "none" else spec.block_bytes,
        fp8_work_us=work.total.us(hw), fp8_weight_us=work.weight.us(hw),
        later_saved_us=later_saved(over, over_gpu, over_host, work),
        later_saved_base_us=later_saved(base_us, base_gpu, base_host, base_work))

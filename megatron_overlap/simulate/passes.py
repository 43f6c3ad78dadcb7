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

The non-overlapped path runs the GEMM and the NCCL collective one after the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..config import LayerSettings
from . import schedules as sch
from .gemm import GemmModel
from .hardware import Hardware, Layout
from .shapes import Shape
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

    @property
    def exposed_us(self) -> float:
        return self.overlapped_us - self.compute_only_us

    @property
    def hidden(self) -> float | None:
        room = self.baseline_us - self.compute_only_us
        return (self.baseline_us - self.overlapped_us) / room if room > 1e-9 else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("gemm_us", "comm_us", "baseline_us", "compute_only_us", "overlapped_us"):
            out[k.replace("_us", "_ms")] = out.pop(k) / 1e3
        out["exposed_ms"] = self.exposed_us / 1e3
        out["hidden_fraction"] = self.hidden
        out["gemm"] = list(self.gemm)
        return out


def engine_for(s: LayerSettings, backend: str, hw: Hardware) -> Engine:
    """Who moves the intra-node bytes. Ring exchange on symm always uses copy engines,
    on nvshmem when use_ce; NCCL (torch_p2p) always runs SM kernels of its own size;
    pipeline and bulk collectives run on num_sm SMs (TE's meaning)."""
    if s.method == "ring_exchange" and (backend == "symm" or (backend == "nvshmem" and s.use_ce)):
        return Engine("ce", 0)
    return Engine("sm", hw.nccl_sms if backend == "torch_p2p" else s.num_sm)


def _kind(s: LayerSettings) -> str | None:
    if s.method == "ring_exchange":
        return "rs_ring" if s.is_reduce_scatter else "ag_ring"
    return "rs_pipeline" if s.method == "pipeline" else None


def _schedule_end(spec: PassSpec, s: LayerSettings | None, ring_order: str, hw: Hardware,
                  layout: Layout, gemm: GemmModel, engine: Engine, comm_moved: bool) -> float:
    """One run of the pass's overlapped schedule (or the compute-only floor when engine.free)."""
    sim = Sim(hw, layout, engine)
    m, k, n = spec.gemm
    tp, sms = layout.tp, sim.gemm_sms
    block = spec.block_elems * hw.dtype_bytes
    step_us = _step_us(hw, gemm)
    if s is None or spec.comm == "none" or comm_moved or tp == 1:  # the GEMM alone
        return gemm.mono_us(m, k, n)
    kind = _kind(s)
    if s.method == "bulk":
        sch.bulk(sim, gemm.mono_us(m, k, n, sms), block, step_us)
        return sim.end()
    if s.method == "ring_exchange" and not s.is_reduce_scatter:
        work = sch.Work(gemm.chunk_us(m, k, n, tp, kind, sms), block, step_us)
        sch.flat_or_hierarchical_ag(sim, work, s.aggregate, ring_order)
        return sim.end()
    # GEMM -> reduce-scatter (row fprop, or a column dgrad under rs_dgrad)
    if spec.pass_name == "dgrad" and spec.shape.column:  # the input's all-gather runs alongside
        for r in range(tp):
            sim.launch_comm(r)
        sim.collective(block, sms=engine.sms or None)
    add_us = gemm.add_us(block)
    if s.method == "pipeline":
        splits = s.splits(tp)
        work = sch.Work(gemm.chunk_us(m, k, n, splits, kind, sms), block, step_us)
        sch.pipeline_rs(sim, work, splits, block / splits)
    else:
        extra = (tp - 1) * add_us  # the measured ring schedule includes its adds
        work = sch.Work(gemm.chunk_us(m, k, n, tp, kind, sms, extra_us=extra), block, step_us,
                        add_us)
        sch.flat_or_hierarchical_rs(sim, work, ring_order)
    return sim.end()


def _step_us(hw: Hardware, gemm: GemmModel) -> float:
    measured = gemm.calibration.eager_step_us() if gemm.calibration else None
    return measured if measured is not None else hw.eager_step_us


def baseline_us(spec: PassSpec, hw: Hardware, layout: Layout, gemm: GemmModel) -> tuple[float, float]:
    """(collective, GEMM + collective) of the non-overlapped path (NCCL, its own SMs)."""
    m, k, n = spec.gemm
    sim = Sim(hw, layout, Engine("sm", hw.nccl_sms))
    coll = 0.0 if spec.comm == "none" else sim.collective_us(spec.block_elems * hw.dtype_bytes)
    return coll, gemm.mono_us(m, k, n) + coll


def simulate_pass(spec: PassSpec, s: LayerSettings | None, hw: Hardware, layout: Layout,
                  gemm: GemmModel, ring_order: str = "flat", comm_moved: bool = False) -> PassResult:
    """Predicted times of one pass with settings `s` (None: not overlapped).
    comm_moved: a column wgrad whose reduce-scatter moved into an rs_dgrad dgrad."""
    if s is not None and s.name != spec.name:
        raise ValueError(f"settings of {s.name} given for pass {spec.name}")
    engine = engine_for(s, layout.backend, hw) if s is not None else Engine("sm", hw.nccl_sms)
    comm_us, base_us = baseline_us(spec, hw, layout, gemm)
    m, k, n = spec.gemm
    if s is None:
        over = floor = base_us
    else:
        over = _schedule_end(spec, s, ring_order, hw, layout, gemm, engine, comm_moved)
        floor = _schedule_end(spec, s, ring_order, hw, layout, gemm, Engine(free=True), comm_moved)
    if s is not None and s.method == "ring_exchange" and layout.nodes == 1:
        ring_order = "flat"  # one node: the order changes nothing
    return PassResult(
        name=spec.name, shape=spec.shape.name, model=spec.shape.model, tp=layout.tp,
        gemm=spec.gemm, comm=spec.comm,
        settings=s.to_dict() if s is not None else {"method": "none"},
        ring_order=ring_order if s is not None and s.method == "ring_exchange" else "-",
        gemm_us=gemm.mono_us(m, k, n), comm_us=comm_us, baseline_us=base_us,
        compute_only_us=floor, overlapped_us=over, gemm_source=gemm.source(m, k, n))

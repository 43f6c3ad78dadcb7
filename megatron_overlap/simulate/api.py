"""simulate(): every pass of every shape under the given settings, the best
settings the model finds for each, and a step-time estimate per model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..config import OverlapConfig
from .calibration import Calibration
from .gemm import GemmModel
from .hardware import Hardware, Layout
from .passes import PassResult, layer_passes, simulate_pass
from .shapes import BUFFERS, MODEL_LAYERS, Shape
from .space import Trial, choose, trials, ub_cfgs


@dataclass
class ShapeResult:
    shape: Shape
    given: list[PassResult]  # the passes under the given settings
    best: list[PassResult]  # the passes under the chosen settings
    chosen: dict[str, Trial]  # pass -> trial
    tried: int = 0


@dataclass
class ModelSummary:
    """Sums over one transformer layer's TP linears (times in us), and the step estimate."""

    model: str
    buffers: list[str]
    layers: int
    micro_batches: int
    gemm_us: float = 0.0
    baseline_us: float = 0.0
    given_us: float = 0.0
    best_us: float = 0.0
    fp8_work_us: float = 0.0  # in each per-layer time: the FP8 work around the GEMMs
    fp8_weight_us: float = 0.0  # of which the FP8 weights': once per step
    # what a step's later micro-batch saves of baseline, overlapped, best (FP8 weights reused)
    later_saved_us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("baseline", "overlapped", "best"), 0.0))
    ub_cfgs: dict[str, dict[str, Any]] = field(default_factory=dict)
    ring_orders: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return set(self.buffers) == set(BUFFERS)

    def step_ms(self, per_layer_us: float, later_saved_us: float = 0.0) -> float:
        """Every layer at every micro-batch, a later micro-batch `later_saved_us` shorter
        (the FP8 weights made once per step, at its first: Megatron's schedules drive the
        FP8 weight cache)."""
        return (per_layer_us * self.micro_batches
                - later_saved_us * (self.micro_batches - 1)) * self.layers / 1e3

    def to_dict(self) -> dict[str, Any]:
        per = {"gemm": self.gemm_us, "baseline": self.baseline_us, "overlapped": self.given_us,
               "best": self.best_us}
        fp8 = {"fp8_work": self.fp8_work_us, "fp8_weights": self.fp8_weight_us}
        return {"model": self.model, "buffers": self.buffers, "complete": self.complete,
                "layers": self.layers, "micro_batches": self.micro_batches,
                "per_layer_ms": {k: v / 1e3 for k, v in {**per, **fp8}.items()},
                "step_ms": {k: self.step_ms(v, self.later_saved_us.get(k, 0.0))
                            for k, v in per.items()},
                "picked_ub_cfgs": self.ub_cfgs, "picked_ring_orders": self.ring_orders}


@dataclass
class Report:
    hw: Hardware
    layout: Layout
    calibration: Calibration
    shapes: list[ShapeResult]
    models: list[ModelSummary]
    rs_dgrad: bool = False

    def picked_config(self, model: str) -> OverlapConfig:
        """The chosen settings of `model` as a validated OverlapConfig (TE defaults for
        layers its shapes do not cover)."""
        summary = next(s for s in self.models if s.model == model)
        return OverlapConfig.load(summary.ub_cfgs)


def _given(cfg: OverlapConfig, shape: Shape, hw: Hardware, layout: Layout,
           gemm: GemmModel) -> list[PassResult]:
    moved = shape.column and cfg[f"{shape.buffer}_dgrad"].is_reduce_scatter
    return [simulate_pass(spec, cfg[spec.name], hw, layout, gemm,
                          comm_moved=moved and spec.pass_name == "wgrad")
            for spec in layer_passes(shape)]


def model_score(hw: Hardware, layout: Layout, gemm: GemmModel) -> Callable[[Trial], PassResult]:
    def score(t: Trial) -> PassResult:
        return simulate_pass(t.spec, t.candidate.settings, hw, layout, gemm, t.comm_moved)
    return score


def simulate(shapes: Sequence[Shape], hw: Hardware, layout: Layout,
             calibration: Calibration | None = None, cfg: OverlapConfig | None = None, *,
             rs_dgrad: bool = False,
             layers: dict[str, int] | None = None, micro_batches: int = 1) -> Report:
    """Predict every pass of `shapes` (each at TP=layout.tp) under `cfg` (TE defaults when
    None; its ring_order, auto by default, is hierarchical across nodes), search the valid
    settings for each pass (`choose`: the fastest, or within its TIE the least compute
    side, so a best total may lie up to 1% above the fastest), and sum per model."""
    calibration = calibration or Calibration()
    cfg = cfg or OverlapConfig.load(None)
    gemm = GemmModel(hw, calibration)
    score = model_score(hw, layout, gemm)
    results: list[ShapeResult] = []
    for shape in shapes:
        if shape.tp != layout.tp:
            raise ValueError(f"{shape.name} is at TP={shape.tp}; the layout is TP={layout.tp}")
        scored = {t: score(t) for t in trials(shape, layout, rs_dgrad=rs_dgrad)}
        chosen = choose(shape, {t: r.overlapped_us for t, r in scored.items()},
                        {t: r.compute_only_us for t, r in scored.items()})
        results.append(ShapeResult(shape, _given(cfg, shape, hw, layout, gemm),
                                   [scored[chosen[p]] for p in ("fprop", "dgrad", "wgrad")],
                                   chosen, len(scored)))
    return Report(hw, layout, calibration, results, summarize(results, layers, micro_batches),
                  rs_dgrad)


def summarize(results: Sequence[ShapeResult], layers: dict[str, int] | None,
              micro_batches: int) -> list[ModelSummary]:
    layers = {**MODEL_LAYERS, **(layers or {})}
    out: dict[str, ModelSummary] = {}
    for r in results:
        m = r.shape.model
        s = out.setdefault(m, ModelSummary(m, [], layers.get(m, 1), micro_batches))
        if r.shape.buffer in s.buffers:
            raise ValueError(f"model {m}: two shapes for {r.shape.buffer}")
        s.buffers.append(r.shape.buffer)
        s.gemm_us += sum(p.gemm_us for p in r.given)
        s.baseline_us += sum(p.baseline_us for p in r.given)
        s.given_us += sum(p.overlapped_us for p in r.given)
        s.best_us += sum(p.overlapped_us for p in r.best)
        s.fp8_work_us += sum(p.fp8_work_us for p in r.given)
        s.fp8_weight_us += sum(p.fp8_weight_us for p in r.given)
        s.later_saved_us["baseline"] += sum(p.later_saved_base_us for p in r.given)
        s.later_saved_us["overlapped"] += sum(p.later_saved_us for p in r.given)
        s.later_saved_us["best"] += sum(p.later_saved_us for p in r.best)
        cfg, orders = ub_cfgs(r.chosen.values())
        s.ub_cfgs.update(cfg)
        s.ring_orders.update(orders)
    return list(out.values())

"""The search space: every valid setting of each layer pass, and nothing else.

Valid means what megatron_overlap.config accepts (TE's rules: allowed methods
per layer, rs-dgrad only when asked for), and a key is varied only where it
takes effect for that method on that backend (LayerSettings.effects), so two
candidates never differ only in a key that changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

from ..config import LayerSettings
from ..config.names import RS_DGRAD_LAYERS
from ..config.settings import allowed_methods
from ..overlap import wait_gemm
from ..overlap.streams import default_gemm_streams
from .hardware import Layout
from .passes import PassSpec, as_run, chunk_gemms, layer_passes, ring_order_of, schedule_of
from .shapes import Shape

SPLITS = (1, 2, 4, 8, 16)
NUM_SMS = (4, 8, 16, 24, 32)
# 0: the global default (overlap.streams.default_gemm_streams); more than a pass's chunk
# GEMMs run as many as it has (`_canonical`)
GEMM_STREAMS = (0, 1, 2, 4, 8)
# candidates whose times lie within this fraction of the fastest's tie; `choose` takes the
# one with the least compute side among them
TIE = 0.01
ACTIVE = "active"


@dataclass(frozen=True)
class Candidate:
    """One pass's settings (ring_order included: auto means hierarchical across nodes)
    and the layout they run on, for what they resolve to."""

    settings: LayerSettings
    layout: Layout

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def ring_order(self) -> str:
        """What runs: flat | hierarchical | - (no ring)."""
        return ring_order_of(self.settings, self.layout)

    def to_dict(self) -> dict[str, Any]:
        return {**self.settings.to_dict(), "ring_order": self.settings.ring_order,
                "runs": schedule_of(self.settings, self.layout)}

    def _streams(self) -> str:
        """The stream count the chunk GEMMs run on (0: the process's default, said so),
        at most the streams the schedule can use."""
        k = self.settings.gemm_streams
        n = min(k or default_gemm_streams(), stream_slots(self.settings, self.layout))
        return f"{n} GEMM stream{'s' if n > 1 else ''}" + ("" if k else " (default)")

    def label(self) -> str:
        s, schedule = self.settings, schedule_of(self.settings, self.layout)
        if schedule == "rs_hier" and s.method == "pipeline":
            return f"pipeline (hierarchical ring) {self._streams()}"
        parts = [{"ring_exchange": "ring", "pipeline": f"pipeline x{s.num_splits}"}.get(
            s.method, s.method)]
        if schedule == "ag_ring" and s.aggregate:
            parts.append("aggregate")
        if schedule == "ag_ring" and s.wait_gemm:
            parts.append("one waiting GEMM")
        elif s.method == "ring_exchange" or (s.method == "pipeline" and s.num_splits > 1):
            parts.append(self._streams())
        if schedule.endswith("hier"):
            parts.append("hierarchical")
        elif self.layout.nodes > 1 and s.method != "bulk" and s.method != "external":
            parts.append("flat")
        return " ".join(parts)

    def label_for(self, backend: str | None = None) -> str:
        """label() plus the SM / copy-engine keys that take effect on the backend."""
        backend = backend or self.layout.backend
        eff, s, extra = self.settings.effects(backend), self.settings, []
        if s.method == "ring_exchange" and eff["use_ce"] == ACTIVE:
            extra.append("ce" if s.use_ce else "sm")
        if eff["num_sm"] == ACTIVE and s.method != "external":
            extra.append(f"num_sm={s.num_sm}")
        return " ".join([self.label()] + extra)


@dataclass(frozen=True)
class Trial:
    """One thing to time: a pass with a candidate. comm_moved: a column wgrad whose
    reduce-scatter an rs_dgrad dgrad took over (its GEMM runs alone)."""

    spec: PassSpec
    candidate: Candidate
    comm_moved: bool = False

    @property
    def name(self) -> str:
        return self.spec.name


def _vary(variants: list[LayerSettings], key: str, values: Iterable[Any], backend: str
          ) -> list[LayerSettings]:
    out: list[LayerSettings] = []
    for v in variants:
        if v.effects(backend)[key] != ACTIVE:
            out.append(v)
            continue
        for value in dict.fromkeys([getattr(v, key), *values]):
            out.append(dataclasses.replace(v, **{key: value}))
    return list(dict.fromkeys(out))


def stream_slots(s: LayerSettings, layout: Layout) -> int:
    """How many streams settings `s` can spread their chunk GEMMs over on `layout`: one per
    chunk GEMM (`chunk_gemms`), a hierarchical all-gather's one per ring step (its node's
    ring twice); 1 at TP=1 and where one waiting GEMM runs the ring (`wait_gemm`)."""
    if layout.tp == 1 or (s.wait_gemm and schedule_of(s, layout) == "ag_ring"):
        return 1
    n = chunk_gemms(s, layout)
    return min(n, 2 * layout.local) if schedule_of(s, layout) == "ag_hier" else n


def _canonical(s: LayerSettings, layout: Layout) -> LayerSettings:
    """Keys the resolved schedule does not read put back to TE's default (`aggregate` too:
    false, never "auto", as the layer runs it: `passes.as_run`), so candidates
    that would run the same thing collapse into one: a stream count beyond the streams
    the schedule can use is cut to them, and one that runs what the default runs is the
    default; a waiting GEMM only on a flat ring of TP > 1 inside one node
    (`overlap.ag_gemm`: across nodes the ring's chunk GEMMs run)."""
    schedule, default = schedule_of(s, layout), LayerSettings.default(s.name, s.method)
    if schedule == "ag_hier" or layout.tp <= 2 or layout.tp % 2:  # (pairs: an even TP > 2)
        s = dataclasses.replace(s, aggregate=False)
    if schedule != "ag_ring" or layout.nodes > 1 or layout.tp == 1:
        s = dataclasses.replace(s, wait_gemm=default.wait_gemm)
    if schedule == "rs_hier" and s.method == "pipeline":
        s = dataclasses.replace(s, num_splits=default.num_splits)
    n = stream_slots(s, layout)
    if s.gemm_streams and (n == 1 or min(s.gemm_streams, n) == min(default_gemm_streams(), n)):
        s = dataclasses.replace(s, gemm_streams=default.gemm_streams)
    elif s.gemm_streams > n:
        s = dataclasses.replace(s, gemm_streams=n)
    return s


def candidates(name: str, layout: Layout, rows_per_rank: int, *, rs_dgrad: bool = False
               ) -> list[Candidate]:
    """Every valid candidate for layer pass `name` (e.g. 'proj_fprop'). Pipeline splits
    must divide a rank's rows; RS-dgrad methods for qkv/fc1 dgrad only with rs_dgrad; ring
    order (auto = hierarchical, or flat) only where the group spans nodes. Ring orders are
    written `auto` rather than `hierarchical` where that means the same, so the YAML keeps
    to TE's keys unless a flat ring wins."""
    out: list[LayerSettings] = []
    backend = layout.backend
    for method in allowed_methods(name):
        if name in RS_DGRAD_LAYERS and method != "bulk" and not rs_dgrad:
            continue
        # aggregate from TE's false: candidates never carry "auto", which each pass resolves
        variants = [LayerSettings.te_default(name, method)]
        if method == "pipeline":
            variants = [dataclasses.replace(variants[0], num_splits=k)
                        for k in SPLITS if rows_per_rank % k == 0]
        if layout.nodes > 1:
            variants = _vary(variants, "ring_order", ("auto", "flat"), backend)
        variants = _vary(variants, "aggregate", (False, True), backend)
        # before the stream keys, which a waiting GEMM does not read (config.effects)
        variants = _vary(variants, "wait_gemm", (False, True), backend)
        variants = _vary(variants, "gemm_streams", GEMM_STREAMS, backend)
        variants = _vary(variants, "use_ce", (True, False), backend)
        variants = _vary(variants, "num_sm", NUM_SMS, backend)
        out += [_canonical(v, layout) for v in variants]
    return [Candidate(s, layout) for s in dict.fromkeys(out)]


def trials(shape: Shape, layout: Layout, *, rs_dgrad: bool = False) -> list[Trial]:
    """Everything to time for one TP linear: each pass's candidates, a waiting GEMM only
    where the pass's operands take one (`_why_no_wait`); a column layer's wgrad also alone
    (for when its dgrad reduce-scatters)."""
    rows = shape.m // layout.tp
    out: list[Trial] = []
    for spec in layer_passes(shape):
        waits = _why_no_wait(spec, layout) is None
        for cand in candidates(spec.name, layout, rows, rs_dgrad=rs_dgrad):
            if waits or not cand.settings.wait_gemm:
                out.append(Trial(spec, cand))
        if spec.pass_name == "wgrad" and shape.column and rs_dgrad:
            out.append(Trial(spec, Candidate(as_run(spec, LayerSettings.default(spec.name), layout),
                                             layout), comm_moved=True))
    return out


def _why_no_wait(spec: PassSpec, layout: Layout) -> str | None:
    """Why the layer would run the ring's chunk GEMMs for `spec` with wait_gemm set (what
    `overlap.wait_gemm.why_not` says of its operands on a GPU), or None."""
    if spec.shape.numerics.scaling == "rowwise":
        return "row-wise FP8 scales"
    m, k, n = spec.gemm
    return wait_gemm.why_not_shape(spec.gemm_dtype, m // layout.tp, k, n, layout.tp)


def choose(shape: Shape, scores: dict[Trial, float],
           compute: dict[Trial, float | None] | None = None) -> dict[str, Trial]:
    """The fastest trial per pass of `shape`; a column layer's dgrad and wgrad are chosen
    together (bulk dgrad + bulk wgrad, or an rs_dgrad dgrad + the wgrad alone, by their
    summed times and compute sides).

    `compute`: each trial's compute side (its schedule with the communication skipped).
    Among the trials within TIE of the fastest, the least compute side wins: where the
    transfers bound a pass, stream counts and chunkings that differ only in how well
    their GEMMs fill the chip time the same, and the one that fills it best keeps the most
    if the links run faster than modelled, and leaves the chip soonest to the next kernel.
    A time or compute side that is unknown or not finite ranks last."""
    mine = {t: v for t, v in scores.items() if t.spec.shape == shape}

    def cost(*ts: Trial) -> float:
        return sum(_finite(compute.get(t)) for t in ts) if compute is not None else 0.0

    def best(pred) -> tuple[Trial, float] | None:
        """(the chosen trial, the fastest time) among the trials `pred` keeps."""
        found = [(_finite(v), cost(t), i, t) for i, (t, v) in enumerate(mine.items()) if pred(t)]
        return (_pick(found), min(f[0] for f in found)) if found else None

    out: dict[str, Trial] = {}
    fastest: dict[str, float] = {}
    for p in ("fprop", "dgrad", "wgrad"):
        hit = best(lambda t: t.spec.pass_name == p and not t.comm_moved
                   and not (p == "dgrad" and shape.column and t.candidate.settings.is_reduce_scatter))
        if hit:
            out[p], fastest[p] = hit
    if shape.column:
        rs = best(lambda t: t.spec.pass_name == "dgrad" and t.candidate.settings.is_reduce_scatter)
        moved = best(lambda t: t.spec.pass_name == "wgrad" and t.comm_moved)
        if rs and moved:
            pairs = [(fastest.get("dgrad", math.inf) + fastest.get("wgrad", math.inf),
                      cost(*(out[p] for p in ("dgrad", "wgrad") if p in out)), 0, None),
                     (rs[1] + moved[1], cost(rs[0], moved[0]), 1, (rs[0], moved[0]))]
            if (won := _pick(pairs)) is not None:
                out["dgrad"], out["wgrad"] = won
    return out


def _pick(options: list[tuple[float, float, int, Any]]) -> Any:
    """The last item of the fastest (time, compute, order, item); among those within TIE
    of the fastest time, of the least compute side (then the fastest, then the first)."""
    v = min(options, key=lambda o: (o[0], o[2]))[0]
    return min((o for o in options if o[0] <= v * (1 + TIE)), key=lambda o: (o[1], o[0], o[2]))[3]


def _finite(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) else math.inf


def ub_cfgs(chosen: Iterable[Trial]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(ub_cfgs entries, the ring order each ring runs) of chosen trials; a wgrad left
    unused by an rs_dgrad dgrad is left out, as TE wants."""
    cfg: dict[str, dict[str, Any]] = {}
    orders: dict[str, str] = {}
    for t in chosen:
        if t.comm_moved:
            continue
        cfg[t.name] = t.candidate.settings.to_dict()
        if t.candidate.ring_order != "-":
            orders[t.name] = t.candidate.ring_order
    return cfg, orders

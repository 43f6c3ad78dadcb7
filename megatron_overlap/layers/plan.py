"""Which pass of a TP linear overlaps what: Megatron's `tp_comm_*` flags (with
Transformer Engine's meaning) applied to the per-layer settings."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..comm.topology import Topology
from ..config import BUFFER_NAMES, COLUMN_BUFFERS, ROW_BUFFERS, LayerSettings, OverlapConfig
from ..config.names import AGGREGATE_AUTO, AGGREGATE_MIN_N, BULK_HIDES, LAYER_NAMES
from ..overlap.hierarchical import RingOrder, choose

log = logging.getLogger("megatron_overlap")
_warned: set[str] = set()  # every layer of a model would repeat the same swap


@dataclass(frozen=True)
class LayerPlan:
    """Settings per pass; None means the pass runs Megatron's plain order."""

    layer: str  # for messages: buffer name and kind, or the module name
    kind: str  # "column" | "row"
    sequence_parallel: bool
    fprop: LayerSettings | None = None
    dgrad: LayerSettings | None = None
    wgrad: LayerSettings | None = None
    rs_dgrad: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    buffer: str | None = None  # the TP-comm buffer name ('qkv', ...): names passes it leaves plain
    auto: tuple[str, ...] = ()  # ring all-gather passes whose settings say `aggregate: auto`

    @property
    def auto_pairs(self) -> tuple[str, ...]:
        """The passes on which `aggregate: auto` runs pairs."""
        return tuple(p for p in self.auto if getattr(self, p).aggregate)

    def plain_across_nodes(self, passes: Sequence[str]) -> "LayerPlan":
        """This plan with `passes` (of `auto_pairs`) on the plain ring: their flat ring
        spans nodes, where a block's transfer outlasts its GEMM (`LayerSettings.aggregates`);
        known only once the TP group's topology is (the first forward)."""
        if not passes:
            return self
        changed = {p: dataclasses.replace(getattr(self, p), aggregate=False) for p in passes}
        notes = tuple(n for n in self.notes if not any(
            n.startswith(f"{changed[p].name}: aggregate auto") for p in passes))
        notes += tuple(f"{changed[p].name}: aggregate auto: plain ring (its flat ring spans "
                       "nodes)" for p in passes)
        return dataclasses.replace(self, **changed, notes=notes)

    def op_name(self, pass_name: str) -> str:
        """What a pass is called in traces, stats and errors: its settings' name
        ('qkv_fprop'), also for a pass the plan leaves plain (which on symm still opens a
        transport pass with a barrier that can be the one left waiting), and for the
        layer's own extra passes ('gather_output', 'scatter_input'), which have no settings."""
        s = getattr(self, pass_name, None)
        if s is not None:
            return s.name
        return f"{self.buffer}_{pass_name}" if self.buffer else pass_name

    @functools.cached_property
    def enabled(self) -> bool:  # asked at every layer call: worked out once (the plan is frozen)
        # "external" (row wgrad) moves nothing itself; it only reuses the dgrad gather.
        return any(s is not None and s.method != "external" for s in (self.fprop, self.dgrad, self.wgrad))

    def rows(self, tp_size: int, backend: str, buffer_bytes: dict[str, int] | None = None, *,
             backends: Sequence[str] | None = None, orders: Mapping[str, Any] | None = None,
             transport: str = "") -> list[dict[str, Any]]:
        """One row per overlapped pass, for the console table and wandb; "no_effect" maps
        each key that does nothing on this pass to the reason. backends: what
        moves the bytes (several for a per-peer transport: a key counts as active only
        where all of them honour it); orders: each ring pass's RingOrder; transport:
        which transport carries each peer."""
        out = []
        for s in (self.fprop, self.dgrad, self.wgrad):
            if s is None:
                continue
            order = (orders or {}).get(s.pass_name)
            notes = [n for n in self.notes if not _of_other_pass(n, s.name)]
            notes += [order.note] if order is not None and order.note else []
            if s.method == "bulk":  # what it hides under: not the schedules' unoverlapped bulk
                notes.append(f"{s.name}: bulk: {BULK_HIDES[s.pass_name]}")
            effects = _effects(s, backends or (backend,))
            if order is not None and order.order == "hierarchical":
                effects.update(_HIERARCHICAL_IGNORES.get((s.method, s.is_reduce_scatter), {}))
            out.append({"layer": self.layer, "settings": s.name, "pass": s.pass_name,
                        "method": s.method, "buffer_bytes": (buffer_bytes or {}).get(s.pass_name, 0),
                        "num_splits": s.splits(tp_size), "num_sm": s.num_sm, "use_ce": s.use_ce,
                        "aggregate": s.aggregate, "backend": backend,
                        "ring_order": order.label if order is not None else "-",
                        "transport": transport or backend,
                        "no_effect": {k: v for k, v in effects.items() if v != "active"},
                        "notes": "; ".join(notes)})
        return out


def _of_other_pass(note: str, name: str) -> bool:
    """Whether `note` is about another pass than `name` (it starts with that pass's name)."""
    head = note.split(":", 1)[0]
    return head in LAYER_NAMES and head != name


def ring_order(s: LayerSettings, sequence_parallel: bool, topo: Topology | None
               ) -> RingOrder | None:
    """The ring order a pass runs (None: it runs no ring), with why where it differs
    from what ring_order asked. The layers and the tuner both ask this."""
    if s.method not in ("ring_exchange", "pipeline"):
        return None
    order = choose(s.ring_order, topo)
    if order.order != "hierarchical":
        return order
    if not sequence_parallel:  # only the row fprop: an all-reduce, whose pipeline stays
        return RingOrder("flat", note="" if s.ring_order == "auto" else
                         f"ring_order {s.ring_order}: without sequence parallelism "
                         "the reduction is an all-reduce, which keeps its flat pipeline")
    return order


# (method, reduce-scatter?) -> keys the hierarchical order does not read, and why
_HIERARCHICAL_IGNORES = {
    ("ring_exchange", False): {"aggregate": "no effect: the hierarchical order rings one direction",
                               "wait_gemm": "no effect: the hierarchical order runs the ring's "
                                            "chunk GEMMs"},
    ("pipeline", True): {"num_splits": "no effect: the hierarchical order reduces one row block "
                                       "per GEMM"},
}


def _effects(s: LayerSettings, backends: Sequence[str]) -> dict[str, str]:
    """Per key: active where every backend honours it, else the first reason it does not."""
    each = [s.effects(b) for b in backends]
    return {k: next((e[k] for e in each if e[k] != "active"), "active") for k in each[0]}


def _ring_all_gather(label: str, s: LayerSettings | None, config: Any, n: int,
                     notes: list[str]) -> LayerSettings | None:
    """The settings of a ring all-gather pass with `aggregate` resolved for its GEMM of `n`
    columns per rank (`LayerSettings.aggregates`; "auto" said in the notes). Pairs of ranks
    asked for by name are refused at build for an odd TP size, before any transfer."""
    if s is None:
        return None
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if s.method == "ring_exchange" and s.aggregate is True and tp % 2:
        raise ValueError(
            f"megatron_overlap: layer {label}: {s.name} has aggregate=1, which pairs the "
            f"ranks of its ring, but the TP size is {tp} (odd). Set aggregate: 0 (or auto) "
            f"for {s.name}.")
    out = s.resolved(n, tp)
    if s.aggregate == AGGREGATE_AUTO and s.is_ring_all_gather and tp > 2:
        notes.append(f"{s.name}: aggregate auto: " + (
            f"pairs (its GEMM's {n} columns a rank outlast a block's transfer: "
            f"{AGGREGATE_MIN_N} and more)" if out.aggregate else
            f"plain ring (its GEMM's {n} columns a rank: a block's transfer may outlast its "
            f"GEMM below {AGGREGATE_MIN_N})" if tp % 2 == 0 else
            f"plain ring (TP {tp} is odd)"))
    return out


def build_plan(config: Any, buffer_name: str | None, kind: str, *, sequence_parallel: bool,
               is_expert: bool, settings: OverlapConfig, rs_dgrad_settings: OverlapConfig,
               ring_n: int, layer: str | None = None) -> LayerPlan:
    """Map Megatron's flags onto this layer, as Megatron's TE layers do: AG overlap
    covers column fprop and row dgrad, RS overlap row fprop, bulk dgrad/wgrad the
    column backward, rs_dgrad turns the column dgrad into GEMM->RS; the disable_qkv /
    disable_fc1 flags turn off AG and rs_dgrad overlap for that layer; experts and
    unnamed buffers are never overlapped. `ring_n`: the GEMM columns per rank of the
    layer's all-gather pass (a column layer's output, a row layer's input), which
    `aggregate: auto` reads."""
    label = layer or f"{buffer_name or '?'} ({kind})"
    base = LayerPlan(label, kind, sequence_parallel)
    if not getattr(config, "tp_comm_overlap", False) or is_expert or buffer_name is None:
        return base
    if buffer_name not in BUFFER_NAMES:
        raise ValueError(
            f"megatron_overlap: layer {label} has tp_comm_buffer_name='{buffer_name}'; overlap "
            f"settings exist for {BUFFER_NAMES}. Pass one of those or set tp_comm_overlap=False.")
    expected = COLUMN_BUFFERS if kind == "column" else ROW_BUFFERS
    if buffer_name not in expected:
        raise ValueError(
            f"megatron_overlap: layer {label} is {kind}-parallel but its buffer '{buffer_name}' "
            f"belongs to a {'row' if kind == 'column' else 'column'}-parallel layer; "
            f"use one of {expected}.")
    flag = lambda name, default: bool(getattr(config, name, default))  # noqa: E731
    get = lambda cfg, p: cfg[f"{buffer_name}_{p}"]  # noqa: E731
    sp, notes = sequence_parallel, []
    if kind == "column":
        disabled = flag(f"tp_comm_overlap_disable_{buffer_name}", False)
        rs_dgrad = sp and flag("tp_comm_overlap_rs_dgrad", False) and not disabled
        fprop = get(settings, "fprop") if sp and flag("tp_comm_overlap_ag", True) and not disabled else None
        if rs_dgrad:
            dgrad, wgrad = get(rs_dgrad_settings, "dgrad"), None
        else:
            dgrad = get(settings, "dgrad") if sp and flag("tp_comm_bulk_dgrad", True) else None
            if dgrad is not None and dgrad.method != "bulk":
                raise ValueError(
                    f"megatron_overlap: layer {label}: {dgrad.name} has method '{dgrad.method}', a "
                    f"reduce-scatter overlap, but tp_comm_overlap_rs_dgrad is False. Set "
                    f"tp_comm_overlap_rs_dgrad=True or give {dgrad.name} method 'bulk'.")
            wgrad = get(settings, "wgrad") if flag("tp_comm_bulk_wgrad", True) else None
        if not sp:
            notes.append("no sequence parallelism: fprop has no communication; "
                         "wgrad hides the dgrad all-reduce")
        ring = _ring_all_gather(label, fprop, config, ring_n, notes)
        return LayerPlan(label, kind, sp, ring, _plain(dgrad), _plain(wgrad), rs_dgrad,
                         tuple(notes), buffer_name, _auto(fprop=fprop, dgrad=dgrad, wgrad=wgrad))
    fprop = get(settings, "fprop") if flag("tp_comm_overlap_rs", True) else None
    given = get(settings, "dgrad") if sp and flag("tp_comm_overlap_ag", True) else None
    dgrad = _ring_all_gather(label, given, config, ring_n, notes)
    if not sp:
        notes.append("no sequence parallelism: fprop reduces with chunked all-reduces "
                     "(pipeline); the backward has no communication")
        if fprop is not None and fprop.method == "ring_exchange":
            swap = (f"{fprop.name}: method ring_exchange runs as a pipeline of TP-size "
                    f"chunked all-reduces (an all-reduce has no ring schedule)")
            notes.append(swap)  # the settings table and wandb (rows), and the log once:
            if swap not in _warned:
                _warned.add(swap)
                log.warning("megatron_overlap: %s", swap)
    wgrad = get(settings, "wgrad") if dgrad is not None else None  # reuses dgrad's gathered grad
    return LayerPlan(label, kind, sp, _plain(fprop), dgrad, _plain(wgrad), False, tuple(notes),
                     buffer_name, _auto(fprop=fprop, dgrad=given, wgrad=wgrad))


def _plain(s: LayerSettings | None) -> LayerSettings | None:
    """A pass that is no ring all-gather, `aggregate` as it runs: not read, false."""
    return None if s is None else s.resolved(0, 1)


def _auto(**passes: LayerSettings | None) -> tuple[str, ...]:
    """The ring all-gather passes whose `aggregate` is "auto" in the settings (what the TP
    ranks compare: `agree.fingerprint`, whatever each rank has resolved so far)."""
    return tuple(p for p, s in passes.items()
                 if s is not None and s.aggregate == AGGREGATE_AUTO and s.is_ring_all_gather)

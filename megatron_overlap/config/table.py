"""The console table of an OverlapConfig: what each layer will do on one backend,
and every key that is accepted but has no effect there, with the reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from .console import Column, lines, table
from .effects import ACTIVE, caps_for
from .errors import bad_value
from .names import BULK_HIDES, KEYS, LAYER_NAMES

if TYPE_CHECKING:
    from .overlap import OverlapConfig

def _yes(flag: bool | str) -> str:
    """yes / no, or a value that is neither as it is ("auto")."""
    return flag if isinstance(flag, str) else "yes" if flag else "no"


def _row_notes(effects: dict[str, str], everywhere: list[str]) -> str:
    """Keys idle on this row, less those idle for the same reason on every row."""
    reasons = set(effects.values()) - {ACTIVE}
    if len(reasons) == 1 and all(v != ACTIVE for v in effects.values()):
        return reasons.pop()  # the whole layer is off (an unused wgrad)
    idle = [k for k, v in effects.items()
            if v != ACTIVE and not v.startswith("fallback") and k not in everywhere]
    fallback = [k for k, v in effects.items() if v.startswith("fallback")]
    parts = (["no effect: " + ", ".join(idle)] if idle else []) + (
        ["fallback: " + ", ".join(fallback)] if fallback else [])
    return "; ".join(parts) or "-"


def _where(layers: Iterable[str]) -> str:
    """The layers a legend line covers, said the short way round when most are."""
    rest = [n for n in LAYER_NAMES if n not in layers]
    if not rest:
        return "all layers"
    if len(rest) <= 3:
        return "all but " + ", ".join(rest)
    return ", ".join(layers)


_ORDER_MEANS = {"auto": "hierarchical where the TP group spans nodes, else flat",
                "flat": "rank order", "hierarchical": "inter-node transfers first"}


def _ring_orders(config: "OverlapConfig", effects: dict[str, dict[str, str]]) -> str:
    """One line: the ring_order of every layer that runs a ring, grouped by value."""
    by: dict[str, list[str]] = {}
    for name in LAYER_NAMES:
        if effects[name]["ring_order"] == ACTIVE:
            by.setdefault(config[name].ring_order, []).append(name)
    parts = [f"{order} ({_ORDER_MEANS[order]}) [{_where(names)}]" for order, names in by.items()]
    return "Ring order: " + ("; ".join(parts) or "no layer runs a ring")


_COLUMNS = (Column("layer"), Column("method"), Column("AG/RS"), Column("splits"),
            Column("num_sm"), Column("cga_size"), Column("set_sm_margin"), Column("use_ce"),
            Column("aggregate"), Column("atomic_gemm"), Column("priority c/g"),
            Column("notes", wrap=True, min_width=len("pipeline_rs_overlap_first_gemm,")))


def render(config: "OverlapConfig", backend: str, tp_size: int | None = None) -> str:
    caps_for(backend)  # unknown backend -> ConfigError before any output
    if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool)
                                or tp_size < 1):
        raise bad_value("*", "tp_size", tp_size, "an int >= 1 or None")

    title = f"TP comm+GEMM overlap on {backend}" + (f", TP={tp_size}" if tp_size else "")
    effects = {name: config.effects(name, backend) for name in LAYER_NAMES}
    # keys idle for one and the same reason on every layer: said once, in the legend
    everywhere = [k for k in KEYS if len({effects[n][k] for n in LAYER_NAMES}) == 1
                  and effects[LAYER_NAMES[0]][k] != ACTIVE]
    rows = []
    for name in LAYER_NAMES:
        s = config[name]
        if tp_size is not None:
            splits = str(s.splits(tp_size))
        else:
            splits = "TP" if s.method == "ring_exchange" else str(s.splits(1))
        prio = ("TE default" if s.comm_priority == 0 and s.gemm_priority == 0
                else f"{s.comm_priority}/{s.gemm_priority}")
        rows.append((name, s.method, "RS" if s.is_reduce_scatter else "AG", splits,
                     str(s.num_sm), str(s.cga_size), _yes(s.set_sm_margin), _yes(s.use_ce),
                     _yes(s.aggregate), _yes(s.atomic_gemm), prio,
                     _row_notes(effects[name], everywhere)))

    # reason -> keys and layers it covers, in first-seen order
    legend: dict[str, tuple[dict[str, None], dict[str, None]]] = {}
    for name in LAYER_NAMES:
        for key, why in effects[name].items():
            if why != ACTIVE:
                keys, layers = legend.setdefault(why, ({}, {}))
                keys[key], layers[name] = None, None

    below = [_ring_orders(config, effects)]
    bulk = {p: [n for n in LAYER_NAMES if config[n].method == "bulk" and n.endswith(p)
                and effects[n]["method"] == ACTIVE] for p in BULK_HIDES}  # (not a wgrad left unused)
    if any(bulk.values()):
        below.append("bulk (hidden under another GEMM of the backward, not unoverlapped): " + "; ".join(
            f"{p}: {BULK_HIDES[p]} [{_where(names)}]" for p, names in bulk.items() if names))
    if legend:
        below.append("Keys without effect here, where, and why:")
        for why, (keys, layers) in sorted(legend.items(),
                                          key=lambda kv: len(kv[1][1]) != len(LAYER_NAMES)):
            what = "all keys" if len(keys) == len(KEYS) else ", ".join(keys)
            below.append(f"  {what} [{_where(layers)}]: {why}")
    if config.notes:
        below.append("Notes:")
        below += [f"  {note}" for note in config.notes]
    return table(title, _COLUMNS, rows) + lines(*below)

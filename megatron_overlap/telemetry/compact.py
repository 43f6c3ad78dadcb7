"""The settings table folded to fit a screen: one line per linear and pass, with the
transformer layers whose settings are alike on that one line, and the keys that do
nothing on any pass (on the backend in use, mostly) named once in a legend instead of
in every row. `settings_table` keeps every row and every reason; print that one (or
save it) when a line here needs explaining."""

from __future__ import annotations

import re
from typing import Any, Sequence

from ..config.console import Column, lines, ranges, table, wrapped
from ..config.names import BUFFER_NAMES, KEYS
from .rows import PASS_ORDER
from .table import _short_order, _yes, human_bytes

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
# key columns: shown unless the key does nothing on every pass
_KEY_COLUMNS = ("num_sm", "use_ce", "aggregate")
_NO_EFFECT = "no effect"


def _linear(module: str) -> str:
    """'decoder.layers.3.mlp.linear_fc1' -> 'mlp.linear_fc1': the same linear in every layer."""
    return _LAYER.split(module)[-1]


def _order_in_layer(linear: str) -> int:
    """qkv, proj, fc1, fc2: the order data meets them in a layer."""
    return next((i for i, b in enumerate(BUFFER_NAMES) if b in linear), len(BUFFER_NAMES))


def _cell(row: dict[str, Any], key: str) -> str:
    if key in (row.get("no_effect") or {}):
        return "-"
    value = row[key]
    return _yes(value) if isinstance(value, bool) else str(value)


def compact_table(rows: Sequence[dict[str, Any]]) -> str:
    """layer_settings rows as a short plain-text table (see the module docstring)."""
    if not rows:
        return lines("TP comm+GEMM overlap: no overlapped layers")
    idle = [dict(r.get("no_effect") or {}) for r in rows]
    # keys that do nothing on every pass, for the same kind of reason: one legend line
    folded = [k for k in KEYS if all(k in e and e[k].startswith(_NO_EFFECT) for e in idle)]
    shown = [k for k in _KEY_COLUMNS if k not in folded]

    groups: dict[tuple, list[int]] = {}
    for r in rows:
        cells = (r["pass"], r["method"], str(r["num_splits"]), *(_cell(r, k) for k in shown),
                 _short_order(r.get("ring_order", "-")), human_bytes(r["buffer_bytes"]))
        groups.setdefault((_linear(r["module"]), cells), []).append(r["layer_number"])
    order = sorted(groups, key=lambda g: (_order_in_layer(g[0]), g[0],
                                          PASS_ORDER.get(g[1][0], len(PASS_ORDER)), min(groups[g])))
    cells, rules, above = [], set(), None
    for i, (linear, row) in enumerate(order):
        first = i == 0 or order[i - 1][0] != linear
        if i + 1 < len(order) and order[i + 1][0] != linear:
            rules.add(i)
        layers = ranges(groups[(linear, row)])
        cells.append((layers if first or layers != above else "", linear if first else "", *row))
        above = layers
    columns = [Column("layers"), Column("linear"), Column("pass"), Column("method"),
               Column("chunks", right=True), *(Column(k) for k in shown), Column("order"),
               Column("buffer", right=True)]

    backends = ", ".join(dict.fromkeys(r["backend"] for r in rows))
    modules = {r["module"] for r in rows}
    title = (f"TP comm+GEMM overlap on {backends}: {len(modules)} linears, {len(rows)} passes "
             f"(one line per linear and pass; layers with the same settings share it)")
    below = wrapped(f"No effect on any pass here: {', '.join(folded) or 'none'}. '-': none on "
                    f"that pass; the full table says why.", indent="")
    # fallbacks and clamps change what runs: each said, never folded away
    changed: dict[str, list[str]] = {}
    for r, e in zip(rows, idle):
        for k, why in e.items():
            if not why.startswith(_NO_EFFECT):
                changed.setdefault(f"{k}: {why}", []).append(r["settings"])
    below += wrapped(*(f"{what} [{', '.join(dict.fromkeys(on))}]" for what, on in changed.items()),
                     indent="")
    links = {r["transport"]: None for r in rows if r.get("transport", r["backend"]) != r["backend"]}
    below += [f"Transport per TP peer (this rank's view): {line}" for line in links]
    below += wrapped(*_notes(rows), indent="")
    return table(title, columns, cells, rules_after=rules) + lines(*below)


def _notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each row's notes once, with the passes they are about: 'qkv_dgrad: bulk: ...' and
    'fc1_dgrad: bulk: ...' are one note, 'bulk: ... [qkv_dgrad, fc1_dgrad]'."""
    by: dict[str, list[str]] = {}
    for r in sorted(rows, key=lambda r: (_order_in_layer(_linear(r["module"])), r["layer_number"])):
        if r.get("notes"):
            by.setdefault(r["notes"].replace(f"{r['settings']}: ", ""), []).append(r["settings"])
    return [f"{note} [{', '.join(dict.fromkeys(on))}]" for note, on in by.items()]

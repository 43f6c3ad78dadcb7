"""The console table of layer_settings rows: the check a user makes once per run
that every layer overlaps what they meant it to, on the transport they meant."""

from __future__ import annotations

import io
from typing import Any, Sequence

WIDTH = 160


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _yes(v: Any) -> str:
    return "yes" if v else "no"


def _idle(no_effect: str) -> dict[str, str]:
    """'key: reason; key: reason' (a row's no_effect) -> {key: reason}."""
    out = {}
    for part in filter(None, (p.strip() for p in no_effect.split("; "))):
        key, _, why = part.partition(": ")
        if " " in key or not why:  # not a "key: reason" pair: keep it whole
            key, why = part, ""
        out[key] = why
    return out


def _short_order(label: str) -> str:
    """'hierarchical (2x4)' -> 'hier 2x4' (nodes x ranks per node): the table is narrow."""
    return label.replace("hierarchical (", "hier ").rstrip(")") if label.startswith("hier") else label


def settings_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows rendered with rich as plain text (no colour), WIDTH columns wide; a
    module's name is printed on its first pass row, layers separated by a rule.
    The no-effect column names the keys; each reason is said once, below."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    modules = {r["module"] for r in rows}
    longest = max(map(len, modules), default=0)
    idle = [_idle(r.get("no_effect") or "") for r in rows]
    reasons = {f"{k}: {why}" if why else k: None for d in idle for k, why in d.items()}
    table = Table(title=f"TP comm+GEMM overlap: {len(modules)} layers, {len(rows)} passes",
                  box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False, padding=(0, 1),
                  collapse_padding=True)
    for header in ("layer", "module", "pass", "method", "splits", "num_sm", "use_ce",
                   "aggregate", "backend", "order", "buffer", "no effect"):
        wrap = header == "no effect"
        table.add_column(header, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis",
                         # module paths are the join key: never cut them short
                         min_width=min(longest, 80) if header == "module" else None,
                         justify="right" if header in ("layer", "splits", "num_sm", "buffer")
                         else "left")
    for i, r in enumerate(rows):
        first = i == 0 or rows[i - 1]["module"] != r["module"]
        last_of_layer = i + 1 == len(rows) or rows[i + 1]["layer_number"] != r["layer_number"]
        table.add_row(str(r["layer_number"]) if first else "", r["module"] if first else "",
                      r["pass"], r["method"], str(r["num_splits"]), str(r["num_sm"]),
                      _yes(r["use_ce"]), _yes(r["aggregate"]), r["backend"],
                      _short_order(r.get("ring_order", "-")), human_bytes(r["buffer_bytes"]),
                      ", ".join(idle[i]) or "-",
                      end_section=last_of_layer)
    out = io.StringIO()
    console = Console(file=out, width=WIDTH, color_system=None, force_terminal=False,
                      highlight=False, emoji=False, markup=False)
    if rows:
        console.print(table)
        if reasons:
            console.print("Keys without effect, and why:")
            for line in reasons:
                console.print(f"  {line}", soft_wrap=True)
        links = {r["transport"]: None for r in rows if r.get("transport", r["backend"]) != r["backend"]}
        for line in links:  # per-peer transports: which link carries which TP peer
            console.print(f"Transport per TP peer (this rank's view): {line}", soft_wrap=True)
        notes = {r["notes"]: None for r in rows if r.get("notes")}
        if notes:
            console.print("Notes:")
            for line in notes:
                console.print(f"  {line}", soft_wrap=True)
    else:
        console.print("TP comm+GEMM overlap: no overlapped layers")
    return out.getvalue()

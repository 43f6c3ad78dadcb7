"""The console table of layer_settings rows: the check a user makes once per run
that every layer overlaps what they meant it to, on the transport they meant."""

from __future__ import annotations

from typing import Any, Sequence

from ..config.console import Column, lines, ranges, table, wrapped


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _yes(v: Any) -> str:
    return "yes" if v else "no"


def _short_order(label: str) -> str:
    """'hierarchical (2x4)' -> 'hier 2x4' (nodes x ranks per node): the table is narrow."""
    return label.replace("hierarchical (", "hier ").rstrip(")") if label.startswith("hier") else label


def settings_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows rendered as plain text, config.console's WIDTH columns wide; a module's
    name is printed on its first pass row, layers separated by a rule. The no-effect
    column names the keys (each row's `no_effect` {key: reason}); each reason is said
    once, below."""
    if not rows:
        return lines("TP comm+GEMM overlap: no overlapped layers")
    modules = {r["module"] for r in rows}
    longest = max(map(len, modules), default=0)
    reasons = {f"{k}: {why}": None for r in rows for k, why in (r.get("no_effect") or {}).items()}
    columns = [Column(h, right=h in ("layer", "splits", "num_sm", "buffer"), wrap=h == "no effect",
                      # module paths are the join key: never cut them short
                      min_width=min(longest, 80) if h == "module" else 0)
               for h in ("layer", "module", "pass", "method", "splits", "num_sm", "use_ce",
                         "aggregate", "backend", "order", "buffer", "no effect")]
    cells, rules = [], set()
    for i, r in enumerate(rows):
        first = i == 0 or rows[i - 1]["module"] != r["module"]
        if i + 1 == len(rows) or rows[i + 1]["layer_number"] != r["layer_number"]:
            rules.add(i)
        cells.append((str(r["layer_number"]) if first else "", r["module"] if first else "",
                      r["pass"], r["method"], str(r["num_splits"]), str(r["num_sm"]),
                      _yes(r["use_ce"]), _yes(r["aggregate"]), r["backend"],
                      _short_order(r.get("ring_order", "-")), human_bytes(r["buffer_bytes"]),
                      ", ".join(r.get("no_effect") or {}) or "-"))
    below = []
    if reasons:
        below += ["Keys without effect, and why:"] + [f"  {line}" for line in reasons]
    links = {r["transport"]: None for r in rows if r.get("transport", r["backend"]) != r["backend"]}
    # per-peer transports: which link carries which TP peer
    below += [f"Transport per TP peer (this rank's view): {line}" for line in links]
    # the layers' precision (bf16, an FP8 recipe): said when any layer is not plain bf16
    precision: dict[str, dict[str, None]] = {}
    for r in rows:
        precision.setdefault(r.get("precision", "bf16"), {})[r["module"]] = None
    if set(precision) != {"bf16"}:
        below += ["Precision:"] + [f"  {p}: {len(m)} layer{'s' if len(m) > 1 else ''}"
                                   for p, m in precision.items()]
    notes = {r["notes"]: None for r in rows if r.get("notes")}
    if notes:
        below += ["Notes:"] + wrapped(*notes)
    title = f"TP comm+GEMM overlap: {len(modules)} layers, {len(rows)} passes"
    return table(title, columns, cells, rules_after=rules) + lines(*below)


ATTENTION_KEYS = ("impl", "mask", "window", "heads", "dropout", "ran", "reason")


def attention_table(rows: Sequence[dict[str, Any]]) -> str:
    """attention_settings rows as one line per distinct setting (layers that share it
    folded into one cell): which core attention each layer runs, and why where it is
    Megatron's."""
    if not rows:
        return lines("Core attention: no attention modules")
    groups: dict[tuple, list[int]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r.get(k) if r.get(k) is not None else "-") for k in ATTENTION_KEYS),
                          []).append(r["layer_number"])
    columns = [Column("layers"), Column("core attention"), Column("mask"), Column("window"),
               Column("heads:groups"), Column("dropout", right=True), Column("ran"),
               Column("why / notes", wrap=True)]
    cells = [(ranges(layers), "torch (fused)" if key[0] == "torch" else "Megatron's unfused", *key[1:])
             for key, layers in groups.items()]
    return table(f"Core attention: {len(rows)} layers", columns, cells)


def attention_summary(rows: Sequence[dict[str, Any]]) -> str:
    """One phrase for a model's core attention (an A/B arm's header): which runs in how many
    layers, with Megatron's reasons."""
    if not rows:
        return "no core-attention modules"
    torch_n = sum(r["impl"] == "torch" for r in rows)
    parts = [f"torch's fused attention in {torch_n} of {len(rows)} layers"] if torch_n else []
    reasons = sorted({r["reason"] for r in rows if r["impl"] != "torch"})
    if len(rows) - torch_n:
        parts.append(f"Megatron's DotProductAttention in {len(rows) - torch_n} of {len(rows)} layers"
                     + (f" ({'; '.join(reasons)})" if reasons else ""))
    return "; ".join(parts)

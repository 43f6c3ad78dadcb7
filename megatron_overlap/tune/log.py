"""The tuner's wandb logging (works offline): one history step per trial, the
whole search and the choice as tables, the chosen ub_cfgs in the run config.
Every function is a no-op without a run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tuner import TuneResult

SEARCH_COLUMNS = ("index", "shape", "pass", "label", "method", "num_splits", "num_sm", "use_ce",
                  "aggregate", "gemm_streams", "ring_order", "comm_moved", "time_ms", "baseline_ms",
                  "compute_only_ms", "cached", "source")
CHOICE_COLUMNS = ("shape", "pass", "label", "method", "num_splits", "num_sm", "use_ce",
                  "aggregate", "gemm_streams", "ring_order", "comm_moved", "time_ms", "baseline_ms",
                  "hidden_fraction", "overlap", "host_bound")
_NUM = ("time_ms", "baseline_ms", "compute_only_ms", "hidden_fraction")
# wandb.Table wants one type per column
_CAST = {"index": int, "num_splits": int, "num_sm": int, "use_ce": bool, "aggregate": bool,
         "gemm_streams": int, "comm_moved": bool, "cached": bool, "overlap": bool,
         "host_bound": bool}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    settings = row.get("settings", {})
    return {**row, **{k: settings.get(k) for k in ("method", "num_splits", "num_sm", "use_ce",
                                                    "aggregate", "ring_order")},
            "gemm_streams": settings.get("gemm_streams", 0)}  # to_dict leaves out its default 0


def _cell(row: dict[str, Any], col: str) -> Any:
    v = row.get(col)
    if v is None:
        return None
    if col in _NUM:
        return _num(v)
    return _CAST.get(col, str)(v)


def trial(run: Any, row: dict[str, Any]) -> None:
    """One measured (or cached) candidate, as a history step."""
    if run is None:
        return
    metrics = {f"tune/{k}": _num(row.get(k)) for k in ("time_ms", "baseline_ms", "compute_only_ms")}
    metrics = {k: v for k, v in metrics.items() if v is not None}
    metrics["tune/cached"] = int(bool(row.get("cached")))
    run.log(metrics, step=row["index"])


def choice(run: Any, result: "TuneResult") -> None:
    """The search and the choice as tables; the chosen ub_cfgs and how they were found in
    the run config."""
    if run is None:
        return
    from ..extras import require

    wandb = require("wandb", "logging the tuner's search to wandb")

    search = wandb.Table(columns=list(SEARCH_COLUMNS),
                         data=[[_cell(_flat(r), c) for c in SEARCH_COLUMNS] for r in result.rows])
    chosen = wandb.Table(columns=list(CHOICE_COLUMNS),
                         data=[[_cell(_flat(r), c) for c in CHOICE_COLUMNS]
                               for r in result.choice_rows])
    run.log({"tune/search": search, "tune/choice": chosen}, commit=False)
    run.config.update({"megatron_overlap_tune": {
        "mode": result.mode, "note": result.note, "hardware": result.hardware,
        "tp": result.layout.tp, "gpus_per_node": result.layout.gpus_per_node,
        "backend": result.layout.backend, "launch": result.layout.mode,
        "measured": result.measured, "cached": result.cached,
        "ub_cfgs": {m: c.to_dict() for m, c in result.configs.items()},
        "ring_orders": result.ring_orders}}, allow_val_change=True)

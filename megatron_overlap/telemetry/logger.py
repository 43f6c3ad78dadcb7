"""OverlapTelemetry: the settings once, the communication counters every step, to
the console and to a wandb run."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .. import comm
from ..comm import stats
from ..extras import require
from ..config import state
from ..overlap import replay
from .rows import attention_settings, layer_settings
from .table import ATTENTION_KEYS, attention_table, settings_table

# Columns of the wandb settings table, in order; the config keeps the tunable subset.
TABLE_COLUMNS = ("layer_number", "module", "pass", "settings", "method", "num_splits", "num_sm",
                 "use_ce", "aggregate", "backend", "ring_order", "transport", "buffer_bytes",
                 "no_effect", "notes", "layer", "precision")
CONFIG_KEYS = ("method", "num_splits", "num_sm", "use_ce", "aggregate", "backend", "ring_order",
               "transport", "buffer_bytes")
# wandb.Table refuses a column whose cells change type (TE's 0/1 flags next to bools)
_CAST = {"layer_number": int, "num_splits": int, "num_sm": int, "buffer_bytes": int,
         "use_ce": bool, "aggregate": bool}


def _cell(row: dict[str, Any], col: str) -> Any:
    v = row.get(col)
    if col == "no_effect":  # {key: reason} -> one string cell
        return "; ".join(f"{k}: {why}" for k, why in (v or {}).items())
    return None if v is None else _CAST.get(col, str)(v)


def step_metrics(snapshot: dict[str, dict[str, float]], prefix: str = "overlap") -> dict[str, float]:
    """stats.snapshot() flattened to wandb keys: per op wait_ms / bytes / transfers,
    plus wait_ms_total and bytes_total."""
    out: dict[str, float] = {}
    for op, s in snapshot.items():
        out[f"{prefix}/{op}/wait_ms"] = s["wait_s"] * 1e3
        out[f"{prefix}/{op}/bytes"] = s["bytes"]
        out[f"{prefix}/{op}/transfers"] = s["transfers"]
    out[f"{prefix}/wait_ms_total"] = sum(s["wait_s"] for s in snapshot.values()) * 1e3
    out[f"{prefix}/bytes_total"] = sum(s["bytes"] for s in snapshot.values())
    return out


class OverlapTelemetry:
    """Logs what the overlap does: `log_settings(model)` once per run (after the
    first forward, so buffer sizes are known), `log_step(step)` every step.

    run: a wandb Run, or None for the console only. The counters are this
    process's: in a multi-rank job, create it with the run on the rank that logs
    (and console=False on the others, or skip them)."""

    def __init__(self, run: Any = None, *, console: bool = True, prefix: str = "overlap") -> None:
        self.run, self.console, self.prefix = run, console, prefix
        self._replay_seen = replay.totals()

    def log_settings(self, model: torch.nn.Module) -> list[dict[str, Any]]:
        """Print the per-pass table and the core-attention table; to wandb, tables
        `<prefix>/settings` and `<prefix>/attention`, and the settings under
        config["megatron_overlap"]. Returns layer_settings(model)."""
        rows, attention = layer_settings(model), attention_settings(model)
        if self.console:
            print(settings_table(rows), file=sys.stdout, flush=True)
            print(attention_table(attention), file=sys.stdout, flush=True)
        if self.run is not None:
            wandb = require("wandb", "OverlapTelemetry(run)")

            table = wandb.Table(columns=list(TABLE_COLUMNS),
                                data=[[_cell(r, c) for c in TABLE_COLUMNS] for r in rows])
            # commit=False: joins the pending step instead of taking one, so the
            # caller's own step numbers (from 0) stay valid for log_step.
            columns = ("module", "layer_number") + ATTENTION_KEYS
            attn = wandb.Table(columns=list(columns),
                               data=[[None if r.get(c) is None else str(r[c]) for c in columns]
                                     for r in attention])
            self.run.log({f"{self.prefix}/settings": table, f"{self.prefix}/attention": attn}, commit=False)
            st = state.current()
            ran = sorted({r["backend"] for r in rows}) or [comm.resolve_backend(st.backend)]
            self.run.config.update({"megatron_overlap": {
                "layers": {f"{r['module']}/{r['pass']}": {k: r[k] for k in CONFIG_KEYS} for r in rows},
                "ub_cfgs": st.settings.to_dict(),
                "backend": ", ".join(ran),
                "backend_requested": st.backend,
                "attention": {r["module"]: r["impl"] + (f" ({r['reason']})" if r["reason"] else "")
                              for r in attention},
            }}, allow_val_change=True)
        return rows

    def log_step(self, step: int, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Counters since the last call (and reset them), merged with `extra` (which
        wins on a clash); logged at `step`. Returns what was logged. Among them, how the
        layer passes ran since the last call (`<prefix>/replay/...`: calls, replays,
        captures, evictions, and replayed, the share issued as one launch of a graph
        captured earlier; the other passes ran eagerly at the full host cost: first
        sightings, tensors that moved; `overlap.replay.totals`)."""
        metrics: dict[str, Any] = step_metrics(stats.snapshot(reset=True), self.prefix)
        now = replay.totals()
        delta = {k: now[k] - self._replay_seen.get(k, 0) for k in now}
        self._replay_seen = now
        metrics.update({f"{self.prefix}/replay/{k}": v for k, v in delta.items()})
        if delta["calls"]:
            metrics[f"{self.prefix}/replay/replayed"] = delta["replays"] / delta["calls"]
        metrics.update(extra or {})
        if self.run is not None:
            self.run.log(metrics, step=step)
        return metrics

"""Telemetry: what each overlapped layer does and what its communication cost.
A tool: may import the runtime; wandb only through `extras.require` ([wandb]).

    tel = OverlapTelemetry(wandb.init(...))   # or OverlapTelemetry() for the console only
    tel.log_settings(model)                   # once: per-layer, per-pass settings, core attention
    print(compact_table(layer_settings(model)))   # the same, folded to fit a screen
    tel.log_step(step, {"loss": loss})        # every step: bytes moved, host time blocked

`read_offline_run` reads an offline wandb run back (after `wait_for_exit`) (tests, A/B reports)."""

from .compact import compact_table
from .logger import OverlapTelemetry
from .offline import read_offline_run, wait_for_exit
from .rows import attention_settings, layer_settings
from .table import attention_summary, attention_table, settings_table

__all__ = ["OverlapTelemetry", "layer_settings", "settings_table", "compact_table",
           "attention_settings", "attention_table", "attention_summary",
           "read_offline_run", "wait_for_exit"]

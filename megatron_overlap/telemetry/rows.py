"""One row per overlapped pass of every layer of a model, keyed by the module's
path so rows from different runs (or ranks) line up."""

from __future__ import annotations

import re
from typing import Any

import torch

PASS_ORDER = {"fprop": 0, "dgrad": 1, "wgrad": 2}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_WRAPPER = "module."  # Megatron's DDP and Float16Module keep the model as `.module`


def module_path(name: str) -> str:
    """The path inside the model proper: wrappers' leading `module.`s stripped, so a
    DDP-wrapped model and a bare one give the same keys."""
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER):]
    return name


def layer_number(path: str) -> int:
    """N from `layers.<N>.` in the path (the index inside the block); -1 when absent."""
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else -1


def _overlapped(module: torch.nn.Module) -> bool:
    plan = getattr(module, "overlap_plan", None)
    return callable(getattr(module, "overlap_rows", None)) and bool(getattr(plan, "enabled", False))


def layer_settings(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Effective settings of every overlapped pass in `model`, with "module" (path)
    and "layer_number" added; sorted by layer, module, then fprop/dgrad/wgrad.
    Layers whose plan overlaps nothing run Megatron's own code and are left out."""
    rows = []
    for name, module in model.named_modules():
        if not _overlapped(module):
            continue
        path = module_path(name)
        for row in module.overlap_rows():
            rows.append({"module": path, "layer_number": layer_number(path), **row})
    rows.sort(key=lambda r: (r["layer_number"], r["module"], PASS_ORDER.get(r["pass"], len(PASS_ORDER))))
    return rows


def attention_settings(model: torch.nn.Module) -> list[dict[str, Any]]:
    """One row per core-attention module of `model` (`attention.attention_row`: which
    implementation runs, torch's fused attention or Megatron's, and why), with "module"
    and "layer_number" added, in layer order."""
    from ..attention import attention_row  # megatron-core: imported only when asked

    rows = []
    for name, module in model.named_modules():
        row = attention_row(module)
        if row is not None:
            path = module_path(name)
            rows.append({"module": path, "layer_number": layer_number(path), **row})
    rows.sort(key=lambda r: (r["layer_number"], r["module"]))
    return rows

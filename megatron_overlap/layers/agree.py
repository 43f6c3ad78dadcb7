"""Ranks that disagree are diagnosed, not crashed.

Before a layer's first transfer for a new input shape, the TP ranks exchange a
small fingerprint (layer, input shape and dtype, per-pass settings, backend)
through the bounded store exchange; once per layer and shape, cached after.
Different fingerprints raise `DisagreementError` on every rank, naming which
ranks differ on what, before any transfer (so the next agreeing call works).
A rank that never comes (it crashed, or runs Megatron's layer without install())
makes the exchange time out with a diagnosis that names it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.exchange import all_gather_object
from ..comm.transport import CommError


class DisagreementError(CommError):
    """The TP ranks called one layer with different shapes or settings."""


def fingerprint(layer: Any, x: torch.Tensor) -> dict[str, Any]:
    plan = layer.overlap_plan
    fp: dict[str, Any] = {"layer": plan.layer, "input shape": tuple(x.shape),
                          "input dtype": str(x.dtype), "sequence_parallel": plan.sequence_parallel,
                          "backend": layer.overlap_backend, "rs_dgrad": plan.rs_dgrad}
    tp = layer.tp_group.size()
    for s in (plan.fprop, plan.dgrad, plan.wgrad):
        if s is not None:
            fp[s.name] = (f"method={s.method} num_splits={s.splits(tp)} "
                          f"aggregate={int(bool(s.aggregate))} ring_order={s.ring_order}")
    return fp


def _describe(key: str, values: list[Any]) -> str:
    by: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(repr(v) if v is not None else "(not overlapped)", []).append(r)
    return f"{key}: " + "; ".join(f"rank{'s' if len(rs) > 1 else ''} "
                                  f"{', '.join(map(str, rs))}: {v}" for v, rs in by.items())


def check(layer: Any, x: torch.Tensor) -> None:
    """Every TP rank calls this layer alike (collective the first time per shape)."""
    if layer.tp_group.size() == 1:
        return
    key = (tuple(x.shape), x.dtype)
    agreed = layer.__dict__.setdefault("_agreed_shapes", set())
    if key in agreed:
        return
    mine = fingerprint(layer, x)
    everyone = all_gather_object(mine, layer.tp_group, "layer agreement (shape and settings)")
    keys = list(dict.fromkeys(k for fp in everyone for k in fp))
    diffs = [_describe(k, [fp.get(k) for fp in everyone]) for k in keys
             if len({repr(fp.get(k)) for fp in everyone}) > 1]
    if diffs:
        raise DisagreementError(
            f"megatron_overlap: layer {layer.overlap_plan.layer!r}: the TP ranks disagree, "
            f"so no transfer was started: " + " | ".join(diffs) + ". Give every rank of the TP "
            f"group the same micro-batch shapes and the same install() settings.")
    agreed.add(key)

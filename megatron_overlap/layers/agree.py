"""Ranks that disagree are diagnosed, not crashed.

Before a layer's first transfer for a new input shape, the TP ranks exchange a
small fingerprint (layer, input shape and dtype, per-pass settings, backend, precision)
through the bounded store exchange; once per layer and shape, cached after.
Different fingerprints raise `DisagreementError` on every rank, naming which
ranks differ on what, before any transfer (so the next agreeing call works).
A rank that never comes (it crashed, or runs Megatron's layer without install())
makes the exchange time out with a diagnosis that names it and the layer.

The transport contract is checked the same way, once per layer, shape and pass
(`PassAudit`): the first run of each pass (fprop, bwd) for a new shape records
its begin_pass() / workspace() calls (a workspace before begin_pass raises at
once, a pass without begin_pass after it), and after the pass the ranks compare a hash of that sequence through the
same bounded exchange (the fingerprint goes before the pass, when the sequence
is not known yet). Ranks whose sequences differ would lay their workspaces out
differently (on symm / nvshmem a peer then writes into the wrong place): every
rank raises `WorkspaceMismatchError` naming the pass, the ranks and the first
call that differs. That first run is always eager (layers.functions runs an audited
pass outside its graphs: a replay would make no host-side calls to record, and a shape
seen before may come back in a new mode, a frozen weight or gather_output, with its
graph already captured), so every rank reaches the check; later calls, replayed or
not, carry no recording and no exchange.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from ..comm.exchange import about, all_gather_object
from ..comm.transport import OPEN_PASS_FIRST, CommError, ContractError, Transport


class DisagreementError(CommError):
    """The TP ranks called one layer with different shapes or settings."""


def fingerprint(layer: Any, x: torch.Tensor, modes: dict[str, Any] | None = None) -> dict[str, Any]:
    plan = layer.overlap_plan
    fp: dict[str, Any] = {"layer": plan.layer, "input shape": tuple(x.shape),
                          "input dtype": str(x.dtype), "sequence_parallel": plan.sequence_parallel,
                          "backend": layer.overlap_backend, "rs_dgrad": plan.rs_dgrad,
                          "precision": layer.precision.describe(), **(modes or {})}
    tp = layer.tp_group.size()
    for s in (plan.fprop, plan.dgrad, plan.wgrad):
        if s is not None:
            given = "auto" if s.pass_name in plan.auto else int(bool(s.aggregate))
            fp[s.name] = (f"method={s.method} num_splits={s.splits(tp)} "
                          f"aggregate={given} ring_order={s.ring_order}")
    return fp


class WorkspaceMismatchError(DisagreementError, ContractError):
    """The TP ranks made different workspace() calls in one layer pass."""


def _describe(key: str, values: list[Any], show: Callable[[Any], str] = repr,
              none: str = "(not overlapped)") -> str:
    by: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(show(v) if v is not None else none, []).append(r)
    return f"{key}: " + "; ".join(f"rank{'s' if len(rs) > 1 else ''} "
                                  f"{', '.join(map(str, rs))}: {v}" for v, rs in by.items())


class PassAudit:
    """The contract check of one layer at one input shape: each of its passes
    ("fprop", "bwd") recorded at its first run and compared across the TP group."""

    def __init__(self, layer: str, group: Any) -> None:
        self.layer, self.group = layer, group
        self.todo = {"fprop", "bwd"}

    def run(self, key: str, tp: Transport, body: Callable[[], None]) -> None:
        """Run pass `key` (the body runs it as the layer would: eagerly, as a first
        sighting is), recording its contract calls, then compare them (collective)."""
        what = f"layer {self.layer!r} {key}"
        with tp.recording_calls(what) as calls:
            body()
        if not any(c.key[0] == "begin_pass" for c in calls):
            raise ContractError(
                f"megatron_overlap: {what}: the pass never called begin_pass(), so the "
                f"transport cannot tell it from the previous pass (its workspaces may be "
                f"reused while peers still read them). {OPEN_PASS_FIRST}")
        mine = [c.key for c in calls]
        digest = hashlib.sha256(repr(mine).encode()).hexdigest()[:16]
        with about(what):
            if len(set(all_gather_object(digest, self.group, "workspace calls (hash)"))) == 1:
                self.todo.discard(key)
                return
            everyone = all_gather_object(list(calls), self.group, "workspace calls (sequences)")
        n = next(i for i in range(max(map(len, everyone)))
                 if len({repr(seq[i].key) if i < len(seq) else None for seq in everyone}) > 1)
        at = _describe(f"call {n + 1}", [seq[n] if n < len(seq) else None for seq in everyone],
                       show=lambda c: c.describe(), none="no call (its sequence ended)")
        raise WorkspaceMismatchError(
            f"megatron_overlap: {what}: the TP ranks made different workspace() calls, so "
            f"their workspaces do not line up (a peer would write into the wrong place): {at}. "
            f"Every rank must make the same begin_pass() / workspace() calls in the same "
            f"order within a pass: a schedule must not choose its workspaces by rank or "
            f"rank-local state.")


_NEW = object()


def check(layer: Any, x: torch.Tensor, modes: dict[str, Any] | None = None) -> PassAudit | None:
    """Every TP rank calls this layer alike (collective the first time per shape and
    `modes`: per-call choices that change which transfers run, such as a frozen weight's
    backward without wgrad, or gather_output). Returns the shape's PassAudit while one of
    its passes is still to be checked (the passes then run through it), None from then on."""
    if layer.tp_group.size() == 1:
        return None
    key = (tuple(x.shape), x.dtype, *sorted((modes or {}).items()))
    agreed = layer.__dict__.setdefault("_agreed_shapes", {})
    audit = agreed.get(key, _NEW)
    if audit is not _NEW:
        if audit is not None and not audit.todo:
            agreed[key] = audit = None
        return audit
    mine = fingerprint(layer, x, modes)
    with about(f"layer {layer.overlap_plan.layer!r}"):  # a timeout names the layer too
        everyone = all_gather_object(mine, layer.tp_group, "layer agreement (shape and settings)")
    keys = list(dict.fromkeys(k for fp in everyone for k in fp))
    diffs = [_describe(k, [fp.get(k) for fp in everyone]) for k in keys
             if len({repr(fp.get(k)) for fp in everyone}) > 1]
    if diffs:
        raise DisagreementError(
            f"megatron_overlap: layer {layer.overlap_plan.layer!r}: the TP ranks disagree, "
            f"so no transfer was started: " + " | ".join(diffs) + ". Give every rank of the TP "
            f"group the same micro-batch shapes, the same install() settings and the same "
            f"frozen weights and gather_output.")
    agreed[key] = audit = PassAudit(layer.overlap_plan.layer, layer.tp_group)
    return audit

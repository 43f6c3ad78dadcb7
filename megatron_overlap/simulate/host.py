"""Measured host time per layer pass call, for the cost model's host clock.

Read from what `benchmarks/host_time.py` writes: per TP size, per TP linear
(qkv, proj, fc1, fc2), the host µs of one forward and one backward call through
the public layers on the real transport, with whole-pass replay off ("eager")
and on ("replay"), first call (device drained) and back to back (`*_b2b_us`:
every rank issuing at once; `*_staggered_us`: one rank's host at a time). Newer
files add, per TP size, the four linears of one transformer layer chained in
their dataflow with one backward for all four, as a model runs them
(`chain_eager`, `chain_replay`: ours; `chain_megatron`: Megatron's own linears
with no communication), each `concurrent` and `staggered`, host µs per linear
call.

Which figure the model takes for our passes (`HostTime.pass_us`):

- launch mode: `--mode eager` -> the eager rows; `--mode graph` -> the replayed
  rows (the layers replay each pass as a CUDA graph, the default on symm; the
  host still pays Python, autograd and one launch per call);
- back to back: a training step queues its calls and the host runs ahead, so a
  pass costs max(host, GPU) per call (first-call figures are launch latency);
- the most training-like figure the file has, per TP size and mode, first found of:
  1. the chain, staggered;  2. the per-layer calls, staggered;
  3. the chain, concurrent; 4. the per-layer calls, concurrent (`*_b2b_us`, the
  only figures of files from before the chain and the turns).
  Staggered before concurrent: host_time.py's ranks share one machine (one GPU, or
  one host's cores), so with every rank issuing at once each rank's host time
  includes the other ranks' contention for the CPUs, which a rank with its own
  cores (a real deployment) does not pay; it grows with the ranks per machine, and
  we expect it to be the larger distortion (not yet measured against a deployment
  with a core set per rank). Chain before per-layer calls: a model runs one autograd-engine call
  per backward for the whole layer, not one per linear. Staggered figures exist
  only where the ranks' waits are on the GPU (replayed passes on symm/nvshmem), so
  eager mode takes the concurrent chain;
- the chain's figure is per linear call, averaged over the four linears: its total
  (x4) is split between them in proportion to their per-layer figures of the same
  kind (staggered where all four have them, else back to back), so each linear
  keeps its own weight and the layer its measured total;
- fprop = the forward call; the backward call (one autograd call runs dgrad and
  wgrad) is split between the passes that communicate: half each in a column
  layer, all on the dgrad in a row layer (its wgrad is the GEMM alone, timed
  without host cost, as Megatron's);
- a TP size not measured: linear between the measured ones, the nearest beyond.

Megatron's non-overlapped path (`HostTime.megatron_pass_us`): `chain_megatron`
where the file has it, taken the way ours are at that TP size and mode (staggered
where ours are, else concurrent: both sides then carry the shared machine's CPU
contention, or neither; the other way where that one is missing), with the same
per-pass split, each linear the chain's average; else None and the cost model
keeps its modelled `eager_step_us + eager_comm_us` per pass. `chain_megatron`
runs Megatron's linears on one-rank groups: the host cost of the autograd linear
itself, without the launch of its collective (modelled elsewhere as
`eager_comm_us`; not counted here, so Megatron's path is, if anything, favoured).

The rows' host time is for TE's default settings of each layer; the model applies
it to every candidate of the pass (with replay, one launch whatever the chunking).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .calibration import CalibrationError, read_json

MODES = {"eager": "eager", "graph": "replay"}  # the model's launch mode -> the file's rows
DIRECTION = {"fprop": "fwd", "dgrad": "bwd", "wgrad": "bwd"}
SHARE = {(True, "fprop"): 1.0, (True, "dgrad"): 0.5, (True, "wgrad"): 0.5,  # (column, pass)
         (False, "fprop"): 1.0, (False, "dgrad"): 1.0, (False, "wgrad"): 0.0}
CHAIN = ("qkv", "proj", "fc1", "fc2")  # host_time.py's chained linears, in dataflow order
MEGATRON = "megatron"  # rows of Megatron's own linears: megatron_staggered, megatron_concurrent
# the figures, most training-like first (see the module docstring)
SOURCES = {"chain_staggered": "one layer's four linears chained, one rank at a time",
           "layer_staggered": "each linear alone, one rank at a time",
           "chain_concurrent": "one layer's four linears chained, all ranks at once",
           "layer_b2b": "each linear alone, all ranks at once"}


def _time(where: str, what: str, v: Any, optional: bool) -> float | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
        raise CalibrationError(f"host-time file {where!r}, {what}: "
                               f"{'not' if optional else 'missing or not'} a time >= 0 ({v!r})")
    return float(v)


def _chain(where: str, i: int, row: dict, arm: str) -> dict[str, dict[str, float]]:
    """{"staggered" | "concurrent": {"fwd": µs, "bwd": µs}} of row[arm]; a way whose two
    figures are not both numbers is left out (None: not measured)."""
    out: dict[str, dict[str, float]] = {}
    got = row.get(arm)
    if got is None:
        return out
    if not isinstance(got, dict):
        raise CalibrationError(f"host-time file {where!r}, row {i}: {arm!r} is not an object")
    for how in ("staggered", "concurrent"):
        t = got.get(how) or {}
        vals = {d: _time(where, f"row {i}, {arm}.{how}.{d}_us", t.get(f"{d}_us"), True)
                if isinstance(t, dict) else None for d in ("fwd", "bwd")}
        if all(v is not None for v in vals.values()):
            out[how] = vals  # type: ignore[assignment]
    return out


@dataclass
class HostTime:
    """(rows, buffer, direction, TP) -> host µs per call, back to back; rows
    "megatron_staggered" / "megatron_concurrent", buffer "*": Megatron's own linears (per
    linear call, every buffer alike)."""

    table: dict[tuple[str, str, str, int], float] = field(default_factory=dict)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # (rows, TP) -> which figure (a SOURCES key) the table holds
    figures: dict[tuple[str, int], str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "HostTime":
        """Read a host_time.py JSON; a CalibrationError names the file and what is wrong."""
        where, data = os.fspath(path), read_json(path, "host-time")
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows:
            raise CalibrationError(f"host-time file {where!r}: expected an object with 'rows' "
                                   "(what benchmarks/host_time.py writes)")
        out = cls(source=where, meta=dict(data.get("meta") or {}))
        for i, row in enumerate(rows):
            tp = row.get("tp") if isinstance(row, dict) else None
            if not isinstance(tp, int) or tp < 1:
                raise CalibrationError(f"host-time file {where!r}, row {i}: 'tp' must be an int >= 1")
            for kind in MODES.values():
                out._ours(where, i, row, kind, tp)
            for how, per in _chain(where, i, row, f"chain_{MEGATRON}").items():
                for d, v in per.items():
                    out.table[(f"{MEGATRON}_{how}", "*", d, tp)] = v
        if not any(k in MODES.values() for k, _, _, _ in out.table):
            raise CalibrationError(f"host-time file {where!r}: no host time of our layers "
                                   "(rows without 'eager' / 'replay')")
        return out

    def _ours(self, where: str, i: int, row: dict, kind: str, tp: int) -> None:
        """Our layers' figures of one row and mode: the most training-like the row has."""
        layer: dict[str, dict[str, dict[str, float | None]]] = {"b2b": {}, "staggered": {}}
        for buffer, t in (row.get(kind) or {}).items():
            if not isinstance(t, dict):
                raise CalibrationError(f"host-time file {where!r}, row {i}, {kind}.{buffer}: "
                                       "not an object")
            for d in ("fwd", "bwd"):
                what = f"row {i}, {kind}.{buffer}: '{d}_b2b_us'"
                layer["b2b"].setdefault(buffer, {})[d] = _time(where, what, t.get(f"{d}_b2b_us"),
                                                               False)
                what = f"row {i}, {kind}.{buffer}: '{d}_staggered_us'"
                layer["staggered"].setdefault(buffer, {})[d] = _time(
                    where, what, t.get(f"{d}_staggered_us"), True)
        measured = {how: {b: v for b, v in per.items() if all(x is not None for x in v.values())}
                    for how, per in layer.items()}
        stag = measured["staggered"] if measured["staggered"].keys() == layer["b2b"].keys() else {}
        chain = _chain(where, i, row, f"chain_{kind}")
        # weights of the chain's split: per-layer figures, staggered where all have them
        weights = stag or measured["b2b"]
        for name, per in (("chain_staggered", chain.get("staggered")), ("layer_staggered", stag),
                          ("chain_concurrent", chain.get("concurrent")),
                          ("layer_b2b", measured["b2b"])):
            if not per:
                continue
            for d in ("fwd", "bwd"):
                if name.startswith("layer"):
                    split = {b: v[d] for b, v in per.items()}
                else:  # the chain's per-linear figure x4, split by the per-layer weights
                    total = per[d] * len(CHAIN)
                    w = {b: weights[b][d] for b in CHAIN} if set(weights) == set(CHAIN) else {}
                    s = sum(w.values()) if w else 0.0
                    split = {b: total * w[b] / s if s > 0 else per[d] for b in CHAIN}
                for b, v in split.items():
                    self.table[(kind, b, d, tp)] = float(v)  # type: ignore[arg-type]
            self.figures[(kind, tp)] = name
            return

    @staticmethod
    def _bracket(known: list[int], tp: int) -> tuple[int, int]:
        """The measured TP sizes `tp` lies between (the nearest twice beyond them)."""
        return (max([t for t in known if t <= tp], default=known[0]),
                min([t for t in known if t >= tp], default=known[-1]))

    def _at(self, kind: str, buffer: str, d: str, tp: int) -> float | None:
        """The table's µs at `tp`: linear between the measured TP sizes, the nearest beyond."""
        known = sorted(t for (k, b, dd, t) in self.table if (k, b, dd) == (kind, buffer, d))
        if not known:
            return None
        lo, hi = self._bracket(known, tp)
        a, b = self.table[(kind, buffer, d, lo)], self.table[(kind, buffer, d, hi)]
        return a if hi == lo else a + (b - a) * (tp - lo) / (hi - lo)

    def _megatron_how(self, mode: str, tp: int) -> list[str]:
        """Megatron's figures to try, in order, at `tp` in `mode`: taken the way ours are
        (staggered where ours at the bracketing TP sizes are, else concurrent), so both sides
        carry the shared machine's CPU contention or neither; the other way where that one
        was not measured."""
        kind = MODES[mode]
        known = sorted(t for k, t in self.figures if k == kind)
        staggered = bool(known) and all(self.figures[(kind, t)].endswith("staggered")
                                        for t in self._bracket(known, tp))
        order = ["staggered", "concurrent"] if staggered else ["concurrent", "staggered"]
        return [f"{MEGATRON}_{how}" for how in order]

    def pass_us(self, buffer: str, pass_name: str, tp: int, mode: str,
                column: bool = True) -> float | None:
        """Host µs one call of the pass costs back to back, in launch `mode` (graph | eager);
        None where the file has no row for the buffer, or for a row layer's wgrad."""
        share = SHARE[(column, pass_name)]
        us = self._at(MODES[mode], buffer, DIRECTION[pass_name], tp) if share else None
        return None if us is None else us * share

    def megatron_pass_us(self, pass_name: str, tp: int, mode: str,
                         column: bool = True) -> float | None:
        """Host µs one call of the pass costs on Megatron's own linears, back to back (the
        same split as ours, each linear the chain's average), taken the way our figures in
        launch `mode` are (staggered or concurrent); None where the file has no
        `chain_megatron` (the caller keeps its modelled figure) or for a row layer's wgrad."""
        share = SHARE[(column, pass_name)]
        if not share:
            return None
        for kind in self._megatron_how(mode, tp):
            us = self._at(kind, "*", DIRECTION[pass_name], tp)
            if us is not None:
                return us * share
        return None

    def sources(self, mode: str) -> dict[str, dict[int, str]]:
        """Which figure each measured TP size's rows come from in launch `mode`:
        {"ours": {TP: SOURCES key}, "megatron": {TP: "chain_staggered" | "chain_concurrent"}}."""
        kind = MODES[mode]
        ours = {tp: name for (k, tp), name in sorted(self.figures.items(), key=lambda kv: kv[0][1])
                if k == kind}
        mcore = {}
        for tp in sorted({t for (k, _, _, t) in self.table if k.startswith(MEGATRON)}):
            got = [k for k in self._megatron_how(mode, tp) if (k, "*", "fwd", tp) in self.table]
            if got:
                mcore[tp] = "chain_" + got[0][len(MEGATRON) + 1:]
        return {"ours": ours, "megatron": mcore}

    def fingerprint(self) -> str:
        """What the model reads of the file (every figure it takes), as a short digest."""
        blob = json.dumps(sorted((list(k), v) for k, v in self.table.items()))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self, mode: str, megatron_modelled_us: float | None = None) -> str:
        tps = sorted({t for (k, _, _, t) in self.table if k in MODES.values()})
        where = self.meta.get("backend", "?")
        src = self.sources(mode)

        def figures(per: dict[int, str]) -> str:
            names = sorted(set(per.values()), key=list(SOURCES).index)
            if len(names) == 1:
                return SOURCES[names[0]]
            return "; ".join(f"TP {'/'.join(str(t) for t, n in per.items() if n == name)}: "
                             f"{SOURCES[name]}" for name in names)

        ours = figures(src["ours"]) if src["ours"] else "no rows"
        if src["megatron"]:
            mcore = (f"Megatron's path: its own linears measured in the same file "
                     f"(chain_megatron, no communication; {figures(src['megatron'])})")
        else:
            modelled = f" {megatron_modelled_us:g} us" if megatron_modelled_us is not None else ""
            mcore = (f"Megatron's path: modelled{modelled} per pass (eager_step_us + "
                     "eager_comm_us; the file has no chain_megatron)")
        return (f"host time per call measured through the public layers on {where} "
                f"({self.source}, TP {'/'.join(map(str, tps))}, {MODES[mode]}, back to back: "
                f"{ours}); {mcore}")

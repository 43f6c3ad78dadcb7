"""Measured host time per layer pass call, for the cost model's host clock.

Read from what `benchmarks/host_time.py` writes: per TP size, per TP linear
(qkv, proj, fc1, fc2), the host µs of one forward and one backward call through
the public layers on the real transport, with whole-pass replay off ("eager")
and on ("replay"), first call (device drained) and back to back (`*_b2b_us`).

Which figure the model takes (`HostTime.pass_us`):

- launch mode: `--mode eager` -> the eager rows; `--mode graph` -> the replayed
  rows (the layers replay each pass as a CUDA graph, the default on symm; the
  host still pays Python, autograd and one launch per call);
- back to back: a training step queues its calls and the host runs ahead, so a
  pass costs max(host, GPU) per call (first-call figures are launch latency);
- fprop = the forward call; the backward call (one autograd call runs dgrad and
  wgrad) is split between the passes that communicate: half each in a column
  layer, all on the dgrad in a row layer (its wgrad is the GEMM alone, timed
  without host cost, as Megatron's);
- a TP size not measured: linear between the measured ones, the nearest beyond.

The rows' host time is for TE's default settings of each layer; the model applies
it to every candidate of the pass (with replay, one launch whatever the chunking).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .calibration import CalibrationError

MODES = {"eager": "eager", "graph": "replay"}  # the model's launch mode -> the file's rows
DIRECTION = {"fprop": "fwd", "dgrad": "bwd", "wgrad": "bwd"}
SHARE = {(True, "fprop"): 1.0, (True, "dgrad"): 0.5, (True, "wgrad"): 0.5,  # (column, pass)
         (False, "fprop"): 1.0, (False, "dgrad"): 1.0, (False, "wgrad"): 0.0}


@dataclass
class HostTime:
    """(rows, buffer, direction, TP) -> host µs per call, back to back."""

    table: dict[tuple[str, str, str, int], float] = field(default_factory=dict)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "HostTime":
        """Read a host_time.py JSON; a CalibrationError names the file and what is wrong."""
        where = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise CalibrationError(f"host-time file {where!r}: not valid JSON: {e}") from None
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
                for buffer, t in (row.get(kind) or {}).items():
                    for d in ("fwd", "bwd"):
                        v = t.get(f"{d}_b2b_us") if isinstance(t, dict) else None
                        if not isinstance(v, (int, float)) or v < 0:
                            raise CalibrationError(f"host-time file {where!r}, row {i}, "
                                                   f"{kind}.{buffer}: '{d}_b2b_us' missing or "
                                                   f"not a time >= 0 ({v!r})")
                        out.table[(kind, buffer, d, tp)] = float(v)
        return out

    def pass_us(self, buffer: str, pass_name: str, tp: int, mode: str,
                column: bool = True) -> float | None:
        """Host µs one call of the pass costs back to back, in launch `mode` (graph | eager);
        None where the file has no row for the buffer, or for a row layer's wgrad."""
        kind, d, share = MODES[mode], DIRECTION[pass_name], SHARE[(column, pass_name)]
        known = sorted(t for (k, b, dd, t) in self.table if (k, b, dd) == (kind, buffer, d))
        if not known or not share:
            return None
        lo = max([t for t in known if t <= tp], default=known[0])
        hi = min([t for t in known if t >= tp], default=known[-1])
        a, b = self.table[(kind, buffer, d, lo)], self.table[(kind, buffer, d, hi)]
        us = a if hi == lo else a + (b - a) * (tp - lo) / (hi - lo)
        return us * share

    def describe(self, mode: str) -> str:
        tps = sorted({t for (_, _, _, t) in self.table})
        where = self.meta.get("backend", "?")
        return (f"host time per call measured through the public layers on {where} "
                f"({self.source}, TP {'/'.join(map(str, tps))}, {MODES[mode]}, back to back)")

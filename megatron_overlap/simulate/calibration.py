"""Measured GEMM times from one GPU (what benchmarks/compute_side.py writes with
--out), indexed the way the cost model asks for them.

Monolithic GEMM times are device times of CUDA-graph replays. A chunked
schedule (run on the null transport: its chunk GEMMs, order and waits) is kept
as its ratio to the monolithic GEMM timed beside it in the same row, graphed
and eager (eager includes the host's launch gaps). Eager host cost per step,
for schedules not measured, comes from the rows' host time per call / steps.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

# compute_side.py's (op, schedule label) -> the cost model's schedule kind
_KINDS = {("ag", "ring"): "ag_ring", ("rs", "ring"): "rs_ring", ("rs", "pipeline4"): "rs_pipeline"}


def _kind(op: str, label: str) -> str | None:
    if (op, label) in _KINDS:
        return _KINDS[(op, label)]
    if op == "rs" and label.startswith("pipeline") and label[8:].isdigit():
        return "rs_pipeline"
    return None


@dataclass
class Calibration:
    """Monolithic GEMM device times (median of the rows that timed a shape) and, per
    chunked schedule, its time relative to the monolithic GEMM of the same row: under a
    CUDA graph (device time of the chunk GEMMs) and eager (host launch gaps included)."""

    mono_samples: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)
    ratios: dict[tuple[int, int, int, str, int], dict[str, float]] = field(default_factory=dict)
    host_step_us: list[float] = field(default_factory=list)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Calibration":
        """Read a compute_side.py JSON ({"meta", "rows", ...}); single-stream rows only."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        rows = data["rows"] if isinstance(data, dict) else data
        cal = cls(source=os.fspath(path), meta=dict(data.get("meta", {})) if isinstance(data, dict) else {})
        for r in rows:
            if int(r.get("gemm_streams", 1)) != 1:
                continue
            dims = (int(r["m"]), int(r["k"]), int(r["n"]))
            mono = r["mono_graph_ms"] * 1e3
            kind = _kind(r["op"], r["schedule"])
            cal.add(dims, mono, kind, int(r.get("chunks", 1)), r["sched_graph_ms"] * 1e3,
                    r.get("sched_ms", 0) * 1e3 or None, r.get("host_us_sched"))
        return cal

    def add(self, dims: tuple[int, int, int], mono_us: float, kind: str | None = None,
            chunks: int = 1, graph_us: float | None = None, eager_us: float | None = None,
            host_us: float | None = None) -> None:
        """One measurement (also how the tuner feeds in what it timed on this GPU): the
        monolithic GEMM and, with `kind`, the chunked schedule timed beside it."""
        self.mono_samples.setdefault(dims, []).append(mono_us)
        if kind is None or graph_us is None:
            return
        entry = self.ratios.setdefault((*dims, kind, chunks), {})
        entry["graph"] = graph_us / mono_us
        if eager_us:
            entry["eager"] = eager_us / mono_us
        if host_us is not None:
            self.host_step_us.append(host_us / chunks)

    @property
    def mono(self) -> dict[tuple[int, int, int], float]:
        return {d: statistics.median(v) for d, v in self.mono_samples.items()}

    def chunked_us(self, dims: tuple[int, int, int], kind: str, chunks: int,
                   mode: str = "graph") -> float | None:
        """The whole chunked schedule's time in `mode`, or None where not measured."""
        ratio = self.ratios.get((*dims, kind, chunks), {}).get(mode)
        return None if ratio is None else ratio * statistics.median(self.mono_samples[dims])

    def eager_step_us(self) -> float | None:
        """Median host time per schedule step (Python, launches), or None without rows."""
        return statistics.median(self.host_step_us) if self.host_step_us else None

    def describe(self) -> str:
        dev = self.meta.get("device", "?")
        return (f"{self.source} ({dev}, {len(self.mono_samples)} GEMM shapes, "
                f"{len(self.ratios)} chunked schedules)")

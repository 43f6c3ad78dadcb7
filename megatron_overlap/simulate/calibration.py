"""Measured GEMM times from one GPU (what benchmarks/compute_side.py writes with
--out), indexed the way the cost model asks for them.

Every time here is device time of CUDA-graph replays (no host gaps): the
monolithic cuBLAS GEMM, and the whole chunked schedule run on the null
transport (its chunk GEMMs back to back). Eager host cost per schedule step
comes from the same rows (host time per call / steps).
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
    """mono[(m,k,n)] = us; chunked[(m,k,n,kind,chunks)] = us for the whole schedule."""

    mono: dict[tuple[int, int, int], float] = field(default_factory=dict)
    chunked: dict[tuple[int, int, int, str, int], float] = field(default_factory=dict)
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
            cal.add(dims, r["mono_graph_ms"] * 1e3)
            kind = _kind(r["op"], r["schedule"])
            if kind is not None:
                cal.add(dims, r["mono_graph_ms"] * 1e3, kind, int(r["chunks"]),
                        r["sched_graph_ms"] * 1e3, r.get("host_us_sched"))
        return cal

    def add(self, dims: tuple[int, int, int], mono_us: float, kind: str | None = None,
            chunks: int = 1, chunked_us: float | None = None, host_us: float | None = None) -> None:
        """One measurement (also how the tuner feeds in what it timed on this GPU)."""
        self.mono[dims] = mono_us
        if kind is not None and chunked_us is not None:
            self.chunked[(*dims, kind, chunks)] = chunked_us
            if host_us is not None:
                self.host_step_us.append(host_us / chunks)

    def eager_step_us(self) -> float | None:
        """Median host time per schedule step (Python, launches), or None without rows."""
        return statistics.median(self.host_step_us) if self.host_step_us else None

    def describe(self) -> str:
        dev = self.meta.get("device", "?")
        return (f"{self.source} ({dev}, {len(self.mono)} GEMM shapes, "
                f"{len(self.chunked)} chunked schedules)")

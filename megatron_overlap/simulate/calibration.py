"""Measured GEMM times from one GPU (what benchmarks/compute_side.py writes with
--out), indexed the way the cost model asks for them.

Monolithic GEMM times are device times of CUDA-graph replays, each of one shape in
one operand layout (`shapes.GEMM_LAYOUTS`: NT, NN, TN), keyed (m, k, n, layout): a row's
`layout`, else NT (compute_side.py times the forward pass's x @ w.t(); the files it wrote
before its rows named their layout hold only those). A chunked
schedule (run on the null transport: its chunk GEMMs, order and waits) is kept
as its ratio to the monolithic GEMM timed beside it in the same row, graphed
and eager (eager includes the host's launch gaps). Eager host cost per step,
for schedules not measured, comes from the rows' host time per call / steps;
a measured host time per layer call (`host`, `--host-time`) overrides it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .shapes import GEMM_LAYOUTS, check_gemm_layout

if TYPE_CHECKING:
    from .host import HostTime

Dims = tuple[int, int, int, str]  # a GEMM [m, k] x [k, n] and its operand layout

# what compute_side.py writes into its meta: the ring reduce-scatter it timed (Calibration.ring_rs)
RING_RS = ("sum", "adds")

# compute_side.py's (op, schedule label) -> the cost model's schedule kind
_KINDS = {("ag", "ring"): "ag_ring", ("rs", "ring"): "rs_ring", ("rs", "pipeline4"): "rs_pipeline"}


def _kind(op: str, label: str) -> str | None:
    if (op, label) in _KINDS:
        return _KINDS[(op, label)]
    if op == "rs" and label.startswith("pipeline") and label[8:].isdigit():
        return "rs_pipeline"
    return None


class CalibrationError(ValueError):
    """A calibration file that cannot be read; names the file, the row and the field."""


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """A results file's JSON; one that is not JSON is a CalibrationError naming it."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise CalibrationError(f"{what} file {os.fspath(path)!r}: not valid JSON: {e}") from None


_MISSING = object()


class _Row:
    """Typed fields of one calibration row, each checked."""

    def __init__(self, path: str, index: int, row: Any):
        if not isinstance(row, dict):
            raise CalibrationError(f"calibration file {path!r}, row {index}: expected an object, "
                                   f"got {type(row).__name__}")
        self.path, self.index, self.row = path, index, row

    def _get(self, key: str, default: Any) -> Any:
        if key in self.row and self.row[key] is not None:
            return self.row[key]
        if default is _MISSING:
            raise self.error(key, "missing")
        return default

    def error(self, key: str, what: str) -> CalibrationError:
        return CalibrationError(f"calibration file {self.path!r}, row {self.index}, field "
                                f"{key!r}: {what}")

    def integer(self, key: str, default: Any = _MISSING) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
            raise self.error(key, f"expected an integer >= 1, got {v!r}")
        return int(v)

    def text(self, key: str) -> str:
        v = self._get(key, _MISSING)
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, got {v!r}")
        return v

    def layout(self, key: str, default: str) -> str:
        """An operand layout (NT, NN, TN, TT), `default` when absent."""
        v = self._get(key, default)
        try:
            return check_gemm_layout(v)
        except ValueError:
            raise self.error(key, f"expected an operand layout (two letters, each N or T), "
                                  f"got {v!r}") from None

    def time(self, key: str, default: Any = _MISSING, scale: float = 1e3) -> Any:
        """A time in ms (scaled to us; `scale` 1 for one in us), or `default` when absent.
        Optional times may be 0 (not measured); required ones must be > 0."""
        v = self._get(key, default)
        if v is default and default is not _MISSING:
            return v if v is None else v * scale
        least = 0 if default is not _MISSING else 1e-300
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < least:
            raise self.error(key, f"expected a finite time {'>= 0' if least == 0 else '> 0'}, "
                                  f"got {v!r}")
        return v * scale


@dataclass
class Calibration:
    """Monolithic GEMM device times (median of the rows that timed a shape in a layout)
    and, per chunked schedule, its time relative to the monolithic GEMM of the same row,
    in the same layout: under a CUDA graph (device time of the chunk GEMMs) and eager
    (host launch gaps included). Keys begin with `Dims`, (m, k, n, operand layout)."""

    mono_samples: dict[Dims, list[float]] = field(default_factory=dict)
    ratios: dict[tuple[int, int, int, str, str, int], dict[str, float]] = \
        field(default_factory=dict)
    host_step_us: list[float] = field(default_factory=list)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # what a measured ring reduce-scatter holds besides its GEMMs (RING_RS): "sum", the one
    # sum of its TP partials `overlap.gemm_rs.ring_exchange` runs; "adds", the TP - 1
    # running-sum adds of the ring before it, in files that do not say (meta "ring_rs")
    ring_rs: str = "sum"
    host: "HostTime | None" = None  # measured host time per layer pass call (host.py)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Calibration":
        """Read a compute_side.py JSON ({"meta", "rows", ...}); single-stream rows only.
        A row's optional `layout` names its GEMMs' operand layout (default NT: what
        compute_side.py has always timed, the forward pass's). A file that is not such a
        JSON is a CalibrationError naming the file, row and field."""
        where, data = os.fspath(path), read_json(path, "calibration")
        rows = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise CalibrationError(f"calibration file {where!r}: expected a list of rows or an "
                                   "object with 'rows' (what benchmarks/compute_side.py --out "
                                   "writes)")
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        meta = dict(meta) if isinstance(meta, dict) else {}
        cal = cls(source=where, meta=meta, ring_rs=meta.get("ring_rs", "adds"))
        if cal.ring_rs not in RING_RS:
            raise CalibrationError(f"calibration file {where!r}: meta 'ring_rs' is "
                                   f"{cal.ring_rs!r}, not one of {sorted(RING_RS)}")
        for i, r in enumerate(rows):
            field = _Row(where, i, r)
            if field.integer("gemm_streams", 1) != 1:
                continue
            dims = (field.integer("m"), field.integer("k"), field.integer("n"),
                    field.layout("layout", GEMM_LAYOUTS["fprop"]))
            kind = _kind(field.text("op"), field.text("schedule"))
            cal.add(dims, field.time("mono_graph_ms"), kind, field.integer("chunks", 1),
                    field.time("sched_graph_ms"), field.time("sched_ms", 0.0) or None,
                    field.time("host_us_sched", None, scale=1.0))
        return cal

    def add(self, dims: Dims, mono_us: float, kind: str | None = None,
            chunks: int = 1, graph_us: float | None = None, eager_us: float | None = None,
            host_us: float | None = None) -> None:
        """One measurement (also how the tuner feeds in what it timed on this GPU): the
        monolithic GEMM (m, k, n) in operand layout `dims[3]` and, with `kind`, the chunked
        schedule timed beside it."""
        if len(dims) != 4:
            raise ValueError(f"calibration dims {dims!r}: expected (m, k, n, operand layout)")
        check_gemm_layout(dims[3])
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
    def mono(self) -> dict[Dims, float]:
        return {d: statistics.median(v) for d, v in self.mono_samples.items()}

    def chunked_us(self, dims: Dims, kind: str, chunks: int,
                   mode: str = "graph") -> float | None:
        """The whole chunked schedule's time in `mode`, or None where not measured."""
        ratio = self.ratios.get((*dims, kind, chunks), {}).get(mode)
        return None if ratio is None else ratio * statistics.median(self.mono_samples[dims])

    def eager_step_us(self) -> float | None:
        """Median host time per schedule step (Python, launches), or None without rows."""
        return statistics.median(self.host_step_us) if self.host_step_us else None

    def host_source(self, mode: str, default_step_us: float,
                    megatron_modelled_us: float | None = None) -> str:
        """Where the model's host time per pass comes from, in launch `mode` (with a host-time
        file: which of its figures, ours and Megatron's path's; `megatron_modelled_us`: what
        Megatron's path is modelled at where the file does not measure it)."""
        if self.host is not None:
            return self.host.describe(mode, megatron_modelled_us)
        if mode == "graph":
            return "host time not counted (graph mode, no --host-time)"
        step = self.eager_step_us()
        return (f"eager host time modelled per schedule step: {step:.0f} us (null-transport rows "
                f"of {self.source})" if step is not None else
                f"eager host time modelled per schedule step: {default_step_us:g} us (default)")

    def describe(self) -> str:
        dev = self.meta.get("device", "?")
        return (f"{self.source} ({dev}, {len(self.mono_samples)} GEMM shapes x operand layouts, "
                f"{len(self.ratios)} chunked schedules)")

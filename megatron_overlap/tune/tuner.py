"""The search: every valid candidate of every layer pass, measured once (the
cache remembers across runs), the fastest kept per pass (`simulate.choose`: within 1%,
the least compute side), written back as a TE
ub_cfgs YAML that install(ub_cfgs=...) and Megatron-LM's --tp-comm-overlap-cfg
both read."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..config import OverlapConfig
from ..simulate import Layout, Shape, Trial, choose, trials, ub_cfgs
from ..simulate.numerics import yaml_comment
from .cache import Cache, cache_key
from .hooks import job_of

Measure = Callable[[Trial], dict[str, Any]]
NOTES = {  # what the numbers are, by measurement mode: said in every output
    "model": "No GPU measurement: every time below is the cost model's prediction (roofline or "
             "--calibration GEMMs, modelled links), not a measurement.",
    "compute": "One GPU: the GEMM side of every candidate is measured here; the communication "
               "side is the cost model's.",
    "real": "Several GPUs: every candidate ran for real, overlapped, on the TP group.",
}
from ..config.names import PASSES  # noqa: E402


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class TuneResult:
    mode: str
    hardware: dict[str, Any]
    layout: Layout
    shapes: list[Shape]
    rows: list[dict[str, Any]]  # one per trial: what, result, cached or not
    chosen: dict[str, dict[str, Trial]]  # shape name -> pass -> trial
    results: dict[Trial, dict[str, Any]]
    configs: dict[str, OverlapConfig]  # model -> validated ub_cfgs
    ring_orders: dict[str, dict[str, str]]
    measured: int = 0
    cached: int = 0
    note: str = ""
    command: str = ""
    choice_rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def precision(self) -> dict[str, Any]:
        """What the tuned passes compute and move in (every shape's; one in a CLI run)."""
        found = {s.numerics.label(): s.numerics for s in self.shapes}
        if len(found) > 1:
            return {"label": " / ".join(found), "mixed": [n.to_dict() for n in found.values()]}
        return next(iter(found.values())).to_dict()

    def write_yaml(self, path: str, model: str | None = None) -> str:
        """The model's ub_cfgs, after a comment saying the precision they were tuned for."""
        model = model or next(iter(self.configs))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        text = yaml_comment(self.precision["label"]) + self.configs[model].to_yaml()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return text

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "mode": self.mode, "note": self.note,
                "precision": self.precision,
                "hardware": self.hardware, "layout": dataclasses.asdict(self.layout),
                "shapes": [dataclasses.asdict(s) for s in self.shapes],
                "measured": self.measured, "cached": self.cached,
                "chosen": self.choice_rows,
                "ub_cfgs": {m: c.to_dict() for m, c in self.configs.items()},
                "ring_orders": self.ring_orders,
                "trials": [{k: _finite(v) for k, v in r.items()} for r in self.rows]}

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1, default=str)


def overlap_pays(result: dict[str, Any]) -> bool:
    """Whether the pass should be overlapped at all: its best overlap is not slower than
    the non-overlapped path (False: "do not overlap this pass"; unknown baseline: True)."""
    base = result.get("baseline_ms")
    return base is None or not math.isfinite(base) or result["time_ms"] <= base


def _te_default_times(results: dict[Trial, dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(shape, pass) -> the time of the candidate with the default settings for that pass
    (TE's get_default_config(), `aggregate` auto resolved for the pass: what runs untuned),
    to say what the tuned YAML gains over them."""
    from ..config.settings import LayerSettings
    from ..simulate.passes import as_run

    return {(t.spec.shape.name, t.name): r["time_ms"] for t, r in results.items()
            if not t.comm_moved and t.candidate.settings == as_run(
                t.spec, LayerSettings.default(t.name), t.candidate.layout)}


class _NoProgress:
    """Progress(disable=True) without rich installed."""

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


def _progress(enabled: bool):
    """A rich progress bar ([tools] extra), or nothing when disabled."""
    if not enabled:
        return _NoProgress()
    from ..extras import require

    p = require("rich.progress", "the tuner's progress bar (or progress=False / --no-progress)")
    return p.Progress(p.TextColumn("{task.description}"), p.BarColumn(), p.MofNCompleteColumn(),
                      p.TimeElapsedColumn(), transient=False)


def tune(shapes: Sequence[Shape], layout: Layout, measure: Measure, *,
         hardware: dict[str, Any] | None = None, cache: Cache | None = None,
         rs_dgrad: bool = False, progress: bool = True, run: Any = None,
         agree: Callable[[dict[str, Any] | None], dict[str, Any] | None] | None = None,
         note: str = "", command: str = "") -> TuneResult:
    """Measure every valid candidate of every pass of `shapes` with `measure` (cached
    results are reused, new ones are cached as they finish), keep the fastest per pass
    (`choose`: among those within its TIE of the fastest, the least compute side).

    hardware: what the cache keys results by besides the trial (default measure.hardware);
    run: a wandb run to log the search and the choice to; agree(hit) -> the cache hit every
    rank acts on (several ranks measuring together: rank 0's, broadcast)."""
    from . import log

    hardware = hardware if hardware is not None else getattr(measure, "hardware", {})
    mode = getattr(measure, "mode", "custom")
    note = note or NOTES.get(mode, "")
    cache = cache if cache is not None else Cache()
    todo = [t for s in shapes for t in trials(s, layout, rs_dgrad=rs_dgrad)]
    rows: list[dict[str, Any]] = []
    results: dict[Trial, dict[str, Any]] = {}
    measured = cached = 0
    with _progress(progress) as bar:
        task = bar.add_task(f"tuning ({mode})", total=len(todo))
        for i, t in enumerate(todo):
            job = job_of(t)
            key = cache_key(job, hardware)
            hit = cache.get(key)
            if agree is not None:
                hit = agree(hit)
            if hit is None:
                result = measure(t)
                cache.put(key, job, hardware, result)
                measured += 1
            else:
                result, cached = hit, cached + 1
            results[t] = result
            row = {"index": i, "shape": t.spec.shape.name, "pass": t.name,
                   "label": t.candidate.label_for(layout.backend), **job, **result,
                   "cached": hit is not None}
            rows.append(row)
            log.trial(run, row)
            bar.update(task, advance=1, description=f"tuning ({mode}) {t.spec.shape.name} {t.name}")

    chosen = {s.name: choose(s, {t: r["time_ms"] for t, r in results.items() if t.spec.shape == s},
                             {t: r.get("compute_only_ms") for t, r in results.items()
                              if t.spec.shape == s})
              for s in shapes}
    te_ms = _te_default_times(results)
    configs, orders, choice_rows = {}, {}, []
    for s in shapes:
        entries, ring = ub_cfgs(chosen[s.name].values())
        configs.setdefault(s.model, {}).update(entries)
        orders.setdefault(s.model, {}).update(ring)
        for p in PASSES:
            if p in chosen[s.name]:
                t = chosen[s.name][p]
                choice_rows.append({"shape": s.name, "model": s.model, "pass": t.name,
                                    "overlap": overlap_pays(results[t]),
                                    "label": t.candidate.label_for(layout.backend),
                                    "settings": t.candidate.to_dict(), "comm_moved": t.comm_moved,
                                    "te_default_ms": _finite(te_ms.get((s.name, t.name))),
                                    **{k: _finite(v) for k, v in results[t].items()}})
    out = TuneResult(mode, hardware, layout, list(shapes), rows, chosen, results,
                     {m: OverlapConfig.load(c) for m, c in configs.items()}, orders,
                     measured, cached, note, command, choice_rows)
    log.choice(run, out)
    return out

"""A simulate() Report as a console table, Markdown, and JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..config.console import WIDTH, Column, lines, table
from .api import Report
from .passes import megatron_modelled_host_us

COLUMNS = ("shape", "pass", "settings", "GEMM ms", "non-overlapped ms", "overlapped ms",
           "exposed ms", "hidden", "best settings", "best ms")


FOOTNOTE = ("Step estimate: the TP linears only (4 per layer x fprop/dgrad/wgrad). hidden = "
            "(non-overlapped - overlapped) / (non-overlapped - compute-only), '-' where chunking "
            "alone costs more than the communication. Eager without --host-time: host launch time "
            "counted per pass as if the GPU waited for it (as benchmarks/compute_side.py "
            "measures). With --host-time: each pass costs max(measured host time per call, GPU "
            "time), as calls queued back to back run (replayed rows in graph mode, eager rows "
            "in eager mode).")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def rows(report: Report) -> list[list[str]]:
    backend = report.layout.backend
    out = []
    for sr in report.shapes:
        for given, best in zip(sr.given, sr.best):
            trial = sr.chosen[given.name.split("_")[1]]
            label = trial.candidate.label_for(backend) + (" (wgrad alone)" if trial.comm_moved else "")
            settings = given.settings.get("method", "none")
            if given.ring_order == "hierarchical" or (given.ring_order == "flat"
                                                       and report.layout.nodes > 1):
                settings += f" {given.ring_order}"
            out.append([sr.shape.name, given.name.split("_")[1], settings,
                        f"{given.gemm_us / 1e3:.3f}", f"{given.baseline_us / 1e3:.3f}",
                        f"{given.overlapped_us / 1e3:.3f}", f"{given.exposed_us / 1e3:.3f}",
                        _pct(given.hidden), label + (" [host-bound]" if best.host_bound else ""),
                        f"{best.overlapped_us / 1e3:.3f}"])
    return out


def _fitted(report: Report) -> float:
    from .gemm import fit_efficiency

    return fit_efficiency(report.hw, report.calibration)


def headline(report: Report) -> str:
    cal = report.calibration
    gemm = (f"GEMMs measured where {cal.describe()} timed the shape, elsewhere a roofline "
            f"fitted to it (efficiency {_fitted(report):.2f} of peak)" if cal.mono
            else f"GEMMs from the roofline (no calibration file; efficiency "
                 f"{report.hw.gemm_efficiency:.2f} of peak)")
    hw = report.hw
    labels = sorted({sr.shape.numerics.label() for sr in report.shapes})
    if any(sr.shape.numerics.fp8 for sr in report.shapes):
        gemm += (f"; FP8 GEMMs from the roofline at {hw.fp8_peak_tflops:g} TFLOP/s"
                 + (" with that efficiency" if cal.mono else "")
                 + f", each FP8 pass with its amaxes, casts and transposed copies at "
                   f"{hw.hbm_gbs:g} GB/s and {hw.kernel_us:g} us a kernel")
    return (f"{hw.name}, {report.layout.describe()}, {' / '.join(labels)}; "
            f"NVLink {hw.nvlink_gbs:g} GB/s "
            f"{hw.nvlink_latency_us:g} us, IB {hw.ib_gbs:g} GB/s {hw.ib_latency_us:g} us; {gemm}; "
            f"{cal.host_source(report.layout.mode, hw.eager_step_us, megatron_modelled_host_us(hw))}")


def not_paying(report: Report) -> list[str]:
    """Passes whose non-overlapped path beats even the best overlap the model found."""
    return [f"{sr.shape.name} {b.name.split('_')[1]}" for sr in report.shapes
            for b in sr.best if b.overlapped_us > b.baseline_us + 1e-9]


def host_bound(report: Report) -> list[str]:
    """Passes whose measured host time per call exceeds their GPU time at the best settings."""
    return [f"{sr.shape.name} {b.name.split('_')[1]}" for sr in report.shapes
            for b in sr.best if b.host_bound]


def summary_lines(report: Report) -> list[str]:
    out = []
    slower, bound = not_paying(report), host_bound(report)
    if slower:
        out.append("Do not overlap: non-overlapped predicted faster than any overlap for: "
                   + ", ".join(slower) + " (turn that overlap off with Megatron's "
                   "tp_comm_overlap_ag / _rs / tp_comm_bulk_dgrad / _wgrad flags)")
    if bound:
        out.append("Host-bound (measured host time per call above the pass's GPU time): "
                   + ", ".join(bound))
    for s in report.models:
        d = s.to_dict()
        per, step = d["per_layer_ms"], d["step_ms"]
        what = "" if s.complete else f" (only {', '.join(s.buffers)}: a partial layer)"
        fp8 = (f" (+ {per['fp8_work']:.3f} ms FP8 work, {per['fp8_weights']:.3f} of it the "
               f"weights', once per step)" if per["fp8_work"] else "")
        out.append(f"{s.model}{what}: per layer {per['gemm']:.3f} ms GEMMs{fp8}, non-overlapped "
                   f"{per['baseline']:.3f}, overlapped {per['overlapped']:.3f}, best "
                   f"{per['best']:.3f} ms; x {s.layers} layers x {s.micro_batches} micro-batch(es): "
                   f"{step['baseline']:.1f} -> {step['overlapped']:.1f} -> {step['best']:.1f} ms")
    return out


def console(report: Report) -> str:
    columns = [Column(c, right="ms" in c or c == "hidden") for c in COLUMNS]
    cells = rows(report)
    rules = {i for i, r in enumerate(cells) if r[1] == "wgrad"}
    return (table(headline(report), columns, cells, rules_after=rules, width=WIDTH)
            + lines(*summary_lines(report), FOOTNOTE))


def markdown(report: Report, command: str) -> str:
    lines = [f"Command: `{command}`", "", headline(report) + ".", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    lines += [""] + [f"- {line}" for line in summary_lines(report)] + [f"- {FOOTNOTE}"]
    for s in report.models:
        orders = ", ".join(f"{k}: {v}" for k, v in s.ring_orders.items())
        lines += ["", f"Settings picked for {s.model} (ub_cfgs; ring orders: {orders or '-'}):", "",
                  "```yaml", report.picked_config(s.model).to_yaml().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def to_json(report: Report, command: str) -> dict[str, Any]:
    passes = []
    for sr in report.shapes:
        for given, best in zip(sr.given, sr.best):
            trial = sr.chosen[given.name.split("_")[1]]
            passes.append({**given.to_dict(), "shape_source": sr.shape.source,
                           "m": sr.shape.m, "k": sr.shape.k, "n": sr.shape.n,
                           "best": {**best.to_dict(), "label": trial.candidate.label_for(
                               report.layout.backend), "comm_moved": trial.comm_moved},
                           "overlap_pays": best.overlapped_us <= best.baseline_us,
                           "host_bound": best.host_bound,
                           "candidates_tried": sr.tried})
    cal = report.calibration
    return {"command": command,
            "meta": {"hardware": dataclasses.asdict(report.hw),
                     "layout": {**dataclasses.asdict(report.layout), "nodes": report.layout.nodes,
                                "local": report.layout.local},
                     "calibration": cal.source or None, "calibration_meta": cal.meta,
                     "calibration_ring_rs": cal.ring_rs,
                     "host_time": cal.host_source(report.layout.mode, report.hw.eager_step_us,
                                                  megatron_modelled_host_us(report.hw)),
                     "host_time_file": cal.host.source if cal.host is not None else None,
                     "host_time_figures": _host_figures(report),
                     "gemm_times": "measured where calibrated, fitted roofline otherwise"
                     if cal.mono else "roofline (no calibration)",
                     "fitted_gemm_efficiency": _fitted(report), "rs_dgrad": report.rs_dgrad,
                     "precision": list({sr.shape.numerics.label(): sr.shape.numerics.to_dict()
                                        for sr in report.shapes}.values())},
            "passes": passes, "models": [s.to_dict() for s in report.models]}


def _host_figures(report: Report) -> dict[str, Any] | None:
    """Which figures of the host-time file the model took, per TP size: ours (simulate.host's
    SOURCES keys) and Megatron's path (`chain_*`, or "modelled" with its µs per pass)."""
    host = report.calibration.host
    if host is None:
        return None
    src = host.sources(report.layout.mode)
    return {"ours": {str(tp): n for tp, n in src["ours"].items()},
            "megatron": {str(tp): n for tp, n in src["megatron"].items()} or
            {"modelled_us_per_pass": megatron_modelled_host_us(report.hw)}}


def write_json(report: Report, path: str, command: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(report, command), f, indent=1)

"""The A/B report: a markdown table (loss parity, median step times, their ratio)
and a PNG of the loss and step-time curves."""

from __future__ import annotations

import os
import statistics
from typing import Mapping, Sequence

from .train import StepResult


def _median_time(results: Sequence[StepResult], skip: int) -> float:
    times = [r.step_time_s for r in results[skip:]] or [r.step_time_s for r in results]
    return statistics.median(times)


def write_report(arms: Mapping[str, Sequence[StepResult]], out_dir: str, *, title: str,
                 baseline: str, details: Mapping[str, object] | None = None,
                 sections: Mapping[str, Sequence[str]] | None = None,
                 warmup: int = 2) -> tuple[str, str]:
    """Write report.md and report.png under out_dir; return their paths. Step
    times are medians over the steps after `warmup`; the speedup is baseline
    median over each arm's median, from steps run side by side. `sections`:
    heading -> bullet lines, after the table (what the run can show, say)."""
    from ..extras import require

    matplotlib = require("matplotlib", "the A/B report's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    base = arms[baseline]
    base_t = _median_time(base, warmup)
    lines = [f"# {title}", ""]
    for k, v in (details or {}).items():
        lines.append(f"- {k}: {v}")
    lines += ["", f"Median step time over steps {warmup}..{len(base) - 1}, arms stepped alternately.", "",
              "| arm | steps | final loss | max abs loss diff vs baseline | median step (ms) | speedup vs baseline |",
              "|---|---|---|---|---|---|"]
    for name, res in arms.items():
        diff = max(abs(a.loss - b.loss) for a, b in zip(res, base))
        t = _median_time(res, warmup)
        lines.append(f"| {name} | {len(res)} | {res[-1].loss:.6f} | {diff:.2e} | {t * 1e3:.2f} | "
                     f"{base_t / t:.3f} |")
    for heading, bullets in (sections or {}).items():
        lines += ["", f"## {heading}", ""] + [f"- {b}" for b in bullets]
    md = os.path.join(out_dir, "report.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in arms.items():
        steps = [r.step for r in res]
        ax_loss.plot(steps, [r.loss for r in res], label=name, marker="o", markersize=3)
        ax_time.plot(steps, [r.step_time_s * 1e3 for r in res], label=name, marker="o", markersize=3)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_time.set(xlabel="step", ylabel="ms", title="step time")
    for ax in (ax_loss, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    png = os.path.join(out_dir, "report.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return md, png

"""PNG plots of benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

import textwrap
from typing import Mapping, Sequence


def _plt():
    from ..extras import require

    matplotlib = require("matplotlib", "benchmark plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str, title: str) -> str:
    fig.suptitle(textwrap.fill(title, 150), fontsize=10)  # a long title wraps, not cut
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(shapes: Sequence[Mapping], path: str, title: str) -> str:
    """Left: each arm's median time relative to the baseline's, per shape (lower is
    better; 1 = the non-overlapped path). Right: hidden fraction per overlapped arm."""
    plt = _plt()
    arms = list(dict.fromkeys(a for s in shapes for a, r in s["arms"].items() if r.get("time_s")))
    hidden = list(dict.fromkeys(a for s in shapes for a, r in s["arms"].items()
                                if r.get("hidden_fraction") is not None))
    names = [s["shape"]["name"] for s in shapes]
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(names) + 6), 4.8))
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        ys = []
        for s in shapes:
            r, b = s["arms"].get(arm, {}), s["arms"].get("baseline", {})
            ok = r.get("time_s") and b.get("time_s")
            ys.append(r["time_s"]["median"] / b["time_s"]["median"] if ok else float("nan"))
        ax_t.bar([j + i * width for j in range(len(names))], ys, width, label=arm)
    ax_t.axhline(1.0, color="k", lw=0.8)
    ax_t.set(ylabel="median time / baseline", title="time relative to the non-overlapped path")
    width_h = 0.8 / max(len(hidden), 1)
    low = -1.0  # below: slower than not overlapping by more than the communication; clipped, labelled
    for i, arm in enumerate(hidden):
        ys = [s["arms"].get(arm, {}).get("hidden_fraction") for s in shapes]
        xs = [j + i * width_h for j in range(len(names))]
        ax_h.bar(xs, [float("nan") if y is None else max(y, low) for y in ys], width_h, label=arm)
        for x, y in zip(xs, ys):
            if y is not None and y < low:
                ax_h.text(x, low, f"{y:.1f}", rotation=90, va="bottom", ha="center", fontsize=6)
    ax_h.set_ylim(low - 0.05, 1.1)
    ax_h.axhline(1.0, color="k", lw=0.8, ls="--")
    ax_h.axhline(0.0, color="k", lw=0.8)
    ax_h.set(ylabel="(baseline - arm) / (baseline - floor)", title="hidden fraction of the communication")
    for ax, n in ((ax_t, len(arms)), (ax_h, len(hidden))):
        ax.set_xticks([j + 0.4 - 0.4 / max(n, 1) for j in range(len(names))], names, rotation=20,
                      ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def plot_steps(arms: Mapping[str, Mapping], path: str, title: str, warmup: int) -> str:
    """Left: loss per step, every arm. Right: median step time per arm (bars: the
    interquartile range over the steps after warmup)."""
    plt = _plt()
    fig, (ax_l, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, a in arms.items():
        if a.get("kind") == "compute_only":  # transfers skipped: not a model's loss
            continue
        ax_l.plot(range(len(a["losses"])), a["losses"], marker="o", markersize=3, label=name)
    ax_l.xaxis.get_major_locator().set_params(integer=True)
    ax_l.set(xlabel="step", ylabel="loss", title="loss (same seed, weights, batches)")
    names = list(arms)
    med = [arms[n]["step_time_s"]["median"] * 1e3 for n in names]
    lo = [m - arms[n]["step_time_s"]["q1"] * 1e3 for m, n in zip(med, names)]
    hi = [arms[n]["step_time_s"]["q3"] * 1e3 - m for m, n in zip(med, names)]
    ax_t.bar(names, med, yerr=[lo, hi], capsize=4, color=[f"C{i}" for i in range(len(names))])
    ax_t.set(ylabel="ms", title=f"median step time (steps {warmup}.., IQR)")
    ax_t.tick_params(axis="x", labelrotation=15)
    for ax in (ax_l, ax_t):
        ax.grid(alpha=0.3)
    ax_l.legend(fontsize=8)
    return _save(plt, fig, path, title)

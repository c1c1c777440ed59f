"""Figures for privacy reports (matplotlib, Agg backend; imported only when plotting).

Each function takes plain numbers, writes one PNG and returns its path. Axes carry units,
every curve is labelled, and the accounting method is named in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["epsilon_over_training", "epsilon_vs_delta", "accountant_comparison"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def epsilon_over_training(
    steps: Sequence[int],
    epsilons: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    delta: float,
    target_epsilon: float | None = None,
    accuracy: Sequence[tuple[int, float]] | None = None,
) -> Path:
    """Epsilon spent after each step (a curve per method); test accuracy on a twin axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, values in epsilons.items():
        ax.plot(steps, values, label=f"epsilon ({name})", lw=2)
    if target_epsilon is not None:
        ax.axhline(target_epsilon, color="grey", ls="--", lw=1, label="target epsilon")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"epsilon spent (delta = {delta:g})")
    ax.set_title("Privacy spent during training")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if accuracy:
        ax2 = ax.twinx()
        xs, ys = zip(*accuracy, strict=True)
        pct = [100 * y for y in ys]
        (line,) = ax2.plot(xs, pct, "o-", color="tab:green", label="test accuracy")
        ax2.set_ylabel("test accuracy (%)")
        handles.append(line)
        labels.append("test accuracy")
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    return _save(fig, plt, path)


def epsilon_vs_delta(
    deltas: Sequence[float],
    epsilons: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    dataset_size: int | None = None,
    chosen_delta: float | None = None,
) -> Path:
    """The (epsilon, delta) curve of the final model, per method; marks 1/N and the chosen delta."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, values in epsilons.items():
        ax.plot(deltas, values, label=name, lw=2)
    if dataset_size:
        ax.axvline(1.0 / dataset_size, color="tab:red", ls=":", lw=1.2, label="1/N")
    if chosen_delta is not None:
        ax.axvline(chosen_delta, color="grey", ls="--", lw=1, label="reported delta")
    ax.set_xscale("log")
    ax.set_xlabel("delta")
    ax.set_ylabel("epsilon")
    ax.set_title("Epsilon as a function of delta (final model)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def accountant_comparison(
    results: Mapping[str, tuple[float, float | None, float | None]],
    path: str | Path,
    *,
    delta: float,
) -> Path:
    """Bar chart of epsilon per accounting method; (epsilon, lower, estimate) per method.

    ``lower`` (a lower bound) and ``estimate`` (a Monte Carlo point estimate) are drawn as
    markers when present, so a reader sees how far each upper bound may be from the truth.
    """
    plt = _pyplot()
    names = [n for n, v in results.items() if v[0] is not None and math.isfinite(v[0])]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    xs = range(len(names))
    ax.bar(xs, [results[n][0] for n in names], color="tab:blue", alpha=0.8, label="upper bound")
    for i, n in enumerate(names):
        _, lower, estimate = results[n]
        if lower is not None:
            ax.plot(i, lower, "v", color="tab:red", ms=9, label="lower bound" if i == 0 else None)
        if estimate is not None:
            ax.plot(i, estimate, "D", color="black", ms=6, label="MC estimate")
        ax.text(i, results[n][0], f"{results[n][0]:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel(f"epsilon at delta = {delta:g}")
    ax.set_title("Accounting methods compared")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

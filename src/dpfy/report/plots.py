"""Figures of a training run's privacy report (matplotlib, imported only when plotting).

Each function takes plain numbers, writes one PNG and returns its path. Axes carry units,
every curve is labelled, and the accounting method is named in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpfy.report import _figures


def epsilon_over_training(
    steps: Sequence[int],
    epsilons: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    delta: float,
    target_epsilon: float | None = None,
    accuracy: Sequence[tuple[int, float]] | None = None,
) -> Path:
    """Epsilon spent after each step (a curve per method); test accuracy on a twin axis.

    ``accuracy`` holds (step, accuracy in [0, 1]) pairs; it is drawn in percent.
    """
    fig, (ax,) = _figures.new_figure()
    for name, values in epsilons.items():
        ax.plot(steps, values, label=f"epsilon ({name})", lw=2)
    if target_epsilon is not None:
        ax.axhline(target_epsilon, color="grey", ls="--", lw=1, label="target epsilon")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"epsilon spent (delta = {delta:g})")
    ax.set_title("Privacy spent during training")
    ax.set_ylim(bottom=0)
    _figures.grid(ax)
    handles, labels = ax.get_legend_handles_labels()
    if accuracy:
        ax2 = ax.twinx()
        xs = [x for x, _ in accuracy]
        pct = [100 * y for _, y in accuracy]
        (line,) = ax2.plot(xs, pct, "o-", color="tab:green", label="test accuracy")
        ax2.set_ylabel("test accuracy (%)")
        handles.append(line)
        labels.append("test accuracy")
    _figures.legend(ax, handles, labels, loc="lower right")
    return _figures.save(fig, path)


def epsilon_vs_delta(
    deltas: Sequence[float],
    epsilons: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    dataset_size: int | None = None,
    chosen_delta: float | None = None,
) -> Path:
    """The (epsilon, delta) curve of the final model, per method; marks 1/N and the chosen delta."""
    fig, (ax,) = _figures.new_figure()
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
    _figures.grid(ax, which="both")
    _figures.legend(ax)
    return _figures.save(fig, path)


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
    names = [n for n, v in results.items() if v[0] is not None and math.isfinite(v[0])]
    fig, (ax,) = _figures.new_figure()
    xs = range(len(names))
    ax.bar(xs, [results[n][0] for n in names], color="tab:blue", alpha=0.8, label="upper bound")
    for i, n in enumerate(names):
        _, lower, estimate = results[n]
        if lower is not None:
            ax.plot(i, lower, "v", color="tab:red", ms=9, label="lower bound")
        if estimate is not None:
            ax.plot(i, estimate, "D", color="black", ms=6, label="MC estimate")
        ax.text(i, results[n][0], f"{results[n][0]:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel(f"epsilon at delta = {delta:g}")
    ax.set_title("Accounting methods compared")
    _figures.legend(ax)
    _figures.grid(ax, axis="y")
    return _figures.save(fig, path)


def attack_risk(
    fpr: Sequence[float],
    tpr: Sequence[float],
    path: str | Path,
    *,
    marked: Mapping[str, float] | None = None,
) -> Path:
    """The membership-inference trade-off: the TPR bound against the FPR (log-log), with the
    random-guess diagonal and the reported FPRs marked."""
    fig, (ax,) = _figures.new_figure()
    ax.plot(fpr, tpr, lw=2, color="tab:red", label="attacker's TPR at most")
    ax.plot(fpr, fpr, lw=1, ls="--", color="grey", label="random guess")
    for key, value in (marked or {}).items():
        ax.plot([float(key)], [value], "o", color="tab:red")
        ax.annotate(f"{value:.3g}", (float(key), value), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title("Membership inference: best possible attack")
    _figures.grid(ax, which="both")
    _figures.legend(ax, loc="lower right")
    return _figures.save(fig, path)

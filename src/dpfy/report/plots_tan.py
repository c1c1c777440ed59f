"""TAN figures of Sander et al. 2023 (matplotlib, imported only when plotting).

* :func:`privacy_wall` — the accountant's epsilon against the noise multiplier at constant
  ``eta`` for several step counts, with eps_TAN and the regimes marked (TAN Fig. 2).
* :func:`batch_scaling` — measured metric against batch size at constant ``eta_step`` and
  ``S``, the log-linear fit and its extrapolation to the reference batch (TAN Fig. 4 style).
* :func:`plan_options` — the options of :func:`dpfy.planning.plan`: compute against per-step
  signal-to-noise, coloured by TAN regime.

Each function writes one PNG and returns its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpfy.accounting import tan
from dpfy.report import _figures

if TYPE_CHECKING:
    from dpfy.planning import Plan


def privacy_wall(
    path: str | Path,
    *,
    target_epsilons: Sequence[float] = (1.0, 8.0),
    delta: float = 1e-5,
    steps: Sequence[int] = (100, 1_000, 10_000, 100_000),
    noise_multipliers: Sequence[float] | None = None,
    method: str = "rdp",
) -> Path:
    """Epsilon vs noise multiplier at constant ``eta`` (one panel per eps_TAN target).

    For each target the ``eta`` with ``eps_TAN(eta) = target`` is fixed; each curve is one step
    count ``S`` and each point uses the sampling rate that keeps ``eta`` (TAN Fig. 2).
    """
    zs = np.geomspace(0.25, 10.0, 36) if noise_multipliers is None else np.asarray(
        noise_multipliers, dtype=float
    )
    fig, axes = _figures.new_figure(len(target_epsilons), panel_size=(5.2, 4.0))
    for ax, target in zip(axes, target_epsilons, strict=True):
        eta_value = float(tan.eta_for_epsilon(target, delta))
        for s in steps:
            eps = tan.privacy_wall_curve(eta_value, int(s), zs, delta, method=method)
            ax.plot(zs, eps, lw=2, label=f"S = {int(s):,}")
        ax.axhline(target, color="black", ls="--", lw=1, label="eps_TAN")
        ax.axvspan(zs.min(), tan.PRIVACY_WALL_NOISE_MULTIPLIER, color="red", alpha=0.08)
        ax.axvline(tan.CONSTANT_PRIVACY_NOISE_MULTIPLIER, color="grey", ls=":", lw=1)
        ax.text(0.27, target * 0.55, "privacy\nwall", color="darkred", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("noise multiplier z (log)")
        ax.set_ylabel(f"epsilon ({method}, delta={delta:g})")
        ax.set_title(f"constant eta = {eta_value:.3g} (eps_TAN = {target:g})")
        _figures.legend(ax)
        _figures.grid(ax, which="both")
    fig.suptitle("The privacy wall: epsilon at constant TAN (Sander et al., Fig. 2)")
    return _figures.save(fig, path)


def batch_scaling(
    fit: tan.BatchScalingFit,
    path: str | Path,
    *,
    reference_batch: float | None = None,
    reference_values: Sequence[float] = (),
    metric: str = "test accuracy (%)",
    title: str = "Batch scaling at constant eta_step and S",
) -> Path:
    """Measurements, the log-linear fit and its extrapolation (TAN Fig. 4 style).

    ``reference_values`` (optional) are measurements at ``reference_batch`` to compare with the
    extrapolation; they are not used in the fit.
    """
    fig, (ax,) = _figures.new_figure()
    b = np.asarray(fit.batch_sizes)
    ax.scatter(b, fit.values, marker="x", color="C0", label="simulations (fitted)")
    hi = max(b.max(), reference_batch or 0.0)
    grid = np.geomspace(b.min(), hi, 100)
    ax.plot(grid, fit.predict(grid), "--", color="C0",
            label=f"fit: {fit.intercept:.2f} {fit.slope:+.3f} log B")
    if reference_batch is not None:
        pred = float(fit.predict(reference_batch))
        err = float(fit.prediction_std(reference_batch))
        ax.errorbar([reference_batch], [pred], yerr=[2 * err] if np.isfinite(err) else None,
                    fmt="o", color="C1", capsize=4, label="extrapolated (±2 s.e.)")
        if len(reference_values):
            ax.scatter([reference_batch] * len(reference_values), reference_values, marker="*",
                       s=120, color="C3", label="reference run(s)")
    ax.set_xscale("log")
    ticks = sorted(set(b.tolist()) | ({float(reference_batch)} if reference_batch else set()))
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("batch size B (log)")
    ax.set_ylabel(metric)
    ax.set_title(title)
    _figures.grid(ax, which="both")
    _figures.legend(ax)
    return _figures.save(fig, path)


def plan_options(plan: Plan, path: str | Path) -> Path:
    """A plan's options: compute (examples processed) against per-step signal-to-noise.

    Each option of :func:`dpfy.planning.plan` is a point labelled with ``(B, z, S)`` and coloured
    by its TAN regime; all meet the same budget, so the picture shows what compute buys.
    """
    colours = {
        tan.Regime.CONSTANT_PRIVACY: "C2",
        tan.Regime.TRANSITION: "C1",
        tan.Regime.PRIVACY_WALL: "C3",
    }
    fig, (ax,) = _figures.new_figure()
    seen: set[tan.Regime] = set()
    for i, o in enumerate((plan.recommendation, *plan.runner_ups)):
        label = o.regime.value.replace("_", " ") if o.regime not in seen else None
        seen.add(o.regime)
        ax.scatter([o.examples_processed], [o.eta_step], s=120 if i == 0 else 50,
                   marker="*" if i == 0 else "o", color=colours[o.regime], label=label)
        ax.annotate(f"{o.label}\nB={o.batch_size}, z={o.noise_multiplier:.2f}, S={o.steps}",
                    (o.examples_processed, o.eta_step), fontsize=7,
                    xytext=(5, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.2)
    ax.set_xlabel("compute: examples processed B x S (log)")
    ax.set_ylabel("eta_step = q / (sqrt(2) z)")
    ax.set_title(
        f"Options at epsilon={plan.target_epsilon:g}, delta={plan.delta:g}, N={plan.dataset_size:,}"
    )
    _figures.grid(ax, which="both")
    _figures.legend(ax, title="TAN regime", title_fontsize=_figures.LEGEND_FONTSIZE)
    return _figures.save(fig, path)

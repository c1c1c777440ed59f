"""The verdict of an accuracy goal, with the test split's own noise taken into account.

A test accuracy ``p`` measured on ``n_test`` examples has the binomial standard error
``sqrt(p (1 - p) / n_test)``: the spread a different test split of the same size would give,
whatever the seeds. A goal is

* **met** if ``mean - SE >= goal``,
* **missed** if ``mean + SE < goal``,
* **within noise** otherwise,

with ``mean`` the mean test accuracy over seeds (a fraction or percent, as ``goal``). The seed
spread is reported beside it, not folded in: it measures the training's randomness, the SE the
test split's. The benchmarks' READMEs and docs/results.md state goal verdicts by this rule.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

VERDICTS = ("met", "within noise", "missed")


def standard_error(accuracy: float, n_test: int) -> float:
    """``sqrt(p (1 - p) / n_test)`` of a test accuracy ``p`` in [0, 1] on ``n_test`` examples."""
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1] (a fraction), got accuracy={accuracy!r}")
    if isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1:
        raise ValueError(f"n_test must be an integer >= 1, got n_test={n_test!r}")
    return math.sqrt(accuracy * (1.0 - accuracy) / n_test)


def verdict(mean: float, goal: float, n_test: int, *, percent: bool = True) -> str:
    """``"met"``, ``"missed"`` or ``"within noise"`` for a mean test accuracy against a goal.

    Args:
      mean, goal: accuracies in percent (``percent=True``) or as fractions.
      n_test: the test split's size.
    """
    scale = 100.0 if percent else 1.0
    for name, value in (("mean", mean), ("goal", goal)):
        if not 0.0 <= value <= scale:
            raise ValueError(f"{name} must be in [0, {scale:g}], got {name}={value!r}")
    se = scale * standard_error(mean / scale, n_test)
    if mean - se >= goal:
        return "met"
    if mean + se < goal:
        return "missed"
    return "within noise"


def summarise(accuracies: list[float], goal: float | None, n_test: int) -> dict[str, Any]:
    """A results row's statistics of per-seed test accuracies in percent: the mean, the seed
    spread (sample standard deviation; None for one seed), the test split's SE at the mean (in
    points), ``n_test``, the goal and its :func:`verdict` (None without a goal)."""
    mean = statistics.fmean(accuracies)
    return {
        "mean": mean,
        "seed_std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
        "test_se": 100.0 * standard_error(mean / 100.0, n_test), "n_test": n_test,
        "goal": goal, "verdict": None if goal is None else verdict(mean, goal, n_test),
    }


if __name__ == "__main__":  # the verdicts docs/results.md states
    for label, mean, goal, n in (
        ("sentiment bias-only, total 2.55 vs goal 76.0 (at 1)", 76.41, 76.0, 1975),
        ("sentiment bias-only, total 6.49 vs goal 77.5 (at 3)", 77.14, 77.5, 1975),
        ("sentiment bias-only, total 15.44 vs goal 78.9 (at 8)", 77.19, 78.9, 1975),
        ("ScatterNet CNN, MNIST, epsilon 3 run alone vs goal 98.8", 98.88, 98.8, 10000),
        ("ScatterNet linear, Fashion-MNIST, epsilon 3 run alone vs goal 90.0", 89.70, 90.0,
         10000),
    ):
        se = 100 * standard_error(mean / 100, n)
        print(f"{label}: {mean:.2f} +- {se:.2f} (SE, n={n}) -> {verdict(mean, goal, n)}")

"""The audit statistics: Clopper-Pearson, threshold bounds, GDP mu, the one-run bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfy.audit.stats import (
    clopper_pearson,
    gdp_mu_lower,
    one_run_ceiling,
    one_run_epsilon,
    one_run_p_value,
    threshold_epsilon_bound,
)


def test_clopper_pearson_limits_and_coverage() -> None:
    lo, hi = clopper_pearson(0, 10, 0.95)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05 ** (1 / 10))
    lo, hi = clopper_pearson(10, 10, 0.95)
    assert hi == 1.0 and lo == pytest.approx(0.05 ** (1 / 10))
    # coverage: the true p lies below the upper bound in at least ~95 % of draws
    rng = np.random.default_rng(0)
    k = rng.binomial(200, 0.1, size=4000)
    lo, hi = clopper_pearson(k, 200, 0.95)
    assert np.mean(hi >= 0.1) >= 0.94 and np.mean(lo <= 0.1) >= 0.94
    assert np.mean(hi >= 0.1) < 0.995  # not trivially wide


def test_one_run_ceiling_matches_the_paper() -> None:
    # Steinke, Nasr, Jagielski 2023: k guesses all correct at 95 %: ~3.5 (k=100), ~5.8 (k=1000)
    assert one_run_ceiling(100, 100, delta=0.0) == pytest.approx(3.49, abs=0.01)
    assert one_run_ceiling(1000, 1000, delta=0.0) == pytest.approx(5.81, abs=0.01)
    # delta = 0: the p-value is exactly the binomial tail of eps-randomised response
    q = 1 / (1 + math.exp(-1.0))
    assert one_run_p_value(50, 40, 30, 1.0, 0.0) == pytest.approx(stats.binom.sf(29, 40, q))
    # delta > 0 only weakens the bound; random guessing gives nothing
    assert one_run_epsilon(1000, 100, 90, delta=1e-5) <= one_run_epsilon(1000, 100, 90, delta=0)
    assert one_run_epsilon(1000, 100, 50, delta=0.0) == 0.0


def test_threshold_bound_on_gaussians_is_below_the_truth_and_informative() -> None:
    from dpfy.accounting.gaussian import gaussian_epsilon

    rng = np.random.default_rng(1)
    mu = 1.0
    truth = float(gaussian_epsilon(mu, 1e-5))
    for selection, grid in (("split", None), ("grid", np.arange(0.0, 5.0, 0.25))):
        b = threshold_epsilon_bound(
            rng.normal(mu, 1.0, 100_000),
            rng.normal(0.0, 1.0, 100_000),
            delta=1e-5,
            selection=selection,
            thresholds=grid,
        )
        assert 1.5 < b.epsilon < truth
        assert 0.5 < b.mu_lower <= mu + 0.05
    # the other orientation (TNR / FNR): the runs without the canary have the heavier low tail
    b = threshold_epsilon_bound(rng.normal(1, 0.5, 50_000), rng.normal(0, 1, 50_000), delta=1e-5)
    assert b.orientation == "below" and b.epsilon > 1.0


def test_no_signal_gives_no_bound_at_high_confidence() -> None:
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(50):
        b = threshold_epsilon_bound(
            rng.normal(size=2000), rng.normal(size=2000), delta=0.0, confidence=0.9
        )
        hits += b.epsilon > 0
    assert hits <= 12  # each run is wrong with probability <= 0.1


def test_gdp_mu_lower() -> None:
    assert gdp_mu_lower(stats.norm.cdf(-1.0), stats.norm.cdf(-2.0)) == pytest.approx(1.0)
    assert gdp_mu_lower(0.1, 0.2) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"confidence": 1.0}, "confidence"),
        ({"delta": -0.1}, "delta"),
        ({"selection": "best"}, "selection"),
        ({"selection": "grid"}, "thresholds"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    args = {"delta": 1e-5, **kwargs}
    with pytest.raises(ValueError, match=match):
        threshold_epsilon_bound(np.zeros(10), np.ones(10), **args)

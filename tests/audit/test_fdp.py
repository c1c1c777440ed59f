"""The f-DP (Gaussian) one-run bound of Mahloujifar, Melis, Chaudhuri 2024."""

from __future__ import annotations

import numpy as np
import pytest

from dpfy.audit.fdp import gdp_rejects, one_run_gdp_bound, one_run_gdp_ceiling
from dpfy.audit.stats import one_run_epsilon

DELTA = 1e-5


@pytest.mark.parametrize(
    "m, r, v",
    [(100, 100, 100), (1000, 100, 100), (1000, 1000, 1000), (1000, 100, 90), (1000, 200, 170),
     (10_000, 1000, 800), (100, 20, 18)],
)
def test_tighter_than_the_eps_delta_analysis_on_the_same_counts(m: int, r: int, v: int) -> None:
    fdp = one_run_gdp_bound(m, r, v, delta=DELTA)
    steinke = one_run_epsilon(m, r, v, delta=DELTA)
    assert steinke > 0.0
    assert fdp.epsilon > steinke


def test_random_guessing_rejects_nothing_and_counts_are_monotone() -> None:
    assert one_run_gdp_bound(1000, 100, 50, delta=DELTA).mu == 0.0
    assert not gdp_rejects(1000, 100, 50, 0.0)
    mus = [one_run_gdp_bound(1000, 100, v, delta=DELTA).mu for v in range(50, 101, 5)]
    assert all(b >= a for a, b in zip(mus, mus[1:], strict=False))
    assert mus[-1] == one_run_gdp_ceiling(1000, 100, delta=DELTA).mu > mus[0]
    # a higher confidence rejects less
    assert (one_run_gdp_bound(1000, 100, 90, delta=DELTA, confidence=0.99).mu
            < one_run_gdp_bound(1000, 100, 90, delta=DELTA, confidence=0.9).mu)


def test_rejected_mus_form_an_interval() -> None:
    for m, r, v in ((1000, 100, 90), (200, 40, 34), (100, 100, 100)):
        b = one_run_gdp_bound(m, r, v, delta=DELTA)
        grid = np.linspace(0.0, 3.0 * b.mu + 0.5, 61)
        rejected = [gdp_rejects(m, r, v, float(mu)) for mu in grid]
        assert rejected == [mu <= b.mu for mu in grid]


def test_valid_on_a_simulated_gaussian_dp_guesser() -> None:
    """Scores N(mu, 1) for included canaries, N(0, 1) otherwise: exactly mu-GDP per canary.
    Guess in for the top r/2, out for the bottom r/2: the bound may exceed mu in at most
    ~5 % of runs at 95 % (seen: 0.5 %), and it is informative (median well above 0)."""
    rng = np.random.default_rng(0)
    mu, m, r = 1.0, 200, 40
    bounds = []
    for _ in range(200):
        coin = rng.random(m) < 0.5
        order = np.argsort(rng.normal(mu * coin, 1.0))
        v = int(coin[order[m - r // 2:]].sum() + (~coin[order[: r // 2]]).sum())
        bounds.append(one_run_gdp_bound(m, r, v, delta=DELTA).mu)
    b = np.asarray(bounds)
    assert np.mean(b > mu) <= 0.05
    assert np.median(b) > 0.3


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="r must be an integer in"):
        one_run_gdp_bound(10, 11, 5, delta=DELTA)
    with pytest.raises(ValueError, match="v must be an integer in"):
        one_run_gdp_bound(10, 5, 6, delta=DELTA)
    with pytest.raises(ValueError, match="confidence must be in"):
        one_run_gdp_bound(10, 5, 5, delta=DELTA, confidence=1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        one_run_gdp_bound(10, 5, 5, delta=0.0)

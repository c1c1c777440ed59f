"""The shared max-bit lower bound (binomial hockey-stick): it reproduces the values the two
former implementations gave (Balls-and-Bins in log space, shuffle in linear space), recorded
before they were merged, and behaves on the edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from dpfy import events as ev
from dpfy.accounting.gaussian import gaussian_delta
from dpfy.accounting.lower_bounds import MaxBitPair, binomial_logpmf, max_bit_lower_delta
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.lower_bound import lower_bound_delta, lower_bound_epsilon
from dpfy.accounting.shuffle import shuffle_lower_bound_delta, shuffle_lower_bound_epsilon

# (epochs, epsilon, delta recorded from the former Balls-and-Bins implementation)
BALLS_AND_BINS_DELTA = [
    ([Epoch(1.0, 100)], 0.5, 2.2136037062640333e-05),
    ([Epoch(1.0, 100)], 2.0, 1.724840319938598e-10),
    ([Epoch(0.8, 50)] * 3, 0.5, 0.012334472485659515),
    ([Epoch(1.0, 59)] * 15 + [Epoch(2.0, 1)] * 3, 2.0, 0.003022070375118959),
    ([Epoch(2.0, 1)], 0.0, 0.1974126513658474),
    ([Epoch(0.5, 1000)] * 40, 0.5, 0.1647735249122643),
]
BALLS_AND_BINS_EPSILON = [
    ([Epoch(0.8, 50)] * 3, 1e-5, 2.1932811737060547),
    ([Epoch(1.0, 59)] * 15 + [Epoch(2.0, 1)] * 3, 1e-5, 3.3926258087158203),
]
# (event, epsilon, delta recorded from the former linear-space shuffle implementation)
SHUFFLE_DELTA = [
    (ev.Shuffled(1.0, 100), 0.5, 0.0450984304031983),
    (ev.Shuffled(1.0, 100, epochs=3), 2.0, 0.0069303028975895775),
    (ev.Shuffled(0.6, 1000), 2.0, 0.08483134141982271),
    (ev.Shuffled(1.0, 1), 2.0, 0.0209236336493753),
    (ev.Composed((ev.Shuffled(1.0, 10, 2), ev.SelfComposed(ev.Gaussian(2.0), 4))), 0.5,
     0.3000703042637351),
]
SHUFFLE_EPSILON = [
    (ev.Shuffled(1.0, 100), 1e-5, 4.063152313232422),
    (ev.Shuffled(0.6, 1000), 1e-5, 7.987648010253906),
]


@pytest.mark.parametrize(("epochs", "eps", "recorded"), BALLS_AND_BINS_DELTA)
def test_balls_and_bins_delta_matches_former_values(epochs, eps, recorded):
    assert lower_bound_delta(epochs, eps) == pytest.approx(recorded, rel=1e-9)


@pytest.mark.parametrize(("epochs", "delta", "recorded"), BALLS_AND_BINS_EPSILON)
def test_balls_and_bins_epsilon_matches_former_values(epochs, delta, recorded):
    assert lower_bound_epsilon(epochs, delta) == pytest.approx(recorded, rel=1e-6)


@pytest.mark.parametrize(("event", "eps", "recorded"), SHUFFLE_DELTA)
def test_shuffle_delta_matches_former_values(event, eps, recorded):
    assert shuffle_lower_bound_delta(event, eps) == pytest.approx(recorded, rel=1e-9)


@pytest.mark.parametrize(("event", "delta", "recorded"), SHUFFLE_EPSILON)
def test_shuffle_epsilon_matches_former_values(event, delta, recorded):
    assert shuffle_lower_bound_epsilon(event, delta) == pytest.approx(recorded, rel=1e-6)


def test_gaussian_pair_is_exact_and_shift_invariant():
    # T = 1: the threshold test is optimal, so the bound is the Gaussian delta; shifting both
    # means by the same amount changes nothing
    exact = float(gaussian_delta(1.0 / 1.5, 0.7))
    a = max_bit_lower_delta([(MaxBitPair(1.5, 1, 1.0, 0.0), 1)], 0.7)
    b = max_bit_lower_delta([(MaxBitPair(1.5, 1, 3.0, 2.0), 1)], 0.7)
    assert a == pytest.approx(exact, rel=1e-4)
    assert b == pytest.approx(a, rel=1e-9)


def test_binomial_logpmf_is_normalised_for_extreme_probabilities():
    log_p = np.log(np.array([1e-300, 1e-9, 0.5, 1.0 - 1e-12]))
    log_1mp = np.log1p(-np.exp(log_p))
    for k in (1, 7, 5000):
        pmf = np.exp(binomial_logpmf(k, log_p, log_1mp))
        assert np.all(np.isfinite(pmf))
        np.testing.assert_allclose(pmf.sum(axis=0), 1.0, rtol=1e-9)

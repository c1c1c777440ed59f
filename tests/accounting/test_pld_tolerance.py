"""The PLD accountant meets its stated tolerance where its grid converges at first order.

Oracle: one Poisson-subsampled Gaussian release has a closed-form privacy profile (the
likelihood ratio is monotone in the output, so each hockey-stick divergence is a difference
of Gaussian tails at one threshold); epsilon(delta) is its root. Independent of the PLD code:
no grid, no FFT. A single coarse release (large q, small sigma) is where connect-the-dots
converges at first order, and where a second-order error model once stopped early
(q = 0.5, sigma = 0.5: 1.1e-3 relative error against a tolerance of 2.5e-4).
"""

from __future__ import annotations

import math

import pytest
from scipy import optimize, stats

from dpfy import events as ev
from dpfy.accounting.pld import DEFAULT_TOLERANCE, pld_epsilon


def _profile(eps: float, q: float, s: float) -> float:
    """delta(eps) of P = (1-q) N(0, s^2) + q N(1, s^2) against Q = N(0, s^2), both orders."""
    n = stats.norm
    a = math.exp(eps)
    # P over Q: the ratio (1-q) + q exp((2x-1)/(2 s^2)) exceeds e^eps for x > t
    t = (2 * s * s * math.log((a - (1 - q)) / q) + 1) / 2
    remove = (1 - q) * n.sf(t / s) + q * n.sf((t - 1) / s) - a * n.sf(t / s)
    # Q over P: the ratio is below e^-eps for x < t'
    b = math.exp(-eps)
    add = 0.0
    if b > 1 - q:
        t2 = (2 * s * s * math.log((b - (1 - q)) / q) + 1) / 2
        add = n.cdf(t2 / s) - a * ((1 - q) * n.cdf(t2 / s) + q * n.cdf((t2 - 1) / s))
    return max(remove, add)


@pytest.mark.parametrize(
    "q,sigma", [(0.5, 0.5), (0.5, 1.0), (0.1, 0.5), (1.0, 0.5), (0.9, 0.7), (0.05, 2.0)]
)
def test_one_release_is_an_upper_bound_within_the_tolerance(q, sigma):
    delta = 1e-5
    exact = optimize.brentq(lambda e: _profile(e, q, sigma) - delta, 1e-4, 100.0, xtol=1e-13)
    got = pld_epsilon(ev.PoissonSampled(q, ev.Gaussian(sigma)), delta).epsilon
    assert got >= exact * (1 - 1e-12)  # an upper bound
    assert (got - exact) / exact <= DEFAULT_TOLERANCE


@pytest.mark.parametrize("count,q,sigma", [(2, 0.5, 0.5), (5, 0.5, 0.5), (3, 0.9, 0.7)])
def test_composed_releases_meet_the_tolerance_against_a_fine_grid(count, q, sigma):
    # no closed form here: a grid 2^-13 fine (its own error ~1e-7 relative) stands in
    from dpfy.accounting.pld import epsilon_with_interval

    event = ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(sigma)), count)
    got = pld_epsilon(event, 1e-5).epsilon
    fine = epsilon_with_interval(event, 1e-5, interval=2.0**-13)[0]
    assert got >= fine * (1 - 1e-12) and (got - fine) / fine <= DEFAULT_TOLERANCE

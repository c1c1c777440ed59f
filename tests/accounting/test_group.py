"""Group privacy (dpfy.accounting.group) against closed forms and a numerical oracle.

Oracles: the Gaussian mechanism, whose group of 2 is exactly the Gaussian with twice the
sensitivity; and one Poisson-subsampled Gaussian step where two units are added (a pair two
add/remove steps apart), whose hockey-stick divergence is integrated numerically in 1-D.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting.group import (
    group2_rdp_epsilon,
    group_delta_factor,
    group_epsilon,
    group_privacy,
)


def test_closed_form_and_the_familiar_looser_bound():
    assert group_privacy(0.7, 1e-6, 1) == (0.7, 1e-6)
    eps, delta = group_privacy(0.7, 1e-6, 2)
    assert eps == pytest.approx(1.4) and delta == pytest.approx(1e-6 * (1 + math.exp(0.7)))
    for k in (2, 3, 5):
        for e in (0.0, 0.1, 1.0, 4.0):
            factor = group_delta_factor(e, k)
            assert factor == pytest.approx(sum(math.exp(i * e) for i in range(k)))
            assert factor <= k * math.exp((k - 1) * e) * (1 + 1e-12)
    assert group_delta_factor(800.0, 3) == math.inf
    with pytest.raises(ValueError, match="k must be"):
        group_privacy(1.0, 1e-6, 0)


@pytest.mark.parametrize("z", [1.0, 3.0, 10.0])
def test_gaussian_group_of_two_is_above_the_exact_doubled_sensitivity(z):
    delta = 1e-5
    exact = accounting.epsilon(ev.Gaussian(z / 2), delta, "gaussian").epsilon
    group = group_epsilon(ev.Gaussian(z), delta, 2, "gaussian")
    assert group.delta <= delta
    assert exact <= group.epsilon <= 3.0 * exact  # valid, and not absurdly loose
    via_rdp = group2_rdp_epsilon(ev.Gaussian(z), delta)
    assert via_rdp is not None and via_rdp >= exact


def _hockey_stick(p_pdf, q_pdf, eps: float) -> float:
    x = np.linspace(-14.0, 18.0, 400_001)
    dx = x[1] - x[0]
    return float(np.maximum(p_pdf(x) - math.exp(eps) * q_pdf(x), 0.0).sum() * dx)


@pytest.mark.parametrize(("q", "z", "delta"), [(0.3, 1.0, 1e-3), (0.05, 0.8, 1e-5)])
def test_subsampled_step_two_units_apart_is_covered(q, z, delta):
    event = ev.PoissonSampled(q, ev.Gaussian(z))
    group = group_epsilon(event, delta, 2, "pld")
    assert group.delta <= delta and math.isfinite(group.epsilon)

    def mix(x):  # two units added, each sampled with probability q
        return ((1 - q) ** 2 * stats.norm.pdf(x, 0, z) + 2 * q * (1 - q) *
                stats.norm.pdf(x, 1, z) + q**2 * stats.norm.pdf(x, 2, z))

    def base(x):
        return stats.norm.pdf(x, 0, z)

    true_delta = max(_hockey_stick(mix, base, group.epsilon),
                     _hockey_stick(base, mix, group.epsilon))
    assert true_delta <= delta * (1 + 1e-6)


def test_example_level_route_is_reported_and_refuses_bad_input():
    event = ev.SelfComposed(ev.PoissonSampled(0.1, ev.Gaussian(1.0)), 50)
    g = group_epsilon(event, 1e-5, 2, "pld")
    unit = accounting.epsilon(event, 1e-5, "pld").epsilon
    assert g.epsilon > unit and g.route in ("approximate-dp", "rdp")
    if g.route == "approximate-dp":
        assert g.delta_unit * (1 + math.exp(g.epsilon_unit)) <= 1e-5 * (1 + 1e-12)
        assert g.epsilon == pytest.approx(2 * g.epsilon_unit)
    with pytest.raises(ValueError, match="delta"):
        group_epsilon(event, 0.0, 2)

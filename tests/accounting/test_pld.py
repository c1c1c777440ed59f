"""Tests for dpfy.accounting.pld: oracles (exact one-step hockey stick, exact Gaussian
composition, dp_accounting's converged PLD, Monte Carlo), limits, properties, events."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, special

from dpfy import events as ev
from dpfy.accounting import UnsupportedEventError, accountants, delta, epsilon, pld

# Accuracy promised by the default tolerance, checked against every oracle: never below the
# oracle (minus 1e-9) and at most 0.5 % above it.
REL = 5e-3
ABS = 1e-9


def _poisson(q: float, z: float, steps: int) -> ev.Event:
    return ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), steps)


def _check_close_above(value: float, ref: float) -> None:
    assert value >= ref - ABS, (value, ref)
    assert value <= ref * (1.0 + REL) + ABS, (value, ref, value / ref - 1.0)


# ------------------------------------------------------------------------------------------
# Independent oracles
# ------------------------------------------------------------------------------------------


def _one_step_delta(q: float, z: float, e: float) -> float:
    """Exact delta(e) of one Poisson-subsampled Gaussian step, max over both directions."""
    # Remove: P = (1-q) N(0, z^2) + q N(1, z^2) vs Q = N(0, z^2); the loss exceeds e beyond x.
    if q < 1.0 and e <= math.log1p(-q):
        d_remove = -math.expm1(e)
    else:
        x = z * z * (math.log(math.expm1(e) + q) - math.log(q)) + 0.5
        tail0, tail1 = special.ndtr(-x / z), special.ndtr(-(x - 1.0) / z)
        d_remove = (1.0 - q) * tail0 + q * tail1 - math.exp(e) * tail0
    # Add: P = N(0, z^2) vs the mixture; the loss exceeds e below x.
    if q < 1.0 and e >= -math.log1p(-q):
        d_add = 0.0
    else:
        x = z * z * (math.log(math.exp(-e) - (1.0 - q)) - math.log(q)) + 0.5
        head0, head1 = special.ndtr(x / z), special.ndtr((x - 1.0) / z)
        d_add = head0 - math.exp(e) * ((1.0 - q) * head0 + q * head1)
    return max(d_remove, d_add)


def _one_step_epsilon(q: float, z: float, target: float) -> float:
    f = lambda e: _one_step_delta(q, z, e) - target  # noqa: E731
    if f(0.0) <= 0.0:
        return 0.0
    hi = 1.0
    while f(hi) > 0.0:
        hi *= 2.0
    return optimize.brentq(f, 0.0, hi, xtol=1e-15, rtol=1e-14)


def _gaussian_delta(mu: float, e: float) -> float:
    """Balle & Wang (2018): exact delta of mu-GDP, stable for large epsilon."""
    return special.ndtr(-e / mu + mu / 2) - math.exp(e + special.log_ndtr(-e / mu - mu / 2))


def _gaussian_epsilon(mu: float, target: float) -> float:
    f = lambda e: _gaussian_delta(mu, e) - target  # noqa: E731
    if f(0.0) <= 0.0:
        return 0.0
    return optimize.brentq(f, 0.0, mu * mu / 2 + 40 * mu + 50, xtol=1e-13, rtol=1e-14)


# ------------------------------------------------------------------------------------------
# Oracle grids (q from 1e-4 to 1, z from 0.5 to 10, T from 1 to 1e5, delta 1e-3 to 1e-10)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("z", [0.5, 1.0, 3.0, 10.0])
def test_one_step_against_exact_hockey_stick(q: float, z: float) -> None:
    for target in (1e-3, 1e-6, 1e-10):
        if q == 1e-4 and z == 0.5 and target == 1e-3:
            continue  # epsilon is exactly 0 there; checked in test_zero_epsilon
        value = pld.pld_epsilon(ev.PoissonSampled(q, ev.Gaussian(z)), target).epsilon
        _check_close_above(value, _one_step_epsilon(q, z, target))


def test_zero_epsilon() -> None:
    # delta(0) = TV distance ~ 8e-6 < 1e-3: epsilon 0 is certified.
    assert pld.pld_epsilon(ev.PoissonSampled(1e-4, ev.Gaussian(0.5)), 1e-3).epsilon == 0.0


@pytest.mark.parametrize(
    ("z", "steps", "target"),
    [
        (0.5, 1, 1e-3),
        (0.5, 100_000, 1e-10),
        (1.0, 10, 1e-6),
        (2.0, 1000, 1e-5),
        (3.0, 10_000, 1e-3),
        (10.0, 1, 1e-10),
        (10.0, 100_000, 1e-8),
    ],
)
def test_gaussian_composition_against_closed_form(z: float, steps: int, target: float) -> None:
    value = pld.pld_epsilon(ev.SelfComposed(ev.Gaussian(z), steps), target).epsilon
    _check_close_above(value, _gaussian_epsilon(math.sqrt(steps) / z, target))


def test_heterogeneous_gaussians_against_closed_form() -> None:
    event = ev.Composed(
        (
            ev.SelfComposed(ev.Gaussian(2.0), 30),
            ev.Gaussian(0.7),
            ev.SelfComposed(ev.Gaussian(5.0), 200),
        )
    )
    mu = math.sqrt(30 / 4.0 + 1 / 0.49 + 200 / 25.0)
    _check_close_above(pld.pld_epsilon(event, 1e-6).epsilon, _gaussian_epsilon(mu, 1e-6))


# dp_accounting 0.6.0 connect-the-dots PLD, discretisation chosen fine enough to be converged
# (1e-5, or finer when epsilon is small); only cases that take well under a second each.
DP_ACCOUNTING_CASES = [
    (1e-4, 3.0, 100_000, 1e-8, 1.25e-6),
    (1e-3, 10.0, 10_000, 1e-10, 2e-6),
    (1e-2, 3.0, 1000, 1e-6, 1e-5),
]


@pytest.mark.parametrize(("q", "z", "steps", "target", "interval"), DP_ACCOUNTING_CASES)
def test_against_dp_accounting(
    q: float, z: float, steps: int, target: float, interval: float
) -> None:
    dp_event = pytest.importorskip("dp_accounting.dp_event")
    pld_acc = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
    acc = pld_acc.PLDAccountant(value_discretization_interval=interval)
    acc.compose(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps
        )
    )
    ref = acc.get_epsilon(target)
    _check_close_above(pld.pld_epsilon(_poisson(q, z, steps), target).epsilon, ref)


def test_heterogeneous_against_dp_accounting() -> None:
    dp_event = pytest.importorskip("dp_accounting.dp_event")
    pld_acc = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
    acc = pld_acc.PLDAccountant(value_discretization_interval=1e-5)
    acc.compose(
        dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(4.0)), 300
                ),
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(8.0)), 100
                ),
            ]
        )
    )
    event = ev.Composed((_poisson(0.01, 4.0, 300), _poisson(0.05, 8.0, 100)))
    _check_close_above(pld.pld_epsilon(event, 1e-6).epsilon, acc.get_epsilon(1e-6))


def test_upper_bound_against_monte_carlo() -> None:
    # delta(eps) = E_P[(1 - exp(eps - L))_+] for 3 composed remove-direction steps, sampled.
    q, z, steps, e = 0.2, 0.8, 3, 0.5
    rng = np.random.default_rng(0)
    n = 400_000
    x = rng.normal(0.0, z, size=(n, steps)) + (rng.random((n, steps)) < q)
    loss = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z * z)).sum(axis=1)
    terms = np.maximum(-np.expm1(e - loss), 0.0)
    mc, se = terms.mean(), terms.std() / math.sqrt(n)
    value = pld.pld_delta(_poisson(q, z, steps), e).delta
    assert value >= mc - 4 * se
    assert value <= mc + 4 * se + 0.01 * mc  # and tight


# ------------------------------------------------------------------------------------------
# Delta direction, tolerance, fixed grids, pessimism of the building blocks
# ------------------------------------------------------------------------------------------


def test_delta_inverts_epsilon() -> None:
    event = _poisson(0.01, 1.0, 1000)
    e = pld.pld_epsilon(event, 1e-5).epsilon
    d = pld.pld_delta(event, e).delta
    assert d <= 1e-5 * (1 + 1e-3)
    assert d >= 1e-5 * 0.98


def test_delta_against_gaussian_closed_form() -> None:
    event = ev.SelfComposed(ev.Gaussian(2.0), 50)
    ref = _gaussian_delta(math.sqrt(50) / 2.0, 3.0)
    value = pld.pld_delta(event, 3.0).delta
    assert ref - ABS <= value <= ref * (1 + REL)


def test_coarse_grid_is_looser_but_valid() -> None:
    event = _poisson(0.01, 1.0, 1000)
    fine = pld.pld_epsilon(event, 1e-5).epsilon
    h = pld.first_interval(event)
    coarse = pld.pld_epsilon(event, 1e-5, interval=h)
    assert coarse.epsilon >= fine
    assert "fixed loss grid interval" in coarse.notes[1]
    assert pld.pld_epsilon(event, 1e-5, tolerance=3e-2).epsilon >= fine


def test_tighter_tolerance_converges_from_above() -> None:
    event = _poisson(0.001, 0.8, 10_000)
    values = [pld.pld_epsilon(event, 1e-5, tolerance=t).epsilon for t in (3e-2, 1e-3, 1e-4)]
    assert values[0] >= values[1] >= values[2]
    assert values[0] / values[2] - 1 <= 3 * 3e-2


def test_one_step_pmf_is_a_pessimistic_probability() -> None:
    for q, z in [(0.01, 1.0), (1.0, 2.0), (0.5, 0.5)]:
        both = pld.poisson_gaussian_pmf(q, z, 1e-3)
        for p in both.values():
            assert np.all(p.pmf >= 0.0)
            assert p.pmf.sum() + p.infinity_mass == pytest.approx(1.0, abs=1e-12)
            losses = (p.offset + np.arange(p.pmf.size)) * p.interval
            # Q-mass of the discrete pair is at most 1 (dominating pair property).
            assert float(np.sum(p.pmf * np.exp(-losses))) <= 1.0 + 1e-9
        # Each direction's hockey stick is above the exact one at off-grid epsilons.
        for e in (0.0123, 0.31, 1.7):
            exact = _one_step_delta(q, z, e)
            assert max(p.delta(e) for p in both.values()) >= exact - 1e-15


def test_coarsen_preserves_both_masses() -> None:
    p = pld.poisson_gaussian_pmf(0.05, 1.0, 1e-3)["remove"]
    c = pld.coarsen(p, 7)
    loss = lambda d: (d.offset + np.arange(d.pmf.size)) * d.interval  # noqa: E731
    assert c.interval == pytest.approx(7e-3)
    assert c.pmf.sum() == pytest.approx(p.pmf.sum(), rel=1e-12)
    assert np.sum(c.pmf * np.exp(-loss(c))) == pytest.approx(
        np.sum(p.pmf * np.exp(-loss(p))), rel=1e-12
    )
    for e in (0.0, 0.0105, 0.05):
        assert c.delta(e) >= p.delta(e) - 1e-15


def test_compose_matches_direct_convolution() -> None:
    p = pld.poisson_gaussian_pmf(0.3, 1.0, 0.05)["remove"]
    out = pld.compose([(p, 3)], tail_mass=1e-30)
    direct = np.convolve(np.convolve(p.pmf, p.pmf), p.pmf)
    assert out.offset >= 3 * p.offset
    shift = out.offset - 3 * p.offset
    np.testing.assert_allclose(out.pmf, direct[shift : shift + out.pmf.size], atol=1e-15)


def test_grid_limit_reports_looser_value() -> None:
    event = _poisson(0.01, 1.0, 1000)
    r = pld.pld_epsilon(event, 1e-5, tolerance=1e-7, max_size=1 << 14)
    assert any("grid size limit" in n for n in r.notes)
    assert r.epsilon >= pld.pld_epsilon(event, 1e-5).epsilon * (1 - 1e-3)


# ------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------

SLACK = 3e-3  # each value is within the tolerance of the truth; compare with this slack


def _eps(q: float, z: float, steps: int, target: float) -> float:
    return pld.pld_epsilon(_poisson(q, z, steps), target, tolerance=1e-3).epsilon


@settings(max_examples=8, deadline=None)
@given(
    q=st.floats(1e-3, 1.0),
    z=st.floats(0.8, 8.0),
    ratio=st.floats(1.02, 3.0),
    steps=st.integers(1, 200),
)
def test_monotone_in_noise_and_sampling_rate(q: float, z: float, ratio: float, steps: int) -> None:
    base = _eps(q, z, steps, 1e-6)
    assert _eps(q, z * ratio, steps, 1e-6) <= base * (1 + SLACK) + ABS
    assert _eps(q / ratio, z, steps, 1e-6) <= base * (1 + SLACK) + ABS


@settings(max_examples=6, deadline=None)
@given(
    q=st.floats(1e-3, 1.0),
    z=st.floats(0.8, 8.0),
    steps=st.integers(1, 200),
    more=st.integers(1, 200),
    exponent=st.floats(3.0, 9.0),
)
def test_monotone_in_steps_and_delta(
    q: float, z: float, steps: int, more: int, exponent: float
) -> None:
    target = 10.0**-exponent
    base = _eps(q, z, steps, target)
    assert _eps(q, z, steps + more, target) >= base * (1 - SLACK) - ABS
    assert _eps(q, z, steps, target * 10) <= base * (1 + SLACK) + ABS


# ------------------------------------------------------------------------------------------
# Events, registry, results
# ------------------------------------------------------------------------------------------


def test_registered_and_result_fields() -> None:
    assert "pld" in accountants()
    r = epsilon(_poisson(0.01, 1.0, 100), 1e-5, method="pld")
    assert r.method == "pld"
    assert r.adjacency == "add_or_remove"
    assert r.provable
    assert any("tolerance=0.00025" in n for n in r.notes)
    d = delta(_poisson(0.01, 1.0, 100), r.epsilon, method="pld")
    assert d.method == "pld"
    assert d.delta <= 1e-5 * (1 + 1e-3)


@pytest.mark.parametrize(
    "event",
    [
        ev.Shuffled(1.0, 10, 2),
        ev.BallsAndBins(1.0, 10, 2),
        ev.Deterministic(1.0, 10, 2),
        ev.FixedSizeSampled(10, 1000, ev.Gaussian(1.0)),
        ev.FixedSizeSampled(10, 1000, ev.Laplace(1.0)),
        ev.RepeatAndSelect(ev.Gaussian(1.0), 3.0),
        ev.PoissonSampled(0.1, ev.Laplace(1.0)),
        ev.ZCDP(0.5),
    ],
)
def test_unsupported_events_name_the_sub_event(event: ev.Event) -> None:
    wrapped = ev.Composed((_poisson(0.01, 1.0, 10), ev.SelfComposed(event, 3)))
    reason = pld.PLDAccountant().unsupported(wrapped)
    assert reason is not None
    inner = event.event if isinstance(event, ev.PoissonSampled) else event
    assert type(inner).__name__ in reason
    with pytest.raises(UnsupportedEventError, match=type(inner).__name__):
        pld.pld_epsilon(wrapped, 1e-5)
    if not isinstance(event, ev.TruncatedPoisson):  # the API accounts truncation centrally
        with pytest.raises(UnsupportedEventError, match=type(inner).__name__):
            epsilon(wrapped, 1e-5, method="pld")


def test_shuffled_run_asking_for_pld_is_an_error() -> None:
    with pytest.raises(UnsupportedEventError, match="Shuffled"):
        epsilon(ev.Shuffled(2.0, 100, 3), 1e-5, method="pld")


def test_truncated_poisson_through_the_api_costs_extra() -> None:
    event = ev.TruncatedPoisson(0.01, 1.0, 1000, 10_000, 150)
    plain = pld.pld_epsilon(_poisson(0.01, 1.0, 1000), 1e-5).epsilon
    assert epsilon(event, 1e-5, method="pld").epsilon >= plain


def test_non_private_and_empty_events() -> None:
    event = ev.Composed((_poisson(0.01, 1.0, 10), ev.NonPrivate("debug print")))
    assert pld.PLDAccountant().unsupported(event) is None
    assert math.isinf(epsilon(event, 1e-5, method="pld").epsilon)
    assert pld.pld_epsilon(ev.SelfComposed(ev.Gaussian(1.0), 0), 1e-5).epsilon == 0.0
    assert pld.pld_epsilon(ev.Composed(()), 1e-5).epsilon == 0.0


def test_composed_equals_self_composed() -> None:
    step = ev.PoissonSampled(0.02, ev.Gaussian(1.5))
    a = pld.pld_epsilon(ev.SelfComposed(step, 60), 1e-6).epsilon
    b = pld.pld_epsilon(ev.Composed((ev.SelfComposed(step, 20), ev.SelfComposed(step, 40))), 1e-6)
    assert b.epsilon == a


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delta": 0.0}, "delta must be in"),
        ({"delta": 1.0}, "delta must be in"),
        ({"delta": 1e-5, "tolerance": 0.0}, "tolerance must be in"),
        ({"delta": 1e-5, "interval": -1.0}, "interval must be in"),
    ],
)
def test_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pld.pld_epsilon(_poisson(0.01, 1.0, 10), **kwargs)

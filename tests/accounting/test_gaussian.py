"""Exact Gaussian / GDP / zCDP accounting: closed forms, dp_accounting PLD, safe side."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfy import events as ev
from dpfy.accounting import UnsupportedEventError
from dpfy.accounting import delta as account_delta
from dpfy.accounting import epsilon as account_epsilon
from dpfy.accounting.gaussian import (
    SHUFFLE_NOTE,
    gaussian_delta,
    gaussian_epsilon,
    gaussian_log_delta,
    mu_of_event,
    unsupported_reason,
    zcdp_delta,
    zcdp_epsilon,
    zcdp_rho,
)

pld = pytest.importorskip("dp_accounting.pld")
de = pytest.importorskip("dp_accounting.dp_event")


def _closed_form(mu: float, eps: float) -> float:
    with mpmath.workdps(50):
        m, e = mpmath.mpf(mu), mpmath.mpf(eps)
        return float(mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2))


@pytest.mark.parametrize("mu", [1e-3, 0.1, 1.0, 3.0, 20.0])
@pytest.mark.parametrize("eps", [0.0, 0.5, 4.0, 30.0])
def test_delta_equals_closed_form(mu: float, eps: float) -> None:
    ref = _closed_form(mu, eps)
    assert gaussian_delta(mu, eps) == pytest.approx(ref, rel=1e-9, abs=1e-300)


def test_log_delta_is_finite_where_delta_underflows() -> None:
    with mpmath.workdps(50):
        m, e = mpmath.mpf(1), mpmath.mpf(200)
        ref = mpmath.log(mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2))
    assert gaussian_delta(1.0, 200.0) == 0.0
    assert gaussian_log_delta(1.0, 200.0) == pytest.approx(float(ref), rel=1e-12)
    assert gaussian_log_delta(2.0, 1.0) == pytest.approx(math.log(gaussian_delta(2.0, 1.0)))


def test_delta_matches_dp_accounting_gaussian_privacy_loss() -> None:
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    for std in (0.3, 1.0, 4.0):
        loss = GaussianPrivacyLoss(standard_deviation=std, sensitivity=1.0)
        for eps in (0.1, 1.0, 5.0):
            ref = loss.get_delta_for_epsilon(eps)
            assert gaussian_delta(1 / std, eps) == pytest.approx(ref, rel=1e-8)


@pytest.mark.parametrize(
    ("z", "count", "delta"), [(1.0, 1, 1e-5), (5.0, 100, 1e-8), (20.0, 1000, 1e-3)]
)
def test_composition_matches_dp_accounting_pld(z: float, count: int, delta: float) -> None:
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(de.SelfComposedDpEvent(de.GaussianDpEvent(z), count))
    ref = acc.get_epsilon(delta)
    ours = account_epsilon(ev.SelfComposed(ev.Gaussian(z), count), delta, method="gaussian")
    # dp_accounting's PLD is pessimistic: never below the exact value, close above it.
    assert ours.epsilon <= ref + 1e-9
    assert ours.epsilon == pytest.approx(ref, rel=1e-6)  # measured <= 1e-7 at this interval
    assert ours.method == "gaussian" and ours.adjacency == "add_or_remove"


def test_epsilon_is_safe_and_tight() -> None:
    mu = np.array([1e-3, 0.05, 0.5, 1.0, 4.0, 50.0])
    for delta in (1e-3, 1e-7, 1e-12):
        eps = gaussian_epsilon(mu, delta)
        assert np.all(gaussian_delta(mu, eps) <= delta)
        below = gaussian_delta(mu, np.maximum(eps * (1 - 1e-9) - 1e-15, 0))
        assert np.all((below > delta) | (eps == 0))
    assert gaussian_epsilon(0.0, 1e-5) == 0.0
    assert gaussian_epsilon(math.inf, 1e-5) == math.inf
    # tiny mu: delta(0) = 2 Phi(mu/2) - 1 < target, epsilon 0
    assert gaussian_epsilon(1e-7, 1e-5) == 0.0


def test_mu_of_event() -> None:
    assert mu_of_event(ev.Gaussian(2.0)) == pytest.approx(0.5)
    tree = ev.Composed((ev.SelfComposed(ev.Gaussian(2.0), 8), ev.Gaussian(1.0)))
    assert mu_of_event(tree) == pytest.approx(math.sqrt(8 / 4 + 1))
    assert mu_of_event(ev.Deterministic(0.8, 50, 9)) == pytest.approx(3 / 0.8)
    assert mu_of_event(ev.Shuffled(0.8, 50, 9)) == pytest.approx(3 / 0.8)
    assert mu_of_event(ev.Deterministic(0.8, 50, 9, "replace_one")) == pytest.approx(6 / 0.8)
    assert mu_of_event(ev.SelfComposed(ev.Gaussian(1.0), 0)) == 0.0
    with pytest.raises(UnsupportedEventError, match="PoissonSampled"):
        mu_of_event(ev.Composed((ev.Gaussian(1.0), ev.PoissonSampled(0.1, ev.Gaussian(1.0)))))


def test_shuffled_is_the_no_amplification_upper_bound_with_a_note() -> None:
    res = account_epsilon(ev.Shuffled(1.2, 100, 4), 1e-5, method="gaussian")
    assert SHUFFLE_NOTE in res.notes
    assert res.epsilon == pytest.approx(gaussian_epsilon(2 / 1.2, 1e-5))
    det = account_epsilon(ev.Deterministic(1.2, 100, 4), 1e-5, method="gaussian")
    assert det.epsilon == res.epsilon and SHUFFLE_NOTE not in det.notes
    d = account_delta(ev.Shuffled(1.2, 100, 4), 1.0, method="gaussian")
    assert d.delta == pytest.approx(gaussian_delta(2 / 1.2, 1.0)) and SHUFFLE_NOTE in d.notes


@pytest.mark.parametrize(
    ("event", "needle"),
    [
        (ev.PoissonSampled(0.1, ev.Gaussian(1.0)), "PoissonSampled"),
        (ev.FixedSizeSampled(2, 10, ev.Gaussian(1.0)), "FixedSizeSampled"),
        (ev.BallsAndBins(1.0, 10), "BallsAndBins"),
        (ev.Laplace(1.0), "Laplace"),
        (ev.RepeatAndSelect(ev.Gaussian(1.0), 2.0), "RepeatAndSelect"),
    ],
)
def test_unsupported_events_are_named(event: ev.Event, needle: str) -> None:
    tree = ev.Composed((ev.Gaussian(1.0), ev.SelfComposed(event, 2)))
    assert needle in (unsupported_reason(tree) or "")
    with pytest.raises(UnsupportedEventError, match=needle):
        account_epsilon(tree, 1e-5, method="gaussian")


def test_zcdp_conversions() -> None:
    assert zcdp_rho(2.0) == 2.0
    for rho in (1e-4, 0.05, 1.0, 10.0):
        for delta in (1e-3, 1e-8):
            eps = zcdp_epsilon(rho, delta)
            # no worse than the classic rho + 2 sqrt(rho log 1/delta), no better than exact GDP
            assert eps <= rho + 2 * math.sqrt(rho * math.log(1 / delta)) + 1e-12
            assert eps >= gaussian_epsilon(math.sqrt(2 * rho), delta) - 1e-9
            assert zcdp_delta(rho, eps) <= delta * (1 + 1e-9)
    # a ZCDP event composes with Gaussians through rho
    res = account_epsilon(ev.Composed((ev.Gaussian(2.0), ev.ZCDP(0.1))), 1e-6, method="gaussian")
    assert res.epsilon == pytest.approx(zcdp_epsilon(0.125 + 0.1, 1e-6))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gaussian_delta(-1.0, 1.0), "mu"),
        (lambda: gaussian_delta(1.0, -0.5), "epsilon"),
        (lambda: gaussian_epsilon(1.0, 0.0), "delta"),
        (lambda: gaussian_epsilon([1.0, np.nan], 1e-5), "mu"),
        (lambda: zcdp_epsilon(-1.0, 1e-5), "rho"),
    ],
)
def test_bad_input_names_the_parameter(call, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        call()


@settings(max_examples=25, deadline=None)
@given(
    mu=st.floats(1e-3, 30.0),
    d=st.floats(1e-12, 1e-2),
    f=st.floats(1.001, 4.0),
)
def test_epsilon_monotone_in_mu_and_delta(mu: float, d: float, f: float) -> None:
    e = gaussian_epsilon(mu, d)
    assert gaussian_epsilon(mu * f, d) >= e
    assert gaussian_epsilon(mu, min(d * f, 0.5)) <= e
    assert gaussian_delta(mu, e) <= d

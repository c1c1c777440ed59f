"""Tuning accounting: Papernot & Steinke against dp_accounting 0.6.0, and the Table 4 options."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event as D
from dp_accounting.rdp import rdp_privacy_accountant as R

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting import tuning
from dpfy.randomness import Randomness

INTEGER_ORDERS = [float(a) for a in range(2, 65)] + [80.0, 128.0, 256.0]
SHAPES = [math.inf, 0.0, 0.5, 1.0, 2.5]


def _run(q: float, z: float, steps: int) -> ev.Event:
    return ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), steps)


def _oracle_run(q: float, z: float, steps: int) -> D.DpEvent:
    return D.SelfComposedDpEvent(D.PoissonSampledDpEvent(q, D.GaussianDpEvent(z)), steps)


@pytest.mark.parametrize("q,z,steps", [(0.01, 1.0, 1000), (0.004, 0.7, 5000), (0.2, 4.0, 50)])
def test_repeat_and_select_matches_dp_accounting(q, z, steps):
    # Integer orders: the inner Poisson-Gaussian RDP is exact in both libraries (DESIGN 3.1), so
    # any difference comes from the repeat-and-select transform or the conversion.
    # With Theorem 6's delta_hat from the RDP curve (dp_accounting's formula): equal. With it
    # from the run's PLD (the default): never above, and below for a Poisson K.
    acc = tuning.RdpTuningAccountant(INTEGER_ORDERS, pld_delta_hat=False)
    tight = tuning.RdpTuningAccountant(INTEGER_ORDERS)
    for mean in (1.0, 3.7, 100.0):
        for shape in SHAPES:
            event = ev.RepeatAndSelect(_run(q, z, steps), mean, shape)
            oracle = R.RdpAccountant(INTEGER_ORDERS)
            oracle.compose(D.RepeatAndSelectDpEvent(_oracle_run(q, z, steps), mean, shape))
            np.testing.assert_allclose(acc.rdp(event), np.asarray(oracle._rdp), rtol=1e-6)
            assert np.all(tight.rdp(event) <= acc.rdp(event) * (1 + 1e-12))
            for delta in (1e-5, 1e-8):
                ours = acc.epsilon(event, delta).epsilon
                assert ours == pytest.approx(oracle.get_epsilon(delta), rel=1e-6), (mean, shape)
                tighter = tight.epsilon(event, delta).epsilon
                if math.isinf(shape) and mean > 1.0:
                    assert tighter < ours * 0.999, (mean, delta)
                elif not math.isinf(shape):
                    assert tighter == ours


def _gaussian_delta(sigma: float, eps: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm. 8)."""
    from scipy.stats import norm

    return float(norm.cdf(0.5 / sigma - eps * sigma)
                 - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma))


@pytest.mark.parametrize("sigma", [0.8, 3.0, 10.0])
def test_pld_delta_hat_bounds_the_exact_gaussian_delta_tightly(sigma):
    orders = np.asarray([0.5, 1.25, 2.0, 4.0, 16.0, 64.0, 256.0])
    d_hat = tuning.pld_delta_hat(ev.Gaussian(sigma), orders)
    assert d_hat is not None and d_hat[0] == 1.0  # no statement below order 1
    for a, d in zip(orders[1:], d_hat[1:], strict=True):
        exact = _gaussian_delta(sigma, math.log1p(1.0 / (a - 1.0)))
        assert exact <= d <= exact * 1.01 + 1e-12, (a, d, exact)


def test_pld_delta_hat_of_a_subsampled_run_agrees_with_dp_accountings_pld():
    from dp_accounting.pld import pld_privacy_accountant as P

    q, z, steps = 0.02, 1.1, 300
    orders = np.asarray([1.5, 2.0, 3.0, 6.0, 12.0, 40.0])
    d_hat = tuning.pld_delta_hat(_run(q, z, steps), orders)
    assert d_hat is not None
    oracle = P.PLDAccountant(value_discretization_interval=1e-4)  # pessimistic, finer grid
    oracle.compose(_oracle_run(q, z, steps))
    theirs = np.array([oracle.get_delta(math.log1p(1.0 / (a - 1.0))) for a in orders])
    np.testing.assert_allclose(d_hat, theirs, rtol=5e-3)


def test_the_result_says_where_delta_hat_came_from():
    poisson = accounting.epsilon(tuning.random_trials(_run(0.01, 1.0, 100), 4.0), 1e-5)
    geometric = accounting.epsilon(tuning.random_trials(_run(0.01, 1.0, 100), 4.0, 1.0), 1e-5)
    assert any("delta_hat from its pessimistic PLD" in n for n in poisson.notes)
    assert not any("delta_hat" in n for n in geometric.notes)


def test_pld_delta_hat_leaves_events_the_pld_engine_cannot_account_to_rdp():
    shuffled = ev.Shuffled(1.0, 10, 2)
    assert tuning.pld_delta_hat(shuffled, np.asarray([2.0, 8.0])) is None
    rdp_only = tuning.RdpTuningAccountant(pld_delta_hat=False)
    default = tuning.RdpTuningAccountant()
    curve = np.asarray(accounting.rdp.rdp_of_event(_run(0.01, 1.0, 100), default.orders))
    with pytest.raises(ValueError, match="delta_hat must be"):
        tuning.rdp_repeat_and_select(default.orders, curve, 3.0, math.inf, delta_hat=[0.1])
    # a delta_hat larger than the RDP curve's changes nothing (the smaller is used)
    ones = np.ones_like(default.orders)
    np.testing.assert_array_equal(
        tuning.rdp_repeat_and_select(default.orders, curve, 3.0, math.inf, delta_hat=ones),
        tuning.rdp_repeat_and_select(default.orders, curve, 3.0, math.inf))
    assert rdp_only.orders.shape == default.orders.shape


@pytest.mark.parametrize("shape", SHAPES)
def test_transform_matches_dp_accounting_on_default_orders(shape):
    # Same single-run curve, dp_accounting's own default (fractional) orders.
    orders = np.asarray(R.DEFAULT_RDP_ORDERS, dtype=float)
    curve = 300 * R._compute_rdp_poisson_subsampled_gaussian(0.02, 1.1, orders)
    for mean in (1.0, 2.0, 50.0):
        ours = tuning.rdp_repeat_and_select(orders, curve, mean, shape)
        theirs = np.asarray(R._compute_rdp_repeat_and_select(orders, curve, mean, shape))
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_gaussian_inner_event_and_composition_with_final_run():
    orders = INTEGER_ORDERS
    acc = tuning.RdpTuningAccountant(orders)
    final = _run(0.01, 1.2, 800)
    event = tuning.with_tuning(final, tuning.random_trials(ev.Gaussian(3.0), 10.0, 1.0))
    oracle = R.RdpAccountant(orders)
    oracle.compose(D.RepeatAndSelectDpEvent(D.GaussianDpEvent(3.0), 10.0, 1.0))
    oracle.compose(_oracle_run(0.01, 1.2, 800))
    assert acc.epsilon(event, 1e-6).epsilon == pytest.approx(oracle.get_epsilon(1e-6), rel=1e-6)


def test_registered_and_reports_its_own_name():
    event = tuning.random_trials(_run(0.01, 1.0, 1000), 10.0)
    assert "rdp_tuning" in accounting.accountants()
    res = accounting.epsilon(event, 1e-5)
    assert res.method == "rdp_tuning"  # the method that accounts this tree again
    assert accounting.epsilon(event, 1e-5, method=res.method).epsilon == res.epsilon
    assert res.epsilon > accounting.epsilon(_run(0.01, 1.0, 1000), 1e-5, method="rdp").epsilon
    # Not a candidate for trees without RepeatAndSelect: the rdp accountant handles those.
    reason = accounting.compare(_run(0.01, 1.0, 10), 1e-5)["rdp_tuning"]
    assert isinstance(reason, str) and "RepeatAndSelect" in reason


def test_unsupported_inner_events_are_named():
    acc = tuning.RdpTuningAccountant()
    bad = ev.RepeatAndSelect(ev.Shuffled(1.0, 10, 2), 5.0)
    assert "Shuffled" in acc.unsupported(bad)
    with pytest.raises(accounting.UnsupportedEventError, match="Shuffled"):
        accounting.epsilon(bad, 1e-5, method="rdp_tuning")
    assert "mean >= 1" in acc.unsupported(ev.RepeatAndSelect(ev.Gaussian(1.0), 0.5))
    mixed = ev.Composed(
        (
            ev.RepeatAndSelect(ev.Gaussian(2.0), 3.0),
            ev.FixedSizeSampled(10, 100, ev.Gaussian(1.0)),
        )
    )
    assert "adjacency" in acc.unsupported(mixed)


def test_monotone_in_mean_and_one_trial_costs_at_least_one_run():
    run = _run(0.01, 1.0, 1000)
    base = accounting.epsilon(run, 1e-5, method="rdp").epsilon
    for shape in SHAPES:
        eps = [accounting.epsilon(ev.RepeatAndSelect(run, m, shape), 1e-5).epsilon
               for m in (1.0, 2.0, 10.0, 100.0)]
        assert all(np.diff(eps) >= -1e-12), (shape, eps)
        assert eps[0] >= base - 1e-9


def test_tnb_gamma_inverts_mean_on_the_safe_side():
    for shape in (0.0, 0.3, 1.0, 4.0):
        for mean in (1.0, 1.001, 7.0, 1e3, 1e6):
            g = tuning.truncated_negative_binomial_gamma(shape, mean)
            m = tuning.truncated_negative_binomial_mean(g, shape)
            assert m >= mean * (1 - 1e-12)
            assert m == pytest.approx(mean, rel=1e-9)
    with pytest.raises(ValueError, match="mean must be in"):
        tuning.truncated_negative_binomial_gamma(1.0, 0.5)


@pytest.mark.parametrize("mean,shape", [(5.0, math.inf), (5.0, 1.0), (5.0, 0.0), (8.0, 2.0)])
def test_draw_number_of_trials_has_the_stated_mean(mean, shape):
    rnd = Randomness(seed=3)
    draws = np.array([tuning.draw_number_of_trials(mean, shape, rnd) for _ in range(2000)])
    if not math.isinf(shape):
        assert draws.min() >= 1
    # Logarithmic has a heavy tail; 6 standard errors is a loose but failing-capable check.
    assert abs(draws.mean() - mean) < 6 * draws.std() / math.sqrt(draws.size)


def test_table4_options_order_and_json():
    run = _run(5000 / 1_000_000, 1.0, 200)  # guide Appendix C flavour, smaller for speed
    rows = tuning.compare_tuning(run, 20, 1e-6)
    by = {r.name: r for r in rows}
    final_only = by["final run only"].epsilon
    simple = by["simple composition"].epsilon
    rdp_all = by["RDP composition of all runs"].epsilon
    assert final_only < rdp_all < simple
    assert by["simple composition"].epsilon == pytest.approx(
        20 * accounting.epsilon(run, 1e-6 / 20).epsilon, rel=1e-9
    )
    ps = [r for r in rows if r.name.startswith("random number of trials")]
    assert len(ps) == 3 and all(final_only < r.epsilon for r in ps)
    assert all(r.covers == "final run plus tuning" for r in rows[1:])
    json.dumps([r.to_dict() for r in rows])
    # A retraining after tuning adds the final run's cost.
    with_final = tuning.compare_tuning(run, 20, 1e-6, final=run)
    assert with_final[-1].epsilon > rows[-1].epsilon


def test_sequential_composition_validates():
    with pytest.raises(ValueError):
        tuning.sequential_composition([], 1e-5)
    with pytest.raises(ValueError, match="delta must be in"):
        tuning.sequential_composition([ev.Gaussian(1.0)], 0.0)


def test_coverage_final_only_vs_plus_tuning():
    final = _run(0.01, 1.2, 500)
    tuning_event = tuning.random_trials(_run(0.01, 1.2, 100), 8.0)
    out = tuning.coverage(final, tuning_event, 1e-5)
    assert set(out) == {"final run only", "final run plus tuning"}
    assert out["final run only"].epsilon < out["final run plus tuning"].epsilon
    selected = tuning.coverage(final, tuning.random_trials(final, 8.0), 1e-5,
                               final_is_selected=True)
    assert selected["final run plus tuning"].epsilon == pytest.approx(
        accounting.epsilon(tuning.random_trials(final, 8.0), 1e-5).epsilon
    )

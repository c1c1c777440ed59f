"""Monte Carlo accounting of Balls-and-Bins: validation against the exact T = 1 Gaussian,
consistency of the samplers (plain / importance / order statistics), bounds, reproducibility."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from scipy import special

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting.gaussian import gaussian_delta, gaussian_epsilon
from dpfy.accounting.monte_carlo.accountant import (
    MonteCarloAccountant,
    balls_and_bins_delta,
    balls_and_bins_epsilon,
    monte_carlo_delta,
)
from dpfy.accounting.monte_carlo.confidence import kl_upper_bound
from dpfy.accounting.monte_carlo.epochs import Epoch, epochs_of_event
from dpfy.accounting.monte_carlo.lower_bound import lower_bound_delta, lower_bound_epsilon
from dpfy.accounting.monte_carlo.order_statistics import block_log_sums, default_orders

# Statistical checks use an error probability of 1e-6 (two-sided intervals: 2e-6 per check);
# seeds are fixed, so the suite is deterministic.
ERR = 1e-6
FAST = {"progress": False}


def _kl_interval(mean: float, n: int, err: float) -> tuple[float, float]:
    up = float(kl_upper_bound(mean, n, err))
    low = 1.0 - float(kl_upper_bound(1.0 - mean, n, err))
    return low, up


@pytest.mark.parametrize("method", ["plain", "importance"])
@pytest.mark.parametrize(("z", "eps"), [(0.5, 1.0), (1.0, 2.0), (2.0, 0.5), (1.0, 4.0)])
def test_single_step_is_the_exact_gaussian(method, z, eps):
    exact = float(gaussian_delta(1.0 / z, eps))
    n = 200_000
    r = balls_and_bins_delta(z, 1, eps, samples=n, seed=7, method=method, error_probability=ERR,
                             **FAST)
    assert r.delta_upper >= exact
    # each direction's estimate is scale x (mean of n [0, 1]-valued samples); at T = 1 both
    # directions have the exact Gaussian delta
    for est, scale in zip(r.direction_estimates, r.direction_scales, strict=True):
        low, up = _kl_interval(est / scale, n, ERR)
        assert low * scale <= exact <= up * scale
    # the certain lower bound is exact at T = 1 (the threshold test is optimal)
    assert r.delta_lower == pytest.approx(exact, rel=1e-3)


def test_single_step_epsilon_brackets_exact_value():
    exact = float(gaussian_epsilon(1.0, 1e-3))
    r = balls_and_bins_epsilon(1.0, 1, 1e-3, samples=200_000, seed=1, error_probability=ERR, **FAST)
    assert r.epsilon_upper >= exact
    assert r.epsilon_lower <= exact * (1 + 1e-6)
    assert abs(r.epsilon_estimate - exact) < 0.05 * exact


def test_two_epochs_compose_like_a_gaussian():
    exact = float(gaussian_delta(math.sqrt(2.0), 1.0))  # two T = 1 epochs, z = 1
    r = monte_carlo_delta([Epoch(1.0, 1)] * 2, 1.0, samples=200_000, seed=3,
                          error_probability=ERR, **FAST)
    assert r.delta_upper >= exact
    low, up = _kl_interval(r.delta_estimate, 200_000, ERR)
    assert low <= exact <= up
    assert r.delta_lower <= exact * (1 + 1e-9)


@pytest.mark.parametrize(("z", "t", "eps"), [(1.0, 10, 1.0), (0.8, 50, 1.5), (2.0, 5, 0.3)])
def test_lower_bound_never_exceeds_estimate(z, t, eps):
    for method in ("plain", "conditional"):
        r = balls_and_bins_delta(z, t, eps, samples=100_000, seed=2, method=method,
                                 error_probability=ERR, **FAST)
        assert r.delta_lower <= r.delta_upper
        assert r.delta_estimate <= r.delta_upper
        if method == "plain":
            assert r.delta_lower <= r.delta_estimate


def test_importance_and_plain_agree_within_intervals():
    z, t, eps, n = 1.0, 4, 2.5, 200_000
    plain = balls_and_bins_delta(z, t, eps, samples=n, seed=5, method="plain",
                                 error_probability=ERR, **FAST)
    imp = balls_and_bins_delta(z, t, eps, samples=n, seed=6, method="importance",
                               error_probability=ERR, **FAST)
    assert imp.method == "importance"
    for d in range(2):  # each direction: the two estimates' intervals overlap
        p_low, p_up = _kl_interval(plain.direction_estimates[d], n, ERR)
        s = imp.direction_scales[d]
        i_low, i_up = _kl_interval(imp.direction_estimates[d] / s, n, ERR)
        assert max(p_low, i_low * s) <= min(p_up, i_up * s)
    # importance sampling is tighter: its upper bound is closer to its estimate
    assert imp.delta_upper / imp.delta_estimate < plain.delta_upper / plain.delta_estimate


def test_order_statistics_bounds_are_pathwise_pessimistic():
    rng = np.random.default_rng(0)
    n = 3000
    v = np.sort(rng.standard_normal((50, n)), axis=1)[:, ::-1] / 0.7  # descending, scaled
    exact = special.logsumexp(v, axis=1)
    for orders in (default_orders(n, dense=16, ratio=1.2), default_orders(n), np.arange(1, n + 1)):
        up, low = block_log_sums(v[:, orders - 1], orders, n)
        assert np.all(up >= exact - 1e-9) and np.all(low <= exact + 1e-9)
    full = np.arange(1, n + 1)
    up, low = block_log_sums(v[:, full - 1], full, n)
    np.testing.assert_allclose(up, exact)
    np.testing.assert_allclose(low, exact)
    with pytest.raises(ValueError, match="orders must increase"):
        block_log_sums(v[:, :2], np.array([2, 5]), n)


def test_order_statistics_estimates_never_below_plain():
    z, t, eps, n = 1.0, 2000, 0.5, 8_000
    plain = balls_and_bins_delta(z, t, eps, samples=n, seed=8, method="plain",
                                 error_probability=ERR, **FAST)
    order = balls_and_bins_delta(z, t, eps, samples=n, seed=9, method="order_statistics",
                                 error_probability=ERR, **FAST)
    assert order.method == "order_statistics"
    p_low, _ = _kl_interval(plain.delta_estimate, n, ERR)
    assert order.delta_estimate >= p_low
    assert order.delta_upper >= plain.delta_estimate


def test_reproducible_from_seed_and_independent_of_executor():
    kw = {"samples": 20_000, "seed": 42, "method": "plain", **FAST}
    a = balls_and_bins_epsilon(1.0, 20, 1e-2, **kw)
    b = balls_and_bins_epsilon(1.0, 20, 1e-2, **kw)
    with ThreadPoolExecutor(2) as pool:
        c = balls_and_bins_epsilon(1.0, 20, 1e-2, executor=pool, chunk_elements=1 << 16, **kw)
    assert a.epsilon_upper == b.epsilon_upper == c.epsilon_upper
    assert a.epsilon_estimate == c.epsilon_estimate
    d = balls_and_bins_epsilon(1.0, 20, 1e-2, samples=20_000, seed=43, method="plain", **FAST)
    e = balls_and_bins_epsilon(1.0, 20, 1e-2, samples=20_000, seed=42, method="conditional",
                               chunk_elements=1 << 16, **FAST)
    with ThreadPoolExecutor(2) as pool:
        f = balls_and_bins_epsilon(1.0, 20, 1e-2, samples=20_000, seed=42, method="conditional",
                                   executor=pool, chunk_elements=1 << 16, **FAST)
    assert e.epsilon_upper == f.epsilon_upper
    assert d.epsilon_estimate != a.epsilon_estimate


def test_epsilon_bounds_are_ordered_for_several_epochs():
    r = balls_and_bins_epsilon(1.5, 10, 1e-3, epochs=3, samples=100_000, seed=0, **FAST)
    assert r.epsilon_lower <= r.epsilon_estimate <= r.epsilon_upper < math.inf
    assert r.epsilon_lower == pytest.approx(lower_bound_epsilon([Epoch(1.5, 10)] * 3, 1e-3))


def test_lower_bound_is_monotone_and_below_no_amplification():
    epochs = [Epoch(1.0, 100)]
    d = [lower_bound_delta(epochs, e) for e in (0.0, 0.5, 1.0, 2.0)]
    assert d == sorted(d, reverse=True)
    assert lower_bound_epsilon(epochs, 1e-5) < float(gaussian_epsilon(1.0, 1e-5))


def test_kl_upper_bound_properties():
    assert float(kl_upper_bound(0.0, 1000, 1e-3)) == pytest.approx(1 - 1e-3 ** (1 / 1000))
    m = np.array([0.0, 0.01, 0.5, 1.0])
    ub = kl_upper_bound(m, 500, 1e-3)
    assert np.all(ub >= m) and ub[-1] == 1.0
    assert float(kl_upper_bound(0.01, 50_000, 1e-3)) < float(kl_upper_bound(0.01, 500, 1e-3))


def test_events_and_accountant():
    e = ev.SelfComposed(ev.Composed((ev.BallsAndBins(1.0, 10, 2), ev.Gaussian(3.0))), 2)
    assert epochs_of_event(e) == ([Epoch(1.0, 10)] * 2 + [Epoch(3.0, 1)]) * 2
    acc = MonteCarloAccountant(samples=50_000, seed=0, progress=False)
    assert acc.unsupported(ev.PoissonSampled(0.1, ev.Gaussian(1.0))) is not None
    assert "replace_one" in acc.unsupported(ev.BallsAndBins(1.0, 10, adjacency="replace_one"))
    res = accounting.epsilon(ev.BallsAndBins(2.0, 10), 1e-3, method=acc)
    assert res.method == "monte_carlo" and res.error_probability == 1e-3
    assert not res.provable
    assert res.epsilon_lower <= res.epsilon_estimate <= res.epsilon
    d = accounting.delta(ev.BallsAndBins(2.0, 10), res.epsilon, method=acc)
    assert d.delta <= 1e-3 * 1.5
    assert "monte_carlo" in accounting.accountants()


def test_falls_back_to_provable_no_amplification_bound():
    acc = MonteCarloAccountant(samples=2_000, seed=0, progress=False, method="plain")
    res = accounting.epsilon(ev.BallsAndBins(1.0, 50), 1e-6, method=acc)
    # 2,000 samples cannot certify delta = 1e-6: the provable Gaussian bound is reported
    assert res.provable and res.epsilon == pytest.approx(float(gaussian_epsilon(1.0, 1e-6)))
    assert res.epsilon_lower <= res.epsilon


def test_truncated_balls_and_bins_pays_truncation_delta():
    acc = MonteCarloAccountant(samples=50_000, seed=0, progress=False)
    plain = accounting.epsilon(ev.BallsAndBins(2.0, 10), 1e-3, method=acc)
    cut = accounting.epsilon(ev.TruncatedBallsAndBins(2.0, 10, 1, 1000, 125), 1e-3, method=acc)
    assert cut.epsilon >= plain.epsilon


def test_validation():
    with pytest.raises(ValueError, match="method must be one of"):
        balls_and_bins_delta(1.0, 2, 1.0, samples=10, method="magic", **FAST)
    with pytest.raises(ValueError, match="single epoch"):
        balls_and_bins_delta(1.0, 2, 1.0, epochs=2, samples=10, method="importance", **FAST)
    with pytest.raises(ValueError, match="samples must be"):
        balls_and_bins_delta(1.0, 2, 1.0, samples=0, **FAST)


def test_conditional_matches_plain_and_bounds_it():
    # one epoch, T = 20: conditional (Rao-Blackwellised + analytic tails) vs plain sampling
    z, t, eps, n = 1.0, 20, 1.0, 100_000
    plain = balls_and_bins_delta(z, t, eps, samples=n, seed=11, method="plain",
                                 error_probability=ERR, **FAST)
    cond = balls_and_bins_delta(z, t, eps, samples=n, seed=12, method="conditional",
                                error_probability=ERR, **FAST)
    assert cond.method == "conditional"
    for d in range(2):
        p_low, p_up = _kl_interval(plain.direction_estimates[d], n, ERR)
        assert p_low <= cond.direction_estimates[d] <= p_up
    assert cond.delta_upper >= plain.delta_estimate
    assert cond.delta_lower <= cond.delta_estimate <= cond.delta_upper
    # the conditional bound is much tighter for the same number of samples
    assert cond.delta_upper - cond.delta_estimate < plain.delta_upper - plain.delta_estimate


def test_conditional_tail_bounds_dominate_empirical_tails():
    from dpfy.accounting.monte_carlo.sum_tails import SumTails as _SumTails

    z, n_terms = 0.8, 50
    rng = np.random.default_rng(0)
    s = np.exp(rng.standard_normal((200_000, n_terms)) / z).sum(axis=1)
    tails = _SumTails(z, n_terms)
    for q in (0.5, 0.9, 0.99, 0.999):
        x = np.quantile(s, q)
        assert tails.right(np.array([x]))[0] >= (1 - q) * 0.9
        y = np.quantile(s, 1 - q)
        assert tails.left(np.array([y]))[0] >= (1 - q) * 0.9


def test_conditional_epsilon_is_ordered_and_auto_uses_tilted():
    r = balls_and_bins_epsilon(1.0, 200, 1e-4, samples=100_000, seed=0, method="conditional",
                               **FAST)
    assert r.method == "conditional"
    assert r.epsilon_lower <= r.epsilon_estimate <= r.epsilon_upper < 1.2 * r.epsilon_estimate
    t = balls_and_bins_epsilon(1.0, 200, 1e-4, samples=50_000, seed=0, **FAST)
    assert t.method == "tilted"  # one epoch: tilted remove direction, conditional add direction
    assert t.epsilon_lower <= t.epsilon_estimate <= t.epsilon_upper < 1.1 * t.epsilon_estimate
    # both samplers estimate the same epsilon
    assert abs(t.epsilon_estimate - r.epsilon_estimate) < 0.03 * r.epsilon_estimate


def test_pure_gaussian_compositions_are_left_to_the_exact_accountant():
    # regression: auto on a pure Gaussian composition crashed (OverflowError in binom.pmf)
    event = ev.SelfComposed(ev.Gaussian(3.0), 50)
    acc = MonteCarloAccountant(progress=False)
    assert "no Balls-and-Bins epoch" in acc.unsupported(event)
    assert acc.unsupported(ev.SelfComposed(ev.BallsAndBins(1.0, 10), 0)) is not None
    assert acc.unsupported(ev.Composed((ev.Gaussian(3.0), ev.BallsAndBins(1.0, 10)))) is None
    res = accounting.epsilon(event, 1e-6)
    exact = accounting.epsilon(event, 1e-6, method="gaussian").epsilon
    assert res.epsilon == pytest.approx(exact, rel=1e-9)
    assert res.method != "monte_carlo"


@pytest.mark.parametrize(
    "epochs",
    [[Epoch(3.0, 1)] * 50, [Epoch(1.0, 10_000)] * 200, [Epoch(0.5, 1000)] * 40,
     [Epoch(1.0, 59)] * 15 + [Epoch(2.0, 1)] * 3],
)
def test_lower_bound_survives_many_steps_and_epochs(epochs):
    d = [lower_bound_delta(epochs, e) for e in (0.0, 1.0, 5.0, 50.0)]
    assert all(0.0 <= x <= 1.0 for x in d) and d == sorted(d, reverse=True)
    low = lower_bound_epsilon(epochs, 1e-5)
    assert 0.0 <= low <= float(gaussian_epsilon(math.sqrt(sum(1 / e.noise_multiplier**2
                                                                for e in epochs)), 1e-5))


@pytest.mark.parametrize("eps", [0.5, 2.0, 3.0])
def test_tilted_matches_the_exact_gaussian_composition(eps):
    # two T = 1 epochs are one Gaussian with mu = sqrt(2); the tilted sampler (order-a mixture
    # tilt, remove direction) must bracket it, and the add direction's Renyi bound lies above
    exact = float(gaussian_delta(math.sqrt(2.0), eps))
    n = 100_000
    r = monte_carlo_delta([Epoch(1.0, 1)] * 2, eps, samples=n, seed=3, method="tilted",
                          error_probability=ERR, **FAST)
    assert r.method == "tilted"
    assert r.delta_upper >= exact
    est, scale = r.direction_estimates[0], r.direction_scales[0]
    low, up = _kl_interval(est / scale, n, ERR)
    assert low * scale <= exact <= up * scale


def test_tilted_agrees_with_plain_and_bounds_both_directions():
    z, t, e, n = 1.0, 10, 3, 100_000
    for eps in (1.0, 2.0):
        plain = balls_and_bins_delta(z, t, eps, epochs=e, samples=n, seed=1, method="plain",
                                     error_probability=ERR, **FAST)
        tilt = balls_and_bins_delta(z, t, eps, epochs=e, samples=n, seed=2, method="tilted",
                                    error_probability=ERR, **FAST)
        p_low, p_up = _kl_interval(plain.direction_estimates[0], n, ERR)
        s = tilt.direction_scales[0]
        i_low, i_up = _kl_interval(tilt.direction_estimates[0] / s, n, ERR)
        assert max(p_low, i_low * s) <= min(p_up, i_up * s)  # remove direction
        a_low, _ = _kl_interval(plain.direction_estimates[1], n, ERR)
        assert tilt.delta_upper >= a_low  # add direction: the analytic bound is above
        assert tilt.delta_upper >= max(p_low, a_low)


def test_add_direction_moments_match_sampling():
    from dpfy.accounting.monte_carlo.tilted import add_log_mgf as _add_log_mgf

    rng = np.random.default_rng(0)
    z, t = 0.8, 20
    lams = np.array([0.1, 0.5, 1.0, 2.0])
    s = np.exp(rng.standard_normal((200_000, t)) / z).sum(axis=1)
    loss = math.log(t) + 0.5 / z**2 - np.log(s)  # log Q/P under Q
    sampled = np.log(np.mean(np.exp(lams[:, None] * loss[None, :]), axis=1))
    quad = _add_log_mgf(z, t, lams)
    np.testing.assert_allclose(quad, sampled, rtol=0.05, atol=2e-3)
    assert np.all(_add_log_mgf(z, 1, lams) == lams * (lams + 1) / (2 * z * z))


def test_several_epochs_give_a_useful_bound_by_default():
    # before the tilted sampler, several epochs fell back to the no-amplification bound
    acc = MonteCarloAccountant(samples=20_000, seed=0, progress=False)
    res = accounting.epsilon(ev.BallsAndBins(1.0, 30, 4), 1e-5, method=acc)
    assert not res.provable
    assert res.epsilon_lower <= res.epsilon_estimate <= res.epsilon
    assert res.epsilon < 1.1 * res.epsilon_estimate
    assert res.epsilon < 0.5 * float(gaussian_epsilon(2.0, 1e-5))

"""PLD of fixed-size (without replacement, replace_one) and truncated Poisson batches.

Reference values come from dp_accounting 0.6.0, computed once by
``vectors/make_pld_samplers.py`` and read from ``vectors/pld_samplers.json``: every dpfy
figure must lie between a valid lower bound on the true epsilon and dp_accounting's own
number for the event (docs/architecture.md, 5.2).
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting import UnsupportedEventError, pld
from dpfy.accounting import pld_events as pe

VECTORS = json.loads(
    (pathlib.Path(__file__).parent / "vectors" / "pld_samplers.json").read_text()
)


def _fixed(b: int, n: int, z: float, steps: int) -> ev.Event:
    return ev.SelfComposed(ev.FixedSizeSampled(b, n, ev.Gaussian(z)), steps)


@pytest.mark.parametrize("row", VECTORS["fixed_size"], ids=lambda r: f"B{r['B']}N{r['N']}")
def test_fixed_size_between_the_reachable_pair_and_dp_accounting_rdp(row: dict) -> None:
    eps = pld.pld_epsilon(_fixed(row["B"], row["N"], row["z"], row["steps"]), row["delta"])
    assert eps.adjacency == "replace_one"
    assert eps.epsilon >= row["lower"] * (1 - 1e-9)
    # never looser than dp_accounting: its PLD accountant does not support sampling without
    # replacement (0.6.0), so its RDP figure is its number for the event (1.56x to 2.28x ours)
    assert eps.epsilon <= row["rdp"]
    # and below dpfy's own RDP figure for the event (Wang, Balle, Kasiviswanathan 2019)
    rdp = accounting.epsilon(
        _fixed(row["B"], row["N"], row["z"], row["steps"]), row["delta"], method="rdp"
    )
    assert eps.epsilon <= rdp.epsilon


@pytest.mark.parametrize("row", VECTORS["truncated"], ids=lambda r: f"Bmax{r['B_max']}")
def test_truncated_never_looser_than_dp_accounting(row: dict) -> None:
    event = ev.TruncatedPoisson(row["q"], row["z"], row["steps"], row["N"], row["B_max"])
    eps = pld.pld_epsilon(event, row["delta"]).epsilon
    # a pessimistic discretisation of the mixture pair: never below that pair's converged value
    # (dp_accounting's Gaussian PLDs at a 10x finer grid), nor below a lower bound on the truth
    assert eps >= row["converged"] * (1 - 1e-9)
    assert eps >= row["lower"]
    # never looser than dp_accounting's default truncated subsampled Gaussian PLD
    assert eps <= row["dp_accounting"] * (1 + 1e-9)


def test_public_truncated_epsilon_is_the_smaller_of_mixture_and_coupling() -> None:
    row = VECTORS["truncated"][4]
    event = ev.TruncatedPoisson(row["q"], row["z"], row["steps"], row["N"], row["B_max"])
    res = accounting.epsilon(event, row["delta"], method="pld")
    assert res.method == "pld"
    assert res.epsilon <= pld.pld_epsilon(event, row["delta"]).epsilon
    assert row["lower"] <= res.epsilon <= row["dp_accounting"] * (1 + 1e-9)


def test_symmetrised_step_is_a_symmetric_probability_with_the_remove_curve() -> None:
    h = 2e-3
    both = pld.poisson_gaussian_pmf(0.05, 0.5, h)  # (q, z/2) of a fixed-size step, z = 1
    sym = pe.symmetrised(both["remove"], both["add"])
    losses = (sym.offset + np.arange(sym.pmf.size)) * h
    assert sym.offset == -(sym.pmf.size - 1) // 2
    pos, neg = sym.pmf[losses > 0], sym.pmf[losses < 0][::-1]
    np.testing.assert_allclose(neg, pos * np.exp(-losses[losses > 0]), rtol=1e-12)
    assert sym.pmf.sum() + sym.infinity_mass == pytest.approx(1.0, abs=1e-12)
    assert sym.infinity_mass == both["remove"].infinity_mass + both["add"].infinity_mass
    for eps in (0.0, 0.1, 0.7, 2.0):
        assert sym.delta(eps) == pytest.approx(both["remove"].delta(eps), rel=1e-9, abs=1e-13)
        assert sym.delta(eps) >= both["add"].delta(eps)


def test_symmetrised_step_covers_an_add_curve_rounded_above_the_remove_curve() -> None:
    # q = 0.001, z/2 = 1.375: both curves are the same total variation at epsilon 0 and the
    # discretised add curve comes out a rounding error above; the step must cover the larger.
    h = 2.0**-13
    both = pld.poisson_gaussian_pmf(0.001, 1.375, h)
    rem, add = both["remove"], both["add"]
    assert add.delta(0.0) > rem.delta(0.0)  # by 3e-16
    sym = pe.symmetrised(rem, add)
    assert sym.pmf.min() >= 0.0
    assert sym.pmf.sum() + sym.infinity_mass == pytest.approx(1.0, abs=1e-12)
    for eps in (0.0, h / 2, 0.01, 0.05, 0.3, 1.0):
        assert sym.delta(eps) >= max(rem.delta(eps), add.delta(eps)) * (1 - 1e-12)
    # once failed: "add direction's delta exceeds the remove direction's at epsilon=0"
    got = pld.pld_epsilon(_fixed(1, 1000, 2.75, 1), 1e-8).epsilon
    reachable = pld.pld_epsilon(ev.PoissonSampled(0.001, ev.Gaussian(1.375)), 1e-8).epsilon
    assert reachable * (1 - 1e-9) <= got <= reachable * 1.01


def test_full_batch_fixed_size_is_the_gaussian_at_half_the_noise() -> None:
    got = pld.pld_epsilon(_fixed(100, 100, 2.0, 7), 1e-6).epsilon
    exact = accounting.epsilon(ev.SelfComposed(ev.Gaussian(1.0), 7), 1e-6, method="gaussian")
    assert got == pytest.approx(exact.epsilon, rel=1e-3)
    assert got >= exact.epsilon * (1 - 1e-9)


def test_fixed_size_covers_runs_that_switch_direction() -> None:
    # An adaptive run can make some steps remove-like and the others add-like; the
    # symmetrised PLD must cover that mix, which exceeds both one-direction compositions.
    q, z, steps, h = 0.2, 1.0, 40, 2e-3
    both = pld.poisson_gaussian_pmf(q, z / 2.0, h)
    mixed = pld.compose([(both["remove"], steps // 2), (both["add"], steps // 2)])
    ours = pld.pld_epsilon(_fixed(20, 100, z, steps), 1e-5).epsilon
    assert ours >= mixed.epsilon(1e-5) * (1 - 1e-3)


def test_truncated_with_a_large_cap_is_the_poisson_step() -> None:
    poisson = ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 200)
    capped = ev.TruncatedPoisson(0.01, 1.0, 200, 10_000, 1_000)
    assert pe.truncation_weights(0.01, 10_000, 1_000)[1] == 0.0
    assert accounting.epsilon(capped, 1e-5, method="pld").epsilon == pytest.approx(
        pld.pld_epsilon(poisson, 1e-5).epsilon, rel=1e-12
    )


def test_truncation_weights_match_a_direct_sum() -> None:
    from scipy import stats

    q, n, b = 0.05, 200, 14
    t_min, t_max, q_bar = pe.truncation_weights(q, n, b)
    k = np.arange(b, n)  # others: n - 1
    pk = stats.binom.pmf(k, n - 1, q)
    assert t_min == pytest.approx(pk.sum(), rel=1e-10)
    k2 = np.arange(b, n + 1)
    pk2 = stats.binom.pmf(k2, n, q)
    assert t_max == pytest.approx(pk2.sum(), rel=1e-10)
    q_bars = [q * np.sum(pk * b / (k + 1)) / pk.sum(), q * np.sum(pk2 * b / (k2 + 1)) / pk2.sum()]
    assert q_bar == pytest.approx(max(q_bars), rel=1e-10)


def test_pld_refuses_mixed_adjacency_and_non_gaussian_fixed_size() -> None:
    mixed = ev.Composed(
        (_fixed(10, 1000, 1.0, 3), ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 3))
    )
    with pytest.raises(UnsupportedEventError, match="PoissonSampled.*FixedSizeSampled"):
        pld.pld_epsilon(mixed, 1e-5)
    laplace = ev.FixedSizeSampled(10, 1000, ev.Laplace(1.0))
    assert "FixedSizeSampled(Gaussian) only" in str(pld.PLDAccountant().unsupported(laplace))
    tiny = ev.FixedSizeSampled(10, 1000, ev.Gaussian(0.01))
    assert "noise multipliers >=" in str(pld.PLDAccountant().unsupported(tiny))


def test_auto_uses_the_pld_for_fixed_size_and_truncated_runs() -> None:
    from dpfy import run_accounting as ra

    fixed = ra.account_run(10_000, 100, 1.0, 1e-5, steps=300, sampler="fixed_size")
    assert fixed.result.method == "pld"
    rdp = accounting.epsilon(_fixed(100, 10_000, 1.0, 300), 1e-5, method="rdp").epsilon
    assert fixed.result.epsilon < rdp
    capped = ra.account_run(
        10_000, 100, 1.0, 1e-5, steps=300, sampler="poisson", max_batch_size=125
    )
    assert capped.result.method == "pld"
    assert math.isfinite(capped.result.epsilon)
    assert any("truncated Poisson" in n for n in capped.result.notes)


_SLACK = 2e-3  # each figure is within the refinement tolerance of its converged value


def _fixed_eps(q_b: int, z: float, steps: int, delta: float) -> float:
    return pld.pld_epsilon(_fixed(q_b, 1000, z, steps), delta).epsilon


def _trunc_eps(q: float, z: float, steps: int, delta: float, b_max: int) -> float:
    event = ev.TruncatedPoisson(q, z, steps, 2000, b_max)
    return accounting.epsilon(event, delta, method="pld").epsilon


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 200),
    z=st.floats(0.6, 4.0),
    steps=st.integers(1, 60),
    delta=st.sampled_from([1e-8, 1e-5, 1e-3]),
)
def test_fixed_size_pld_is_monotone(b: int, z: float, steps: int, delta: float) -> None:
    base = _fixed_eps(b, z, steps, delta)
    assert _fixed_eps(b, z * 1.25, steps, delta) <= base * (1 + _SLACK) + 1e-9
    assert _fixed_eps(min(1000, b + 20), z, steps, delta) >= base * (1 - _SLACK) - 1e-9
    assert _fixed_eps(b, z, steps + 10, delta) >= base * (1 - _SLACK) - 1e-9
    assert _fixed_eps(b, z, steps, delta * 10) <= base * (1 + _SLACK) + 1e-9


@settings(max_examples=5, deadline=None)  # ~0.3 s per value on the capped grid
@given(
    q=st.floats(0.01, 0.2),
    z=st.floats(0.7, 3.0),
    steps=st.integers(1, 60),
    delta=st.sampled_from([1e-7, 1e-5]),
)
def test_truncated_pld_is_monotone(q: float, z: float, steps: int, delta: float) -> None:
    b = math.ceil(2000 * q * 1.2)  # the cap binds now and then
    base = _trunc_eps(q, z, steps, delta, b)
    assert _trunc_eps(q, z * 1.25, steps, delta, b) <= base * (1 + _SLACK) + 1e-9
    assert _trunc_eps(q * 1.2, z, steps, delta, b) >= base * (1 - _SLACK) - 1e-9
    assert _trunc_eps(q, z, steps + 10, delta, b) >= base * (1 - _SLACK) - 1e-9
    assert _trunc_eps(q, z, steps, delta * 10, b) <= base * (1 + _SLACK) + 1e-9


def test_truncated_delta_and_epsilon_agree_and_beat_the_coupling_bound() -> None:
    from dpfy.accounting.truncation import event_truncation_probability

    event = ev.TruncatedPoisson(0.01, 1.0, 300, 10_000, 125)
    p = event_truncation_probability(event)
    assert p > 1e-5  # the coupling bound alone cannot reach delta = 1e-5
    res = accounting.epsilon(event, 1e-5, method="pld")
    assert math.isfinite(res.epsilon)
    d = accounting.delta(event, res.epsilon, method="pld")
    assert d.delta <= 1e-5 * (1 + 1e-2)
    assert d.delta < p  # below the coupling term alone
    # the rdp accountant has only the coupling bound: no finite epsilon here
    assert accounting.epsilon(event, 1e-5, method="rdp").epsilon == math.inf


def test_attack_risk_of_a_fixed_size_run_uses_the_symmetric_pld() -> None:
    from dpfy.accounting.risk import attack_risk

    event = _fixed(100, 10_000, 1.0, 300)
    risk = attack_risk(event, method="pld")
    gauss = attack_risk(ev.SelfComposed(ev.Gaussian(0.5), 300), method="gaussian")
    for ours, no_sampling in zip(risk.tpr, gauss.tpr, strict=True):
        assert ours <= no_sampling + 1e-9  # subsampling never hurts the bound


def test_attack_risk_of_a_truncated_run_beats_the_coupling_term() -> None:
    from dpfy.accounting.risk import attack_risk
    from dpfy.accounting.truncation import event_truncation_probability

    event = ev.TruncatedPoisson(0.01, 1.0, 300, 10_000, 125)
    p = event_truncation_probability(event)
    risk = attack_risk(event, fpr=(1e-3,), method="pld")
    untruncated = attack_risk(ev.untruncated(event), fpr=(1e-3,), method="pld")
    assert untruncated.tpr[0] <= risk.tpr[0] < untruncated.tpr[0] + p
    assert any("mixture PLD" in n for n in risk.notes)

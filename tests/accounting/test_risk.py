"""The attack-risk view: TPR bounds of a membership-inference attacker from the PLD."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from dpfy import events as ev
from dpfy.accounting.pld import DiscretePLD
from dpfy.accounting.risk import (
    FPRS,
    attack_risk,
    tpr_from_epsilon_delta,
    tpr_from_pld,
)

ALPHAS = np.array(FPRS)


def _gaussian_tpr(alpha: np.ndarray, mu: float) -> np.ndarray:
    return norm.cdf(norm.ppf(alpha) + mu)


@pytest.mark.parametrize(("z", "count"), [(0.5, 1), (1.0, 1), (2.0, 4), (5.0, 1), (3.0, 100)])
def test_gaussian_matches_closed_form_from_above(z: float, count: int) -> None:
    # Composed Gaussians are mu-GDP with mu = sqrt(count) / z (Dong, Roth, Su 2022).
    event = ev.SelfComposed(ev.Gaussian(z), count) if count > 1 else ev.Gaussian(z)
    risk = attack_risk(event)
    exact = _gaussian_tpr(ALPHAS, math.sqrt(count) / z)
    tpr = np.array(risk.tpr)
    assert risk.method == "gaussian"  # the exact trade-off curve, no discretisation slack
    assert tpr == pytest.approx(np.maximum(exact, ALPHAS), rel=1e-12, abs=1e-15)
    curve = attack_risk(event, (0.01,))  # one FPR alone: the same closed form
    assert curve.tpr[0] == pytest.approx(_gaussian_tpr(np.array([0.01]), math.sqrt(count) / z)[0])


@pytest.mark.parametrize(
    ("q", "z", "steps"), [(0.01, 1.0, 1000), (0.1, 2.0, 100), (0.02, 0.6, 3000), (1.0, 1.0, 1)]
)
def test_poisson_gaussian_agrees_with_riskcal(q: float, z: float, steps: int) -> None:
    riskcal = pytest.importorskip("riskcal.analysis")
    pld_mod = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
    ref_pld = pld_mod.from_gaussian_mechanism(
        z, sampling_prob=q, value_discretization_interval=1e-3
    ).self_compose(steps)
    ref = 1.0 - np.asarray(riskcal.get_beta_from_pld(ref_pld, alpha=ALPHAS))
    step = ev.PoissonSampled(q, ev.Gaussian(z)) if q < 1 else ev.Gaussian(z)
    tpr = np.array(attack_risk(ev.SelfComposed(step, steps)).tpr)
    assert np.max(np.abs(tpr - ref)) <= 1e-3, (tpr, ref)


def test_discrete_pair_by_hand() -> None:
    # P: 0.2 at loss -0.5, 0.8 at loss 0.5 (grid 0.5, offset -1). Q = p e^-loss there, and
    # Q's remaining 1 - 0.815 sits where P is 0.
    pld = DiscretePLD(0.5, -1, np.array([0.2, 0.0, 0.8]), 0.0)
    q_hi, q_lo = 0.8 * math.exp(-0.5), 0.2 * math.exp(0.5)
    got = tpr_from_pld(pld, [0.2, q_hi, 0.7, 0.9])
    want = [0.8 * 0.2 / q_hi, 0.8, 0.8 + 0.2 * (0.7 - q_hi) / q_lo, 1.0]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_infinity_mass_is_caught_at_every_fpr() -> None:
    pld = DiscretePLD(0.1, 0, np.array([0.9]), 0.1)  # loss 0 w.p. 0.9, +inf w.p. 0.1
    got = tpr_from_pld(pld, [1e-6, 0.5])
    np.testing.assert_allclose(got, [0.1 + 0.9 * 1e-6 / 0.9, 0.1 + 0.5], atol=1e-9)


def test_epsilon_delta_bound_is_kairouz() -> None:
    # Pure eps-DP: TPR <= e^eps alpha at small alpha, and 1 - e^-eps (1 - alpha) at large.
    eps = 1.0
    got = tpr_from_epsilon_delta([0.01, 0.9], [eps], [0.0])
    np.testing.assert_allclose(got, [math.e * 0.01, 1 - math.exp(-1) * 0.1])


def test_rdp_only_events_use_the_epsilon_delta_curve() -> None:
    inner = ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100)
    tuned = ev.RepeatAndSelect(inner, mean=3.0, shape=1.0)
    risk = attack_risk(tuned)
    assert risk.method == "epsilon-delta"
    assert all(0.0 < t <= 1.0 for t in risk.tpr)
    assert all(t >= a for t, a in zip(risk.tpr, risk.fpr, strict=True))


def test_non_private_gives_certainty() -> None:
    risk = attack_risk(ev.Composed((ev.Gaussian(1.0), ev.NonPrivate())))
    assert risk.tpr == (1.0, 1.0, 1.0)


def test_truncation_adds_its_probability() -> None:
    plain = ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100)
    trunc = ev.TruncatedPoisson(0.01, 1.0, 100, dataset_size=1000, max_batch_size=16)
    a, b = attack_risk(plain), attack_risk(trunc)
    assert all(y >= x for x, y in zip(a.tpr, b.tpr, strict=True))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.nan])
def test_bad_fpr_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="fpr"):
        attack_risk(ev.Gaussian(1.0), [bad])


@settings(max_examples=25, deadline=None)
@given(z=st.floats(0.5, 5.0), q=st.floats(0.001, 0.5), steps=st.integers(1, 300))
def test_monotone_in_noise_and_steps(z: float, q: float, steps: int) -> None:
    base = np.array(attack_risk(ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), steps)).tpr)
    noisier = attack_risk(ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(1.25 * z)), steps))
    longer = attack_risk(ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), 2 * steps))
    assert np.all(np.array(noisier.tpr) <= base + 2e-3 * base)
    assert np.all(np.array(longer.tpr) >= base - 2e-3 * base)
    assert np.all(np.diff(base) >= 0)


def test_cli_epsilon_json_has_tpr_at_fpr() -> None:
    import json

    from typer.testing import CliRunner

    from dpfy.cli import app

    args = ["epsilon", "-n", "60000", "-b", "256", "-z", "1.0", "--epochs", "2",
            "--delta", "1e-5", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    want = attack_risk(ev.SelfComposed(ev.PoissonSampled(256 / 60000, ev.Gaussian(1.0)), 468))
    assert payload["tpr_method"] == "pld"
    assert payload["tpr_at_fpr"] == pytest.approx(want.to_dict()["tpr_at_fpr"])


def test_balls_and_bins_uses_the_random_allocation_pld() -> None:
    risk = attack_risk(ev.BallsAndBins(1.0, 8, 1))
    assert risk.method == "random_allocation"
    assert all(a < t < 1.0 for a, t in zip(risk.fpr, risk.tpr, strict=True))
    # One step per epoch is the Gaussian mechanism itself: the closed form, from above.
    one = np.array(attack_risk(ev.BallsAndBins(2.0, 1, 3)).tpr)
    exact = _gaussian_tpr(ALPHAS, math.sqrt(3) / 2.0)
    assert np.all(one >= exact - 1e-12) and np.all(one - exact <= 2e-3), (one, exact)

"""TAN: eps_TAN against the RDP accountant, the privacy wall, scaling helpers, batch-scaling fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfy import accounting
from dpfy.accounting import tan

DELTA = 1e-5
TARGETS = (1.0, 2.0, 4.0, 8.0)
STEPS = (100, 1000, 10_000)
ZS = (0.3, 0.4, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


@pytest.fixture(scope="module")
def ratios() -> dict[str, np.ndarray]:
    table = {
        c: tan.ratio_table(TARGETS, STEPS, ZS, DELTA, conversion=c) for c in ("balle", "basic")
    }
    # The ratio table, shown with `pytest -s` (and quoted in the TAN docs).
    for conv, r in table.items():
        print(f"\neps_RDP / eps_TAN at constant eta, delta={DELTA:g}, conversion={conv}")
        print("eps_TAN  steps  " + " ".join(f"z={z:<5g}" for z in ZS))
        for i, t in enumerate(TARGETS):
            for j, s in enumerate(STEPS):
                cells = " ".join(
                    f"{v:7.3f}" if np.isfinite(v) else "    -  " for v in r[i, j]
                )
                print(f"{t:7g} {s:6d}  {cells}")
    return table


def test_constant_privacy_regime_within_20_percent(ratios):
    r = ratios["balle"]
    big = np.asarray(ZS) >= tan.CONSTANT_PRIVACY_NOISE_MULTIPLIER
    vals = r[..., big]
    vals = vals[np.isfinite(vals)]
    assert vals.size > 30
    # Within 20 % of eps_TAN everywhere on the grid...
    assert np.all(np.abs(vals - 1.0) <= 0.20)
    # ...and mostly an over-estimate of the accountant's epsilon (ratio < 1). The measured
    # range is about [0.81, 1.04]: eps_TAN under-estimates only near z = 2 with large epsilon
    # and few steps; as z grows it over-estimates by up to ~23 % of the RDP epsilon (eps_TAN=1).
    assert 0.80 < vals.min() < 0.85
    assert 1.0 < vals.max() < 1.05
    over = r[:, :, np.asarray(ZS) >= 3.0]
    assert np.all(over[np.isfinite(over)] < 1.0)


def test_eps_tan_is_the_large_noise_limit_of_the_basic_conversion(ratios):
    # TAN Eq. 3-4 start from Mironov's conversion eps = min_a RDP(a) + log(1/delta)/(a-1).
    # Against that, eps_TAN is a lower bound that becomes tight as z grows.
    r = ratios["basic"]
    zs = np.asarray(ZS)
    big = r[..., zs >= 2.0]
    assert np.all(big[np.isfinite(big)] >= 1.0)
    assert np.all(big[np.isfinite(big)] <= 1.25)
    at10 = r[..., zs == 10.0]
    assert np.all(at10[np.isfinite(at10)] <= 1.025)


def test_privacy_wall(ratios):
    r = ratios["balle"]
    zs = np.asarray(ZS)
    wall = r[..., zs < tan.PRIVACY_WALL_NOISE_MULTIPLIER]
    assert np.all(wall[np.isfinite(wall)] > 4.0)  # epsilon at least 4x what TAN predicts
    # At constant eta, epsilon falls monotonically as z grows (the wall, then the plateau).
    for i in range(len(TARGETS)):
        for j in range(len(STEPS)):
            row = r[i, j][np.isfinite(r[i, j])]
            assert np.all(np.diff(row) < 0)


def test_privacy_wall_curve_matches_accountant():
    e = tan.eta_for_epsilon(2.0, DELTA)
    zs = np.array([0.4, 1.0, 3.0, 1e4])
    curve = tan.privacy_wall_curve(e, 1000, zs, DELTA)
    assert np.isnan(curve[-1])  # q > 1 needed
    from dpfy import events as ev

    q = math.sqrt(2) * 3.0 * e / math.sqrt(1000)
    event = ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(3.0)), 1000)
    # the curve converts on the default order grid; the accountant optimises the order
    # continuously, so it can only be (slightly) lower
    exact = accounting.epsilon(event, DELTA, method="rdp").epsilon
    assert exact <= curve[2] <= exact * (1 + 1e-3)
    assert curve[0] > 3 * curve[2]


def test_closed_forms_and_inverse():
    assert tan.eta_step(0.01, 2.0) == pytest.approx(0.01 / (math.sqrt(2) * 2.0))
    assert tan.eta(0.01, 2.0, 400) == pytest.approx(20 * tan.eta_step(0.01, 2.0))
    assert tan.total_amount_of_noise(0.01, 2.0, 400) == pytest.approx(1 / tan.eta(0.01, 2.0, 400))
    for eps in (0.1, 1.0, 8.0, 50.0):
        e = tan.eta_for_epsilon(eps, DELTA)
        assert tan.epsilon_tan_from_eta(e, DELTA) == pytest.approx(eps, rel=1e-12)
        z = tan.noise_multiplier_for_eta(0.02, 500, e)
        assert tan.epsilon_tan(0.02, z, 500, DELTA) == pytest.approx(eps, rel=1e-12)
    # Vectorised, and TAN's "mental gymnastics": double q, quarter S -> same eps_TAN.
    v = tan.epsilon_tan(np.array([0.01, 0.02]), 3.0, np.array([4000, 1000]), DELTA)
    assert v[0] == pytest.approx(v[1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: tan.eta_step(0.0, 1.0),
        lambda: tan.eta_step(1.5, 1.0),
        lambda: tan.eta_step(0.1, -1.0),
        lambda: tan.epsilon_tan(0.1, 1.0, 10, 0.0),
        lambda: tan.regime(0.0),
        lambda: tan.TanConfig(0, 1.0, 10, 100),
        lambda: tan.simulate_small_batch(tan.TanConfig(64, 1.0, 10, 100), 0.5),
        lambda: tan.fit_batch_scaling([64, 64], [1.0, 2.0]),
    ],
)
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call()


def test_regime_thresholds():
    assert tan.regime(2.0) is tan.Regime.CONSTANT_PRIVACY
    assert tan.regime(1.99) is tan.Regime.TRANSITION
    assert tan.regime(0.5) is tan.Regime.TRANSITION
    assert tan.regime(0.49) is tan.Regime.PRIVACY_WALL


def test_small_batch_simulation_keeps_eta_step_and_steps():
    ref = tan.TanConfig(4096, 3.0, 2500, 50_000)  # TAN Sec. 4.4 CIFAR-10 reference
    for k in (2, 8, 16, 3):
        sim = tan.simulate_small_batch(ref, k)
        assert sim.steps == ref.steps
        assert sim.eta_step == pytest.approx(ref.eta_step, rel=1e-12)
        assert sim.batch_size == round(4096 / k)
        assert sim.examples_processed == pytest.approx(ref.examples_processed / k, rel=0.01)
    sim8 = tan.simulate_small_batch(ref, 8)
    assert (sim8.batch_size, sim8.noise_multiplier) == (512, 0.375)  # TAN Fig. 5
    assert sim8.regime is tan.Regime.PRIVACY_WALL  # its own epsilon is large: a simulation only
    eps_ref = accounting.epsilon(ref.privacy_event(), 1e-5, method="rdp").epsilon
    eps_sim = accounting.epsilon(sim8.privacy_event(), 1e-5, method="rdp").epsilon
    assert eps_sim > 3 * eps_ref


def test_constant_tan_family_has_nearly_constant_epsilon_when_z_large():
    ref = tan.TanConfig(16384, 2.5, 72_000, 1_281_167)  # TAN Table 4 (ImageNet)
    fam = tan.constant_tan_family(ref, steps=[18_000, 36_000, 72_000])
    assert [c.steps for c in fam] == [18_000, 36_000, 72_000]
    assert fam[0].batch_size == pytest.approx(32768)
    assert all(c.eta == pytest.approx(ref.eta, rel=1e-12) for c in fam)
    eps = [accounting.epsilon(c.privacy_event(), 8e-7, method="rdp").epsilon for c in fam]
    assert max(eps) / min(eps) < 1.02  # TAN Table 4: 8.00 vs 7.97
    assert eps[-1] == pytest.approx(8.0, abs=0.2)
    by_batch = tan.constant_tan_family(ref, batch_sizes=[8192, 32768])
    assert [c.steps for c in by_batch] == [288_000, 18_000]
    too_big = tan.constant_tan_family(ref, steps=[1])  # would need B > N: left out
    assert too_big == []


def test_batch_scaling_fit_recovers_a_log_linear_law():
    rng = np.random.default_rng(0)
    b = np.repeat([64, 128, 256, 512], 3).astype(float)
    y = 75.0 - 1.3 * np.log(b) + rng.normal(0, 0.05, b.size)
    fit = tan.fit_batch_scaling(b, y)
    assert fit.slope == pytest.approx(-1.3, abs=0.1)
    pred = fit.predict(4096)
    assert pred == pytest.approx(75.0 - 1.3 * math.log(4096), abs=0.4)
    assert 0.0 < fit.prediction_std(4096) < 0.3
    assert fit.prediction_std(4096) > fit.prediction_std(128)
    assert set(fit.to_dict()) >= {"intercept", "slope", "residual_std"}

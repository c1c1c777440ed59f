"""Planning: every recommended option meets the budget under the real accountant."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfy import accounting
from dpfy.accounting import tan
from dpfy.planning import DEFAULT_MAX_STEPS, plan


def _check_plan(p, target, delta, max_steps, compute):
    for opt in (p.recommendation, *p.runner_ups):
        res = accounting.epsilon(opt.privacy_event(), delta)
        assert res.epsilon <= target * (1 + 1e-12), (opt, res)
        assert opt.epsilon == pytest.approx(res.epsilon)
        assert 1 <= opt.batch_size <= p.dataset_size
        if compute is not None:
            assert opt.examples_processed <= compute
    assert p.recommendation.steps <= (max_steps or DEFAULT_MAX_STEPS)
    json.dumps(p.to_dict())


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    n=st.integers(50, 2_000_000),
    target=st.floats(0.2, 20.0),
    log_delta=st.floats(-10.0, -4.0),
    max_steps=st.one_of(st.none(), st.integers(1, 20_000)),
    epochs=st.one_of(st.none(), st.floats(0.05, 200.0)),
)
def test_plan_always_meets_the_budget(n, target, log_delta, max_steps, epochs):
    delta = 10.0**log_delta
    compute = None if epochs is None else max(1, int(epochs * n))
    p = plan(n, target, delta, max_steps, compute, runner_ups=1)
    _check_plan(p, target, delta, max_steps, compute)


def test_recommendation_sits_at_the_edge_of_the_constant_privacy_regime():
    p = plan(60_000, 3.0, 1e-5, max_steps=2_000, runner_ups=2)
    rec = p.recommendation
    assert rec.steps == 2_000
    assert rec.regime is tan.Regime.CONSTANT_PRIVACY
    assert 2.0 <= rec.noise_multiplier < 2.1  # smallest batch with z >= 2
    assert rec.epsilon == pytest.approx(3.0, abs=0.01)  # no budget left on the table
    assert rec.method == "pld"
    by = {o.label: o for o in p.runner_ups}
    # TAN: doubling the batch doubles z and keeps eta_step (only compute changes) ...
    double = by["2x batch, same steps"]
    assert double.noise_multiplier > 1.8 * rec.noise_multiplier
    assert double.eta_step == pytest.approx(rec.eta_step, rel=0.1)
    # ... while halving it falls toward the wall and loses signal-to-noise.
    half = by["half batch, same steps"]
    assert half.eta_step < 0.9 * rec.eta_step
    assert any("privacy wall" in line for line in p.explanation)
    assert "recommended" in p.summary()


def test_compute_budget_limits_steps_and_is_respected():
    compute = 3_000_000
    p = plan(60_000, 1.0, 1e-5, max_examples_processed=compute, runner_ups=2)
    _check_plan(p, 1.0, 1e-5, None, compute)
    free = plan(60_000, 1.0, 1e-5, max_examples_processed=1_200_000, runner_ups=1)
    assert free.recommendation.steps < p.recommendation.steps  # less compute, fewer steps
    assert free.recommendation.regime is tan.Regime.CONSTANT_PRIVACY


def test_too_little_compute_is_explained():
    p = plan(60_000, 1.0, 1e-5, max_examples_processed=60_000, runner_ups=1)
    rec = p.recommendation
    assert rec.regime is not tan.Regime.CONSTANT_PRIVACY
    assert rec.steps == DEFAULT_MAX_STEPS // 10  # min_steps default
    assert rec.examples_processed <= 60_000
    assert any("too little" in line for line in p.explanation)


def test_large_delta_warns_and_bad_input_raises():
    p = plan(100, 2.0, 0.05, max_steps=50, runner_ups=0)
    assert p.runner_ups == ()
    assert any("1/N" in line for line in p.explanation)
    with pytest.raises(ValueError, match="target_epsilon must be in"):
        plan(100, 0.0, 1e-5)
    with pytest.raises(ValueError, match="delta must be in"):
        plan(100, 1.0, 1.0)
    with pytest.raises(ValueError, match="dataset_size must be an integer"):
        plan(10.5, 1.0, 1e-5)
    with pytest.raises(ValueError, match="max_steps must be an integer"):
        plan(100, 1.0, 1e-5, max_steps=0)

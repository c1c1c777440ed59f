"""dpfy.training.trainer and data: padding, noise everywhere, ledger = sampler event, guard."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpfy import accounting
from dpfy.accounting.monte_carlo.accountant import MonteCarloAccountant
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.sampling import BallsAndBinsSampler, PoissonSampler, SampleSpec
from dpfy.training import BudgetExceededError, BudgetGuard
from dpfy.training.data import PhysicalBatcher, accumulate_logical_batch
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import PrivateTrainer, TrainerOptions
from dpfy.training.validate import UnsupportedModuleError

LOSS = nn.CrossEntropyLoss(reduction="none")


def _data(n: int = 120, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def _mlp(d: int = 6, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 2))


def _trainer(model, sampler, x, y, **kw):
    kw.setdefault("clip_norm", 0.5)
    kw.setdefault("epochs", 2)
    kw.setdefault("delta", 1e-5)
    kw.setdefault("max_physical_batch_size", 8)
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    return PrivateTrainer(model, opt, LOSS, x, y, sampler, TrainerOptions(**kw))


# -- data path ----------------------------------------------------------------------------------


def test_physical_batches_are_fixed_shape_and_padded():
    x, y = _data(20)
    batcher = PhysicalBatcher(x, y, max_physical_batch_size=4)
    chunks = list(batcher.chunks(np.array([3, 1, 4, 15, 9, 2])))
    assert [c.count for c in chunks] == [4, 2]
    assert all(c.inputs.shape == (4, 6) and c.weights.shape == (4,) for c in chunks)
    assert chunks[1].weights.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.equal(chunks[1].inputs[:2], x[[9, 2]])
    assert not chunks[1].inputs[2:].any() and not chunks[1].targets[2:].any()
    # an empty Poisson batch still gives one all-padding chunk; truncation fixes the count
    empty = list(batcher.chunks(np.array([], dtype=np.int64)))
    assert len(empty) == 1 and empty[0].count == 0
    fixed = PhysicalBatcher(x, y, max_physical_batch_size=4, max_batch_size=10)
    assert len(list(fixed.chunks(np.array([1])))) == 3
    with pytest.raises(ValueError, match="max_batch_size"):
        list(fixed.chunks(np.arange(11)))
    with pytest.raises(ValueError, match="indices must be in"):
        list(batcher.chunks(np.array([20])))


def test_padded_physical_batches_equal_one_unpadded_batch_and_naive_reference():
    x, y = _data(40)
    model = _mlp()
    idx = np.array([5, 17, 3, 22, 8, 31, 0])
    clip = 0.3
    padded = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=7)
    accumulate_logical_batch(
        padded, PhysicalBatcher(x, y, max_physical_batch_size=3), idx, LOSS
    )
    whole = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=7)
    whole.accumulate(x[idx], y[idx], LOSS)
    a, b = padded.clipped_sum(), whole.clipped_sum()
    # naive reference: each example's full gradient clipped, then summed
    ref = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in idx:
        model.zero_grad()
        LOSS(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        for n in ref:
            ref[n] += grads[n] * min(1.0, clip / float(norm))
    for n in ref:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(a[n], ref[n], rtol=1e-5, atol=1e-7)


# -- trainer ------------------------------------------------------------------------------------


def test_noise_on_every_trainable_parameter_including_unused_ones():
    x, y = _data(200)

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(6, 2)
            self.unused = nn.Linear(3, 50)
            self.frozen = nn.Linear(6, 2).requires_grad_(False)

        def forward(self, inp):
            return self.used(inp)

    model = WithUnused()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sampler = PoissonSampler(200, 0.25, randomness=Randomness(3))
    z, clip = 2.0, 0.5
    trainer = _trainer(
        model, sampler, x, y, noise_multiplier=z, clip_norm=clip,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0), randomness=Randomness(4),
    )
    result = trainer.fit(max_steps=1)
    assert result.steps == 1
    step = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    expected_std = z * clip / sampler.expected_batch_size
    unused = torch.cat([step["unused.weight"].flatten(), step["unused.bias"].flatten()])
    assert unused.abs().min() > 0  # every coordinate got noise
    assert abs(float(unused.std()) / expected_std - 1) < 0.12  # 200 draws
    assert not step["frozen.weight"].any() and not step["frozen.bias"].any()
    assert step["used.weight"].abs().min() > 0
    # the ledger recorded the noise std actually used
    queries = [r for r in result.ledger.entries if type(r).__name__ == "SumQueryRecord"]
    assert len(queries) == 1 and queries[0].noise_std == pytest.approx(z * clip)
    assert queries[0].sensitivity == pytest.approx(clip)


@pytest.mark.parametrize("kind", ["poisson", "balls_and_bins"])
def test_ledger_accounts_the_sampler_event(kind):
    x, y = _data(120)
    rng = Randomness(5)
    sampler = (
        PoissonSampler(120, 0.1, randomness=rng)
        if kind == "poisson"
        else BallsAndBinsSampler(120, 10, randomness=rng)
    )
    z = 1.3
    method = (  # plain Monte Carlo: seeded and cheap (auto's tilted quadrature costs seconds)
        "rdp" if kind == "poisson"
        else MonteCarloAccountant(samples=2000, method="plain", progress=False)
    )
    result = _trainer(
        _mlp(), sampler, x, y, noise_multiplier=z, epochs=2, accounting=method, delta=1e-3
    ).fit()
    assert result.steps == 20 and result.stopped == "completed"
    event = sampler.privacy_event(z, epochs=2)
    expected = accounting.epsilon(event, 1e-3, method).epsilon
    assert result.privacy.epsilon == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert result.ledger.to_event() == event
    if kind == "poisson":
        assert accounting.epsilon(result.ledger, 1e-5, "pld").epsilon == pytest.approx(
            accounting.epsilon(event, 1e-5, "pld").epsilon, rel=1e-9
        )
    assert [e.epoch for e in result.history.epochs] == [0, 1]
    assert len(result.history.steps) == 20


def test_calibrated_run_meets_target_and_reports_history():
    x, y = _data(120)
    sampler = PoissonSampler(120, 0.1, randomness=Randomness(6))
    trainer = _trainer(
        _mlp(), sampler, x, y, target_epsilon=4.0, accounting="rdp", test_data=(x, y),
        ema_decay=0.9, randomness=Randomness(7),
    )
    seen = []
    trainer.callbacks = (seen.append,)
    result = trainer.fit()
    assert result.stopped == "completed" and result.steps == 20
    assert result.privacy.epsilon <= 4.0 and result.privacy.method == "rdp"
    z_expected = accounting.calibrate.calibrate_noise_multiplier(
        lambda z: sampler.privacy_event(z, epochs=2), 4.0, 1e-5, "rdp"
    )
    assert result.noise_multiplier == pytest.approx(z_expected)
    assert result.model is not result.trained_model  # EMA copy released
    assert all(0.0 <= e.test_accuracy <= 1.0 for e in result.history.epochs)
    assert result.history.epochs[-1].epsilon == pytest.approx(result.privacy.epsilon, rel=1e-6)
    assert [i.kind for i in seen].count("epoch") == 2 and [i.kind for i in seen].count("step") == 20
    meta = result.ledger.metadata
    assert meta["noise_multiplier"] == pytest.approx(result.noise_multiplier)


def test_budget_guard_stops_or_raises_before_passing_the_target():
    x, y = _data(120)
    target = 4.0
    stop = _trainer(
        _mlp(), PoissonSampler(120, 0.1, randomness=Randomness(8)), x, y,
        noise_multiplier=1.0, target_epsilon=target, epochs=5, accounting="rdp",
    )
    with pytest.warns(UserWarning, match="budget guard"):
        result = stop.fit()
    assert result.stopped == "budget" and 0 < result.steps < 50
    assert result.privacy.epsilon <= target
    one_more = accounting.epsilon(
        PoissonSampler(120, 0.1).privacy_event(1.0, steps=result.steps + 1), 1e-5, "rdp"
    ).epsilon
    assert one_more > target  # the refused step would have passed the target

    raising = _trainer(
        _mlp(), PoissonSampler(120, 0.1, randomness=Randomness(8)), x, y,
        noise_multiplier=1.0, target_epsilon=target, epochs=5, accounting="rdp",
        on_budget="raise",
    )
    with pytest.raises(BudgetExceededError, match="target_epsilon=4.0"):
        raising.fit()
    assert accounting.epsilon(raising.ledger, 1e-5, "rdp").epsilon <= target
    assert raising.ledger.iteration == result.steps


def test_budget_guard_counts_what_the_ledger_already_holds():
    ledger = Ledger()
    spec = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.1)
    guard = BudgetGuard(3.0, 1e-5, method="rdp")
    step = PoissonSampler(1000, 0.1).privacy_event(1.0, steps=1)
    guard.check(ledger, step)
    for _ in range(30):
        sid = ledger.record_sample(spec)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    with pytest.raises(BudgetExceededError):
        guard.check(ledger, step)
    allowed = guard.allowed_steps(
        Ledger(), lambda k: PoissonSampler(1000, 0.1).privacy_event(1.0, steps=k), 100
    )
    assert 1 <= allowed < 30
    eps = accounting.epsilon(PoissonSampler(1000, 0.1).privacy_event(1.0, steps=allowed), 1e-5,
                             "rdp").epsilon
    assert eps <= 3.0
    assert guard.epsilon_after(Ledger(), None) == 0.0


def test_bad_arguments_and_models_are_refused():
    x, y = _data(40)
    sampler = PoissonSampler(40, 0.2, randomness=Randomness(0))
    with pytest.raises(ValueError, match="target_epsilon"):
        _trainer(_mlp(), sampler, x, y).fit()
    with pytest.raises(ValueError, match="clip_norm must be in"):
        _trainer(_mlp(), sampler, x, y, noise_multiplier=1.0, clip_norm=-1.0).fit()
    with pytest.raises(ValueError, match="40 examples but inputs has 39"):
        _trainer(_mlp(), sampler, x[:39], y[:39], noise_multiplier=1.0).fit()
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(UnsupportedModuleError, match="GroupNorm"):
        _trainer(bn, sampler, x, y, noise_multiplier=1.0).fit()


def test_secure_mode_trains_and_records():
    x, y = _data(60)
    sampler = PoissonSampler(60, 0.2, randomness=Randomness.secure_mode())
    result = _trainer(
        _mlp(), sampler, x, y, noise_multiplier=1.0, epochs=1,
        randomness=Randomness.secure_mode(),
    ).fit()
    assert result.steps == 5 and result.ledger.iteration == 5
    assert result.ledger.metadata["secure_randomness"] is True
    assert all(math.isfinite(p.sum().item()) for p in result.model.parameters())


def test_default_randomness_is_secure_and_recorded_for_sampler_and_noise():
    """No randomness given: the sampler and the trainer both draw from the secure generator,
    and the ledger names each; an explicit Randomness(seed) stays seeded and says so."""
    from dpfy.randomness import SECURE_DESCRIPTION
    from dpfy.sampling import make_sampler

    x, y = _data(60)
    sampler = make_sampler("poisson", 60, 12)
    trainer = _trainer(_mlp(), sampler, x, y, noise_multiplier=1.0, epochs=1)
    assert sampler.randomness.secure and trainer.randomness.secure
    meta = trainer.fit().ledger.metadata
    assert meta["sampling_randomness"] == meta["noise_randomness"] == SECURE_DESCRIPTION
    assert meta["secure_randomness"] is True
    seeded = _trainer(
        _mlp(), PoissonSampler(60, 0.2, randomness=Randomness(7)), x, y, noise_multiplier=1.0,
        epochs=1, randomness=Randomness(8),
    )
    meta = seeded.fit().ledger.metadata
    assert (meta["sampling_randomness"], meta["noise_randomness"]) == (
        "seeded (seed 7)", "seeded (seed 8)"
    )


def test_query_noise_std_matches_gaussian_sum_query():
    q = GaussianSumQuery(0.5, 2.0)
    assert q.noise_std == pytest.approx(1.0)


def test_guard_merges_repetitions_of_one_mechanism():
    from dpfy import events as ev
    from dpfy.training.budget import _compose

    step = ev.PoissonSampled(0.1, ev.Gaussian(1.0))
    assert _compose(ev.SelfComposed(step, 3), ev.SelfComposed(step, 2)) == ev.SelfComposed(step, 5)
    assert _compose(step, ev.SelfComposed(step, 2)) == ev.SelfComposed(step, 3)
    other = ev.PoissonSampled(0.2, ev.Gaussian(1.0))
    assert _compose(step, other) == ev.Composed((step, other))
    bb = _compose(ev.BallsAndBins(1.0, 10, 1), ev.BallsAndBins(1.0, 10, 2))
    assert bb == ev.BallsAndBins(1.0, 10, 3)
    tp = ev.TruncatedPoisson(0.1, 1.0, 4, 100, 20)
    assert _compose(tp, ev.TruncatedPoisson(0.1, 1.0, 6, 100, 20)).steps == 10

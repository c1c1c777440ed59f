"""Correlated-noise (DP-FTRL / matrix-factorization) training: docs/architecture.md, 5.16.

Oracles: the accountant on the plan's ``MatrixMechanism`` (the ledger must give the same
epsilon), the dense inverse ``C^{-1}`` from NumPy (the noise added over T steps must be
exactly ``C^{-1} Z`` for the fresh draws Z replayed from the same seed, so its covariance is
``sigma^2 C^{-1} C^{-T}``), brute-force sensitivity over patterns, and an uninterrupted run
(a resumed run must end with the same weights).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from dpfy import accounting
from dpfy.correlated import BandMF, Cyclic, SingleEpoch, make_plan
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.correlated.schemas import sensitivity
from dpfy.correlated.tree import TreeAggregation
from dpfy.correlated.tree_efficient import efficient_decoder_matrix
from dpfy.ledger import Ledger
from dpfy.ledger.records import MatrixRunRecord, MatrixStepRecord, SampleRecord
from dpfy.queries.correlated import CorrelatedNoiseQuery
from dpfy.randomness import Randomness
from dpfy.sampling import CyclicSampler, SampleSpec, make_sampler
from dpfy.training import PrivateTrainer, TrainerOptions

STRATEGIES = ("bandmf", "blt", "tree", "tree-efficient")
N, B, EPOCHS = 48, 12, 3  # 4 steps per epoch, 12 steps


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g)
    return x, (x[:, 0] > 0).long()


def _trainer(
    plan: CorrelatedPlan | None, sampler_kind: str = "cyclic", **kw: object
) -> PrivateTrainer:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = _data()
    args: dict[str, object] = dict(
        clip_norm=1.0, epochs=EPOCHS, delta=1e-5, target_epsilon=6.0, accounting="gaussian",
        randomness=Randomness(7), correlated=plan,
    )
    args.update(kw)
    return PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
        nn.CrossEntropyLoss(reduction="none"), x, y,
        make_sampler(sampler_kind, N, B, randomness=Randomness(5)),
        TrainerOptions(**args),  # type: ignore[arg-type]
    )


@functools.cache
def _plan(strategy: str, steps: int = 12, period: int = 4) -> CorrelatedPlan:
    return make_plan(strategy, steps, Cyclic(period), band=3, buffers=2, maxiter=50)


# -- the plan's sensitivity and noise map against independent oracles ----------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("schema", [SingleEpoch(), Cyclic(4), Cyclic(5)])
def test_plan_sensitivity_and_inverse_match_dense_oracles(strategy: str, schema: object) -> None:
    plan = make_plan(strategy, 13, schema, band=3, buffers=2, maxiter=50)  # type: ignore[arg-type]
    c = plan.strategy_matrix()
    assert np.all(c >= 0)
    assert plan.sensitivity == pytest.approx(sensitivity(c, schema), rel=1e-12)  # type: ignore[arg-type]
    if strategy == "tree-efficient":  # the full tree (nodes x T); G is a left inverse
        assert c.shape == (13 + 6 + 3 + 1, 13)
        np.testing.assert_allclose(plan.noise_map() @ c, np.eye(13), atol=1e-12)
    else:
        assert np.allclose(np.tril(c), c)
        np.testing.assert_allclose(plan.noise_map(), np.linalg.inv(c), atol=1e-12)
    # the closed-form tree sensitivity of one epoch (Kairouz et al. 2021)
    if strategy.startswith("tree") and isinstance(schema, SingleEpoch):
        assert plan.sensitivity == pytest.approx(np.sqrt(np.floor(np.log2(13)) + 1))


# -- 1. the ledger's epsilon is the accountant's on the MatrixMechanism ---------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_ledger_epsilon_equals_matrix_mechanism(strategy: str, tmp_path) -> None:
    plan = _plan(strategy)
    trainer = _trainer(plan, ledger=Ledger(tmp_path / "ledger.jsonl", fsync=False))
    result = trainer.fit()
    assert result.steps == 12 and result.stopped == "completed"
    z = result.noise_multiplier
    event = plan.event(z)
    assert trainer.ledger.to_event() == event
    want = accounting.epsilon(event, 1e-5, method="gaussian").epsilon
    assert result.privacy.epsilon == pytest.approx(want, rel=1e-12)
    assert want <= 6.0 and want == pytest.approx(6.0, rel=1e-3)  # calibrated to the target
    trainer.ledger.close()
    loaded = Ledger.load(tmp_path / "ledger.jsonl")
    assert loaded.to_event() == event  # the records round-trip JSON and re-resolve
    assert accounting.epsilon(loaded, 1e-5, method="auto").epsilon == pytest.approx(want)


def test_dpsgd_under_the_cyclic_sampler_is_the_no_amplification_bound() -> None:
    trainer = _trainer(None)
    result = trainer.fit()
    mu = np.sqrt(EPOCHS) / result.noise_multiplier  # one Gaussian per example per epoch
    from dpfy.accounting.gaussian import gaussian_epsilon

    assert result.privacy.epsilon == pytest.approx(float(gaussian_epsilon(mu, 1e-5)), rel=1e-9)


# -- 2. the noise over T steps is exactly C^{-1} Z ------------------------------------------
def _noise_run(
    plan: CorrelatedPlan, size: int, sigma: float, seed: int, flat: bool = False
) -> np.ndarray:
    """The noise the query adds to a zero sum at each of the plan's steps (T x size); with
    ``flat`` the sum and the output are views of one buffer each (the trainer's fused path)."""
    query = CorrelatedNoiseQuery(plan, clip_norm=1.0, noise_multiplier=sigma)
    period = plan.schema.period if isinstance(plan.schema, Cyclic) else plan.steps
    spec = CyclicSampler(period * 2, 2).sample_spec()
    ledger, rng, noises = Ledger(), Randomness(seed), []
    for t in range(plan.steps):
        sid = ledger.record_sample(spec, epoch=t // period, step=t)
        if flat:
            src, dst = torch.zeros(size), torch.empty(size)
            zero = {"w": src[: size - 5], "b": src[size - 5 :]}
            out = query.add_noise(zero, ledger=ledger, sample_id=sid, randomness=rng,
                                  out={"w": dst[: size - 5], "b": dst[size - 5 :]}, scale=0.5)
            out = {k: v / 0.5 for k, v in out.items()}
        else:
            zero = {"w": torch.zeros(size - 5), "b": torch.zeros(5)}
            out = query.add_noise(zero, ledger=ledger, sample_id=sid, randomness=rng)
        noises.append(torch.cat([out["w"], out["b"]]).double().numpy())
    return np.stack(noises)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_noise_sequence_is_the_linear_map_of_the_fresh_draws(
    strategy: str, flat: bool, monkeypatch
) -> None:
    monkeypatch.setattr("dpfy.correlated.blt._CHUNK", 1500)  # BLT: several chunks
    steps, period, size, sigma = 12, 4, 4000, 0.7
    plan = _plan(strategy, steps, period)
    w = _noise_run(plan, size, sigma, seed=11, flat=flat)
    # the same stream: one fresh N(0, sigma^2) per step, or, for the efficient tree, one per
    # node ending at n = t + 1 (level 0 first), placed in the full tree's node order
    nodes = [(0, t) for t in range(steps)]
    if strategy == "tree-efficient":
        nodes = TreeAggregation(steps).nodes
    replay, z = Randomness(11), np.zeros((len(nodes), size))
    for n in range(1, steps + 1):
        for level in range((n & -n).bit_length() if strategy == "tree-efficient" else 1):
            buf = torch.empty(size)
            replay.normal_([buf], [sigma])
            z[nodes.index((level, (n >> level) - 1))] = buf.double().numpy()
    c = plan.strategy_matrix()
    c_inv = np.linalg.pinv(c)  # the oracle: NumPy's (pseudo-)inverse
    if strategy == "tree-efficient":  # the least-squares decoder, not pinv(C) (that would use
        c_inv = np.diff(efficient_decoder_matrix(steps), axis=0, prepend=0.0)  # future nodes)
        np.testing.assert_allclose(c_inv @ c, np.eye(steps), atol=1e-12)
    np.testing.assert_allclose(w, c_inv @ z, rtol=0, atol=1e-5)
    # hence Cov(w) = sigma^2 C^{-1} C^{-T} exactly; the coordinates are i.i.d. samples of it
    cov = sigma**2 * c_inv @ c_inv.T
    if strategy == "bandmf":  # and the strategy module's own covariance agrees
        own = BandMF(np.asarray(plan.params["coeffs"])).noise_covariance(steps)
        np.testing.assert_allclose(sigma**2 * own, cov, atol=1e-12)
    emp = w @ w.T / size
    # each entry of the empirical covariance has std <= sqrt(2 / size) max_i cov_ii
    assert np.abs(emp - cov).max() < 6 * np.sqrt(2.0 / size) * np.diag(cov).max()


def test_noise_stream_memory_is_the_band_or_buffers() -> None:
    size = 1000
    for strategy, rows in (("bandmf", 2), ("blt", 2), ("tree", 4), ("tree-efficient", 4)):
        query = CorrelatedNoiseQuery(_plan(strategy), 1.0, 1.0)
        ledger = Ledger()
        sid = ledger.record_sample(CyclicSampler(8, 2).sample_spec())
        query.add_noise({"w": torch.zeros(size)}, ledger=ledger, sample_id=sid,
                        randomness=Randomness(0))
        assert query._stream is not None and tuple(query._stream.buf.shape) == (rows, size)


# -- 3. a sampler that does not implement the schema is refused -----------------------------
@pytest.mark.parametrize("kind", ["poisson", "shuffle", "balls_and_bins", "fixed_size"])
def test_mismatched_sampler_is_refused_before_the_first_step(kind: str) -> None:
    trainer = _trainer(_plan("bandmf"), sampler_kind=kind)
    with pytest.raises(ValueError, match="cyclic"):
        trainer.fit()
    assert len(trainer.ledger) == 0 and trainer.global_step_ == 0


def test_plan_shorter_than_the_run_is_refused() -> None:
    trainer = _trainer(_plan("blt", steps=8))
    with pytest.raises(ValueError, match="plan's steps=8"):
        trainer.fit()
    assert len(trainer.ledger) == 0


def _ledger(spec: SampleSpec, run: MatrixRunRecord, steps: list[tuple[int, float]]) -> Ledger:
    records: list[object] = [run]
    for i, (epoch, std) in enumerate(steps):
        records.append(SampleRecord(i, spec, epoch, i))
        records.append(MatrixStepRecord(i, run.name, i, 1.0, std))
    return Ledger.from_records(records)  # type: ignore[arg-type]


def test_ledger_resolution_refuses_steps_that_break_the_schema() -> None:
    plan = _plan("bandmf", steps=8, period=4)
    run = MatrixRunRecord("gradient", plan, 1.0, 2.0, plan.sensitivity)
    cyclic = CyclicSampler(8, 2).sample_spec()
    ok = _ledger(cyclic, run, [(t // 4, 2.0) for t in range(8)])
    assert ok.to_event() == plan.event(2.0)
    poisson = SampleSpec("poisson", dataset_size=8, sampling_rate=0.25)
    bad = {
        "cyclic": _ledger(poisson, run, [(0, 2.0)] * 3),  # a Poisson sampler with BandMF
        "epoch": _ledger(cyclic, run, [(0, 2.0)] * 5),  # step 4 must be in epoch 1
        "noise_std": _ledger(cyclic, run, [(0, 2.0), (0, 1.5)]),  # less noise than recorded
        "covers steps": _ledger(cyclic, run, [(t // 4, 2.0) for t in range(9)]),
        "below the exact": _ledger(
            cyclic, MatrixRunRecord("gradient", plan, 1.0, 2.0, 0.9 * plan.sensitivity), []
        ),
        "steps_per_epoch": _ledger(CyclicSampler(10, 2).sample_spec(), run, [(0, 2.0)]),
    }
    for message, ledger in bad.items():
        with pytest.raises(ValueError, match=message):
            ledger.to_event()
    with pytest.raises(ValueError, match="before its matrix run"):
        Ledger.from_records([SampleRecord(0, cyclic), MatrixStepRecord(0, "g", 0, 1.0, 2.0)])


# -- 4. resume continues the noise stream exactly -------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_from_checkpoint_continues_the_noise_stream(strategy: str, tmp_path) -> None:
    plan = _plan(strategy)
    straight = _trainer(plan)
    straight.fit()
    path = tmp_path / "ckpt.pt"
    first = _trainer(plan, checkpoint_path=path)
    assert first.fit(max_steps=6).stopped == "max_steps"  # mid-epoch: step 6 of 12
    second = _trainer(plan, checkpoint_path=path).resume(path)
    result = second.fit()
    assert result.steps == 12
    for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert second.ledger.to_event() == plan.event(result.noise_multiplier)


def test_cyclic_sampler_repeats_one_permutation_and_resumes_it_with_secure_randomness() -> None:
    s = CyclicSampler(20, 5, randomness=Randomness.secure_mode())
    e0 = [b.tolist() for b in s.batches(0)]
    assert sorted(sum(e0, [])) == list(range(20))
    it = s.batches(1)
    assert next(it).tolist() == e0[0]
    state = s.state_dict()
    again = CyclicSampler(20, 5, randomness=Randomness.secure_mode())
    again.load_state_dict(state)
    assert [b.tolist() for b in again.batches(1)] == e0[1:]
    assert [b.tolist() for b in again.batches(2)] == e0


def test_a_noise_state_that_does_not_fit_is_refused_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stream's state (BandMF: band - 1 vectors of the parameters' size, plus z and w)
    is checked against the free memory before the first step, with the figure."""
    from dpfy.queries import correlated as corr

    plan = _plan("bandmf")  # band 3: (2 + 2) x 34 parameters x 4 bytes = 544 bytes
    assert corr.stream_bytes(plan, 34) == 544
    assert corr.stream_bytes(_plan("tree"), 34) == (12 .bit_length() + 2) * 34 * 4
    corr.check_stream_memory(plan, 34, 544)
    with pytest.raises(ValueError, match=r"bandmf noise state needs .*band must be at most 2"):
        corr.check_stream_memory(plan, 34, 543)
    monkeypatch.setattr(corr, "available_memory", lambda device: 500)
    ledger = Ledger()
    trainer = _trainer(plan, ledger=ledger)
    with pytest.raises(ValueError, match=r"noise state needs 0\.0 MiB"):
        trainer.fit()
    assert not ledger.entries and not ledger.samples

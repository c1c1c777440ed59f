"""Self-tests of the distributed, federated and correlated-noise releases (dpfy.audit.selftests).

Each self-test must pass on dpfy's own code and FAIL on a deliberately broken variant that
exists only here: noise at half or sqrt(2) times the recorded std, noise skipped, noise added
on every rank, two releases per round, independent noise recorded as BandMF, and the noise of
the wrong band. The thresholds are Bonferroni-corrected at alpha = 1e-6, so a pass on the real
code is not luck, and every broken variant lands many thresholds away. Here, on top, every
self-test's noise is reproducible: secure streams are keyed from a seeded stream in this process
(the ``fixed_os_key`` fixture, autouse below) and with a fixed key per rank in spawned ranks
(:func:`keyed`), and the broken variants built on seeded streams have fixed seeds, so no
assertion here, passing or failing variant, can fail by chance.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import dpfy.randomness as R
from dpfy import runs
from dpfy.audit.run import audit_run
from dpfy.audit.selftests import (
    SelfTest,
    correlated_selftest,
    distributed_selftest,
    dpsgd_selftest,
    federated_selftest,
    sharded_selftest,
)
from dpfy.correlated import Cyclic, SingleEpoch, TreeAggregation, make_plan
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.queries import correlated as correlated_module
from dpfy.queries.correlated import CorrelatedNoiseQuery
from dpfy.randomness import Randomness
from dpfy.sampling import CyclicSampler
from dpfy.training.distributed import Distributed

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_keys(fixed_os_key: None) -> None:
    """Every test here: secure streams in this process (rank 0 of the spawned runs included)
    keyed from a seeded stream, so the self-tests' statistics are the same in every run."""


def keyed(rng: Randomness, rank: int) -> Randomness:
    """``rng`` (secure) keyed now with a fixed per-rank key instead of one from the OS: for the
    ranks the self-tests spawn, out of the fixture's reach (the ranks' streams still differ)."""
    key = bytes([rank + 1]) * 32
    with mock.patch.object(R.os, "urandom", lambda n: key[:n]):
        rng.uniform(1)  # the keystream reads its key at its first draw
    return rng


def keyed_secure() -> Randomness:
    """``make_randomness`` of :func:`distributed_selftest`: the default secure stream, keyed."""
    return keyed(Randomness(secure=True), torch.distributed.get_rank())


def keyed_secure_rank(rank: int) -> Randomness:
    """``make_randomness`` of :func:`sharded_selftest`: the default secure stream, keyed."""
    return keyed(Randomness(secure=True), rank)


class ScaledNoise(Randomness):
    """Broken randomness: every noise std multiplied by ``factor`` (seeded draws, seed 1)."""

    def __init__(self, factor: float) -> None:
        super().__init__(seed=1)
        self.factor = factor

    def normal_(
        self, tensors: Sequence[Any], stds: Sequence[float], *, add: Sequence[Any] | None = None
    ) -> None:
        super().normal_(tensors, [s * self.factor for s in stds], add=add)


class ReusedNoise(Randomness):
    """Broken secure randomness: every second call repeats the previous call's noise (the std
    is right; only the step-to-step independence test can see it)."""

    def __init__(self) -> None:
        super().__init__(secure=True)
        self.calls = 0
        self.last: list[torch.Tensor] | None = None

    def normal_(
        self, tensors: Sequence[Any], stds: Sequence[float], *, add: Sequence[Any] | None = None
    ) -> None:
        super().normal_(tensors, stds)  # the noise alone, drawn as usual
        last = self.last
        if self.calls % 2 == 1 and last is not None and [t.shape for t in last] == [
            t.shape for t in tensors
        ]:
            for t, old in zip(tensors, last, strict=True):
                t.copy_(old)
        self.last = [t.detach().clone() for t in tensors]
        self.calls += 1
        for t, a in zip(tensors, add or [None] * len(tensors), strict=True):
            if a is not None:
                t.add_(a)


def reused_noise(rank: int) -> Randomness:
    return keyed(ReusedNoise(), rank)


def _failed(result: SelfTest, what: str) -> None:
    assert not result.passed, result
    assert any(what in f for f in result.findings), result.findings


def _ratio(result: SelfTest) -> float:
    """The measured / recorded std a finding states."""
    found = [re.search(r"std ([0-9.]+(?:e[-+]?[0-9]+)?) x", f) for f in result.findings]
    return float(next(m for m in found if m is not None).group(1))


def _passed(result: SelfTest) -> None:
    assert result.passed and result.findings == (), result
    assert 0.0 <= result.statistic <= result.threshold and 4.0 < result.threshold < 7.0


# -- correlated noise --------------------------------------------------------------------------
def _plan(strategy: str, band: int = 4, schema: Any = None) -> CorrelatedPlan:
    return make_plan(strategy, 12, schema or Cyclic(4), band=band, buffers=2, maxiter=50)


# statistical: fixed OS key (fixed_os_key): deterministic
@pytest.mark.parametrize("strategy", ["bandmf", "blt", "tree", "tree-efficient"])
def test_correlated_passes_on_every_strategy(strategy: str) -> None:
    _passed(correlated_selftest(_plan(strategy)))


# statistical: fixed OS key (fixed_os_key): deterministic
def test_correlated_passes_for_one_epoch() -> None:
    _passed(correlated_selftest(make_plan("bandmf", 10, SingleEpoch(), band=4, maxiter=50)))


def _stream_of(plan: CorrelatedPlan, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken query: the noise stream follows ``plan`` whatever the ledger records."""
    real = correlated_module.open_stream
    monkeypatch.setattr(correlated_module, "open_stream",
                        lambda _plan, size, like: real(plan, size, like))


# statistical: fixed OS key (fixed_os_key): deterministic
def test_correlated_flags_independent_noise_recorded_as_bandmf(monkeypatch) -> None:
    recorded = _plan("bandmf")
    assert recorded.params["coeffs"][1] > 0.1  # a real band: C is not the identity
    _stream_of(CorrelatedPlan("bandmf", {"coeffs": (1.0,)}, 12, Cyclic(4)), monkeypatch)
    _failed(correlated_selftest(recorded), "whiteness")


# statistical: fixed OS key (fixed_os_key): deterministic
@pytest.mark.parametrize("strategy", ["bandmf", "tree", "tree-efficient"])
def test_correlated_tests_a_prefix_of_a_long_plan(strategy: str, monkeypatch) -> None:
    long = make_plan(strategy, 100, SingleEpoch(), band=4, maxiter=20)
    short = dataclasses.replace(long, steps=16)
    # the prefix's C is the leading block of the long plan's C (the full tree: its nodes
    # ending by step 16, the same noise map on them)
    if strategy == "tree-efficient":
        keep = [i for i, (lv, j) in enumerate(TreeAggregation(100).nodes) if (j + 1) << lv <= 16]
        np.testing.assert_array_equal(short.strategy_matrix(),
                                      long.strategy_matrix()[keep, :16])
        np.testing.assert_allclose(short.noise_map(), long.noise_map()[:16, keep], atol=1e-12)
    else:
        np.testing.assert_array_equal(short.strategy_matrix(), long.strategy_matrix()[:16, :16])
    _passed(correlated_selftest(long, max_steps=16))
    _stream_of(make_plan(strategy, 100, SingleEpoch(), band=2, maxiter=20)
               if strategy == "bandmf" else CorrelatedPlan("bandmf", {"coeffs": (1.0,)}, 100,
                                                           SingleEpoch()), monkeypatch)
    assert not correlated_selftest(long, max_steps=16).passed


# statistical: fixed OS key (fixed_os_key): deterministic
def test_correlated_flags_the_noise_of_the_wrong_band(monkeypatch) -> None:
    _stream_of(_plan("bandmf", band=2), monkeypatch)
    _failed(correlated_selftest(_plan("bandmf", band=4)), "whiteness")


# statistical: fixed OS key (fixed_os_key): deterministic
def test_correlated_flags_tree_noise_recorded_as_blt(monkeypatch) -> None:
    _stream_of(_plan("tree"), monkeypatch)
    assert not correlated_selftest(_plan("blt")).passed


# statistical: fixed OS key (fixed_os_key): deterministic
@pytest.mark.parametrize(("real", "recorded"), [("tree", "tree-efficient"),
                                                ("tree-efficient", "tree")])
def test_correlated_flags_one_tree_recorded_as_the_other(
    real: str, recorded: str, monkeypatch
) -> None:
    # plain-tree noise claimed as the efficient estimator (or the reverse): same C, same
    # sensitivity, another noise covariance
    _stream_of(CorrelatedPlan(real, {}, 32, SingleEpoch()), monkeypatch)
    assert not correlated_selftest(CorrelatedPlan(recorded, {}, 32, SingleEpoch())).passed


# statistical: fixed seed 1 (ScaledNoise): deterministic
@pytest.mark.parametrize("factor", [0.5, math.sqrt(2.0), 0.0])
def test_correlated_flags_the_wrong_std(factor: float) -> None:
    result = correlated_selftest(_plan("blt"), randomness=ScaledNoise(factor))
    _failed(result, "std")
    assert result.statistic > 5 * result.threshold
    assert _ratio(result) == pytest.approx(factor, abs=0.15)


def test_correlated_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="plan must be"):
        correlated_selftest("bandmf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_steps"):
        correlated_selftest(_plan("tree"), max_steps=1)
    with pytest.raises(ValueError, match="alpha"):
        correlated_selftest(_plan("tree"), alpha=0.0)


# -- federated ---------------------------------------------------------------------------------
# statistical: fixed OS key (fixed_os_key): deterministic
def test_federated_passes() -> None:
    _passed(federated_selftest())


# statistical: fixed seed 1 (ScaledNoise): deterministic
@pytest.mark.parametrize("factor", [0.5, math.sqrt(2.0), 0.0])
def test_federated_flags_the_wrong_std(factor: float) -> None:
    result = federated_selftest(randomness=ScaledNoise(factor))
    _failed(result, "std")
    assert _ratio(result) == pytest.approx(factor, abs=0.15)


# statistical: fixed OS key (fixed_os_key): deterministic
def test_federated_flags_noise_added_twice_per_round(monkeypatch) -> None:
    real = GaussianSumQuery.add_noise

    def twice(self, clipped_sum, **kw):  # type: ignore[no-untyped-def]
        return real(self, real(self, clipped_sum, **kw), **kw)

    monkeypatch.setattr(GaussianSumQuery, "add_noise", twice)
    result = federated_selftest()
    _failed(result, "2 release records, expected 1")
    assert result.statistic <= result.threshold  # the noise is what the two records declare


# statistical: fixed OS key (fixed_os_key): deterministic
def test_federated_flags_noise_used_in_two_rounds() -> None:
    result = federated_selftest(randomness=ReusedNoise())
    _failed(result, "independence: the noise of rounds")
    assert not any("std" in f.split("(")[0] for f in result.findings), result.findings


# -- one process's DP-SGD steps ----------------------------------------------------------------
# statistical: fixed OS key (fixed_os_key): deterministic
def test_dpsgd_passes() -> None:
    _passed(dpsgd_selftest())


# statistical: fixed seed 1 (ScaledNoise): deterministic
@pytest.mark.parametrize("factor", [0.5, math.sqrt(2.0)])
def test_dpsgd_flags_the_wrong_std(factor: float) -> None:
    result = dpsgd_selftest(randomness=ScaledNoise(factor))
    _failed(result, "noise: the released gradient minus the clipped sum")
    assert _ratio(result) == pytest.approx(factor, abs=0.05)


# statistical: fixed OS key (fixed_os_key): deterministic
def test_dpsgd_flags_noise_used_on_two_steps() -> None:
    result = dpsgd_selftest(randomness=ReusedNoise())
    _failed(result, "independence: the noise of steps")
    assert not any(f.startswith("noise:") for f in result.findings), result.findings


def test_federated_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="clients_per_round"):
        federated_selftest(num_clients=4, clients_per_round=5)


# -- distributed (2 gloo processes; the broken variants must be picklable) ---------------------
class EveryRankAddsNoise:
    """Broken reducer: each rank noises its own clipped sum and the noisy sums are added."""

    def __init__(self, d: Distributed) -> None:
        self.d = d
        self.rank = d.rank

    @property
    def releases(self) -> bool:
        return True

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        pass

    def share_(self, tensors: list[torch.Tensor]) -> None:
        self.d.sum_(tensors)

    def sum_numbers(self, values: list[float]) -> list[float]:
        return self.d.sum_numbers(values)


def skipped_noise() -> Randomness:
    return ScaledNoise(0.0)


# statistical: a fixed key per rank (keyed_secure), or seed 1: deterministic
@pytest.mark.slow
def test_distributed_passes_and_flags_broken_variants() -> None:
    _passed(distributed_selftest(make_randomness=keyed_secure))
    result = distributed_selftest(make_reducer=EveryRankAddsNoise, make_randomness=keyed_secure)
    _failed(result, "noise:")
    assert _ratio(result) == pytest.approx(math.sqrt(2.0), abs=0.1)  # noise added twice
    result = distributed_selftest(make_randomness=skipped_noise)
    _failed(result, "noise:")
    assert _ratio(result) < 1e-6  # noise skipped (float32 rounding of the clipped sum)


class SecureScaled(Randomness):
    """Broken secure randomness: every noise std multiplied by ``factor`` (secure streams are
    used as given on every rank, so the break reaches the rank that builds it)."""

    def __init__(self, factor: float) -> None:
        super().__init__(secure=True)
        self.factor = factor

    def normal_(
        self, tensors: Sequence[Any], stds: Sequence[float], *, add: Sequence[Any] | None = None
    ) -> None:
        super().normal_(tensors, [s * self.factor for s in stds], add=add)


def every_shard_doubled(rank: int) -> Randomness:
    return keyed(SecureScaled(math.sqrt(2.0)), rank)


def rank1_skips(rank: int) -> Randomness:
    return keyed(SecureScaled(0.0 if rank == 1 else 1.0), rank)


class SameStreamEverywhere(Randomness):
    """Broken: every rank draws its noise from one seeded stream (seed 11), so two ranks'
    shards get the same noise; flagged secure, so the sharded release keeps it as given."""

    def __init__(self) -> None:
        super().__init__(secure=True)
        self.inner = Randomness(11)

    def normal_(
        self, tensors: Sequence[Any], stds: Sequence[float], *, add: Sequence[Any] | None = None
    ) -> None:
        self.inner.normal_(tensors, stds, add=add)


def same_stream(rank: int) -> Randomness:
    return SameStreamEverywhere()


# statistical: a fixed key per rank (keyed_secure_rank): deterministic
@pytest.mark.slow
def test_sharded_passes() -> None:
    _passed(sharded_selftest(make_randomness=keyed_secure_rank))


# one case per test: each spawns two processes, so the test workers share them out
# statistical: a fixed key per rank (keyed), or seed 11 (same_stream): deterministic
@pytest.mark.parametrize("variant", ["doubled", "rank1_skips", "same_stream", "reused"])
def test_sharded_flags_broken_variants(variant: str) -> None:
    if variant == "doubled":
        result = sharded_selftest(make_randomness=every_shard_doubled)
        _failed(result, "noise: rank 0")
        _failed(result, "noise: rank 1")
        assert _ratio(result) == pytest.approx(math.sqrt(2.0), abs=0.1)  # noise x sqrt(2)
    elif variant == "rank1_skips":
        result = sharded_selftest(make_randomness=rank1_skips)
        _failed(result, "noise: rank 1's shard")
        assert not any("rank 0's" in f for f in result.findings), result.findings
        assert _ratio(result) < 1e-6  # skipped on rank 1 (float32 rounding of the clipped sum)
    elif variant == "same_stream":
        result = sharded_selftest(make_randomness=same_stream)
        _failed(result, "ranks 0 and 1 drew correlated noise")
        assert not any("shard of the released" in f for f in result.findings)  # std still right
    else:
        result = sharded_selftest(make_randomness=reused_noise)
        _failed(result, "rank 0: independence: the noise of steps")
        _failed(result, "rank 1: independence: the noise of steps")
        assert not any("shard of the released" in f for f in result.findings)  # std still right


def test_sharded_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        sharded_selftest(1)
    with pytest.raises(ValueError, match="out must be"):
        sharded_selftest(4, out=3)


def test_distributed_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        distributed_selftest(1)
    with pytest.raises(ValueError, match="rows"):
        distributed_selftest(4, rows=3)


# -- dpfy audit RUN_DIR runs the self-tests of the paths a run used ---------------------------
def _correlated_fed_run(tmp_path: Path) -> Path:
    """A tiny run directory whose ledger has a BandMF run and DP-FedAvg metadata."""
    run = tmp_path / "run"
    run.mkdir()
    plan = _plan("bandmf")
    ledger = Ledger(run / "ledger.jsonl")
    ledger.record_metadata(clip_norm=1.0, noise_multiplier=2.0, trainer="dpfy.fed.DPFedAvg")
    query, spec, rng = CorrelatedNoiseQuery(plan, 1.0, 2.0), CyclicSampler(8, 2).sample_spec(), \
        Randomness(0)
    for t in range(plan.steps):
        sid = ledger.record_sample(spec, epoch=t // 4, step=t)
        query.add_noise({"w": torch.zeros(3)}, ledger=ledger, sample_id=sid, randomness=rng)
    ledger.record_metadata(delta=1e-5)
    ledger.close()
    runs.report_ledger(run / "ledger.jsonl", out=run, figures=False)
    return run


# statistical: fixed OS key (fixed_os_key): deterministic
def test_audit_run_runs_the_self_tests_of_the_run(tmp_path: Path, monkeypatch) -> None:
    run = _correlated_fed_run(tmp_path)
    section = audit_run(run, method="one-run", trials=1000)
    assert section["self_tests_run"] == [
        "replay", "sampler", "ledger counts", "recorded epsilon", "keys", "federated",
        "correlated (bandmf)"
    ]
    assert section["self_tests"] == [] and section["verdict"] == "no violation found"
    assert "Self-tests run" in (run / "report.md").read_text()
    _stream_of(CorrelatedPlan("bandmf", {"coeffs": (1.0,)}, 12, Cyclic(4)), monkeypatch)
    section = audit_run(run, method="one-run", trials=1000)
    assert section["verdict"].startswith("VIOLATION")
    assert any(f.startswith("correlated (bandmf): whiteness") for f in section["self_tests"])

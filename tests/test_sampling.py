"""Samplers: batch distributions (chi-square with stated false-failure rates), shapes, truncation,
padding, checkpoint/resume, events and ledger specs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfy import events as ev
from dpfy.accounting.truncation import (
    event_truncation_probability,
    truncated_delta,
    truncated_epsilon,
    truncation_delta,
)
from dpfy.randomness import Randomness
from dpfy.sampling import (
    BallsAndBinsSampler,
    DeterministicSampler,
    FixedSizeSampler,
    PoissonSampler,
    Sampler,
    SampleSpec,
    ShuffleSampler,
    make_sampler,
)
from dpfy.sampling.balls_and_bins import balls_and_bins_sizes
from dpfy.sampling.base import pad_batch

# Each chi-square test below fails with probability <= this under a correct sampler (seeds are
# fixed, so the suite is deterministic; the rate says how unlucky a seed would have to be).
FALSE_FAILURE = 1e-6


def _chi_square_binomial_pvalue(sizes: np.ndarray, n: int, p: float) -> float:
    """Goodness of fit of integer samples to Binomial(n, p), bins with expected count >= 5."""
    sizes = np.asarray(sizes)
    k = np.arange(n + 1)
    expected = stats.binom.pmf(k, n, p) * len(sizes)
    observed = np.bincount(sizes, minlength=n + 1).astype(float)
    # merge tails into bins with expected count >= 5
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        acc_o += o
        acc_e += e
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    bins_o[-1] += acc_o
    bins_e[-1] += acc_e
    return float(stats.chisquare(bins_o, np.asarray(bins_e) * sum(bins_o) / sum(bins_e)).pvalue)


# statistical: fixed seed 11 (deterministic)
def test_poisson_batch_sizes_are_binomial():
    n, q = 300, 0.05
    s = PoissonSampler(n, q, steps_per_epoch=1000, randomness=Randomness(11))
    sizes = np.array([len(b) for e in range(3) for b in s.batches(e)])
    assert len(sizes) == 3000
    assert _chi_square_binomial_pvalue(sizes, n, q) > FALSE_FAILURE
    # inclusion is uniform over indices (each index ~ Binomial(steps, q))
    counts = np.zeros(n)
    for b in s.batches(3):
        counts[b] += 1
    assert _chi_square_binomial_pvalue(counts.astype(int), 1000, q) > FALSE_FAILURE


# statistical: fixed seed 3 (deterministic)
def test_balls_and_bins_every_index_once_and_binomial_marginals():
    n, t = 120, 6
    s = BallsAndBinsSampler(n, t, randomness=Randomness(3))
    first, last = [], []
    for epoch in range(1500):
        batches = list(s.batches(epoch))
        assert len(batches) == t
        everything = np.concatenate(batches)
        np.testing.assert_array_equal(np.sort(everything), np.arange(n))
        first.append(len(batches[0]))
        last.append(len(batches[-1]))
    # Bonferroni over the two positions tested: each at FALSE_FAILURE / 2.
    assert _chi_square_binomial_pvalue(np.array(first), n, 1 / t) > FALSE_FAILURE / 2
    assert _chi_square_binomial_pvalue(np.array(last), n, 1 / t) > FALSE_FAILURE / 2


def test_balls_and_bins_sizes_sum_to_n_and_handle_empty_remainder():
    r = Randomness(0)
    for n, t in [(1, 5), (7, 7), (1000, 3), (5, 1)]:
        sizes = balls_and_bins_sizes(n, t, r)
        assert sizes.sum() == n and len(sizes) == t and (sizes >= 0).all()


@pytest.mark.parametrize("cls", [ShuffleSampler, DeterministicSampler])
def test_shuffle_and_deterministic_shapes(cls):
    s = cls(103, 10, randomness=Randomness(1))
    assert s.steps_per_epoch == 10
    batches = list(s.batches(0))
    assert [len(b) for b in batches] == [10] * 10
    flat = np.concatenate(batches)
    assert len(np.unique(flat)) == 100  # disjoint; 3 examples dropped
    s2 = cls(103, 10, drop_last=False, randomness=Randomness(1))
    sizes = [len(b) for b in s2.batches(0)]
    assert sizes == [10] * 10 + [3]
    np.testing.assert_array_equal(np.sort(np.concatenate(list(s2.batches(1)))), np.arange(103))


def test_deterministic_order_and_shuffle_permutes():
    det = list(DeterministicSampler(20, 5).batches(0))
    np.testing.assert_array_equal(det[1], np.arange(5, 10))
    shuffle = ShuffleSampler(20, 5, randomness=Randomness(0))
    sh = [list(shuffle.batches(e)) for e in range(2)]
    assert not all(np.array_equal(a, b) for a, b in zip(sh[0], sh[1], strict=True))


def test_fixed_size_batches_are_distinct_indices():
    s = FixedSizeSampler(50, 8, randomness=Randomness(2))
    for b in s.batches(0):
        assert len(b) == 8 and len(np.unique(b)) == 8 and b.max() < 50


def test_truncation_keeps_a_subset_and_counts():
    n, t, cap = 200, 4, 48  # expected batch 50, so most batches are truncated
    full = BallsAndBinsSampler(n, t, randomness=Randomness(9))
    cut = BallsAndBinsSampler(n, t, max_batch_size=cap, randomness=Randomness(9))
    # the epoch layout is drawn first, so epoch 0 has the same untruncated batches
    truncated = 0
    for a, b in zip(full.batches(0), cut.batches(0), strict=True):
        assert len(b) == min(len(a), cap)
        assert set(b.tolist()) <= set(a.tolist())
        truncated += len(a) > cap
    assert cut.truncated_steps == truncated > 0
    p = PoissonSampler(n, 0.25, max_batch_size=cap, randomness=Randomness(4))
    assert all(len(b) <= cap for b in p.batches(0))
    assert p.truncated_steps > 0


def test_pad_batch_marks_padding_with_zero_weight():
    idx, w = pad_batch(np.array([4, 2, 9]), 5)
    np.testing.assert_array_equal(idx[:3], [4, 2, 9])
    np.testing.assert_array_equal(w, [1, 1, 1, 0, 0])
    assert idx.dtype == np.int64 and w.dtype == np.float32
    with pytest.raises(ValueError, match="size must be"):
        pad_batch(np.arange(6), 5)


@pytest.mark.parametrize(
    "make",
    [
        lambda r: BallsAndBinsSampler(100, 10, max_batch_size=12, randomness=r),
        lambda r: PoissonSampler(100, 0.1, randomness=r),
        lambda r: ShuffleSampler(100, 10, randomness=r),
        lambda r: FixedSizeSampler(100, 10, randomness=r),
    ],
)
def test_resume_mid_epoch_continues_identically(make):
    a = make(Randomness(5))
    it = a.batches(0)
    for _ in range(4):
        next(it)
    state = a.state_dict()
    rest = list(it)
    b = make(Randomness(123))  # a different seed: the state must restore everything
    b.load_state_dict(state)
    resumed = list(b.batches(0))
    assert len(resumed) == len(rest) == 6
    for x, y in zip(rest, resumed, strict=True):
        np.testing.assert_array_equal(x, y)
    # after the epoch both continue with the same next epoch
    np.testing.assert_array_equal(next(a.batches(1)), next(b.batches(1)))


def test_secure_resume_keeps_every_index_once():
    s = BallsAndBinsSampler(60, 6, randomness=Randomness.secure_mode())
    it = s.batches(0)
    seen = [next(it) for _ in range(2)]
    state = s.state_dict()
    assert "randomness" not in state
    s2 = BallsAndBinsSampler(60, 6, randomness=Randomness.secure_mode())
    s2.load_state_dict(state)
    seen += list(s2.batches(0))
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(60))


def test_load_state_rejects_other_kind():
    with pytest.raises(ValueError, match="kind"):
        PoissonSampler(10, 0.5).load_state_dict(ShuffleSampler(10, 2).state_dict())


def test_privacy_events_name_the_sampler():
    z = 1.3
    assert PoissonSampler(1000, 0.01).privacy_event(z, epochs=2) == ev.SelfComposed(
        ev.PoissonSampled(0.01, ev.Gaussian(z)), 200
    )
    assert PoissonSampler(1000, 0.01, max_batch_size=30).privacy_event(
        z, steps=7
    ) == ev.TruncatedPoisson(0.01, z, 7, 1000, 30)
    assert BallsAndBinsSampler(1000, 10).privacy_event(z, steps=25) == ev.BallsAndBins(z, 10, 3)
    assert BallsAndBinsSampler(1000, 10, max_batch_size=200).privacy_event(
        z, epochs=2
    ) == ev.TruncatedBallsAndBins(z, 10, 2, 1000, 200)
    assert ShuffleSampler(1000, 100).privacy_event(z, epochs=1.5) == ev.Shuffled(z, 10, 2)
    assert DeterministicSampler(1000, 100).privacy_event(z) == ev.Deterministic(z, 10, 1)
    assert FixedSizeSampler(1000, 100).privacy_event(z, steps=3) == ev.SelfComposed(
        ev.FixedSizeSampled(100, 1000, ev.Gaussian(z)), 3
    )
    with pytest.raises(ValueError, match="not both"):
        ShuffleSampler(1000, 100).privacy_event(z, epochs=1, steps=10)


def test_sample_specs_are_ledger_specs():
    for kind in ("poisson", "balls_and_bins", "shuffle", "deterministic", "fixed_size"):
        s = make_sampler(kind, 500, 50)
        assert isinstance(s, Sampler)
        spec = s.sample_spec()
        assert isinstance(spec, SampleSpec) and spec.sampler == kind
    spec = make_sampler("balls-and-bins", 500, 50, max_batch_size=80).sample_spec()
    assert spec.max_batch_size == 80 and spec.steps_per_epoch == 10
    assert make_sampler("fixed_size", 500, 50).sample_spec().adjacency == "replace_one"


def test_make_sampler_validates():
    with pytest.raises(ValueError, match="kind must be one of"):
        make_sampler("uniform", 10, 2)
    with pytest.raises(ValueError, match="max_batch_size applies"):
        make_sampler("shuffle", 10, 2, max_batch_size=3)
    with pytest.raises(ValueError, match="batch_size must be"):
        make_sampler("poisson", 10, 11)
    assert make_sampler("poisson", 1000, 10).sampling_rate == 0.01


def test_truncation_delta_matches_binomial_tail_and_union_bound():
    q, n, cap, steps = 0.01, 10_000, 130, 500
    per_step = 1.0 - stats.binom.cdf(cap, n + 1, q)
    assert truncation_delta(q, n, cap, steps) == pytest.approx(steps * per_step, rel=1e-6)
    assert truncation_delta(q, n, 10, 500) == 1.0
    assert truncation_delta(q, n, cap + 20, steps) < truncation_delta(q, n, cap, steps)
    # far tails stay positive and finite (sf, not 1 - cdf)
    assert 0.0 < truncation_delta(q, n, 300, steps) < 1e-30
    e = ev.TruncatedBallsAndBins(1.0, 100, 3, 10_000, 150)
    assert event_truncation_probability(e) == pytest.approx(
        truncation_delta(0.01, 10_000, 150, 300)
    )
    assert event_truncation_probability(ev.SelfComposed(e, 2)) == pytest.approx(
        2 * truncation_delta(0.01, 10_000, 150, 300)
    )
    assert event_truncation_probability(ev.BallsAndBins(1.0, 100)) == 0.0


def test_truncated_epsilon_is_certified():
    def eps_of(d):  # a Gaussian mechanism's epsilon(delta) via the classic bound
        return math.sqrt(2 * math.log(1.25 / d)) / 2.0

    p = 1e-8
    eps = truncated_epsilon(eps_of, 1e-5, p)
    assert eps >= eps_of(1e-5)
    # the mechanism's delta at eps plus the truncation term stays within the target
    mech_delta = 1.25 * math.exp(-((2 * eps) ** 2) / 2)
    assert truncated_delta(mech_delta, eps, p) <= 1e-5 * (1 + 1e-9)
    assert truncated_epsilon(eps_of, 1e-5, 1e-5) == math.inf

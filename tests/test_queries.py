"""Queries: sensitivity on adversarial neighbours, noise std, McMahan's formulas, fast path.

Statistical tests state their false-failure rate: each variance test is a two-sided chi-square
test on the sample variance at level ALPHA = 1e-6 (seeded, so reproducible in CI anyway).
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import dpfy.queries
from dpfy import accounting
from dpfy import events as ev
from dpfy.correlated import SingleEpoch, make_plan
from dpfy.ledger import Ledger
from dpfy.ledger.records import SumQueryRecord
from dpfy.queries import (
    AdaptiveClipQuery,
    GaussianSumQuery,
    JointClipQuery,
    LedgerEntry,
    NestedQuery,
    Query,
    QueryBase,
    clip_weights_from_norms,
)
from dpfy.queries._tree import expand_weights, per_example_norms
from dpfy.queries.adaptive import AdaptiveNestedQuery
from dpfy.queries.base import ReleasesClippedSums, check_query
from dpfy.queries.correlated import CorrelatedNoiseQuery
from dpfy.queries.nested import Group, dimension_adjusted_noise, proportional_noise, split_clip_norm
from dpfy.queries.sum import AverageQuery, NoPrivacyQuery, gaussian_average_query
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient

ALPHA = 1e-6
SHAPES = {"a": (3, 2), "b": (4,), "c": (5,)}
GROUPS = {"g1": ("a", "b"), "g2": ("c",)}
SCALES = {"g1": 1.0, "g2": 50.0}
POISSON = SampleSpec("poisson", dataset_size=10_000, sampling_rate=0.01)


def _queries():
    """name -> (factory, whitening) where whitening maps a difference of sums to one vector per
    ledger entry, in the units of that entry's sensitivity (the mechanism's own view)."""

    def flat(d):
        return [torch.cat([t.flatten() for t in d.values()])]

    def by_group(d):
        return [torch.cat([d[n].flatten() for n in GROUPS[g]]) for g in GROUPS]

    def scaled(d):
        return [torch.cat([d[n].flatten() / SCALES[g] for g in GROUPS for n in GROUPS[g]])]

    return {
        "sum": (lambda: GaussianSumQuery(0.7, 1.3), flat),
        "average": (lambda: gaussian_average_query(0.7, 1.3, denominator=10.0), flat),
        "nested": (
            lambda: NestedQuery({"g1": Group(GROUPS["g1"], 0.5, 0.8),
                                 "g2": Group(GROUPS["g2"], 2.0, 1.5)}),
            by_group,
        ),
        "joint": (lambda: JointClipQuery(GROUPS, SCALES, 1.2, 0.9), scaled),
        "adaptive": (lambda: AdaptiveClipQuery(0.9, 1.1, expected_batch_size=40.0), flat),
        "adaptive_nested": (
            lambda: AdaptiveNestedQuery(GROUPS, {"g1": 0.6, "g2": 1.5}, 1.1,
                                        expected_batch_size=40.0),
            by_group,
        ),
        "no_privacy": (lambda: NoPrivacyQuery(0.7), flat),
    }


QUERY_NAMES = list(_queries())


def _batch(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn((n, *s), generator=g, dtype=torch.float64)
            for k, s in SHAPES.items()}


def _adversaries(seed=1):
    """Neighbours that try to move the sum as far as possible (and some that cannot)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for scale in (1e6, 10.0, 1.0, 1e-3):
        out.append({k: scale * torch.randn(s, generator=g, dtype=torch.float64)
                    for k, s in SHAPES.items()})
    for group in GROUPS.values():  # all mass in one group
        out.append({k: (1e6 if k in group else 0.0) * torch.randn(s, generator=g,
                                                                   dtype=torch.float64)
                    for k, s in SHAPES.items()})
    return out


def _add_row(batch, x):
    return {k: torch.cat([batch[k], x[k][None]]) for k in batch}


def _recorded(ledger):
    return [r for r in ledger.entries if isinstance(r, SumQueryRecord)]


def _recorded_tuples(query):
    """Entries one release writes to a ledger (sensitivity, noise_std)."""
    ledger, rng = Ledger(), Randomness(seed=0)
    sid = ledger.record_sample(POISSON)
    zeros = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    query.add_noise(zeros, ledger=ledger, sample_id=sid, randomness=rng)
    return [(r.sensitivity, r.noise_std) for r in _recorded(ledger)], ledger


def _query_classes():
    """Every concrete query class defined in the modules of ``dpfy.queries``."""
    found = set()
    for info in pkgutil.iter_modules(dpfy.queries.__path__, "dpfy.queries."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and obj.__module__ == module.__name__
                    and issubclass(obj, ReleasesClippedSums) and not inspect.isabstract(obj)
                    and obj is not ReleasesClippedSums):  # the mixin, not a query
                found.add(obj)
    return found


def test_every_query_class_satisfies_the_query_protocol():
    # Each query class of the package is in the table above (or built here), and each
    # instance is a ``Query``: PrivateGradient reads queries only through that protocol.
    correlated = CorrelatedNoiseQuery(make_plan("tree", 4, SingleEpoch()), 1.0, 1.0)
    instances = [factory() for factory, _ in _queries().values()] + [correlated]
    assert {type(q) for q in instances} == _query_classes()
    # A query of one's own that only declares (QueryBase) satisfies it too; its noise
    # multiplier follows from its entries (McMahan et al. 2018, Eq. 1).
    own = _HalfNoise(0.7, 1.3 * 0.7)
    assert isinstance(own, Query) and own.noise_multiplier == pytest.approx(1.3)
    for query in instances:
        assert isinstance(query, Query), type(query).__name__
        check_query(query)  # does not raise
        assert query.privacy_tuples() == tuple(
            (e.sensitivity, e.noise_std) for e in query.ledger_entries()
        )


def test_a_query_lacking_part_of_the_protocol_is_refused_by_name():
    class NoFusedFlag:  # every member but ``fused_release`` and ``ledger_entries``
        groups, noise_multiplier = None, 1.0
        clip_weights = clip_and_sum = add_noise = release = privacy_tuples = print

    assert not isinstance(NoFusedFlag(), Query)
    with pytest.raises(ValueError, match=r"missing fused_release, ledger_entries\)"):
        check_query(NoFusedFlag())
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="missing fused_release"):
        PrivateGradient(model, NoFusedFlag(), expected_batch_size=4)
    with pytest.raises(ValueError, match="sum query"):  # a query that divides is refused too
        PrivateGradient(model, gaussian_average_query(1.0, 1.0, 4.0), expected_batch_size=4)


# -- sensitivity ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_worst_case_sensitivity_equals_the_recorded_one(name):
    factory, whiten = _queries()[name]
    batch = _batch(16)
    recorded, ledger = _recorded_tuples(factory())
    if name == "no_privacy":
        assert recorded == [] and accounting.epsilon(ledger, 1e-5).epsilon == math.inf
        recorded = [(0.7, 0.0)]  # the clip bound still holds; there is just no noise
    n_counts = {"adaptive": 1, "adaptive_nested": len(GROUPS)}.get(name, 0)
    gradient_entries = recorded[: len(recorded) - n_counts]
    worst = np.zeros(len(gradient_entries))
    for x in _adversaries():
        base = factory().clip_and_sum(batch)
        plus = factory().clip_and_sum(_add_row(batch, x))
        diffs = whiten({k: plus[k] - base[k] for k in base})
        for j, d in enumerate(diffs):
            norm = float(d.norm())
            assert norm <= recorded[j][0] * (1 + 1e-9)
            worst[j] = max(worst[j], norm)
    np.testing.assert_allclose(worst, [s for s, _ in gradient_entries], rtol=1e-9)
    if n_counts:  # the other releases: centred counts of unclipped examples
        changes = []
        for x in _adversaries():
            a, b = factory(), factory()
            a.clip_and_sum(batch)
            b.clip_and_sum(_add_row(batch, x))
            if name == "adaptive":
                changes.append(abs(b.pending_centred_count() - a.pending_centred_count()))
            else:
                ca, cb = a.pending_centred_counts(), b.pending_centred_counts()
                changes.extend(abs(cb[g] - ca[g]) for g in GROUPS)
        assert max(changes) == 0.5
        assert {s for s, _ in recorded[len(gradient_entries):]} == {0.5}


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_padding_rows_are_neighbours_that_change_nothing(name):
    """Fast path with a mask: a weight-0 row (even NaN) contributes exactly nothing."""
    factory, _ = _queries()[name]
    batch = _add_row(_batch(8), {k: torch.full(s, math.nan, dtype=torch.float64)
                                 for k, s in SHAPES.items()})
    mask = torch.ones(9, dtype=torch.float64)
    mask[-1] = 0
    got = factory().clip_and_sum(batch, mask=mask)
    want = factory().clip_and_sum({k: v[:-1] for k, v in batch.items()})
    for k in want:
        assert torch.equal(got[k], want[k])


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_fast_path_equals_materialised_path(name):
    factory, _ = _queries()[name]
    batch = _batch(12, scale=0.6)
    query = factory()
    groups = query.groups
    norms = per_example_norms(batch, groups)
    w = expand_weights(query.clip_weights(norms), groups, list(batch))
    fast = {k: torch.einsum("b,b...->...", w[k], v) for k, v in batch.items()}
    slow = factory().clip_and_sum(batch)
    for k in slow:
        assert torch.allclose(fast[k], slow[k], rtol=1e-12, atol=1e-12)


def test_partial_norms_combine_for_flat_queries():
    q = GaussianSumQuery(1.0, 1.0)
    parts = {"x": torch.tensor([3.0, 0.3]), "y": torch.tensor([4.0, 0.4])}
    assert torch.allclose(q.clip_weights(parts), torch.tensor([0.2, 1.0], dtype=torch.float64))


# -- noise --------------------------------------------------------------------------------------


def _chi2_ok(samples: np.ndarray, std: float) -> bool:
    n = samples.size
    stat = float(np.sum(samples.astype(np.float64) ** 2)) / std**2  # mean is known: 0
    lo, hi = stats.chi2.ppf(ALPHA / 2, n), stats.chi2.isf(ALPHA / 2, n)
    return lo <= stat <= hi


def test_chi2_check_has_power():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1.0, 100_000)
    assert _chi2_ok(x, 1.0)
    assert not _chi2_ok(x, 1.05) and not _chi2_ok(x, 0.95)


# statistical: fixed seed 7, or secure noise under a fixed OS key (fixed_os_key): deterministic
@pytest.mark.parametrize(
    ("name", "secure"),
    [(n, False) for n in QUERY_NAMES if n != "no_privacy"] + [("sum", True)],
)
def test_empirical_noise_std_matches_the_recorded_one(name, secure, fixed_os_key):
    """Noise on a zero sum, whitened like the sensitivity, has the recorded std per entry."""
    factory, whiten = _queries()[name]
    query = factory()
    big = {k: torch.zeros((20_000, *s), dtype=torch.float64) for k, s in SHAPES.items()}
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    rng = Randomness.secure_mode() if secure else Randomness(seed=7)
    noisy = query.add_noise(big, ledger=ledger, sample_id=sid, randomness=rng)
    denom = getattr(query, "denominator", 1.0)
    parts = whiten({k: v * denom for k, v in noisy.items()})
    recorded = _recorded(ledger)
    for part, rec in zip(parts, recorded, strict=False):
        assert _chi2_ok(part.numpy(), rec.noise_std), (name, rec)


def test_no_privacy_adds_no_noise_and_is_never_private():
    batch = _batch(5)
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    out = NoPrivacyQuery().release(batch, ledger=ledger, sample_id=sid,
                                   randomness=Randomness(seed=0))
    for k in batch:
        assert torch.allclose(out[k], batch[k].sum(0), rtol=1e-12, atol=1e-12)
    assert _has_non_private(ledger.to_event())
    assert accounting.epsilon(ledger, 1e-5).epsilon == math.inf


def _has_non_private(event):
    if isinstance(event, ev.NonPrivate):
        return True
    return any(_has_non_private(c) for c in ev._children(event))


# -- McMahan: nested queries, joint clipping, allocation ----------------------------------------


def test_nested_effective_noise_multiplier_is_mcmahans_formula():
    query, _ = _queries()["nested"]
    q = query()
    _, ledger = _recorded_tuples(q)
    formula = (0.5**2 / 0.8**2 + 2.0**2 / 1.5**2) ** -0.5
    assert q.noise_multiplier == pytest.approx(formula, rel=1e-14)
    assert ledger.noise_multipliers()[0] == pytest.approx(formula, rel=1e-14)
    assert ledger.to_event() == ev.PoissonSampled(0.01, ev.Gaussian(ledger.noise_multipliers()[0]))


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["l1", "l2", "l3", "l4", "l5"]),
        st.tuples(st.floats(1e-3, 1e3), st.integers(1, 10**6)),
        min_size=1,
    ),
    st.floats(0.1, 20.0),
)
def test_noise_allocation_meets_the_target_multiplier(groups, z):
    clips = {g: c for g, (c, _) in groups.items()}
    dims = {g: d for g, (_, d) in groups.items()}
    prop = proportional_noise(clips, z)
    dim = dimension_adjusted_noise(clips, dims, z)
    for stds in (prop, dim):
        eff = sum((clips[g] / stds[g]) ** 2 for g in clips) ** -0.5
        assert eff == pytest.approx(z, rel=1e-12)
    ratios = [prop[g] / clips[g] for g in clips]  # proportional: s_j / C_j constant
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)
    rms = [dim[g] / (clips[g] / math.sqrt(dims[g])) for g in clips]  # noise / max RMS constant
    assert max(rms) == pytest.approx(min(rms), rel=1e-12)
    for how in ("equal", "dimension"):
        split = split_clip_norm(2.0, dims, how=how)
        assert sum(c**2 for c in split.values()) == pytest.approx(4.0, rel=1e-12)


def test_nested_from_noise_multiplier_records_the_target():
    dims = {"g1": 10, "g2": 5}
    for allocation in ("proportional", "dimension"):
        q = NestedQuery.from_noise_multiplier(
            GROUPS, {"g1": 1.0, "g2": 0.1}, 1.7, allocation=allocation, dims=dims
        )
        _, ledger = _recorded_tuples(q)
        assert ledger.noise_multipliers()[0] == pytest.approx(1.7, rel=1e-12)


def test_joint_clipping_uses_side_information_mcmahan_example():
    """McMahan Sec. 2: either group is zero; scales 1 and 100 leave in-scale examples unclipped,
    while the noise on each group is its scale times z C."""
    q = JointClipQuery({"u": ["u"], "v": ["v"]}, {"u": 1.0, "v": 100.0}, 1.0, 2.0)
    norms = {"u": torch.tensor([1.0, 0.0, 3.0]), "v": torch.tensor([0.0, 100.0, 0.0])}
    assert torch.allclose(q.clip_weights(norms),
                          torch.tensor([1.0, 1.0, 1 / 3], dtype=torch.float64))
    assert q.noise_stds() == {"u": 2.0, "v": 200.0}
    assert q.privacy_tuples() == ((1.0, 2.0),)


def test_structure_and_validation():
    nested_batch = {"layer": {"w": torch.randn(4, 2, 2), "b": torch.randn(4, 2)}}
    ledger, rng = Ledger(), Randomness(seed=0)
    sid = ledger.record_sample(POISSON)
    out = GaussianSumQuery(1.0, 1.0).release(nested_batch, ledger=ledger, sample_id=sid,
                                             randomness=rng)
    assert set(out) == {"layer"} and out["layer"]["w"].shape == (2, 2)
    with pytest.raises(ValueError, match="is in groups"):
        NestedQuery({"x": Group(("a",), 1.0, 1.0), "y": Group(("a", "b"), 1.0, 1.0)})
    nested = NestedQuery({"x": Group(("a",), 1.0, 1.0)})
    with pytest.raises(ValueError, match="belong to no group"):
        nested.add_noise({"a": torch.zeros(2), "b": torch.zeros(2)}, ledger=ledger,
                         sample_id=sid, randomness=rng)
    with pytest.raises(ValueError, match="norms must be a dict keyed by the groups"):
        nested.clip_weights({"z": torch.ones(3)})
    with pytest.raises(ValueError, match="noise_multiplier must be in"):
        GaussianSumQuery(1.0, 0.0)
    with pytest.raises(ValueError, match=r"norms must be in \[0, inf\]"):
        GaussianSumQuery(1.0, 1.0).clip_weights(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match=r"mask must be in \[0, 1\]"):
        GaussianSumQuery(1.0, 1.0).clip_weights(torch.ones(2), mask=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="count_noise_std must be in"):
        AdaptiveClipQuery(1.0, 2.0, expected_batch_size=10.0, count_noise_std=0.5)
    with pytest.raises(ValueError, match="ledger must be"):
        GaussianSumQuery(1.0, 1.0).add_noise({"a": torch.zeros(1)}, ledger=None, sample_id=sid,
                                             randomness=rng)
    assert isinstance(gaussian_average_query(1.0, 1.0, 5.0), AverageQuery)


# -- adaptive clipping (Andrew et al. 2021) -----------------------------------------------------


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_adaptive_clip_norm_tracks_the_target_quantile(target):
    rng_norms = np.random.default_rng(3)
    m = 200
    q = AdaptiveClipQuery(0.05, 1.0, expected_batch_size=m, target_quantile=target,
                          learning_rate=0.2)
    ledger, rng = Ledger(), Randomness(seed=11)
    fractions, clips = [], []
    zero = {"w": torch.zeros(3)}
    for step in range(300):
        norms = torch.from_numpy(rng_norms.lognormal(0.0, 1.0, m))
        fractions.append(float((norms <= q.clip_norm).double().mean()))
        clips.append(q.clip_norm)
        q.clip_weights(norms)
        sid = ledger.record_sample(POISSON, step=step)
        q.add_noise(zero, ledger=ledger, sample_id=sid, randomness=rng)
    true_quantile = math.exp(stats.norm.ppf(target))  # lognormal(0, 1) quantile
    assert abs(np.mean(fractions[150:]) - target) < 0.05
    assert np.median(clips[150:]) == pytest.approx(true_quantile, rel=0.15)


def test_adaptive_count_noise_std_matches_the_recorded_one():
    m, count_std = 50.0, 2.5
    q = AdaptiveClipQuery(1.0, 1.0, expected_batch_size=m, learning_rate=0.0,
                          count_noise_std=count_std)
    ledger, rng = Ledger(), Randomness(seed=5)
    sid = ledger.record_sample(POISSON)
    norms = torch.linspace(0.1, 2.0, 50)
    noise = []
    for _ in range(2000):
        q.clip_weights(norms)
        centred = q.pending_centred_count()
        q.add_noise({"w": torch.zeros(1)}, ledger=ledger, sample_id=sid, randomness=rng)
        noise.append((q.last_unclipped_fraction - 0.5) * m - centred)
    recorded = {r.noise_std for r in _recorded(ledger) if r.name.endswith("unclipped_count")}
    assert recorded == {count_std}
    assert _chi2_ok(np.array(noise), count_std)


def test_adaptive_cost_is_in_the_ledger_and_in_epsilon():
    import dpfy.accounting.rdp  # noqa: F401 - registers the "rdp" accountant
    from dpfy.accounting import epsilon

    z, steps = 1.1, 30
    q = AdaptiveClipQuery(1.0, z, expected_batch_size=100.0)
    ledger, rng = Ledger(), Randomness(seed=0)
    for step in range(steps):
        q.clip_weights(torch.rand(100) * 2)
        sid = ledger.record_sample(POISSON, step=step)
        q.add_noise({"w": torch.zeros(2)}, ledger=ledger, sample_id=sid, randomness=rng)
    assert isinstance(ledger.to_event(), ev.SelfComposed)  # one run despite a moving C
    names = [r.name for r in _recorded(ledger)]
    assert names.count("adaptive/unclipped_count") == steps
    assert all(v == pytest.approx(z, rel=1e-12) for v in ledger.noise_multipliers().values())
    got = epsilon(ledger, 1e-5, method="rdp").epsilon
    want = epsilon(ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(z)), steps), 1e-5,
                   method="rdp").epsilon
    gradient_only = epsilon(
        ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(q.gradient_noise_multiplier)), steps),
        1e-5, method="rdp",
    ).epsilon
    assert got == pytest.approx(want, rel=1e-9)
    assert got > gradient_only  # the quantile estimate is not free


def test_adaptive_state_round_trip():
    q = AdaptiveClipQuery(1.0, 1.0, expected_batch_size=100.0)
    q.clip_weights(torch.ones(3))
    q.load_state_dict({"clip_norm": 0.25})
    assert q.clip_norm == 0.25 and q.pending_centred_count() == 0.0
    assert q.state_dict() == {"clip_norm": 0.25}


def test_adaptive_nested_tracks_each_groups_quantile_at_the_requested_z():
    rng_norms = np.random.default_rng(4)
    m, z, target = 200, 1.2, 0.7
    q = AdaptiveNestedQuery({"small": ["a"], "large": ["b"]}, 1.0, z, expected_batch_size=m,
                            target_quantile=target, learning_rate=0.2)
    ledger, rng = Ledger(), Randomness(seed=2)
    zero = {"a": torch.zeros(2), "b": torch.zeros(3)}
    fractions = {"small": [], "large": []}
    for step in range(300):
        norms = {"small": torch.from_numpy(rng_norms.lognormal(-1.0, 0.5, m)),
                 "large": torch.from_numpy(rng_norms.lognormal(2.0, 0.5, m))}
        for g in norms:
            fractions[g].append(float((norms[g] <= q.clip_norms[g]).double().mean()))
        q.clip_weights(norms)
        sid = ledger.record_sample(POISSON, step=step)
        q.add_noise(zero, ledger=ledger, sample_id=sid, randomness=rng)
    for g in fractions:
        assert abs(np.mean(fractions[g][150:]) - target) < 0.05, g
    assert q.clip_norms["large"] > 10 * q.clip_norms["small"]  # true quantiles: 9.6, 0.48
    assert all(v == pytest.approx(z, rel=1e-12) for v in ledger.noise_multipliers().values())
    assert isinstance(ledger.to_event(), ev.SelfComposed)
    with pytest.raises(ValueError, match="count_noise_std must be in"):
        AdaptiveNestedQuery(GROUPS, 1.0, 2.0, expected_batch_size=10.0, count_noise_std=1.0)


def test_add_noise_writes_into_out_buffers():
    sums = {"w": torch.randn(30, 20), "b": torch.randn(20)}
    out = {"w": torch.empty(30, 20), "b": torch.empty(20)}
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.1))
    q = GaussianSumQuery(1.0, 2.0)
    got = q.add_noise(sums, ledger=ledger, sample_id=sid, randomness=Randomness(seed=1), out=out)
    assert got["w"] is out["w"] and got["b"] is out["b"]
    ref = q.add_noise(sums, ledger=ledger, sample_id=sid, randomness=Randomness(seed=1))
    assert torch.equal(ref["w"], out["w"]) and torch.equal(ref["b"], out["b"])
    with pytest.raises(ValueError, match=r"out\['b'\] must match the clipped sum"):
        q.add_noise(sums, ledger=ledger, sample_id=sid, randomness=Randomness(seed=1),
                    out={"w": torch.empty(30, 20), "b": torch.empty(21)})


@pytest.mark.parametrize("name", sorted(_queries()))
def test_scale_post_processes_the_same_release(name):
    # add_noise(s x sum, scale=s) == s x add_noise(sum): same draws, same ledger entries. The
    # outputs go to views of one flat buffer (the fused noise path) and to separate tensors.
    factory, _ = _queries()[name]
    sums = {n: torch.randn(shape) for n, shape in SHAPES.items()}
    s = 1.0 / 64
    flat = torch.empty(sum(math.prod(v) for v in SHAPES.values()))
    out, start = {}, 0
    for n, shape in SHAPES.items():
        out[n] = flat[start : start + math.prod(shape)].view(shape)
        start += math.prod(shape)
    results, entries = [], []
    for kwargs in ({}, {"scale": s, "out": out}):
        ledger = Ledger()
        sid = ledger.record_sample(POISSON)
        arg = sums if not kwargs else {n: v * s for n, v in sums.items()}
        got = factory().add_noise(arg, ledger=ledger, sample_id=sid, randomness=Randomness(seed=2),
                                  **kwargs)
        results.append({n: v.clone() for n, v in got.items()})
        entries.append([(e.sensitivity, e.noise_std) for e in ledger.entries
                        if isinstance(e, SumQueryRecord)])
    assert entries[0] == entries[1]
    for n in SHAPES:
        torch.testing.assert_close(results[1][n], results[0][n] * s, rtol=1e-5, atol=1e-6 * s)
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale must be in"):
            factory().add_noise(sums, ledger=ledger, sample_id=sid,
                                randomness=Randomness(seed=2), scale=bad)
    assert not [e for e in ledger.entries if isinstance(e, SumQueryRecord)]  # nothing recorded


# -- the release template (QueryBase) ---------------------------------------------------------


class _HalfNoise(QueryBase):
    """A new query: flat clipping to C and a given noise std; only the declarations (its
    ledger entry, its noise std, its clip weights) -- QueryBase runs the release."""

    def __init__(self, clip_norm, noise_std, sensitivity_factor=1.0):
        self.clip_norm, self.std, self.factor = clip_norm, noise_std, sensitivity_factor
        self.name = "half"

    def ledger_entries(self):
        return (LedgerEntry(self.name, self.clip_norm, self.std, self.factor),)

    def noise_stds(self):
        return self.std

    def clip_weights(self, norms, *, mask=None):
        return clip_weights_from_norms(norms, self.clip_norm, mask)


class _Spy(Randomness):
    """Randomness that remembers how many sum entries the ledger held at each noise draw."""

    def __init__(self, ledger, seed):
        super().__init__(seed=seed)
        self.ledger, self.seen = ledger, []

    def normal_(self, tensors, stds, *, add=None):
        self.seen.append(len(_recorded(self.ledger)))
        super().normal_(tensors, stds, add=add)


def test_a_new_query_declares_entries_and_the_base_releases_write_ahead():
    batch = _batch(10)
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    spy = _Spy(ledger, seed=3)
    got = _HalfNoise(0.7, 1.3 * 0.7).release(batch, ledger=ledger, sample_id=sid, randomness=spy)
    assert spy.seen == [1]  # the entry was durable before any noise existed
    assert [(r.name, r.sensitivity, r.noise_std) for r in _recorded(ledger)] == [
        ("half", 0.7, pytest.approx(1.3 * 0.7))
    ]
    assert ledger.noise_multipliers()[0] == pytest.approx(1.3)
    ref_ledger = Ledger()
    ref = GaussianSumQuery(0.7, 1.3).release(batch, ledger=ref_ledger,
                                             sample_id=ref_ledger.record_sample(POISSON),
                                             randomness=Randomness(seed=3))
    for k in ref:  # same clipping, same draws: the same release as the built-in sum query
        assert torch.equal(got[k], ref[k])


@pytest.mark.parametrize("name", QUERY_NAMES)
def test_every_query_writes_ahead(name):
    factory, _ = _queries()[name]
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    spy = _Spy(ledger, seed=0)
    n = len(factory().privacy_tuples()) if name != "no_privacy" else 0
    factory().add_noise({k: torch.zeros(s) for k, s in SHAPES.items()}, ledger=ledger,
                        sample_id=sid, randomness=spy)
    assert spy.seen and spy.seen[0] == n


def test_a_query_cannot_record_a_sensitivity_below_its_clip_norm():
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    spy = _Spy(ledger, seed=0)
    with pytest.raises(ValueError, match="below its clip norm"):
        _HalfNoise(1.0, 1.0, sensitivity_factor=0.5).add_noise(
            {"w": torch.zeros(3)}, ledger=ledger, sample_id=sid, randomness=spy)
    assert len(ledger.entries) == 1 and spy.seen == []  # nothing recorded, nothing drawn
    with pytest.raises(ValueError, match="below its clip norm"):
        LedgerEntry("x", 2.0, 1.0, sensitivity_factor=0.999)
    with pytest.raises(TypeError):  # the caller cannot hand a query its sensitivity
        GaussianSumQuery(1.0, 1.0, sensitivity=0.5)
    q = GaussianSumQuery(1.0, 1.5, clipped_unit="microbatch_average")
    assert q.privacy_tuples() == ((2.0, 3.0),)  # derived from the clipped unit: 2 C
    with pytest.raises(ValueError, match="clipped_unit must be one of"):
        GaussianSumQuery(1.0, 1.0, clipped_unit="batch")


def test_a_refused_release_records_nothing():
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    q = NestedQuery({"x": Group(("a",), 1.0, 1.0)})
    with pytest.raises(ValueError, match=r"out\['a'\] must match"):
        q.add_noise({"a": torch.zeros(2)}, ledger=ledger, sample_id=sid,
                    randomness=Randomness(seed=0), out={"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="belong to no group"):
        q.add_noise({"a": torch.zeros(2), "b": torch.zeros(1)}, ledger=ledger, sample_id=sid,
                    randomness=Randomness(seed=0))
    assert _recorded(ledger) == []

"""Strategy math of the correlated-noise mechanisms (dpfy.correlated): factorisations, exact
sensitivity against brute force, streaming noise against the materialised matrices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from correlated_oracles import BandMFNoise, BLTNoise, TreeNoise
from scipy.stats import norm

from dpfy.correlated import BLT, BandMF, Cyclic, MinSeparation, SingleEpoch, TreeAggregation
from dpfy.correlated.bandmf import optimize_bandmf
from dpfy.correlated.schemas import sensitivity
from dpfy.correlated.tree import tree_sensitivity
from dpfy.correlated.workload import prefix_sum_matrix, toeplitz_inverse_coeffs, toeplitz_lower


def _brute(c: np.ndarray, schema: object) -> float:
    """max ||C u|| over every allowed 0/1 pattern, enumerated from the schema's definition."""
    steps = c.shape[1]
    best = 0.0
    for bits in itertools.product((0, 1), repeat=steps):
        idx = [t for t in range(steps) if bits[t]]
        if not idx:
            continue
        if isinstance(schema, SingleEpoch) and len(idx) > 1:
            continue
        if isinstance(schema, Cyclic) and idx != list(range(idx[0], steps, schema.period)):
            continue
        if isinstance(schema, MinSeparation) and (
            len(idx) > schema.max_participations
            or any(b - a < schema.separation for a, b in itertools.pairwise(idx))
        ):
            continue
        best = max(best, float(np.linalg.norm(c @ np.asarray(bits, dtype=float))))
    return best


STEPS = 10
STRATEGIES = {
    "identity": np.eye(STEPS),
    "tree": TreeAggregation(STEPS).strategy_matrix(),
    "bandmf": BandMF(np.array([1.0, 0.6, 0.4])).strategy_matrix(STEPS),
    "blt": BLT(np.array([-0.4, -0.1]), np.array([0.8, 0.3])).strategy_matrix(STEPS),
}
SCHEMAS = [SingleEpoch(), Cyclic(3), Cyclic(5), MinSeparation(3, 2), MinSeparation(4, 3)]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: str(s.to_dict()))
def test_sensitivity_equals_brute_force(name: str, schema: object) -> None:
    c = STRATEGIES[name]
    assert np.all(c.T @ c >= -1e-12), "the strategies under test have C^T C >= 0"
    assert sensitivity(c, schema) == pytest.approx(_brute(c, schema), rel=1e-12)  # type: ignore[arg-type]


def test_identity_strategy_is_dpsgd_without_amplification() -> None:
    for k in (1, 2, 5):
        assert sensitivity(np.eye(20), MinSeparation(4, k)) == pytest.approx(np.sqrt(k))
    assert sensitivity(np.eye(20), Cyclic(6)) == pytest.approx(np.sqrt(4))  # ceil(20 / 6)


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 9, 31, 64, 100])
def test_tree_factorises_prefix_sums_and_matches_closed_form(steps: int) -> None:
    tree = TreeAggregation(steps)
    assert np.array_equal(tree.decoder_matrix() @ tree.strategy_matrix(), prefix_sum_matrix(steps))
    closed = np.sqrt(np.floor(np.log2(steps)) + 1)
    assert tree_sensitivity(steps) == pytest.approx(closed)
    assert sensitivity(tree.strategy_matrix(), SingleEpoch()) == pytest.approx(closed)


def test_negative_gram_is_refused_for_multi_participation() -> None:
    c = np.array([[1.0, -1.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="C\\^T C >= 0"):
        sensitivity(c, Cyclic(1))


def _covariance_within_bounds(samples: np.ndarray, cov: np.ndarray) -> None:
    """Sample covariance entries inside Bonferroni-corrected 99.9 % normal bounds."""
    n, m = samples.shape
    sample = samples.T @ samples / n  # mean zero by construction
    d = np.diag(cov)
    se = np.sqrt((np.outer(d, d) + cov**2) / n)
    z = norm.ppf(1 - 0.001 / (2 * m * m))
    assert np.all(np.abs(sample - cov) <= z * se), np.max(np.abs(sample - cov) / se)


def test_tree_stream_prefix_noise_has_the_tree_covariance() -> None:
    steps, draws, std = 9, 20_000, 0.7
    tree = TreeAggregation(steps)
    stream = TreeNoise((draws,), std, np.random.default_rng(3))
    per_step = np.stack([stream.next() for _ in range(steps)], axis=1)
    prefix = np.cumsum(per_step, axis=1)
    b = tree.decoder_matrix()
    _covariance_within_bounds(prefix, std**2 * b @ b.T)
    # the prefix noise at t has popcount(t + 1) node noises
    assert np.diag(b @ b.T).tolist() == [bin(t + 1).count("1") for t in range(steps)]


@pytest.mark.parametrize("kind", ["bandmf", "blt"])
def test_toeplitz_streams_equal_materialised_inverse_and_covariance(kind: str) -> None:
    steps, draws, std = 8, 10_000, 1.3
    if kind == "bandmf":
        strat = BandMF(np.array([1.0, 0.5, 0.25]))
        stream = BandMFNoise(strat, (draws,), std, np.random.default_rng(5))
        inv = toeplitz_lower(toeplitz_inverse_coeffs(strat.coeffs, steps), steps)
        cov = strat.noise_covariance(steps)
    else:
        blt = BLT(np.array([-0.4, -0.1]), np.array([0.8, 0.3]))
        stream = BLTNoise(blt, (draws,), std, np.random.default_rng(5))  # type: ignore[assignment]
        inv = toeplitz_lower(blt.inverse_coeffs(steps), steps)
        cov = blt.noise_covariance(steps)
        assert np.allclose(blt.strategy_matrix(steps) @ inv, np.eye(steps))
    w = np.stack([stream.next() for _ in range(steps)], axis=1)
    rng = np.random.default_rng(5)
    z = np.stack([std * rng.standard_normal(draws) for _ in range(steps)], axis=1)
    np.testing.assert_allclose(w, z @ inv.T, rtol=1e-10, atol=1e-10)
    _covariance_within_bounds(w, std**2 * cov)


def test_optimised_bandmf_beats_dpsgd_and_its_start() -> None:
    steps, band = 64, 8
    dpsgd = float(np.sum(np.arange(steps, 0, -1)))  # ||A||_F^2 with sensitivity 1
    best = optimize_bandmf(steps, band)
    assert best.band == band and best.coeffs[0] == 1.0 and np.all(best.coeffs >= 0)
    inv = toeplitz_inverse_coeffs(best.coeffs, steps)
    loss = float(np.sum(np.cumsum(inv) ** 2 * np.arange(steps, 0, -1))) * float(
        best.coeffs @ best.coeffs
    )
    assert loss < 0.5 * dpsgd
    assert optimize_bandmf(steps, 1).coeffs.tolist() == [1.0]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: optimize_bandmf(10, 11), "band must be"),
        (lambda: optimize_bandmf(10, 2, objective="mean"), "objective must be in"),  # type: ignore[arg-type]
        (lambda: BLT(np.array([0.1]), np.array([1.0])), "theta must be in"),
        (lambda: BandMF(np.array([0.0, 1.0])), "coeffs\\[0\\] must be in"),
        (lambda: Cyclic(0), "period must be"),
        (lambda: sensitivity(np.ones(3), SingleEpoch()), "strategy must be"),
    ],
)
def test_bad_arguments_name_the_parameter(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["tree", "bandmf", "blt"])
def test_stream_state_resumes_bit_for_bit(kind: str) -> None:
    def make(seed: int) -> TreeNoise | BandMFNoise | BLTNoise:
        rng = np.random.default_rng(seed)
        if kind == "tree":
            return TreeNoise((3, 2), 0.5, rng)
        if kind == "bandmf":
            return BandMFNoise(BandMF(np.array([1.0, 0.5, 0.2])), (3, 2), 0.5, rng)
        return BLTNoise(BLT(np.array([-0.3]), np.array([0.6])), (3, 2), 0.5, rng)

    full = make(11)
    first = [full.next() for _ in range(5)]
    state = full.state_dict()
    rest = [full.next() for _ in range(6)]
    resumed = make(999)  # a different seed: everything must come from the state
    resumed.load_state_dict(state)
    for a, b in zip(rest, [resumed.next() for _ in range(6)], strict=True):
        assert np.array_equal(a, b)
    assert not np.array_equal(first[0], rest[0])


def test_optimised_blt_is_near_the_full_toeplitz_optimum_with_four_buffers() -> None:
    from dpfy.correlated.blt import blt_loss, optimize_blt

    steps = 64
    full = optimize_bandmf(steps, steps)  # a full-band Toeplitz strategy: the BLT's benchmark
    inv = toeplitz_inverse_coeffs(full.coeffs, steps)
    best = float(np.sum(np.cumsum(inv) ** 2 * np.arange(steps, 0, -1))) * float(
        full.coeffs @ full.coeffs
    )
    blt = optimize_blt(steps, 4)
    assert blt.buffers == 4 and np.all(blt.omega < 0)
    assert blt_loss(blt, steps) <= 1.01 * best
    c = blt.strategy_matrix(steps)
    assert np.all(c >= 0)  # so multi-participation sensitivity is exact (C^T C >= 0)
    assert sensitivity(c, Cyclic(16)) >= sensitivity(c, SingleEpoch())

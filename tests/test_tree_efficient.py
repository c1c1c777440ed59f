"""Tree aggregation with the efficient (Honaker 2015) estimator, ``"tree-efficient"``.

Oracles: least squares over the completed nodes (``a_n^T pinv(C_n)`` from NumPy), the dense
full-tree matrix, brute force over every participation pattern with signs, the sample
covariance of seeded draws, the plain tree's prefix variance ``popcount(t + 1)``, the closed
form ``sqrt(floor(log2 T) + 1) / z`` and dp_accounting's ``SingleEpochTreeAggregationDpEvent``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from correlated_oracles import EfficientTreeNoise
from dp_accounting import dp_event as dpe
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant
from scipy.stats import norm

from dpfy.accounting.gaussian import mu_of_event
from dpfy.correlated import Cyclic, SingleEpoch, TreeAggregation
from dpfy.correlated.plan import CorrelatedPlan, make_plan
from dpfy.correlated.schemas import sensitivity
from dpfy.correlated.tree_efficient import (
    efficient_decoder_matrix,
    efficient_noise_map,
    level_variances,
    prefix_variances,
)
from dpfy.correlated.workload import prefix_sum_matrix
from dpfy.run_accounting import compare_mechanisms


def _node_draws(steps: int, shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """The node noises in TreeAggregation's node order, drawn in the stream's order (step by
    step, the nodes ending at n = t + 1 from level 0 up)."""
    tree = TreeAggregation(steps)
    index = {node: i for i, node in enumerate(tree.nodes)}
    rng, z = np.random.default_rng(seed), np.zeros((len(tree.nodes), *shape))
    for n in range(1, steps + 1):
        for level in range((n & -n).bit_length()):
            z[index[(level, (n >> level) - 1)]] = std * rng.standard_normal(shape)
    return z


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 12, 13])
def test_decoder_is_least_squares_over_the_completed_nodes(steps: int) -> None:
    tree = TreeAggregation(steps)
    c = tree.strategy_matrix()
    b = efficient_decoder_matrix(steps)
    np.testing.assert_allclose(b @ c, prefix_sum_matrix(steps), atol=1e-12)  # unbiased
    np.testing.assert_allclose(efficient_noise_map(steps) @ c, np.eye(steps), atol=1e-12)
    for t in range(steps):
        n = t + 1
        done = [i for i, (lv, j) in enumerate(tree.nodes) if (j + 1) << lv <= n]
        prefix = np.zeros(steps)
        prefix[:n] = 1.0
        row = np.zeros(len(tree.nodes))
        row[done] = prefix @ np.linalg.pinv(c[done])  # the BLUE from what exists at step t
        np.testing.assert_allclose(b[t], row, atol=1e-10)
    np.testing.assert_allclose(np.diag(b @ b.T), prefix_variances(steps), rtol=1e-12)


def test_level_variances_follow_the_recursion_and_beat_the_plain_tree() -> None:
    v = level_variances(6)
    assert v[0] == 1.0 and v[1] == pytest.approx(2 / 3) and v[2] == pytest.approx(4 / 7)
    assert np.all(np.diff(v) < 0) and np.all(v > 0.5)
    for steps in (64, 1024):
        eff = prefix_variances(steps)
        plain = np.array([bin(n).count("1") for n in range(1, steps + 1)], dtype=float)
        assert np.all(eff <= plain + 1e-12)
        n = np.arange(1, steps + 1)
        assert np.all(eff[(n & ~1) > 0] < plain[(n & ~1) > 0])  # a node above the leaves
        assert math.sqrt(eff.mean()) < 0.8 * math.sqrt(plain.mean())


@pytest.mark.parametrize("steps", [1, 7, 12, 16])
def test_stream_equals_the_matrix_form(steps: int) -> None:
    stream = EfficientTreeNoise((3, 2), 0.7, np.random.default_rng(4))
    w = np.stack([stream.next() for _ in range(steps)])
    z = _node_draws(steps, (3, 2), 0.7, seed=4)
    np.testing.assert_allclose(w, np.einsum("tk,kab->tab", efficient_noise_map(steps), z),
                               rtol=0, atol=1e-12)
    assert len(stream.levels) == bin(steps).count("1")  # O(log T) buffers


def test_prefix_noise_covariance_matches_the_decoder_over_seeded_draws() -> None:
    steps, draws, std = 11, 20_000, 0.8
    stream = EfficientTreeNoise((draws,), std, np.random.default_rng(9))
    prefix = np.cumsum(np.stack([stream.next() for _ in range(steps)], axis=1), axis=1)
    b = efficient_decoder_matrix(steps)
    cov = std**2 * b @ b.T
    sample = prefix.T @ prefix / draws
    d = np.diag(cov)
    se = np.sqrt((np.outer(d, d) + cov**2) / draws)
    crit = norm.ppf(1 - 0.001 / (2 * steps * steps))  # 99.9 %, Bonferroni over the entries
    assert np.all(np.abs(sample - cov) <= crit * se), np.max(np.abs(sample - cov) / se)
    # and it is not the plain tree's covariance: prefix 2 (n = 4) has variance v_2 < 1
    assert sample[3, 3] < 0.7 * std**2


def test_stream_resumes_bit_for_bit() -> None:
    full = EfficientTreeNoise((4,), 0.5, np.random.default_rng(1))
    [full.next() for _ in range(5)]
    state = full.state_dict()
    rest = [full.next() for _ in range(7)]
    resumed = EfficientTreeNoise((4,), 0.5, np.random.default_rng(77))
    resumed.load_state_dict(state)
    for a, b in zip(rest, [resumed.next() for _ in range(7)], strict=True):
        assert np.array_equal(a, b)


def _brute(c: np.ndarray, schema: SingleEpoch | Cyclic) -> float:
    """max ||C x|| over every pattern the schema allows and every sign of each contribution
    (scalars in [-1, 1]: the maximum of a convex function is at a vertex)."""
    steps = c.shape[1]
    starts = range(steps if isinstance(schema, SingleEpoch) else min(schema.period, steps))
    best = 0.0
    for i in starts:
        idx = [i] if isinstance(schema, SingleEpoch) else list(range(i, steps, schema.period))
        signs = np.array(list(itertools.product((-1.0, 0.0, 1.0), repeat=len(idx))))
        x = np.zeros((signs.shape[0], steps))
        x[:, idx] = signs
        best = max(best, float(np.sqrt(((x @ c.T) ** 2).sum(axis=1).max())))
    return best


@pytest.mark.parametrize("steps", [1, 3, 5, 8, 11, 12])
def test_sensitivity_equals_brute_force_under_every_schema(steps: int) -> None:
    schemas: list[SingleEpoch | Cyclic] = [SingleEpoch()]
    schemas += [Cyclic(p) for p in sorted({1, 2, 3, 4, 5, steps})]
    for schema in schemas:
        plan = CorrelatedPlan("tree-efficient", {}, steps, schema)
        c = plan.strategy_matrix()
        assert np.all(c >= 0) and c.shape == (len(TreeAggregation(steps).nodes), steps)
        u = np.random.default_rng(steps).standard_normal(steps)
        np.testing.assert_allclose(plan.apply(u), c @ u, atol=1e-12)
        assert plan.sensitivity == pytest.approx(_brute(c, schema), rel=1e-12), schema
        assert plan.sensitivity == pytest.approx(sensitivity(c, schema), rel=1e-12)
    # the same C as the plain tree's column norms, so the same single-epoch sensitivity
    one = CorrelatedPlan("tree-efficient", {}, steps, SingleEpoch()).sensitivity
    assert one == pytest.approx(math.sqrt(math.floor(math.log2(steps)) + 1), rel=1e-12)
    assert one == pytest.approx(CorrelatedPlan("tree", {}, steps, SingleEpoch()).sensitivity)


@pytest.mark.parametrize("steps", [1, 5, 8, 100, 1000])
def test_event_is_the_closed_form_and_dp_accountings_tree(steps: int) -> None:
    z = 1.7
    event = make_plan("tree-efficient", steps, SingleEpoch()).event(z)
    assert event.strategy == "tree-efficient" and event.band == 0
    mu = mu_of_event(event)
    assert mu == pytest.approx(math.sqrt(math.floor(math.log2(steps)) + 1) / z, rel=1e-12)
    orders = [2.0, 8.0, 32.0]
    rdp = RdpAccountant(orders, neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    rdp.compose(dpe.SingleEpochTreeAggregationDpEvent(z, steps))
    np.testing.assert_allclose(rdp._rdp, [a * mu**2 / 2 for a in orders], rtol=1e-12)


def test_plan_refuses_parameters_and_round_trips() -> None:
    with pytest.raises(ValueError, match="params of 'tree-efficient' must have the keys"):
        CorrelatedPlan("tree-efficient", {"coeffs": (1.0,)}, 8, SingleEpoch())
    with pytest.raises(ValueError, match="tree-efficient"):
        CorrelatedPlan("tree-honaker", {}, 8, SingleEpoch())
    plan = make_plan("tree-efficient", 20, Cyclic(5))
    assert CorrelatedPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="not Toeplitz"):
        plan.coeffs()


def test_compare_mechanisms_row_has_the_trees_z_and_less_noise() -> None:
    rows = {r.mechanism: r for r in compare_mechanisms(2.0, 640, 10, 1e-5)}  # T = 64
    tree, eff = rows["tree"], rows["tree-efficient"]
    assert eff.noise_multiplier == pytest.approx(tree.noise_multiplier, rel=1e-9)
    assert eff.prefix_rmse < 0.85 * tree.prefix_rmse
    want = eff.noise_multiplier * math.sqrt(prefix_variances(64).mean())
    assert eff.prefix_rmse == pytest.approx(want, rel=1e-12)


def test_ledger_recomputes_the_full_trees_sensitivity() -> None:
    from dpfy.ledger import Ledger
    from dpfy.ledger.records import MatrixRunRecord, MatrixStepRecord, SampleRecord
    from dpfy.sampling import CyclicSampler

    plan = CorrelatedPlan("tree-efficient", {}, 8, Cyclic(4))
    square = CorrelatedPlan("tree", {}, 8, Cyclic(4))
    # two epochs: more full-tree nodes hold both of an example's steps than square-tree ones
    assert plan.sensitivity > square.sensitivity
    spec = CyclicSampler(8, 2).sample_spec()

    def ledger(recorded: float) -> Ledger:
        records: list[object] = [MatrixRunRecord("gradient", plan, 1.0, 2.0, recorded)]
        for i in range(8):
            records += [SampleRecord(i, spec, i // 4, i), MatrixStepRecord(i, "gradient", i,
                                                                           1.0, 2.0)]
        return Ledger.from_records(records)  # type: ignore[arg-type]

    assert ledger(plan.sensitivity).to_event() == plan.event(2.0)
    with pytest.raises(ValueError, match="below the exact"):
        ledger(square.sensitivity).to_event()  # the plain tree's figure for the full tree

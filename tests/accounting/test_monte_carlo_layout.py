"""The Monte Carlo package's seams: every method builds a LossEstimator, and the core imports
neither torch nor the ledger."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from dpfy.accounting.monte_carlo.base import DIRECTIONS, LossEstimator
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.methods import build_estimator


@pytest.mark.parametrize(
    ("method", "epochs", "expected"),
    [
        ("plain", [Epoch(1.0, 10)], "EmpiricalLosses"),
        ("importance", [Epoch(1.0, 4)], "EmpiricalLosses"),
        ("order_statistics", [Epoch(1.0, 300)] * 2, "EmpiricalLosses"),
        ("conditional", [Epoch(1.0, 20)], "ConditionalLosses"),
        ("tilted", [Epoch(1.0, 10)] * 2, "TiltedLosses"),
        ("tilted", [Epoch(1.0, 20)], "HybridLosses"),
    ],
)
def test_every_method_builds_a_loss_estimator(method, epochs, expected):
    est, mode = build_estimator(
        epochs, samples=2_000, threshold=0.5, method=method, seed=0, executor=None,
        chunk_elements=1 << 16, progress=False, error_probability=1e-3, delta=None,
    )
    assert mode == method and type(est).__name__ == expected
    assert isinstance(est, LossEstimator)
    e, ub, direction = est.delta(1.0, est.error_probability)
    assert direction in DIRECTIONS and 0.0 <= e <= ub <= 1.0 + 1e-12
    assert est.upper(1.0) == ub and est.estimate(1.0) == e
    (rem, add), (s_rem, s_add) = est.by_direction(1.0)
    assert rem >= 0.0 and (math.isnan(add) or add >= 0.0) and s_rem > 0.0
    assert est.top() >= 0.5


def test_accounting_imports_neither_torch_nor_the_ledger():
    code = (
        "import sys, dpfy.accounting, dpfy.accounting.monte_carlo, dpfy.accounting.shuffle; "
        "bad = [m for m in ('torch', 'dpfy.ledger') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

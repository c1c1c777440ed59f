"""accounting.roots: every answer is on the certified side and within the tolerance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfy.accounting import roots


def test_scalar_low_side_is_certified_and_tight() -> None:
    x = roots.safe_root(lambda v: v * v - 2.0, 0.0, 2.0, side="low")
    assert x * x <= 2.0
    assert abs(x - math.sqrt(2.0)) <= 1e-14


def test_scalar_high_side_is_certified_and_tight() -> None:
    x = roots.safe_root(lambda v: 2.0 - v * v, 0.0, 2.0, side="high")
    assert x * x >= 2.0
    assert abs(x - math.sqrt(2.0)) <= 1e-14


@pytest.mark.parametrize("side", ["low", "high"])
def test_coarse_tolerance_still_certified(side: roots.Side) -> None:
    sign = 1.0 if side == "low" else -1.0
    for c in np.linspace(0.1, 3.9, 40):
        x = roots.safe_root(lambda v, c=c: sign * (v - c), 0.0, 4.0, side=side, xtol=1e-3)
        assert sign * (x - c) <= 0.0 and abs(x - c) <= 3e-3


def test_vectorised_with_args() -> None:
    c = np.array([0.5, 1.0, 2.0, 3.0])
    x = roots.safe_root(
        lambda v, c_: v * v - c_, np.zeros(4), 4.0, side="low", args=(c,), vectorized=True
    )
    assert isinstance(x, np.ndarray) and x.shape == (4,)
    assert np.all(x * x <= c) and np.allclose(x, np.sqrt(c), rtol=1e-13)


def test_whole_bracket_certified_returns_far_end_and_bad_bracket_raises() -> None:
    assert roots.safe_root(lambda v: v - 5.0, 0.0, 2.0, side="low") == 2.0
    assert roots.safe_root(lambda v: -v - 5.0, 0.0, 2.0, side="high") == 0.0
    with pytest.raises(ValueError, match="certified end"):
        roots.safe_root(lambda v: v - 1.0, 2.0, 3.0, side="low")
    with pytest.raises(ValueError, match="side"):
        roots.safe_root(lambda v: v, 0.0, 1.0, side="middle")  # type: ignore[arg-type]


def test_infinite_and_nan_values_count_as_uncertified() -> None:
    step = roots.safe_root(lambda v: math.inf if v > 1.0 else -math.inf, 0.0, 2.0, side="low")
    assert step <= 1.0 and step > 1.0 - 1e-12
    x = roots.safe_root(lambda v: math.nan if v > 1.5 else v - 1.0, 0.0, 2.0, side="low")
    assert x <= 1.0 and x > 1.0 - 1e-12


def test_log_root_relative_tolerance() -> None:
    x = roots.safe_log_root(lambda v: v - 1e-7, 1e-12, 1.0, side="low", rtol=1e-6)
    assert x <= 1e-7 and x >= 1e-7 * (1.0 - 3e-6)


def test_integer_searches() -> None:
    calls: list[int] = []

    def square_at_least_50(k: int) -> bool:
        calls.append(k)
        return k * k >= 50

    assert roots.smallest_true(square_at_least_50, 0, 100) == 8
    assert 100 not in calls and len(calls) <= 7
    assert roots.smallest_true(lambda k: False, 3, 10) == 10  # hi vouched for
    assert roots.largest_true(lambda k: k * k <= 50, 0, 100) == 7
    assert roots.largest_true(lambda k: k == 0, 0, 100) == 0  # lo vouched for
    assert roots.largest_true(lambda k: True, 0, 100) == 100


def test_integer_search_vectorised_matches_scalar() -> None:
    thresholds = np.array([50, 2, 1000, 10_001])
    lo = np.array([0, 0, 0, 5])
    hi = np.full(4, 100)

    def pred(k: np.ndarray, index: np.ndarray) -> np.ndarray:
        return k * k >= thresholds[index]

    got = roots.smallest_true_array(pred, lo, hi)
    want = [roots.smallest_true(lambda k, t=t: k * k >= t, int(a), 100)
            for t, a in zip(thresholds, lo, strict=True)]
    assert got.tolist() == want == [8, 2, 32, 100]

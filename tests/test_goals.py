"""The goal verdict rule of benchmarks/goals.py: met if mean - SE >= goal, missed if
mean + SE < goal, else within noise; SE the test split's binomial standard error."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "goals", Path(__file__).resolve().parents[1] / "benchmarks" / "goals.py")
assert _SPEC is not None and _SPEC.loader is not None
goals = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(goals)


def test_the_standard_error_is_the_binomial_one():
    assert goals.standard_error(0.5, 100) == pytest.approx(0.05)
    assert goals.standard_error(0.9888, 10_000) == pytest.approx(
        math.sqrt(0.9888 * 0.0112 / 10_000))
    assert goals.standard_error(1.0, 7) == 0.0


@pytest.mark.parametrize(("mean", "goal", "n", "expected"), [
    (80.0, 75.0, 1000, "met"),            # SE 1.26 points: 78.7 >= 75
    (80.0, 78.8, 1000, "within noise"),   # 78.74 < 78.8 <= 81.26
    (80.0, 81.2, 1000, "within noise"),
    (80.0, 81.3, 1000, "missed"),         # 81.26 < 81.3
    (98.88, 98.8, 10_000, "within noise"),  # SE 0.105: 98.775 < 98.8
    (77.19, 78.9, 1975, "missed"),        # SE 0.94: 78.13 < 78.9
    (50.0, 45.0, 100, "met"),             # exactly mean - SE == goal counts as met
])
def test_verdicts_at_and_around_one_standard_error(mean, goal, n, expected):
    assert goals.verdict(mean, goal, n) == expected
    assert goals.verdict(mean / 100, goal / 100, n, percent=False) == expected


@pytest.mark.parametrize(("args", "message"), [
    ((0.5, 0), "n_test must be an integer >= 1"),
    ((1.5, 10), "accuracy must be in [0, 1]"),
])
def test_bad_inputs_name_the_parameter(args, message):
    with pytest.raises(ValueError, match=None) as err:
        goals.standard_error(*args)
    assert message in str(err.value)
    with pytest.raises(ValueError, match="goal must be in"):
        goals.verdict(80.0, 120.0, 100)

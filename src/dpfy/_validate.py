"""Argument checks shared by every layer: one message template, no dependencies beyond NumPy.

Every public function checks its arguments with :func:`check_range` so that a bad value is
refused with ``"{name} must be in {range}, got {name}={value!r}"`` before anything is computed
or written. Integers beyond float range compare as +-inf instead of raising ``OverflowError``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_range", "check_count", "check_finite_nonneg"]


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` in the project's one template unless ``value`` lies in the range.

    The message reads ``"{name} must be in {range}, got {name}={value!r}"``. NaN is never valid.
    """
    lo = "-inf" if low is None else repr(low)
    hi = "inf" if high is None else repr(high)
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    interval = f"{left}{lo}, {hi}{right}"
    kind = "an integer in " if integer else "in "
    message = f"{name} must be {kind}{interval}, got {name}={value!r}"
    if isinstance(value, bool):
        raise ValueError(message)
    if integer:
        if not isinstance(value, int) and not (
            isinstance(value, float) and value.is_integer()
        ):
            if not isinstance(value, np.integer):
                raise ValueError(message)
    try:
        v = float(value)
    except OverflowError:  # an integer beyond float range: compare as +-inf
        v = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if math.isnan(v):
        raise ValueError(message)
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(message)
    if high is not None and (v > high or (high_open and v == high)):
        raise ValueError(message)


def check_finite_nonneg(name: str, value: Any) -> None:
    """``check_range(name, value, 0, inf)`` with a fast path for plain ints and floats."""
    if type(value) in (float, int) and 0.0 <= value < math.inf:
        return
    check_range(name, value, 0.0, math.inf, high_open=True)


def check_count(name: str, value: Any) -> None:
    """``check_range(name, value, 0, None, integer=True)`` with a fast path for plain ints."""
    if type(value) is int and value >= 0:
        return
    check_range(name, value, 0, None, integer=True)

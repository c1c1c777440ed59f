"""Argument checks shared by every layer: one message template, no dependencies beyond NumPy.

Every public function checks its arguments with :func:`check_range` so that a bad value is
refused with ``"{name} must be in {range}, got {name}={value!r}"`` before anything is computed
or written. Integers beyond float range compare as +-inf instead of raising ``OverflowError``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

#: Largest count (sizes, steps, samples, limits) accepted anywhere: 2**53, the largest range
#: in which every integer is an exact float, so no count overflows float arithmetic downstream.
MAX_COUNT = 2**53
#: Seeds are in [0, 2**63 - 1] (a signed 64-bit integer: torch and NumPy accept all of them).
MAX_SEED = 2**63 - 1
#: Largest target epsilon: beyond it an (epsilon, delta) statement promises nothing
#: (exp(100) ~ 2.7e43) and exp(epsilon) arithmetic nears float overflow.
MAX_EPSILON = 100.0
#: Largest value of a float that scales tensors (clip norm, learning rate): its products with a
#: noise multiplier and a norm stay far inside float32 range (about 3.4e38).
MAX_SCALE = 1e15


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
    shown = _short_repr(value)
    message = f"{name} must be {kind}{interval}, got {name}={shown}"
    if isinstance(value, bool | str | bytes):  # a number is a number: "1" is not 1
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
    if type(value) is float and 0.0 <= value < math.inf:
        return
    check_range(name, value, 0.0, math.inf, high_open=True)


def check_count(name: str, value: Any) -> None:
    """An integer in ``[0, MAX_COUNT]``, with a fast path for plain ints."""
    if type(value) is int and 0 <= value <= MAX_COUNT:
        return
    check_range(name, value, 0, MAX_COUNT, integer=True)


def _short_repr(value: Any) -> str:
    """``repr(value)``, with the middle of a very long one elided (a 400-digit integer stays
    one readable line)."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond the int -> str digit limit
        return f"<int of more than {4300} digits>"
    return text if len(text) <= 60 else f"{text[:25]}...<{len(text)} chars>...{text[-10:]}"


def check_int(name: str, value: Any, low: int = 1, high: int = MAX_COUNT) -> None:
    """An integer in ``[low, high]`` (default: a positive count up to :data:`MAX_COUNT`)."""
    if type(value) is int and low <= value <= high:
        return
    check_range(name, value, low, high, integer=True)


def check_seed(name: str, value: Any) -> None:
    """A seed: an integer in ``[0, MAX_SEED]``."""
    check_int(name, value, 0, MAX_SEED)


def check_positive(name: str, value: Any, high: float = math.inf) -> None:
    """A finite float in ``(0, high]`` (``(0, inf)`` by default): never inf, never NaN."""
    if high == math.inf:
        check_range(name, value, 0.0, math.inf, low_open=True, high_open=True)
    else:
        check_range(name, value, 0.0, high, low_open=True)


def check_real(name: str, value: Any) -> None:
    """A JSON number read from a file: an ``int`` or ``float`` (not a bool, not a string).

    Raises ``TypeError`` naming the field otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {name}={_short_repr(value)}")


def _encodable(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{name} must be a path whose name is valid UTF-8, got {name}={text!r}"
        ) from None


def check_output_path(name: str, value: Any) -> None:
    """An output directory: a non-empty, UTF-8 path that is not an existing non-directory and
    whose nearest existing ancestor is a writable directory (so it can be created).

    Nothing is created; raises ``ValueError`` naming ``name`` otherwise.
    """
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} must be a non-empty directory path, got {name}={value!r}")
    _encodable(name, text)
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} must be a directory, got {name}={text!r} (an existing file)")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK) or (
        parent != path and _is_pseudo_fs(parent)
    ):
        raise ValueError(
            f"{name} must be a directory that can be created, got {name}={text!r} "
            f"({parent!r} is not a writable directory)"
        )


def _is_pseudo_fs(path: str) -> bool:
    """``/proc`` and ``/sys`` refuse new directories even to root."""
    real = os.path.realpath(path)
    return any(real == p or real.startswith(p + os.sep) for p in ("/proc", "/sys"))


def check_input_file(name: str, value: Any) -> None:
    """An existing, readable regular file with a UTF-8 name; ``ValueError`` naming ``name``
    otherwise (the file is opened for reading once, so a permission problem is one line)."""
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not os.path.isfile(text):
        raise ValueError(f"{name} must be an existing file, got {name}={value!r}")
    _encodable(name, text)
    try:
        with open(text, "rb"):
            pass
    except OSError as err:
        raise ValueError(
            f"{name} must be a readable file, got {name}={value!r} ({err.strerror or err})"
        ) from None

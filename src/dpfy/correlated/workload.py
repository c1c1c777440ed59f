"""The prefix-sum workload and lower-triangular Toeplitz algebra shared by the strategies.

A lower-triangular Toeplitz ``T x T`` matrix is fully described by its first column
``coeffs`` (``M[i, j] = coeffs[i - j]`` for ``i >= j``); products and inverses of such matrices
are again lower-triangular Toeplitz, so the strategies never need the ``T x T`` matrix except
in tests (Choquette-Choo et al. 2023, Sec. 4; McMahan et al. 2024, Sec. 2).
"""

from __future__ import annotations

import numpy as np

from dpfy._validate import check_int


def prefix_sum_matrix(steps: int) -> np.ndarray:
    """The workload ``A``: ``(A x)_t = x_0 + ... + x_t`` (lower-triangular ones, square)."""
    check_int("steps", steps)
    return np.tril(np.ones((steps, steps)))


def toeplitz_lower(coeffs: np.ndarray, steps: int) -> np.ndarray:
    """The ``steps x steps`` lower-triangular Toeplitz matrix with first column ``coeffs``.

    ``coeffs`` shorter than ``steps`` is zero-padded (a banded matrix); longer is truncated.
    """
    check_int("steps", steps)
    col = np.zeros(steps)
    c = np.asarray(coeffs, dtype=float)[:steps]
    col[: c.size] = c
    idx = np.arange(steps)
    diff = idx[:, None] - idx[None, :]
    return np.where(diff >= 0, col[np.clip(diff, 0, None)], 0.0)


def toeplitz_inverse_coeffs(coeffs: np.ndarray, steps: int) -> np.ndarray:
    """First column of the inverse of the lower-triangular Toeplitz matrix of ``coeffs``.

    The inverse's first column is the impulse response of ``1 / C(z)`` (``C(z)`` the
    generating polynomial of ``coeffs``), computed by a linear filter in ``O(steps * len)``.

    Raises:
        ValueError: if ``coeffs[0]`` is not a positive finite number (the matrix is singular).
    """
    check_int("steps", steps)
    c = np.asarray(coeffs, dtype=float)
    if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
        raise ValueError(f"coeffs[0] must be in (0, inf), got coeffs={c!r}")
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    # imported here: scipy.signal pulls in scipy.stats and more (seconds), and every ledger
    # reader imports this module without needing a filter
    from scipy.signal import lfilter

    return np.asarray(lfilter([1.0], c, impulse))


def prefix_error_total(inverse_coeffs: np.ndarray) -> float:
    """``||A C^{-1}||_F^2`` for lower-triangular Toeplitz ``C^{-1}`` with first column given.

    ``A C^{-1}`` is lower-triangular Toeplitz with first column ``s = cumsum(inverse_coeffs)``,
    and diagonal ``n`` appears ``T - n`` times, so the squared Frobenius norm (the total
    variance of the released prefix sums per unit noise) is ``sum_n (T - n) s_n^2``.
    """
    s = np.cumsum(np.asarray(inverse_coeffs, dtype=float))
    weights = np.arange(s.size, 0, -1, dtype=float)
    return float(np.dot(weights, s * s))

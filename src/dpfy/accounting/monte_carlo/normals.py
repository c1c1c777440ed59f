"""Standard-normal helpers shared by the samplers: log CDF, row-wise log-sum-exp, and
truncated draws. All arrays are float64 unless stated."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import special

from dpfy.accounting.monte_carlo.base import AnyFloatArray, FloatArray


def log_cdf(x: Any) -> Any:
    """log Phi(x), the standard normal log CDF (accurate far in the left tail)."""
    return special.log_ndtr(x)


def log_sum_exp_rows(a: AnyFloatArray) -> FloatArray:
    """log sum_j exp(a[i, j]) for every row i, stable for large entries.

    Computed in the precision of ``a``; returned as float64 (exact for float32 input).
    """
    m = a.max(axis=1)
    return np.asarray(m + np.log(np.exp(a - m[:, None]).sum(axis=1)), dtype=np.float64)


def truncated_normals_below(
    bound: FloatArray,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    dtype: type[np.floating[Any]] = np.float64,
) -> AnyFloatArray:
    """i.i.d. N(0,1) conditioned on <= bound (per row), via draw-and-fix-up.

    A draw above the bound is replaced by an exact conditional draw Phi^-1(u Phi(bound)); the
    mixture is exactly the conditional law. ``dtype`` is that of the draws (float32 halves
    memory for the samplers' fast paths).
    """
    g: AnyFloatArray = rng.standard_normal(shape, dtype=dtype)
    b = np.broadcast_to(bound.reshape(-1, *([1] * (len(shape) - 1))), shape)
    bad = g > b
    if bad.any():
        bb = b[bad].astype(np.float64)
        u = rng.random(bb.shape)
        g[bad] = special.ndtri(u * special.ndtr(bb)).astype(dtype)
    return g

"""Upper confidence bounds on means of [0, 1]-valued samples (Chernoff-Hoeffding, Bernoulli KL).

Chua et al. 2025 (Alg. 4, Thm. 4.1) bound a Monte Carlo delta this way: with probability
>= 1 - error_probability the true mean is at most the reported bound (Hoeffding 1963, Thm. 1).
"""

from __future__ import annotations

import math

import numpy as np

from dpfy._validate import check_int, check_range
from dpfy.accounting import roots
from dpfy.accounting.monte_carlo.base import FloatArray


def _bernoulli_kl(p: FloatArray, q: FloatArray) -> FloatArray:
    """kl(p || q) of Bernoulli laws, elementwise (0 log 0 = 0)."""
    p = np.clip(p, 0.0, 1.0)
    q = np.clip(q, 1e-300, 1.0 - 1e-16)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
        b = np.where(p < 1, (1 - p) * (np.log1p(-p) - np.log1p(-q)), 0.0)
    out: FloatArray = a + b
    return out


def kl_upper_bound(mean: float | FloatArray, n: int, error_probability: float) -> FloatArray:
    """Upper confidence bound on the mean of i.i.d. [0, 1]-valued variables.

    The largest q >= mean with ``n * kl(mean || q) <= log(1 / error_probability)``
    (Chernoff-Hoeffding; Hoeffding 1963, Thm. 1): the true mean exceeds it with probability at
    most ``error_probability``. Vectorised over ``mean``.
    """
    check_int("n", n)
    check_range("error_probability", error_probability, 0.0, 1.0, low_open=True, high_open=True)
    target = math.log(1.0 / error_probability) / n
    if np.ndim(mean) == 0:
        return np.asarray(_kl_ucb_scalar(float(mean), target))
    m = np.clip(np.asarray(mean, dtype=float), 0.0, 1.0)
    # kl(m || q) increases in q >= m: the certified side is q with kl(m || q) >= target.
    return np.asarray(
        roots.safe_root(
            lambda q, m_: np.where(q >= 1.0, -np.inf, target - _bernoulli_kl(m_, q)),
            m,
            np.ones_like(m),
            side="high",
            args=(m,),
            vectorized=True,
        )
    )


def _kl_ucb_scalar(m: float, target: float) -> float:
    """The scalar case of :func:`kl_upper_bound` (a root in q on [m, 1])."""
    m = min(max(m, 0.0), 1.0)
    if m >= 1.0:
        return 1.0

    def kl(q: float) -> float:
        a = m * (math.log(m) - math.log(q)) if m > 0 else 0.0
        return a + (1 - m) * (math.log1p(-m) - math.log1p(-q))

    return roots.safe_root(lambda q: -math.inf if q >= 1.0 else target - kl(q), m, 1.0, side="high")

"""Banded Toeplitz matrix factorization (BandMF; Choquette-Choo et al. 2023, "(Amplified)
banded matrix factorization: a unified approach to private training", Sec. 4).

The strategy ``C`` is lower-triangular Toeplitz with ``band`` non-zero diagonals
``c_0 = 1, c_1, ..., c_{b-1}``; the per-step noise ``w = C^{-1} z`` obeys the recursion
``w_t = z_t - sum_{k=1}^{b-1} c_k w_{t-k}``, so the stream keeps ``b - 1`` buffers of the
parameters' shape and never forms a ``T x T`` matrix. With ``c >= 0``, ``C^T C >= 0`` and,
for participations at least ``b`` steps apart, the pattern's columns are orthogonal: the
sensitivity under ``k`` participations separated by ``>= b`` steps is
``sqrt(sum_{i < k} ||c[: T - i sep]||^2)`` (the earliest pattern, column norms decrease).

:func:`optimize_bandmf` minimises the total (or the largest) squared error of the released
prefix sums, ``||A C^{-1}||_F^2 x sens^2`` (or the max row norm instead), over
``c_1..c_{b-1} >= 0`` with L-BFGS-B, starting from the optimal-Toeplitz square-root
coefficients ``binom(2k, k) / 4^k`` of Fichtenberger et al. 2023 truncated to the band.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import numpy as np
from scipy.optimize import minimize
from scipy.special import gammaln

from dpfy._validate import check_finite_nonneg, check_int
from dpfy.correlated.workload import prefix_error_total, toeplitz_inverse_coeffs, toeplitz_lower

Objective = Literal["total", "max"]


class BandMF:
    """A banded Toeplitz strategy.

    Args:
        coeffs: ``c_0 .. c_{b-1}`` (``c_0 > 0``; ``band = len(coeffs)``).
    """

    def __init__(self, coeffs: np.ndarray) -> None:
        c = np.asarray(coeffs, dtype=float)
        if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
            raise ValueError(f"coeffs[0] must be in (0, inf) with finite entries, got {c!r}")
        self.coeffs = c

    @property
    def band(self) -> int:
        return int(self.coeffs.size)

    def strategy_matrix(self, steps: int) -> np.ndarray:
        return toeplitz_lower(self.coeffs, steps)

    def noise_covariance(self, steps: int) -> np.ndarray:
        """Covariance of the per-step noise ``C^{-1} z`` per unit ``sigma^2``."""
        inv = toeplitz_lower(toeplitz_inverse_coeffs(self.coeffs, steps), steps)
        return np.asarray(inv @ inv.T)

    def separated_sensitivity(self, steps: int, participations: int = 1) -> float:
        """Sensitivity for ``participations`` uses ``>= band`` steps apart (exact, ``c >= 0``)."""
        check_int("steps", steps)
        check_int("participations", participations)
        c = self.coeffs[:steps]
        total = 0.0
        for i in range(participations):
            start = i * self.band
            if start >= steps:
                break
            keep = min(steps - start, c.size)
            total += float(np.dot(c[:keep], c[:keep]))
        return float(np.sqrt(total))


class BandMFNoise:
    """Streaming per-step noise ``w = C^{-1} z`` of a :class:`BandMF`, ``band - 1`` buffers.

    Args:
        strategy: the banded strategy.
        shape: shape of one step's noise.
        noise_std: standard deviation of ``z`` (clip norm x noise multiplier).
        rng: the NumPy generator ``z`` is drawn from.
    """

    def __init__(
        self,
        strategy: BandMF,
        shape: tuple[int, ...],
        noise_std: float,
        rng: np.random.Generator,
    ) -> None:
        check_finite_nonneg("noise_std", noise_std)
        self.coeffs = strategy.coeffs
        self.shape = tuple(shape)
        self.noise_std = float(noise_std)
        self.rng = rng
        self.history: deque[np.ndarray] = deque(maxlen=max(strategy.band - 1, 1))

    def next(self) -> np.ndarray:
        """The noise to add to the current step's clipped sum; advances one step."""
        w = self.noise_std * self.rng.standard_normal(self.shape)
        for k, prev in enumerate(reversed(self.history), start=1):
            if k >= self.coeffs.size:
                break
            w -= self.coeffs[k] * prev
        w /= self.coeffs[0]
        if self.coeffs.size > 1:
            self.history.append(w)
        return w

    def state_dict(self) -> dict[str, Any]:
        """The last ``band - 1`` noises and the generator state. Secret (see :class:`TreeNoise`)."""
        return {"history": [h.copy() for h in self.history], "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: the stream continues bit for bit."""
        self.history.clear()
        self.history.extend(np.array(h) for h in state["history"])
        self.rng.bit_generator.state = state["rng"]


def _sqrt_coeffs(n: int) -> np.ndarray:
    k = np.arange(n, dtype=float)
    return np.asarray(np.exp(gammaln(2 * k + 1) - 2 * gammaln(k + 1) - k * np.log(4.0)))


def _loss(coeffs: np.ndarray, steps: int, participations: int, objective: Objective) -> float:
    strat = BandMF(coeffs)
    inv = toeplitz_inverse_coeffs(coeffs, steps)
    if objective == "total":
        err = prefix_error_total(inv)
    else:
        s = np.cumsum(inv)
        err = float(np.dot(s, s))
    return err * strat.separated_sensitivity(steps, participations) ** 2


def optimize_bandmf(
    steps: int,
    band: int,
    participations: int = 1,
    objective: Objective = "total",
    maxiter: int = 500,
) -> BandMF:
    """Optimise the band coefficients for ``steps`` steps.

    Args:
        steps: number of steps ``T``.
        band: number of non-zero diagonals ``b`` (``1 <= b <= T``; ``b = 1`` is DP-SGD).
        participations: participations per example, at least ``band`` steps apart.
        objective: ``"total"`` (sum of the prefix sums' variances) or ``"max"`` (the largest).
        maxiter: L-BFGS-B iterations.

    Returns:
        The optimised :class:`BandMF` (``c_0 = 1``, ``c_k >= 0``).
    """
    check_int("steps", steps)
    check_int("band", band, high=steps)
    check_int("participations", participations)
    check_int("maxiter", maxiter)
    if objective not in ("total", "max"):
        raise ValueError(f"objective must be in {{'total', 'max'}}, got objective={objective!r}")
    init = _sqrt_coeffs(band)
    if band == 1:
        return BandMF(init)

    def f(x: np.ndarray) -> float:
        return _loss(np.concatenate(([1.0], x)), steps, participations, objective)

    res = minimize(
        f,
        init[1:],
        method="L-BFGS-B",
        bounds=[(0.0, None)] * (band - 1),
        options={"maxiter": maxiter},
    )
    best = res.x if res.fun <= f(init[1:]) else init[1:]
    return BandMF(np.concatenate(([1.0], best)))

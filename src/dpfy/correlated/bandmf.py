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

:class:`BandMF` is the registered strategy ``"bandmf"``; :class:`BandMFStream` its noise.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Literal

import numpy as np
from scipy.special import gammaln

from dpfy._validate import check_int
from dpfy.correlated.schemas import Cyclic, Schema
from dpfy.correlated.strategy import (
    AddNoise,
    NoiseStream,
    Params,
    Tensor,
    ToeplitzStrategy,
    register_strategy,
)
from dpfy.correlated.workload import prefix_error_total, toeplitz_inverse_coeffs

Objective = Literal["total", "max"]


@register_strategy
class BandMF(ToeplitzStrategy):
    """A banded Toeplitz strategy (``"bandmf"``; a plan records ``coeffs``, ``c_0 = 1``).

    Args:
        coeffs: ``c_0 .. c_{b-1}`` (``c_0 > 0``; ``band = len(coeffs)``).
    """

    name = "bandmf"
    keys = ("coeffs",)

    def __init__(self, coeffs: np.ndarray) -> None:
        c = np.asarray(coeffs, dtype=float)
        if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
            raise ValueError(f"coeffs[0] must be in (0, inf) with finite entries, got {c!r}")
        self.coeffs = c

    @classmethod
    def from_params(cls, params: Params, steps: int) -> BandMF:
        c = np.asarray(params["coeffs"], dtype=float)
        if c.size == 0 or c[0] != 1.0 or np.any(c < 0):
            raise ValueError(
                f"coeffs must start with 1 and be >= 0 (BandMF), got coeffs={c.tolist()!r}"
            )
        return cls(c)

    @classmethod
    def optimised(
        cls, steps: int, schema: Schema, *, band: int, buffers: int, maxiter: int
    ) -> BandMF:
        """:func:`optimize_bandmf` for ``k`` participations ``>= band`` apart (``k`` the
        epochs of a cyclic schema, whose period must then be ``>= band``), ``c_0 = 1``."""
        check_int("band", band, high=steps)
        k = 1
        if isinstance(schema, Cyclic):
            if schema.period < band:
                raise ValueError(
                    f"band must be in [1, {schema.period}] (the cyclic period: participations "
                    f"are a period apart), got band={band}"
                )
            k = -(-steps // schema.period)
        coeffs = optimize_bandmf(steps, band, participations=k, maxiter=maxiter).coeffs
        return cls(coeffs / coeffs[0])

    def params(self) -> dict[str, tuple[float, ...]]:
        return {"coeffs": tuple(float(c) for c in self.coeffs)}

    @property
    def band(self) -> int:
        return int(self.coeffs.size)

    def first_column(self, steps: int) -> np.ndarray:
        c = np.zeros(steps)
        k = min(steps, self.band)
        c[:k] = self.coeffs[:k]
        return c

    def inverse_column(self, steps: int) -> np.ndarray:
        return toeplitz_inverse_coeffs(self.coeffs, steps)

    def noise_covariance(self, steps: int) -> np.ndarray:
        """Covariance of the per-step noise ``C^{-1} z`` per unit ``sigma^2``."""
        inv = self.noise_map(steps)
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

    def state_rows(self, steps: int) -> int:
        return max(self.band - 1, 0)

    def largest_fitting(self, rows: int) -> tuple[str, int] | None:
        return ("band", rows + 1)

    def stream(self, steps: int, size: int, like: Tensor, xp: ModuleType) -> BandMFStream:
        return BandMFStream(self.coeffs, steps, size, like, xp)


class BandMFStream(NoiseStream):
    """``w_t = z_t - sum_{k<b} c_k w_{t-k}`` (``c_0 = 1``), the last ``b - 1`` noises in a
    ring buffer (row ``r`` holds ``w_{t-k}``, ``k = ((head - 1 - r) mod (b - 1)) + 1``;
    rows not yet written are 0)."""

    def __init__(
        self, coeffs: np.ndarray, steps: int, size: int, like: Tensor, xp: ModuleType
    ) -> None:
        super().__init__(steps, size, max(len(coeffs) - 1, 0), like)
        self.coeffs, self.xp = [float(c) for c in coeffs], xp

    def _next(self, z: Tensor, refill: Callable[[], None] | None, add: AddNoise | None) -> Tensor:
        buf, w, m = self.buf, self.w, self.buf.shape[0]
        if m == 0:
            return w.copy_(z)
        coef = buf.new_tensor([self.coeffs[(self.head - 1 - r) % m + 1] for r in range(m)])
        self.xp.addmv(z, buf.T, coef, alpha=-1.0, out=w)
        buf[self.head].copy_(w)
        self.head = (self.head + 1) % m
        return w


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

    from scipy.optimize import minimize  # imported when used: a heavy import

    res = minimize(
        f,
        init[1:],
        method="L-BFGS-B",
        bounds=[(0.0, None)] * (band - 1),
        options={"maxiter": maxiter},
    )
    best = res.x if res.fun <= f(init[1:]) else init[1:]
    return BandMF(np.concatenate(([1.0], best)))

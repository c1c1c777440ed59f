"""Buffered linear Toeplitz (BLT) noise (McMahan et al. 2024, "Efficient and near-optimal noise
generation for streaming differential privacy"; Dvijotham et al. 2024).

The inverse strategy ``C^{-1}`` is lower-triangular Toeplitz with first column
``r_0 = 1, r_k = sum_i omega_i theta_i^{k-1}`` (``d`` buffers, ``0 <= theta_i < 1``). The
per-step noise ``w = C^{-1} z`` streams with ``d`` buffers of the parameters' shape:
``w_t = z_t + sum_i omega_i s_i`` then ``s_i <- theta_i s_i + z_t`` (``O(d x params)``
memory). ``C`` itself is the Toeplitz matrix of the rational series ``D(x) / N(x)``,
``D = prod_i (1 - theta_i x)``, ``N = D + x sum_i omega_i prod_{j != i} (1 - theta_j x)``,
computed by a linear filter for the sensitivity (:mod:`.schemas`). :func:`optimize_blt`
fits the parameters for ``T`` steps and a single epoch (total squared error of the prefix sums
times sensitivity^2, L-BFGS-B) with ``theta_i = sigmoid(b_i)`` and
``omega_i = -(1 - theta_i) s p_i`` (``p = softmax(a)``, ``s = sigmoid(q) < 1``): negative
weights, the sign pattern of the inverse of the optimal Toeplitz square root ``(1 - x)^{1/2}``
(Fichtenberger et al. 2023), and ``sum_i |omega_i| / (1 - theta_i) = s < 1``, so ``C^{-1}(x)``
has no zero in the closed unit disc and ``C``'s coefficients stay bounded.

:class:`BLT` is the registered strategy ``"blt"``; :class:`BLTStream` its noise.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
from numpy.polynomial import polynomial as P

from dpfy._validate import check_int
from dpfy.correlated.schemas import Schema
from dpfy.correlated.strategy import (
    AddNoise,
    NoiseStream,
    Params,
    Tensor,
    ToeplitzStrategy,
    register_strategy,
)
from dpfy.correlated.workload import prefix_error_total


@register_strategy
class BLT(ToeplitzStrategy):
    """A BLT strategy given by its inverse's buffer weights and decays (``"blt"``; a plan
    records ``omega`` and ``theta``).

    Args:
        omega: buffer weights ``omega_i`` (finite).
        theta: buffer decays ``theta_i`` in ``[0, 1)`` (same length as ``omega``).
    """

    name = "blt"
    keys = ("omega", "theta")

    def __init__(self, omega: np.ndarray, theta: np.ndarray) -> None:
        w = np.atleast_1d(np.asarray(omega, dtype=float))
        t = np.atleast_1d(np.asarray(theta, dtype=float))
        if w.ndim != 1 or w.shape != t.shape or not np.all(np.isfinite(w)):
            raise ValueError(
                f"omega must be a finite 1-D array shaped like theta, got omega={w!r}, theta={t!r}"
            )
        if not np.all((t >= 0) & (t < 1)):
            raise ValueError(f"theta must be in [0, 1), got theta={t!r}")
        self.omega, self.theta = w, t

    @classmethod
    def from_params(cls, params: Params, steps: int) -> BLT:
        strat = cls(np.asarray(params["omega"]), np.asarray(params["theta"]))
        if np.any(strat.coeffs(steps) < -1e-12):
            raise ValueError(
                "the BLT strategy C must have entries >= 0 (so that C^T C >= 0 and the "
                "sensitivity is exact); got a negative coefficient"
            )
        return strat

    @classmethod
    def optimised(cls, steps: int, schema: Schema, *, band: int, buffers: int, maxiter: int) -> BLT:
        """:func:`optimize_blt` with ``buffers`` buffers (fitted for one epoch)."""
        return optimize_blt(steps, buffers, maxiter=maxiter)

    def params(self) -> dict[str, tuple[float, ...]]:
        return {"omega": tuple(float(w) for w in self.omega),
                "theta": tuple(float(t) for t in self.theta)}

    @property
    def band(self) -> int:
        return self.buffers

    @property
    def buffers(self) -> int:
        return int(self.omega.size)

    def inverse_coeffs(self, steps: int) -> np.ndarray:
        """First column of ``C^{-1}``: ``1, sum_i omega_i theta_i^{k-1}``."""
        check_int("steps", steps)
        k = np.arange(1, steps)
        r = np.empty(steps)
        r[0] = 1.0
        r[1:] = (self.omega[None, :] * self.theta[None, :] ** (k[:, None] - 1)).sum(axis=1)
        return r

    def coeffs(self, steps: int) -> np.ndarray:
        """First column of ``C`` (the series of ``D / N``)."""
        check_int("steps", steps)
        den = np.array([1.0])
        for th in self.theta:
            den = P.polymul(den, [1.0, -th])
        num = np.array(den, dtype=float)
        for i, om in enumerate(self.omega):
            rest = np.array([1.0])
            for j, th in enumerate(self.theta):
                if j != i:
                    rest = P.polymul(rest, [1.0, -th])
            num = P.polyadd(num, om * P.polymulx(rest))
        impulse = np.zeros(steps)
        impulse[0] = 1.0
        # scipy.signal and scipy.optimize are imported where they are used: importing them
        # costs seconds, and every ledger reader imports this module
        from scipy.signal import lfilter

        return np.asarray(lfilter(den, num, impulse))

    def first_column(self, steps: int) -> np.ndarray:
        return self.coeffs(steps)

    def inverse_column(self, steps: int) -> np.ndarray:
        return self.inverse_coeffs(steps)

    def noise_covariance(self, steps: int) -> np.ndarray:
        """Covariance of the per-step noise ``C^{-1} z`` per unit ``sigma^2``."""
        inv = self.noise_map(steps)
        return np.asarray(inv @ inv.T)

    def state_rows(self, steps: int) -> int:
        return self.buffers

    def largest_fitting(self, rows: int) -> tuple[str, int] | None:
        return ("buffers", rows)

    def stream(self, steps: int, size: int, like: Tensor, xp: ModuleType) -> BLTStream:
        return BLTStream(self, steps, size, like, xp)


#: Values per chunk of the BLT update: its d + 2 slices stay in cache between the passes.
_CHUNK = 1 << 17


class BLTStream(NoiseStream):
    """``w_t = z_t + sum_i omega_i s_i``, then ``s_i <- theta_i s_i + z_t``, one buffer
    ``s_i`` per decay, in cache-sized chunks (one pass for ``w_t``, one fused pass for the
    buffers) that also hand ``w_t`` to ``add``."""

    fuses_add = True

    def __init__(
        self, strategy: BLT, steps: int, size: int, like: Tensor, xp: ModuleType
    ) -> None:
        super().__init__(steps, size, strategy.buffers, like)
        self.omega = like.new_tensor([float(w) for w in strategy.omega])
        self.theta = like.new_tensor([float(t) for t in strategy.theta])
        self.xp = xp

    def _next(self, z: Tensor, refill: Callable[[], None] | None, add: AddNoise | None) -> Tensor:
        theta = self.theta[:, None]
        for a in range(0, self.size, _CHUNK):
            b = min(a + _CHUNK, self.size)
            zc, sc, wc = z[a:b], self.buf[:, a:b], self.w[a:b]
            self.xp.addmv(zc, sc.T, self.omega, out=wc)
            self.xp.addcmul(zc.expand_as(sc), sc, theta, out=sc)
            if add is not None:
                add(a, b, wc)
        return self.w


def blt_loss(strategy: BLT, steps: int) -> float:
    """Single-epoch total squared prefix error ``||A C^{-1}||_F^2 x ||c[:T]||^2``."""
    c = strategy.coeffs(steps)
    return prefix_error_total(strategy.inverse_coeffs(steps)) * float(np.dot(c, c))


def optimize_blt(steps: int, buffers: int = 4, maxiter: int = 300) -> BLT:
    """Fit a ``buffers``-buffer BLT for ``steps`` steps and a single epoch (see module doc).

    Args:
        steps: number of steps ``T``.
        buffers: number of buffers ``d`` (``1..16``).
        maxiter: L-BFGS-B iterations.
    """
    check_int("steps", steps)
    check_int("buffers", buffers, high=16)
    check_int("maxiter", maxiter)

    def make(x: np.ndarray) -> BLT:
        a, b, q = x[:buffers], np.clip(x[buffers : 2 * buffers], -30.0, 30.0), x[-1]
        theta = np.minimum(1.0 / (1.0 + np.exp(-b)), 1.0 - 1e-12)
        p = np.exp(a - a.max())
        s = 1.0 / (1.0 + np.exp(-np.clip(q, -30.0, 30.0)))
        return BLT(-(1.0 - theta) * s * p / p.sum(), theta)

    def f(x: np.ndarray) -> float:
        loss = blt_loss(make(x), steps)
        return loss if np.isfinite(loss) else 1e300

    decays = 1.0 - np.logspace(-0.5, -np.log10(max(steps, 10)), buffers)
    x0 = np.concatenate((np.zeros(buffers), np.log(decays / (1 - decays)), [0.0]))
    from scipy.optimize import minimize

    res = minimize(f, x0, method="L-BFGS-B", options={"maxiter": maxiter})
    return make(res.x if res.fun <= f(x0) else x0)

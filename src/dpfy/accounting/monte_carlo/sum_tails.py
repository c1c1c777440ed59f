"""Chernoff bounds on the tails of a sum of i.i.d. log-normal terms (for :mod:`.conditional`).

S = sum of n i.i.d. e^(g/z), g ~ N(0, 1). Right tail: P(S >= s) <= n P(g > m) +
exp(-lam s + n log E[e^(lam e^(g/z)); g <= m]) minimised over (m, lam); left tail: the exact
Laplace transform, P(S <= s) <= exp(lam s + n log E[e^(-lam e^(g/z))]). The moment generating
functions are computed by Gauss-Legendre quadrature on g in [-16, m].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from dpfy.accounting.monte_carlo.base import FloatArray

QuadratureRule = tuple[FloatArray, FloatArray]


@functools.cache
def gauss_legendre_rule(points: int) -> QuadratureRule:
    """The ``points``-point Gauss-Legendre rule on [-1, 1], computed on first use (400 points
    take a tenth of a CPU-second; importing the accountant should not pay it)."""
    nodes, weights = np.polynomial.legendre.leggauss(points)
    nodes.flags.writeable = weights.flags.writeable = False  # shared by every caller
    return nodes, weights


def gauss_legendre(a: FloatArray, b: FloatArray, points: int) -> tuple[FloatArray, FloatArray]:
    """Nodes and weights of the ``points``-point Gauss-Legendre rule mapped to [a, b]
    (broadcast over a trailing axis)."""
    x, w = gauss_legendre_rule(points)
    half = (b - a)[..., None] / 2.0
    return a[..., None] + half * (x + 1.0), half * w


class SumTails:
    """Chernoff bounds on the tails of S = sum of n i.i.d. e^{g/z}, g ~ N(0, 1).

    With ``truncate = m*`` the terms are conditioned on g <= m* (stratum without big terms):
    the union-bound term disappears and the moment generating functions are normalised by
    Phi(m*).
    """

    def __init__(self, z: float, n: int, truncate: float | None = None) -> None:
        self.z, self.n = z, n
        # right tail: P(S >= s) <= n P(g > m) + exp(-lam s + n log E[e^{lam Y}; g <= m])
        if truncate is None:
            self.m = np.linspace(0.0, 10.0, 41)
            log_norm = np.zeros_like(self.m)
            self.log_union = math.log(n) + special.log_ndtr(-self.m)  # log n P(g > m)
        else:
            self.m = np.array([float(truncate)])
            log_norm = special.log_ndtr(self.m)
            self.log_union = np.array([-np.inf])
        theta = np.geomspace(1e-4, 40.0, 48)
        lam = theta[None, :] * np.exp(-self.m[:, None] / z)  # lam e^{g/z} <= theta on g <= m
        g, w = gauss_legendre(np.full(self.m.shape, -16.0), self.m, 400)  # (M, 400)
        log_phi = -0.5 * g * g - 0.5 * math.log(2 * math.pi)
        y = np.exp(g / z)
        expo = log_phi[:, None, :] + lam[:, :, None] * y[:, None, :]  # (M, L, 400)
        mx = expo.max(axis=-1, keepdims=True)
        self.log_mgf = mx[..., 0] + np.log(np.sum(w[:, None, :] * np.exp(expo - mx), axis=-1))
        self.log_mgf -= log_norm[:, None]
        self.lam = lam
        # left tail: P(S <= s) <= exp(lam s + n log E[e^{-lam Y}])
        self.lam_left = np.geomspace(1e-8, 1e3, 400) * math.exp(-0.5 / (z * z))
        top = 16.0 if truncate is None else min(16.0, float(truncate))
        g2, w2 = gauss_legendre(np.array(-16.0), np.array(top), 400)
        log_phi2 = -0.5 * g2 * g2 - 0.5 * math.log(2 * math.pi)
        e2 = log_phi2[None, :] - self.lam_left[:, None] * np.exp(g2 / z)[None, :]
        mx2 = e2.max(axis=-1, keepdims=True)
        self.log_lt = mx2[:, 0] + np.log(np.sum(w2[None, :] * np.exp(e2 - mx2), axis=-1))
        if truncate is not None:
            self.log_lt -= float(special.log_ndtr(truncate))

    def right(self, s: FloatArray) -> FloatArray:
        s = np.asarray(s, dtype=float)
        chern = -self.lam[None] * s[:, None, None] + self.n * self.log_mgf[None]  # (S, M, L)
        best = np.logaddexp(self.log_union[None, :], chern.min(axis=-1))  # (S, M)
        out: FloatArray = np.minimum(np.exp(best.min(axis=-1)), 1.0)
        return out

    def left(self, s: FloatArray) -> FloatArray:
        s = np.asarray(s, dtype=float)
        chern = self.lam_left[None, :] * s[:, None] + self.n * self.log_lt[None, :]
        out: FloatArray = np.minimum(np.exp(chern.min(axis=-1)), 1.0)
        return out


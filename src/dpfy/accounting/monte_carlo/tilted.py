"""Tilted importance sampling, any number of epochs (dpfy's extension of Chua et al. 2025).

Remove direction. For an integer order a >= 2 the tilted law R_a = P^a Q^(1-a) / M_a of one
epoch is a finite Gaussian mixture: with counts c = (c_1..c_T), sum c = a,
    P^a Q^(1-a) = T^-a sum_c (a! / prod c_t!) exp(sum_t c_t (c_t - 1) / (2 z^2)) N(c, z^2 I),
and M_a = E_Q[(P/Q)^a] is that sum's total mass. L is symmetric in the
coordinates, so only the multiset of counts (a partition of a) matters. Under R_a (every
epoch), dP/dR = prod_e M_a,e exp(-(a - 1) L) with L the total loss, hence
    E_P[(1 - e^(eps - L))_+] = B(eps) E_R[Y],   B(eps) = M exp(-(a - 1) eps) kappa_a,
    Y = e^(-(a - 1)(L - eps)) (1 - e^(eps - L))_+ / kappa_a in [0, 1],
kappa_a = max_{u >= 0} e^(-(a - 1) u)(1 - e^-u) = (1/a)((a - 1)/a)^(a - 1). B is the Renyi
(order a) bound on delta, the KL confidence bound applies to the mean of Y, and the sample
only has to resolve delta / B instead of delta. a is chosen from M_a alone (no samples).

Add direction: the Chernoff (Renyi) bound E_Q[e^(lam L')] e^(-lam eps) kappa(lam), L' = -L,
with E_Q[(Q/P)^lam] = (T e^(1/(2 z^2)))^lam E[S^-lam], S = sum_t e^(x_t / z^2), and
E[S^-lam] = Gamma(lam)^-1 int_0^inf u^(lam - 1) E[e^(-u e^(g/z))]^T du (numerical
quadrature), minimised over a grid of lam. It is an upper bound, not an estimate.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import special

from dpfy.accounting._logsumexp import logsumexp_rows
from dpfy.accounting.monte_carlo.base import (
    AnyFloatArray,
    Direction,
    DirectionPair,
    FloatArray,
    Job,
    LossSamples,
)
from dpfy.accounting.monte_carlo.confidence import kl_upper_bound
from dpfy.accounting.monte_carlo.epochs import Epoch, group_epochs

MAX_TILT_ORDER = 24


def partitions(a: int, largest: int, parts: int) -> list[tuple[int, ...]]:
    """Partitions of a into at most ``parts`` parts, each <= ``largest`` (non-increasing)."""
    return list(_partitions(a, largest, parts))


@functools.lru_cache(maxsize=4096)
def _partitions(a: int, largest: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """:func:`partitions` as a tuple, cached: the recursion meets the same sub-problems often."""
    if a == 0:
        return ((),)
    if parts == 0:
        return ()
    out: list[tuple[int, ...]] = []
    for p in range(min(a, largest), 0, -1):
        out.extend((p, *rest) for rest in _partitions(a - p, p, parts - 1))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _shape_table(order: int, parts: int) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The z- and T-free part of :func:`tilt_table` (read-only; cached, as every tilted run
    looks at the orders 2..MAX_TILT_ORDER): count shapes padded to ``order`` columns, the
    number of used bins of each, and the log of the multiplicities of its equal counts."""
    shapes = partitions(order, order, parts)
    counts = np.zeros((len(shapes), order))
    for i, s in enumerate(shapes):
        counts[i, : len(s)] = s
    used = counts > 0
    r = used.sum(axis=1).astype(np.float64)
    log_mult = np.zeros(len(shapes))
    for i, s in enumerate(shapes):
        # multiplicities of the equal counts, by increasing count (as np.unique orders them)
        m = np.array([c for _, c in sorted(collections.Counter(s).items())], dtype=np.float64)
        log_mult[i] = special.gammaln(m + 1.0).sum()
    for arr in (counts, r, log_mult):
        arr.setflags(write=False)
    return counts, r, log_mult


def tilt_table(z: float, steps: int, order: int) -> tuple[FloatArray, FloatArray, float]:
    """(count shapes padded to ``order`` columns, log-probabilities, log M_order) of one epoch."""
    counts, r, log_mult = _shape_table(order, min(order, steps))
    log_w = (
        special.gammaln(steps + 1.0) - special.gammaln(steps - r + 1.0) - log_mult
        + special.gammaln(order + 1.0) - special.gammaln(counts + 1.0).sum(axis=1)
        + (counts * (counts - 1.0)).sum(axis=1) / (2.0 * z * z) - order * math.log(steps)
    )
    log_m = float(special.logsumexp(log_w))
    return counts, log_w - log_m, log_m


def log_kappa(lam: AnyFloatArray | float) -> FloatArray:
    """log max_{u >= 0} e^(-lam u)(1 - e^-u) = log((lam/(lam+1))^lam / (lam+1)), lam > 0."""
    a = np.asarray(lam, dtype=np.float64)
    out: FloatArray = a * np.log(a / (a + 1.0)) - np.log1p(a)
    return out


def tilt_log_moments(epochs: Sequence[Epoch], orders: npt.NDArray[np.integer[Any]]) -> FloatArray:
    """sum over epochs of log M_a (remove direction), for each order a."""
    out = np.zeros(len(orders))
    for e, k in group_epochs(epochs):
        out += k * np.array([tilt_table(e.noise_multiplier, e.steps, int(a))[2] for a in orders])
    return out


def choose_tilt_order(epochs: Sequence[Epoch], delta: float) -> int:
    """The order a minimising the Renyi epsilon bound at delta (depends on no samples)."""
    orders = np.arange(2, MAX_TILT_ORDER + 1)
    log_m = tilt_log_moments(epochs, orders)
    eps = (log_m + log_kappa(orders - 1.0) - math.log(delta)) / (orders - 1.0)
    return int(orders[int(np.argmin(eps))])


def tilted_losses(
    z: float, steps: int, order: int, n: int, rng: np.random.Generator, chunk: int
) -> FloatArray:
    """Remove-direction losses of one epoch under the tilted mixture R_order."""
    counts, log_p, _ = tilt_table(z, steps, order)
    cdf = np.cumsum(np.exp(log_p))
    width = min(order, steps)
    out = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z2 = 1.0 / (z * z)
    c = 0.5 * inv_z2
    log_t = math.log(steps)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        idx = np.minimum(np.searchsorted(cdf, rng.random(m) * cdf[-1], side="right"),
                         len(cdf) - 1)
        g = rng.standard_normal((m, steps))
        v = g * (z * inv_z2)  # x / z^2 with x = counts + z g
        v[:, :width] += counts[idx, :width] * inv_z2
        mx = v.max(axis=1, keepdims=True)
        v -= mx
        np.exp(v, out=v)
        out[start : start + m] = mx[:, 0] + np.log(v.sum(axis=1)) - c - log_t
    return out


ADD_LAMBDAS = np.concatenate((np.geomspace(0.02, 1.0, 30, endpoint=False),
                               np.linspace(1.0, 40.0, 157)))


def add_log_mgf(z: float, steps: int, lams: FloatArray) -> FloatArray:
    """log E_Q[(Q/P)^lam] of one epoch (add direction), by quadrature; exact for T = 1.

    Errors are kept on the upper side where it is cheap: M(u) = E[e^(-u e^(g/z))] gets the
    normal mass outside the g-grid added, the u-integral below the grid is bounded with
    M <= 1 and above it with M(u) <= Phi(-z log(u) / 2) + exp(-sqrt(u)).
    """
    c = 0.5 / (z * z)
    if steps == 1:
        return lams * (lams + 1.0) * c
    lo_v, hi_v = -40.0, 40.0
    v = np.linspace(lo_v, hi_v, 4001)  # u = e^v
    dv = v[1] - v[0]
    g = np.linspace(-40.0, 12.0, 6001)
    log_phi = -0.5 * g * g - 0.5 * math.log(2.0 * math.pi) + math.log(g[1] - g[0])
    y = np.exp(g / z)
    log_m = np.empty_like(v)
    for i in range(0, len(v), 250):
        u = np.exp(v[i : i + 250])[:, None]
        log_m[i : i + 250] = logsumexp_rows(log_phi[None, :] - u * y[None, :])
    log_m = np.minimum(np.logaddexp(log_m, float(special.log_ndtr(-12.0)) + math.log(2.0)), 0.0)
    parts = [logsumexp_rows(lams[:, None] * v[None, :] + steps * log_m[None, :])
             + math.log(dv)]
    parts.append(lams * lo_v - np.log(lams))  # int_{-inf}^{lo_v} e^(lam v) dv
    w = np.linspace(hi_v, 2000.0, 20001)
    with np.errstate(over="ignore"):
        env = np.logaddexp(special.log_ndtr(-0.5 * z * w), -np.exp(0.5 * w))
    parts.append(logsumexp_rows(lams[:, None] * w[None, :] + steps * env[None, :])
                 + math.log(w[1] - w[0]) + 1.0)  # Riemann sum of a unimodal envelope, x e
    integral = special.logsumexp(np.stack(parts), axis=0)
    out: FloatArray = lams * (math.log(steps) + c) - special.gammaln(lams) + integral
    return out


class TiltedLosses:
    """Remove direction by tilted importance sampling, add direction by the Renyi bound."""

    def __init__(
        self,
        results: Sequence[LossSamples],
        epochs: Sequence[Epoch],
        order: int,
        threshold: float,
        error_probability: float,
    ) -> None:
        self.n = sum(r.n for r in results)
        self.values = np.sort(np.concatenate([r.remove for r in results]))
        self.order = order
        self.threshold = threshold
        self._error_probability = error_probability
        self.log_m = float(tilt_log_moments(epochs, np.array([order]))[0])
        self.log_kappa = float(log_kappa(order - 1.0))
        add = np.zeros(len(ADD_LAMBDAS))
        for e, k in group_epochs(epochs):
            add += k * add_log_mgf(e.noise_multiplier, e.steps, ADD_LAMBDAS)
        # quadrature safety margin: 1e-6 relative per epoch on the moment
        self.add_log_mgf = add + 1e-6 * len(epochs)

    @property
    def error_probability(self) -> float:
        return self._error_probability

    def scale(self, epsilon: float) -> float:
        """B(eps) = M e^(-(a - 1) eps) kappa_a: the remove delta is B times a [0, 1] mean."""
        return math.exp(self.log_m - (self.order - 1) * epsilon + self.log_kappa)

    def _mean(self, epsilon: float) -> float:
        v = self.values[self.values > epsilon]
        lam = self.order - 1
        y = np.exp(-lam * (v - epsilon) - self.log_kappa) * -np.expm1(epsilon - v)
        return float(np.minimum(y, 1.0).sum() / self.n)

    def add_bound(self, epsilon: float) -> float:
        """The certain Renyi (Chernoff) bound on the add direction's delta at epsilon."""
        log_b = self.add_log_mgf - ADD_LAMBDAS * epsilon + log_kappa(ADD_LAMBDAS)
        return float(min(1.0, math.exp(min(0.0, float(log_b.min())))))

    def remove(self, epsilon: float) -> tuple[float, float]:
        """(estimate, upper confidence bound) of the remove direction's delta at epsilon."""
        s, m = self.scale(epsilon), self._mean(epsilon)
        ub = s * float(kl_upper_bound(m, self.n, self.error_probability))
        return s * m, min(ub, 1.0)

    def estimate(self, epsilon: float) -> float:
        return self.remove(epsilon)[0]

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, Direction]:
        est, ub = self.remove(epsilon)
        add = self.add_bound(epsilon)
        return (est, ub, "remove") if ub >= add else (est, add, "add")

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def by_direction(self, epsilon: float) -> tuple[DirectionPair, DirectionPair]:
        return (self.estimate(epsilon), math.nan), (self.scale(epsilon), math.nan)

    def top(self) -> float:
        return math.inf


def sample_tilted(job: Job, rng: np.random.Generator) -> LossSamples:
    """Remove-direction total losses over the job's epochs, every epoch drawn from its tilt of
    order ``job.tilt_order`` (the add direction is not sampled: left empty)."""
    total = np.zeros(job.n)
    for ep in job.epochs:
        total += tilted_losses(ep.noise_multiplier, ep.steps, job.tilt_order, job.n, rng, job.chunk)
    return LossSamples(job.n, np.sort(total[total > job.threshold]), np.zeros(0))

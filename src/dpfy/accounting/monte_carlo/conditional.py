"""Conditional Monte Carlo with analytic tails (one epoch; dpfy's refinement of Chua et al. 2025).

Integrate the differing example's coordinate analytically given the sum S of the other T - 1
terms, and split E[psi(S)] = E[min(psi(S), tau)] + int_tau^1 P(psi(S) > u) du: the first term
is a mean of [0, tau]-valued samples (KL bound on a range tau << 1), the second is bounded
analytically by Chernoff bounds on sums of log-normals (:mod:`.sum_tails`). The other
coordinates are stratified at a level m*: the rare stratum "their maximum exceeds m*" (exact
probability) is sampled directly with 1/16 of the samples (maximum placed first, Chua et al.
2025, Alg. 10), the rest has light tails. Samples are kept as histograms of log S.

Write S = sum_{t >= 2} e^{g_t / z} for the T - 1 coordinates that do not hold the differing
example (g standard normal). Given S, the expectation over the differing coordinate g_1 is a
one-dimensional integral: psi_remove(S) = E_g1[(1 - e^(eps - L))_+] (increasing in S) and
psi_add(S) = E_g1[(1 - e^(eps + L))_+] (decreasing in S, closed form). So delta = E[psi(S)]
with psi in [0, 1], but psi(S) is large only in a far tail of S. For a level tau,
    E[psi(S)] = E[min(psi(S), tau)] + int_tau^1 P(psi(S) > u) du,
the first term is a mean of [0, tau]-valued samples (KL bound on the range tau instead of 1:
about 1/tau times fewer samples for the same bound) and the second is bounded analytically by
Chernoff bounds on the sum of i.i.d. log-normal terms (right tail: terms truncated at e^{m/z},
plus the union bound (T - 1) P(g > m); left tail: the exact Laplace transform). tau is chosen
from (n, error probability, a reference epsilon) only, never from the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from dpfy.accounting.monte_carlo.base import (
    DIRECTIONS,
    Direction,
    DirectionPair,
    FloatArray,
    IntArray,
    Job,
    SumHistograms,
)
from dpfy.accounting.monte_carlo.confidence import kl_upper_bound
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.normals import (
    log_cdf,
    log_sum_exp_rows,
    truncated_normals_below,
)
from dpfy.accounting.monte_carlo.sum_tails import SumTails, gauss_legendre

HIST_BINS = 1 << 17

def psi_remove(s: FloatArray, z: float, steps: int, epsilon: float) -> FloatArray:
    """E over g1 ~ N(0,1) of (1 - K / (e^{g1/z + 1/z^2} + s))_+, K = T e^{eps + 1/(2z^2)}."""
    s = np.asarray(s, dtype=float)
    c = 0.5 / (z * z)
    log_k = math.log(steps) + epsilon + c
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.exp(log_k) - s
        a = np.where(gap > 0, z * (np.log(np.where(gap > 0, gap, 1.0)) - 2 * c), -np.inf)
    lo = np.maximum(a, -16.0)
    hi = np.maximum(lo, 0.0) + 14.0
    g, w = gauss_legendre(lo, hi, 64)
    with np.errstate(over="ignore"):
        denom = np.exp(np.minimum(g / z + 2 * c, 700.0)) + s[..., None]
    inner = np.maximum(1.0 - np.exp(log_k) / denom, 0.0)
    dens = np.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    out: FloatArray = np.minimum(np.sum(w * dens * inner, axis=-1), 1.0)
    return out


def psi_add(s: FloatArray, z: float, steps: int, epsilon: float) -> FloatArray:
    """E over g1 of (1 - kappa (e^{g1/z} + s))_+, kappa = e^{eps - 1/(2z^2)} / T (closed form)."""
    s = np.asarray(s, dtype=float)
    c = 0.5 / (z * z)
    kappa = math.exp(min(epsilon - c, 700.0)) / steps
    rest = 1.0 - kappa * s
    with np.errstate(divide="ignore", invalid="ignore"):
        b = z * np.log(np.where(rest > 0, rest / kappa, 1.0))
    val = rest * special.ndtr(b) - kappa * math.exp(c) * special.ndtr(b - 1.0 / z)
    return np.where(rest > 0, np.maximum(val, 0.0), 0.0)


def stratum_sums(
    z: float,
    steps: int,
    n: int,
    rng: np.random.Generator,
    chunk: int,
    m_star: float,
    big: bool,
) -> FloatArray:
    """log S for the stratum of the T - 1 other coordinates: all <= m* (big=False) or max > m*.

    Stratum "big" places the conditional maximum first (Chua et al. 2025, Alg. 10), then the rest
    i.i.d. below it.
    """
    k = steps - 1
    out = np.empty(n)
    rows = max(1, chunk // k)
    inv_z = 1.0 / z
    p_big = -math.expm1(k * float(log_cdf(m_star)))
    for start in range(0, n, rows):
        m = min(rows, n - start)
        if big:
            u = rng.random(m)
            log_cdf_m = np.log1p(-u * p_big) / k
            bound = -special.ndtri(-np.expm1(log_cdf_m))
            g = truncated_normals_below(bound, (m, k - 1), rng, dtype=np.float32)
            first = bound * inv_z
        else:
            g = truncated_normals_below(np.full(m, m_star), (m, k), rng, dtype=np.float32)
            first = np.full(m, -np.inf)
        if z >= 0.15 and k > 1:  # float32 fast path: e^{g/z} < e^{13/0.15} cannot overflow
            g32 = g.astype(np.float32)
            g32 *= np.float32(inv_z)
            np.exp(g32, out=g32)
            rest = np.log(g32.sum(axis=1, dtype=np.float64))
        elif g.shape[1]:
            rest = log_sum_exp_rows(g * inv_z)
        else:
            rest = np.full(m, -np.inf)
        out[start : start + m] = np.logaddexp(first, rest)
    return out


def conditional_sums(
    z: float, steps: int, n: int, rng: np.random.Generator, chunk: int
) -> FloatArray:
    """log S for n samples, S = sum of T - 1 i.i.d. e^{g/z}."""
    out = np.empty(n)
    rows = max(1, chunk // (steps - 1))
    inv_z = 1.0 / z
    fast = z >= 0.15
    for start in range(0, n, rows):
        m = min(rows, n - start)
        g = rng.standard_normal((m, steps - 1), dtype=np.float32 if fast else np.float64)
        if fast:
            g *= np.float32(inv_z)
            np.exp(g, out=g)
            out[start : start + m] = np.log(g.sum(axis=1, dtype=np.float64))
        else:
            out[start : start + m] = log_sum_exp_rows(g * inv_z)
    return out


def hist_range(z: float, steps: int) -> tuple[float, float]:
    """(lo, width) of the log S histogram: generous around log((T - 1) e^{1/(2z^2)})."""
    center = math.log(steps - 1) + 0.5 / (z * z)
    lo = center - 10.0 - 4.0 / z
    hi = center + 10.0 + 12.0 / z
    return lo, (hi - lo) / HIST_BINS


class Histogram:
    """Occupied bins of a log S histogram with pessimistic and central representatives."""

    def __init__(self, hist: IntArray, lo: float, width: float) -> None:
        self.n = int(hist.sum())
        idx = np.flatnonzero(hist)
        self.counts = hist[idx].astype(float)
        # pessimistic representatives: upper edges for psi_remove (increasing), lower edges
        # for psi_add (decreasing); underflow bin 0 -> [0, e^lo), overflow -> [e^hi, inf)
        upper = np.exp(lo + idx * width)
        lower = np.exp(lo + (idx - 1) * width)
        self.s_up = np.where(idx == HIST_BINS + 1, np.inf, upper)
        self.s_low = np.where(idx == 0, 0.0, lower)
        mid = np.exp(lo + (idx - 0.5) * width)
        self.s_mid = np.where(idx == 0, 0.0, np.where(idx == HIST_BINS + 1, lower, mid))


BIG_FRACTION = 1.0 / 16.0  # share of samples drawn from the stratum "others' max > m*"
BIG_ERROR_SHARE = 0.1  # share of the error probability spent on that stratum's bound


def split_level(steps: int, n_big: int, delta_ref: float, error_probability: float) -> float:
    """m*: P(max of the T - 1 others > m*) = p with p log(1/beta_B) / n_big ~ delta_ref / 20."""
    if n_big <= 0 or delta_ref <= 0.0:
        return math.inf
    beta_b = BIG_ERROR_SHARE * error_probability
    p = min(0.5, 0.05 * delta_ref * n_big / math.log(1.0 / beta_b))
    if p < 1e-12:
        return math.inf
    k = steps - 1
    return float(-special.ndtri(-math.expm1(math.log1p(-p) / k)))


class ConditionalLosses:
    """Histograms of log S (two strata) and the bounds of the conditional method (one epoch).

    Stratum A: all T - 1 other coordinates <= m* (probability 1 - p_big), light tails, capped
    range tau plus Chernoff tail integral. Stratum B: their maximum > m* (probability p_big,
    sampled by placing the maximum first), range 1. When both are sampled, stratum B's KL
    bound uses 10 % of the error probability and stratum A's the rest (union bound).
    """

    def __init__(
        self,
        results: Sequence[SumHistograms],
        epoch: Epoch,
        error_probability: float,
        reference_epsilon: float,
        m_star: float = math.inf,
    ) -> None:
        self.z, self.steps = epoch.noise_multiplier, epoch.steps
        self.lo, self.width = hist_range(self.z, self.steps)
        hist = np.zeros(HIST_BINS + 2, dtype=np.int64)
        hist_big = np.zeros(HIST_BINS + 2, dtype=np.int64)
        for r in results:
            hist += r.hist
            hist_big += r.hist_big
        self.a = Histogram(hist, self.lo, self.width)
        self.b = Histogram(hist_big, self.lo, self.width)
        self.n = self.a.n
        k = self.steps - 1
        if math.isfinite(m_star):
            self.p_big = -math.expm1(k * float(log_cdf(m_star)))
            self.tails = SumTails(self.z, k, truncate=m_star)
        else:
            self.p_big = 0.0
            self.tails = SumTails(self.z, k)
        both = self.p_big > 0 and self.b.n > 0
        share = BIG_ERROR_SHARE if both else 0.0
        self._error_probability = error_probability
        self.error_probability_a = (1.0 - share) * error_probability
        self.error_probability_big = max(share * error_probability, 1e-300)
        self._tail_grids()
        self.tau = {d: self._choose_tau(d, reference_epsilon) for d in DIRECTIONS}

    @property
    def error_probability(self) -> float:
        """Total error probability (split between the strata by a union bound)."""
        return self._error_probability

    def _psi(self, direction: Direction, s: FloatArray, epsilon: float) -> FloatArray:
        if direction == "remove":
            out = psi_remove(np.where(np.isfinite(s), s, 0.0), self.z, self.steps, epsilon)
            res: FloatArray = np.where(np.isfinite(s), out, 1.0)
            return res
        return psi_add(s, self.z, self.steps, epsilon)

    def _tail_grids(self) -> None:
        """Fixed s-grids (log-spaced) with the analytic tail bounds at each point."""
        mean_s = (self.steps - 1) * math.exp(0.5 / (self.z * self.z))
        self.grid_right = mean_s * np.exp(np.linspace(-2.0, 14.0, 1601))
        self.tail_right = self.tails.right(self.grid_right)
        self.grid_left = np.concatenate((mean_s * np.exp(np.linspace(2.0, -30.0, 1601)), [0.0]))
        self.tail_left = self.tails.left(self.grid_left)

    def _tail_integrals(
        self, direction: Direction, epsilon: float, taus: FloatArray
    ) -> FloatArray:
        """Upper bounds on int_tau^1 P(psi(S) > u) du, vectorised over tau.

        On the grid s_0, s_1, ... ordered so that psi(s_j) increases: for u in
        [psi(s_j), psi(s_{j+1})), P(psi(S) > u) <= P(S beyond s_j) <= tail(s_j); the piece
        from tau to the first grid value above it uses the tail at the grid point before.
        """
        if direction == "remove":
            grid, tail, top = self.grid_right, self.tail_right, 1.0
        else:
            grid, tail = self.grid_left, self.tail_left
            top = float(self._psi("add", np.array([0.0]), epsilon)[0])
        psi = np.maximum.accumulate(self._psi(direction, grid, epsilon))
        nxt = np.concatenate((psi[1:], [top]))
        pieces = np.maximum(nxt - psi, 0.0) * tail
        suffix = np.concatenate((np.cumsum(pieces[::-1])[::-1], [0.0]))  # sum over j >= k
        taus = np.asarray(taus, dtype=float)
        k = np.searchsorted(psi, taus, side="left")  # first j with psi_j >= tau
        prev_tail = np.where(k > 0, tail[np.maximum(k - 1, 0)], 1.0)
        first = np.where(k < len(psi), psi[np.minimum(k, len(psi) - 1)], top)
        out = np.maximum(first - taus, 0.0) * prev_tail + suffix[k]
        res: FloatArray = np.where(taus >= top, 0.0, out)
        return res

    def _tail_integral(self, direction: Direction, epsilon: float, tau: float) -> float:
        return float(self._tail_integrals(direction, epsilon, np.array([tau]))[0])

    def _choose_tau(self, direction: Direction, epsilon: float) -> float:
        """tau minimising (KL slack of a range-tau mean) + tail integral at epsilon."""
        slack = math.log(1.0 / self.error_probability_a) / self.n
        taus = np.geomspace(1e-7, 1.0, 141)
        cost = taus * slack + self._tail_integrals(direction, epsilon, taus)
        return float(taus[int(np.argmin(cost))])

    def direction_upper(self, d: Direction, epsilon: float) -> float:
        """Upper confidence bound on direction ``d``'s delta at epsilon."""
        tau, beta = self.tau[d], self.error_probability_a
        rep = self.a.s_up if d == "remove" else self.a.s_low
        capped = np.minimum(self._psi(d, rep, epsilon), tau)
        m = float(np.sum(self.a.counts * capped) / self.a.n / tau)
        ub = tau * float(kl_upper_bound(m, self.a.n, beta))
        ub += self._tail_integral(d, epsilon, tau) if tau < 1.0 else 0.0
        if self.p_big == 0.0:
            return ub
        if self.b.n == 0:
            return (1.0 - self.p_big) * ub + self.p_big
        rep_b = self.b.s_up if d == "remove" else self.b.s_low
        m_b = float(np.sum(self.b.counts * self._psi(d, rep_b, epsilon)) / self.b.n)
        ub_b = float(kl_upper_bound(min(m_b, 1.0), self.b.n, self.error_probability_big))
        return (1.0 - self.p_big) * ub + self.p_big * ub_b

    def direction_estimate(self, d: Direction, epsilon: float) -> float:
        """Point estimate of direction ``d``'s delta at epsilon (bin centres)."""
        est = float(np.sum(self.a.counts * self._psi(d, self.a.s_mid, epsilon)) / self.a.n)
        if self.p_big == 0.0 or self.b.n == 0:
            return est
        est_b = float(np.sum(self.b.counts * self._psi(d, self.b.s_mid, epsilon)) / self.b.n)
        return (1.0 - self.p_big) * est + self.p_big * est_b

    def estimate(self, epsilon: float) -> float:
        return max(self.direction_estimate(d, epsilon) for d in DIRECTIONS)

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, Direction]:
        """(estimate, bound, direction); the error probability is the one given at creation."""
        ub = {d: self.direction_upper(d, epsilon) for d in DIRECTIONS}
        direction = max(ub, key=lambda d: ub[d])
        return self.estimate(epsilon), ub[direction], direction

    def upper(self, epsilon: float) -> float:
        return max(self.direction_upper(d, epsilon) for d in DIRECTIONS)

    def by_direction(self, epsilon: float) -> tuple[DirectionPair, DirectionPair]:
        rem, add = (self.direction_estimate(d, epsilon) for d in DIRECTIONS)
        return (rem, add), (1.0, 1.0)

    def top(self) -> float:
        return math.inf


def sample_conditional(job: Job, rng: np.random.Generator) -> SumHistograms:
    """Histograms of log S for the job's single epoch: the stratum "others' maximum <= m*"
    (``n - n_big`` samples) and, when m* is finite, the stratum "maximum > m*" (``n_big``)."""
    (ep,) = job.epochs
    z, t = ep.noise_multiplier, ep.steps
    lo, width = hist_range(z, t)
    n_big = int(round(job.n * job.big_fraction)) if math.isfinite(job.m_star) else 0
    hists: list[IntArray] = []
    for size, big in ((job.n - n_big, False), (n_big, True)):
        if math.isfinite(job.m_star):
            log_s = stratum_sums(z, t, size, rng, job.chunk, job.m_star, big)
        else:
            log_s = conditional_sums(z, t, size, rng, job.chunk)
        idx = np.clip(np.floor((log_s - lo) / width) + 1, 0, HIST_BINS + 1).astype(np.int64)
        hists.append(np.bincount(idx, minlength=HIST_BINS + 2))
    return SumHistograms(job.n - n_big, n_big, hists[0], hists[1])

"""Certain lower bounds on delta from the max-bit post-processing (binomial hockey-stick).

Any post-processing of a pair (P, Q) can only shrink its hockey-stick divergence, so the exact
divergence of a post-processed pair is a certain lower bound on delta(epsilon). Both epoch
samplers without a tight upper bound use the same construction:

* Balls-and-Bins (Chua et al. 2025, Eq. 6): one epoch of T steps is dominated by
  P = (1/T) sum_t N(e_t, z^2 I_T) vs Q = N(0, z^2 I_T).
* Shuffling (Chua et al. 2024a): one epoch is dominated from below by
  P = (1/T) sum_t N(2 e_t, z^2 I_T) vs Q = (1/T) sum_t N(e_t, z^2 I_T).
* A plain Gaussian (or a deterministic epoch) is the case T = 1.

All three are a :class:`MaxBitPair`: T coordinates with noise z, the differing example shifts
one coordinate to mean ``shift_p`` under P and ``shift_q`` under Q, all others have mean 0. Each
use is post-processed to the bit 1{max_t x_t > c}; identical uses give binomial counts, groups
of different uses compose by convolving their count distributions, and the hockey-stick
divergence of the counts is exact. It is maximised over both directions and over the threshold
c = z s + (shift_p + shift_q) / 2 (one shared s for all groups) on a grid refined once; any s
gives a valid lower bound, so the grid only costs tightness.

Everything up to the final hockey-stick sum is in log space: bit probabilities near 0 or 1 keep
their relative precision and binomial pmfs never overflow, for any number of steps and epochs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
from scipy import special

from dpfy.accounting import roots

FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, slots=True)
class MaxBitPair:
    """One use of a T-coordinate Gaussian pair, reduced to the bit 1{max_t x_t > c}.

    Attributes:
      noise_multiplier: z, the noise standard deviation per coordinate (sensitivity units).
      steps: T, the number of coordinates (batches of the epoch); 1 for a plain Gaussian.
      shift_p / shift_q: mean of the differing example's coordinate under P / Q (the other
        T - 1 coordinates have mean 0 under both).
    """

    noise_multiplier: float
    steps: int
    shift_p: float = 1.0
    shift_q: float = 0.0

    def threshold(self, s: FloatArray) -> FloatArray:
        """The threshold c = z s + (shift_p + shift_q) / 2 for grid parameters s."""
        return self.noise_multiplier * s + 0.5 * (self.shift_p + self.shift_q)

    def log_no_bit(self, s: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(log P(max_t x_t <= c), log Q(max_t x_t <= c)) at c = :meth:`threshold`, exact."""
        c = self.threshold(s)
        return self._log_max_cdf(c, self.shift_p), self._log_max_cdf(c, self.shift_q)

    def _log_max_cdf(self, c: FloatArray, shift: float) -> FloatArray:
        z, t = self.noise_multiplier, self.steps
        if shift == 0.0:  # all T coordinates identically distributed
            return np.asarray(t * special.log_ndtr(c / z), dtype=np.float64)
        rest = (t - 1) * special.log_ndtr(c / z)
        return np.asarray(special.log_ndtr((c - shift) / z) + rest, dtype=np.float64)


def max_bit_lower_delta(
    groups: Sequence[tuple[MaxBitPair, int]],
    epsilon: float,
    *,
    grid: int = 513,
    s_min: float = -6.0,
) -> float:
    """A certain lower bound on delta(epsilon) of a composition (both directions).

    Args:
      groups: (pair, count) for each kind of use; the uses are independent.
      epsilon: epsilon >= 0.
      grid: number of threshold parameters s on the coarse grid [s_min, s_max]; the best one
        is refined on 129 points between its neighbours.
      s_min: lower end of the grid (s_max grows with z epsilon and sqrt(2 log T)).
    """
    z_max = max(p.noise_multiplier for p, _ in groups)
    t_max = max(p.steps for p, _ in groups)
    s_hi = max(10.0, z_max * epsilon + 8.0, math.sqrt(2.0 * math.log(t_max)) + 8.0)
    s = np.linspace(s_min, s_hi, grid)
    best = max_bit_lower_delta_on(groups, epsilon, s)
    i = int(np.argmax(best))
    fine = np.linspace(s[max(i - 1, 0)], s[min(i + 1, grid - 1)], 129)
    return float(max(best.max(), max_bit_lower_delta_on(groups, epsilon, fine).max()))


def max_bit_lower_delta_on(
    groups: Sequence[tuple[MaxBitPair, int]], epsilon: float, s: FloatArray
) -> FloatArray:
    """The max-bit lower bound at every threshold parameter in ``s`` (vectorised)."""
    if len(groups) == 1:
        ((pair, k),) = groups
        log_p0, log_q0 = pair.log_no_bit(s)
        log_a = binomial_logpmf(k, log1mexp(log_p0), log_p0)
        log_b = binomial_logpmf(k, log1mexp(log_q0), log_q0)
        return hockey_stick_from_logs(log_a, log_b, epsilon)
    # Several groups: the joint count distribution is a convolution of binomials (exact).
    dist_p = np.ones((1, len(s)))
    dist_q = np.ones((1, len(s)))
    for pair, k in groups:
        log_p0, log_q0 = pair.log_no_bit(s)
        dist_p = convolve_columns(dist_p, np.exp(binomial_logpmf(k, log1mexp(log_p0), log_p0)))
        dist_q = convolve_columns(dist_q, np.exp(binomial_logpmf(k, log1mexp(log_q0), log_q0)))
    with np.errstate(divide="ignore"):
        return hockey_stick_from_logs(np.log(dist_p), np.log(dist_q), epsilon)


def log1mexp(a: FloatArray) -> FloatArray:
    """log(1 - e^a) for a <= 0 (accurate on both sides of -log 2; -inf at a = 0)."""
    a = np.minimum(np.asarray(a, dtype=np.float64), 0.0)
    with np.errstate(divide="ignore"):
        out = np.where(a > -math.log(2.0), np.log(-np.expm1(a)), np.log1p(-np.exp(a)))
    return np.asarray(out, dtype=np.float64)


def binomial_logpmf(k: int, log_p: FloatArray, log_1mp: FloatArray) -> FloatArray:
    """log Binomial(k, p) pmf at j = 0..k (rows), vectorised over columns; never overflows."""
    j = np.arange(k + 1, dtype=np.float64)[:, None]
    log_choose = special.gammaln(k + 1.0) - special.gammaln(j + 1.0) - special.gammaln(k - j + 1.0)
    with np.errstate(invalid="ignore"):
        a = np.where(j > 0, j * log_p[None, :], 0.0)  # 0 * log 0 = 0
        b = np.where(k - j > 0, (k - j) * log_1mp[None, :], 0.0)
    return np.asarray(log_choose + a + b, dtype=np.float64)


def hockey_stick_from_logs(log_a: FloatArray, log_b: FloatArray, epsilon: float) -> FloatArray:
    """max over both directions of sum_j (a_j - e^eps b_j)_+, from log-masses (rows: outcomes,
    columns: independent pairs)."""

    def one(la: FloatArray, lb: FloatArray) -> FloatArray:
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(np.isfinite(la), epsilon + lb - la, np.inf)
            term = np.where(diff < 0, np.exp(la) * -np.expm1(np.minimum(diff, 0.0)), 0.0)
        return np.asarray(term.sum(axis=0), dtype=np.float64)

    return np.maximum(one(log_a, log_b), one(log_b, log_a))


def convolve_columns(a: FloatArray, b: FloatArray) -> FloatArray:
    """Column-wise convolution of two stacks of distributions (rows: outcomes)."""
    out = np.zeros((a.shape[0] + b.shape[0] - 1, a.shape[1]))
    for i in range(b.shape[0]):
        out[i : i + a.shape[0]] += a * b[i]
    return out


def epsilon_from_lower_delta(lower_delta: Callable[[float], float], delta: float) -> float:
    """Largest epsilon certainly spent at ``delta``, given a lower bound on delta(epsilon).

    ``lower_delta`` is non-increasing in epsilon; the result e satisfies ``lower_delta(e) >=
    delta`` (so it is itself a lower bound on the true epsilon), found to a relative 1e-9 by
    :func:`dpfy.accounting.roots.safe_root`. ``0.0`` when even epsilon = 0 is below ``delta``;
    ``inf`` when the bound still exceeds ``delta`` at epsilon = 1e4.
    """
    if lower_delta(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while lower_delta(hi) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            return math.inf
    return roots.safe_root(
        lambda e: delta - lower_delta(e), lo, hi, side="low", xtol=1e-9, rtol=1e-9
    )

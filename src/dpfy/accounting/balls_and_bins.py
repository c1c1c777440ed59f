"""Monte Carlo accounting of Balls-and-Bins sampling (Chua et al. 2025; DESIGN 4.2).

One epoch of T steps of Balls-and-Bins DP-SGD with noise multiplier z is tightly dominated by
    P = (1/T) sum_t N(e_t, z^2 I_T),   Q = N(0, z^2 I_T)                 (Chua et al., Thm. 3.1)
with privacy loss L(x) = log P(x)/Q(x) = logsumexp_t((2 x_t - 1) / (2 z^2)) - log T. Several
epochs (or any composition of Balls-and-Bins epochs and plain Gaussians, a Gaussian being the
T = 1 case) compose as products, so L adds over epochs. For add/remove (and zero-out) adjacency
    delta(eps) = max( E_P[(1 - e^(eps - L))_+],  E_Q[(1 - e^(eps + L))_+] ),
the "remove" and "add" directions. Both are means of [0, 1]-valued variables, estimated here by
Monte Carlo with an upper confidence bound from the Chernoff-Hoeffding (Bernoulli-KL) inequality
(Chua et al., Alg. 4, Thm. 4.1): with probability >= 1 - error_probability the true delta is at
most the reported bound. The reported epsilon at a target delta is the smallest epsilon whose
delta bound is <= delta; it is >= the true epsilon with the same probability (the bound is
monotone in epsilon). The direction taking the maximum is fixed (if unknown), so each direction
uses the full error probability.

Samplers of the privacy loss (``method``):
  * ``plain``: exact draws; both directions share the Gaussian draws (x_1 is shifted for P).
  * ``importance`` (Chua et al., Alg. 5, App. B.1; one epoch only): sample only the event E
    outside which the integrand is 0 and multiply by its exact probability. Remove direction:
    E = {max_t y_t >= z eps0 - 1/(2z)} with y = (x - e_1)/z, drawn by placing the conditional
    maximum first (Alg. 10). Add direction: E = {max_t x_t / z <= (1/2 + z^2 (log T - eps0)) / z},
    i.i.d. truncated normals. Gains a factor 1 / P(E): large for small T or large epsilon.
  * ``order_statistics`` (Chua et al., Alg. 6, Eqs. 4-5): draw only the order statistics
    k_1 = 1 < k_2 < ... < k_m of the T - 1 unshifted coordinates (as Beta / exponential
    spacings pushed through the inverse normal CDF) and bound the sum of exp(x_t / z^2) above
    (remove) or below (add) blockwise. Every loss sample is >= the exact one in its direction, so
    the estimate and bound are pessimistic by construction; cost O(m) instead of O(T).
  * ``conditional`` (dpfy's refinement, one epoch): integrate the differing example's
    coordinate analytically given the sum S of the other T - 1 terms, and split
    E[psi(S)] = E[min(psi(S), tau)] + int_tau^1 P(psi(S) > u) du: the first term is a mean of
    [0, tau]-valued samples (KL bound on a range tau << 1), the second is bounded analytically
    by Chernoff bounds on sums of log-normals. The other coordinates are stratified at a level
    m*: the rare stratum "their maximum exceeds m*" (exact probability) is sampled directly
    with 1/16 of the samples (maximum placed first, Alg. 10), the rest has light tails. Same
    cost per sample as plain, but far fewer samples for the same bound (see the section below).
  * ``tilted`` (dpfy's extension, any number of epochs): remove direction by importance
    sampling from the order-a tilt P^a Q^(1-a) / M_a of every epoch, a finite Gaussian mixture
    with exact weights; the likelihood ratio M exp(-(a - 1) L) times the integrand is at most
    the order-a Renyi bound B(eps), so the KL bound applies to a [0, 1]-valued mean and only
    delta / B has to be resolved. The add direction gets the Renyi (Chernoff) bound from
    E_Q[(Q/P)^lam], computed by one-dimensional quadrature (an upper bound, not sampled).
    See the section "Tilted importance sampling" below.
    For one epoch with T >= 16 the add direction instead comes from the ``conditional``
    sampler (same sample count, independent stream), or the Renyi bound where that is smaller.
  * ``auto``: importance sampling for one epoch when P(E) < 1/4 in both directions, else
    ``tilted`` (with the conditional add direction) for one epoch with T >= 16; for several
    epochs order statistics when T > 20,000, ``tilted`` otherwise.

The cheap lower bound (Chua et al., Eq. 6, extended to several epochs): post-process each epoch
to the bit 1{max_t x_t > c}; the epochs' bits are binomial under both hypotheses, so their
hockey-stick divergence is exact and maximised over c. It is a certain lower bound on delta,
hence on epsilon.

Computation is vectorised and chunked (at most ``chunk_elements`` Gaussians in memory per job),
reproducible from ``seed`` (per-job ``numpy.random.SeedSequence`` children, so results do not
depend on the executor), shows a rich progress bar when it runs longer than ~2 s, and spreads
jobs over any ``concurrent.futures.Executor`` (e.g. ``ProcessPoolExecutor``; Dask and Ray
provide Executor-compatible clients).

Registered accountant: ``monte_carlo``, in ``auto`` because it is the only accountant for
``BallsAndBins``. Its default sample count (:func:`default_samples`, about 1e8 Gaussian draws)
keeps ``epsilon(BallsAndBins(...), 1e-5)`` to a few seconds on an idle core, at the price of a
looser upper bound; pass a :class:`MonteCarloAccountant` with more ``samples`` (and an
``executor``) for a tighter one. Results have ``provable=False`` and state
``error_probability``. When the Monte Carlo bound is looser than the provable no-amplification
bound (exact Gaussian composition, valid since Balls-and-Bins is at least as private as
deterministic batching, Chua et al. 2025, Prop. 3.3), that provable bound is reported instead.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Literal

import numpy as np
from scipy import special

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting._api import PrivacyResult, first_unsupported, register_accountant

__all__ = [
    "Epoch",
    "MonteCarloEstimate",
    "MonteCarloAccountant",
    "epochs_of_event",
    "kl_upper_bound",
    "lower_bound_delta",
    "lower_bound_epsilon",
    "monte_carlo_delta",
    "monte_carlo_epsilon",
    "balls_and_bins_delta",
    "balls_and_bins_epsilon",
    "default_orders",
    "default_samples",
    "block_log_sums",
]

Method = Literal["auto", "plain", "importance", "order_statistics", "conditional", "tilted"]
_METHODS = ("auto", "plain", "importance", "order_statistics", "conditional", "tilted")
_DIRECTIONS = ("remove", "add")


@dataclasses.dataclass(frozen=True, slots=True)
class Epoch:
    """One Balls-and-Bins epoch: ``steps`` steps with noise multiplier ``noise_multiplier``.

    ``steps = 1`` is a plain Gaussian mechanism with sensitivity 1.
    """

    noise_multiplier: float
    steps: int

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_range("steps", self.steps, 1, None, integer=True)


# ---------------------------------------------------------------------------------------------
# Events -> epochs
# ---------------------------------------------------------------------------------------------


def _unsupported(event: ev.Event) -> str | None:
    reason = _unsupported_part(event)
    if reason is None and not _has_balls_and_bins(event):
        # pure Gaussian compositions are the exact "gaussian" accountant's job
        return f"{type(event).__name__} contains no Balls-and-Bins epoch"
    return reason


def _has_balls_and_bins(event: ev.Event) -> bool:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        return event.epochs > 0
    if isinstance(event, ev.SelfComposed):
        return event.count > 0 and _has_balls_and_bins(event.event)
    if isinstance(event, ev.Composed):
        return any(_has_balls_and_bins(e) for e in event.events)
    return False


def _unsupported_part(event: ev.Event) -> str | None:
    return first_unsupported(event, _unsupported_leaf)


def _unsupported_leaf(event: ev.Event) -> str | None:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        if event.adjacency == ev.Adjacency.REPLACE_ONE.value:
            return f"{type(event).__name__} with replace_one adjacency"
        return None
    if isinstance(event, ev.Gaussian):
        return None
    return f"{type(event).__name__} is not a Balls-and-Bins epoch or a Gaussian"


def epochs_of_event(event: ev.Event) -> list[Epoch]:
    """The epochs of a supported event tree (``TruncatedBallsAndBins`` counts as untruncated).

    Raises:
      ValueError: for an unsupported sub-event (named in the message).
    """
    reason = _unsupported(event)
    if reason is not None:
        raise ValueError(f"monte_carlo cannot account this event: {reason}")
    return _epochs(event)


def _epochs(event: ev.Event) -> list[Epoch]:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        return [Epoch(event.noise_multiplier, event.steps_per_epoch)] * event.epochs
    if isinstance(event, ev.Gaussian):
        return [Epoch(event.noise_multiplier, 1)]
    if isinstance(event, ev.SelfComposed):
        return _epochs(event.event) * event.count
    out: list[Epoch] = []
    for e in event.events:  # Composed
        out.extend(_epochs(e))
    return out


# ---------------------------------------------------------------------------------------------
# Confidence bound
# ---------------------------------------------------------------------------------------------


def _bernoulli_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    p = np.clip(p, 0.0, 1.0)
    q = np.clip(q, 1e-300, 1.0 - 1e-16)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
        b = np.where(p < 1, (1 - p) * (np.log1p(-p) - np.log1p(-q)), 0.0)
    return a + b


def kl_upper_bound(mean: float | np.ndarray, n: int, error_probability: float) -> np.ndarray:
    """Upper confidence bound on the mean of i.i.d. [0, 1]-valued variables.

    The largest q >= mean with ``n * kl(mean || q) <= log(1 / error_probability)``
    (Chernoff-Hoeffding; Hoeffding 1963, Thm. 1): the true mean exceeds it with probability at
    most ``error_probability``. Vectorised over ``mean``.
    """
    check_range("n", n, 1, None, integer=True)
    check_range("error_probability", error_probability, 0.0, 1.0, low_open=True, high_open=True)
    target = math.log(1.0 / error_probability) / n
    if np.ndim(mean) == 0:
        return np.asarray(_kl_ucb_scalar(float(mean), target))
    m = np.clip(np.asarray(mean, dtype=float), 0.0, 1.0)
    lo, hi = m.copy(), np.ones_like(m)
    for _ in range(100):  # bisection to ~1e-30 relative; kl(m||q) increases in q >= m
        mid = 0.5 * (lo + hi)
        ok = _bernoulli_kl(m, mid) <= target
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid)
    return hi


def _kl_ucb_scalar(m: float, target: float) -> float:
    m = min(max(m, 0.0), 1.0)
    if m >= 1.0:
        return 1.0

    def kl(q: float) -> float:
        a = m * (math.log(m) - math.log(q)) if m > 0 else 0.0
        return a + (1 - m) * (math.log1p(-m) - math.log1p(-q))

    lo, hi = m, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if kl(mid) <= target:
            lo = mid
        else:
            hi = mid
    return hi


# ---------------------------------------------------------------------------------------------
# Cheap lower bound (Chua et al. 2025, Eq. 6; several epochs via binomial composition)
# ---------------------------------------------------------------------------------------------


def _log_cdf(x):
    return special.log_ndtr(x)


def _max_bits(z: float, steps: int, c: np.ndarray) -> tuple[np.ndarray, ...]:
    """Log-probabilities of the bit 1{max_t x_t > c} for one epoch, vectorised over c.

    Returns (log P(bit), log P(no bit), log Q(bit), log Q(no bit)); P(no bit) and Q(no bit)
    are exact in log space, so probabilities near 0 or 1 keep their relative precision.
    """
    log_q0 = steps * _log_cdf(c / z)  # log Q(max <= c)
    log_p0 = _log_cdf((c - 1.0) / z) + (steps - 1) * _log_cdf(c / z)
    return _log1mexp(log_p0), log_p0, _log1mexp(log_q0), log_q0


def _log1mexp(a: np.ndarray) -> np.ndarray:
    """log(1 - e^a) for a <= 0 (accurate on both sides of -log 2; -inf at a = 0)."""
    a = np.minimum(np.asarray(a, dtype=float), 0.0)
    with np.errstate(divide="ignore"):
        return np.where(a > -math.log(2.0), np.log(-np.expm1(a)), np.log1p(-np.exp(a)))


def _binom_logpmf(k: int, log_p: np.ndarray, log_1mp: np.ndarray) -> np.ndarray:
    """log Binomial(k, p) pmf at j = 0..k (rows), vectorised over columns; never overflows."""
    j = np.arange(k + 1, dtype=float)[:, None]
    log_choose = special.gammaln(k + 1.0) - special.gammaln(j + 1.0) - special.gammaln(k - j + 1.0)
    with np.errstate(invalid="ignore"):
        a = np.where(j > 0, j * log_p[None, :], 0.0)  # 0 * log 0 = 0
        b = np.where(k - j > 0, (k - j) * log_1mp[None, :], 0.0)
    return log_choose + a + b


def _hockey_log(log_a: np.ndarray, log_b: np.ndarray, epsilon: float) -> np.ndarray:
    """max over both directions of sum_j (a_j - e^eps b_j)_+, from log-masses (columns)."""

    def one(la: np.ndarray, lb: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(np.isfinite(la), epsilon + lb - la, np.inf)
            term = np.where(diff < 0, np.exp(la) * -np.expm1(np.minimum(diff, 0.0)), 0.0)
        return term.sum(axis=0)

    return np.maximum(one(log_a, log_b), one(log_b, log_a))


def _binomial_hockey(bits_p, bits_q, k: int, epsilon: float) -> np.ndarray:
    """max over both directions of H_eps(Bin(k, p1) || Bin(k, p0)), vectorised over columns."""
    log_a = _binom_logpmf(k, bits_p[0], bits_p[1])
    log_b = _binom_logpmf(k, bits_q[0], bits_q[1])
    return _hockey_log(log_a, log_b, epsilon)


def lower_bound_delta(epochs: Sequence[Epoch], epsilon: float, *, grid: int = 513) -> float:
    """A certain lower bound on the Balls-and-Bins delta(epsilon) (both directions).

    Each epoch is post-processed to the bit 1{max_t x_t > c}; groups of identical epochs give
    binomial counts, whose hockey-stick divergence is exact. Different groups use thresholds
    c = z * s + 1/2 with one shared s, and are composed by pairing their count distributions.
    The best s on a grid (refined once) is returned; any s gives a valid lower bound.
    """
    check_range("epsilon", epsilon, 0.0, None)
    groups = _group(epochs)
    z_max = max(e.noise_multiplier for e, _ in groups)
    t_max = max(e.steps for e, _ in groups)
    s_hi = max(10.0, z_max * epsilon + 8.0, math.sqrt(2.0 * math.log(t_max)) + 8.0)
    s = np.linspace(-6.0, s_hi, grid)
    best = _lower_delta_on(groups, epsilon, s)
    i = int(np.argmax(best))
    fine = np.linspace(s[max(i - 1, 0)], s[min(i + 1, grid - 1)], 129)
    return float(max(best.max(), _lower_delta_on(groups, epsilon, fine).max()))


def _group(epochs: Sequence[Epoch]) -> list[tuple[Epoch, int]]:
    counts: dict[Epoch, int] = {}
    for e in epochs:
        counts[e] = counts.get(e, 0) + 1
    return list(counts.items())


def _lower_delta_on(groups, epsilon: float, s: np.ndarray) -> np.ndarray:
    if len(groups) == 1:
        (e, k), = groups
        lp1, lp0, lq1, lq0 = _max_bits(e.noise_multiplier, e.steps, e.noise_multiplier * s + 0.5)
        return _binomial_hockey((lp1, lp0), (lq1, lq0), k, epsilon)
    # Several groups: the joint count distribution is a convolution of binomials (exact).
    dist_p = np.ones((1, len(s)))
    dist_q = np.ones((1, len(s)))
    for e, k in groups:
        lp1, lp0, lq1, lq0 = _max_bits(e.noise_multiplier, e.steps, e.noise_multiplier * s + 0.5)
        dist_p = _convolve_columns(dist_p, np.exp(_binom_logpmf(k, lp1, lp0)))
        dist_q = _convolve_columns(dist_q, np.exp(_binom_logpmf(k, lq1, lq0)))
    with np.errstate(divide="ignore"):
        return _hockey_log(np.log(dist_p), np.log(dist_q), epsilon)


def _convolve_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0] + b.shape[0] - 1, a.shape[1]))
    for i in range(b.shape[0]):
        out[i : i + a.shape[0]] += a * b[i]
    return out


def lower_bound_epsilon(epochs: Sequence[Epoch], delta: float) -> float:
    """Largest epsilon certainly spent at ``delta``: the root of ``lower_bound_delta = delta``."""
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if lower_bound_delta(epochs, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while lower_bound_delta(epochs, hi) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            return math.inf
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if lower_bound_delta(epochs, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6 * max(1.0, hi):
            break
    return lo


# ---------------------------------------------------------------------------------------------
# Privacy-loss samplers (pure functions of a numpy Generator)
# ---------------------------------------------------------------------------------------------


def default_orders(n: int, *, dense: int = 256, ratio: float = 1.005) -> np.ndarray:
    """Order-statistic indices 1 = k_1 < ... < k_m = n: dense at the top, then geometric."""
    check_range("n", n, 1, None, integer=True)
    if n <= dense:
        return np.arange(1, n + 1)
    ks = list(range(1, dense + 1))
    k = float(dense)
    while True:
        k = max(k * ratio, k + 1)
        if k >= n:
            break
        ks.append(int(k))
    ks.append(n)
    return np.unique(np.asarray(ks, dtype=np.int64))


def _log_sum_exp_rows(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=1)
    return m + np.log(np.exp(a - m[:, None]).sum(axis=1))


def _plain_losses(z: float, steps: int, n: int, rng: np.random.Generator, chunk: int):
    """Exact (remove, add) loss samples of one epoch sharing Gaussian draws."""
    rem = np.empty(n)
    add = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    fast = z >= 0.15  # exp(g / z) cannot overflow float32 for |g| < 13
    for start in range(0, n, rows):
        m = min(rows, n - start)
        g = rng.standard_normal((m, steps), dtype=np.float32 if fast else np.float64)
        g1 = g[:, 0].astype(np.float64) * inv_z
        if steps == 1:
            rest_log = np.full(m, -np.inf)
        elif fast:
            g_rest = g[:, 1:]
            g_rest *= np.float32(inv_z)
            np.exp(g_rest, out=g_rest)
            rest_log = np.log(g_rest.sum(axis=1, dtype=np.float64))
        else:
            rest_log = _log_sum_exp_rows(g[:, 1:] * inv_z)
        # remove: x ~ P (coordinate 1 shifted by 1): log sum = logaddexp(g1/z + 1/z^2, rest)
        rem[start : start + m] = np.logaddexp(g1 + 2 * c, rest_log) - c - log_t
        # add: x ~ Q: L_QP(x) = -(logsumexp(x / z^2 - 1/(2 z^2)) - log T)
        add[start : start + m] = -(np.logaddexp(g1, rest_log) - c - log_t)
    return rem, add


def _truncated_normals_below(bound: np.ndarray, shape, rng, dtype=np.float64) -> np.ndarray:
    """i.i.d. N(0,1) conditioned on <= bound (per row), via draw-and-fix-up.

    A draw above the bound is replaced by an exact conditional draw Phi^-1(u Phi(bound)); the
    mixture is exactly the conditional law.
    """
    g = rng.standard_normal(shape, dtype=dtype)
    b = np.broadcast_to(bound.reshape(-1, *([1] * (len(shape) - 1))), shape)
    bad = g > b
    if bad.any():
        bb = b[bad].astype(np.float64)
        u = rng.random(bb.shape)
        g[bad] = special.ndtri(u * special.ndtr(bb)).astype(dtype)
    return g


def _importance_remove(z, steps, n, eps0, rng, chunk):
    """Remove-direction losses on E = {max y >= b}, and log P(E) (Chua et al., Alg. 10)."""
    b = z * eps0 - 0.5 / z
    log_cdf_b = float(_log_cdf(b))
    p_e = -math.expm1(steps * log_cdf_b)  # P(max of T std normals >= b)
    out = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        # Conditional maximum: P(M >= x) = 1 - Phi(x)^T; draw its survival u * P(M >= b).
        u = rng.random(m)
        log_cdf_m = np.log1p(-u * p_e) / steps  # log Phi(M)
        mx = -special.ndtri(-np.expm1(log_cdf_m))  # M = Phi^-1(exp(.)) via the upper tail
        others = _truncated_normals_below(mx, (m, steps - 1), rng)
        pos = rng.integers(0, steps, m)  # position of the maximum among the T coordinates
        y = np.empty((m, steps))
        y[:, 1:] = others
        y[:, 0] = mx
        swap = pos > 0
        rows_idx = np.flatnonzero(swap)
        y[rows_idx, 0] = others[rows_idx, pos[rows_idx] - 1]
        y[rows_idx, pos[rows_idx]] = mx[rows_idx]
        a = y * inv_z
        a[:, 0] += 2 * c  # x_1 = z y_1 + 1
        out[start : start + m] = _log_sum_exp_rows(a) - c - log_t
    return out, p_e


def _importance_add(z, steps, n, eps0, rng, chunk):
    """Add-direction losses on E = {all x_t / z <= b}, and P(E) (Chua et al., App. B.1)."""
    b = (0.5 + z * z * (math.log(steps) - eps0)) / z
    p_e = math.exp(steps * float(_log_cdf(b)))
    out = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        g = _truncated_normals_below(np.full(m, b), (m, steps), rng)
        out[start : start + m] = -(_log_sum_exp_rows(g * inv_z) - c - log_t)
    return out, p_e


def block_log_sums(scaled: np.ndarray, orders: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Pathwise bounds on ``log sum_t exp(v_t)`` from the order statistics of n values v_t.

    ``scaled[:, i]`` is the ``orders[i]``-th largest value (orders k_1 = 1 < ... < k_m = n).
    Upper: each block [k_i, k_{i+1}) is at most its first value (Chua et al. 2025, Eq. 4);
    lower: each block (k_{i-1}, k_i] is at least its last value (Eq. 5). Returns (upper, lower).
    """
    k = np.asarray(orders, dtype=np.int64)
    if k[0] != 1 or k[-1] != n or np.any(np.diff(k) <= 0):
        raise ValueError(f"orders must increase from 1 to n={n}, got orders={k!r}")
    upper_w = np.log(np.diff(np.concatenate((k, [n + 1]))).astype(float))
    lower_w = np.log(np.diff(np.concatenate(([0], k))).astype(float))
    return _log_sum_exp_rows(scaled + upper_w), _log_sum_exp_rows(scaled + lower_w)


def _order_statistic_losses(z, steps, n, rng, chunk, orders):
    """Pessimistic (remove, add) losses from order statistics of the T - 1 unshifted coordinates.

    The k-th largest of T - 1 standard normals is -Phi^-1(U_(k)) with U_(k) the k-th smallest of
    T - 1 uniforms, drawn jointly as exponential spacings U_(k) = G_k / G_T (Gamma partial
    sums; equivalent to the Beta recursion of Chua et al., Alg. 6). :func:`block_log_sums`
    bounds the sum above (remove direction) and below (add direction).
    """
    rem = np.empty(n)
    add = np.empty(n)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    n_rest = steps - 1
    k = np.asarray(orders, dtype=np.int64)
    gaps = np.diff(np.concatenate(([0], k))).astype(float)  # k_i - k_{i-1}
    tail = float(n_rest + 1 - k[-1])
    rows = max(1, chunk // (len(k) + 1))
    for start in range(0, n, rows):
        m = min(rows, n - start)
        inc = rng.standard_gamma(np.broadcast_to(gaps, (m, len(k))))
        cum = np.cumsum(inc, axis=1)
        total = cum[:, -1] + rng.standard_gamma(tail, m)
        a = -special.ndtri(cum / total[:, None]) * inv_z  # k-th largest normal, over z
        g1 = rng.standard_normal(m) * inv_z
        up, low = block_log_sums(a, k, n_rest)
        rem[start : start + m] = np.logaddexp(g1 + 2 * c, up) - c - log_t
        add[start : start + m] = -(np.logaddexp(g1, low) - c - log_t)
    return rem, add


# ---------------------------------------------------------------------------------------------
# Conditional Monte Carlo with analytic tails (one epoch; dpfy's refinement, not in the paper)
# ---------------------------------------------------------------------------------------------
#
# Write S = sum_{t >= 2} e^{g_t / z} for the T - 1 coordinates that do not hold the differing
# example (g standard normal). Given S, the expectation over the differing coordinate g_1 is a
# one-dimensional integral: psi_remove(S) = E_g1[(1 - e^(eps - L))_+] (increasing in S) and
# psi_add(S) = E_g1[(1 - e^(eps + L))_+] (decreasing in S, closed form). So delta = E[psi(S)]
# with psi in [0, 1], but psi(S) is large only in a far tail of S. For a level tau,
#     E[psi(S)] = E[min(psi(S), tau)] + int_tau^1 P(psi(S) > u) du,
# the first term is a mean of [0, tau]-valued samples (KL bound on the range tau instead of 1:
# about 1/tau times fewer samples for the same bound) and the second is bounded analytically by
# Chernoff bounds on the sum of i.i.d. log-normal terms (right tail: terms truncated at e^{m/z},
# plus the union bound (T - 1) P(g > m); left tail: the exact Laplace transform). tau is chosen
# from (n, error probability, a reference epsilon) only, never from the samples.

_GL64 = np.polynomial.legendre.leggauss(64)
_GL400 = np.polynomial.legendre.leggauss(400)
_HIST_BINS = 1 << 17


def _gl(a: np.ndarray, b: np.ndarray, rule) -> tuple[np.ndarray, np.ndarray]:
    x, w = rule
    half = (b - a)[..., None] / 2.0
    return a[..., None] + half * (x + 1.0), half * w


def _psi_remove(s: np.ndarray, z: float, steps: int, epsilon: float) -> np.ndarray:
    """E over g1 ~ N(0,1) of (1 - K / (e^{g1/z + 1/z^2} + s))_+, K = T e^{eps + 1/(2z^2)}."""
    s = np.asarray(s, dtype=float)
    c = 0.5 / (z * z)
    log_k = math.log(steps) + epsilon + c
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.exp(log_k) - s
        a = np.where(gap > 0, z * (np.log(np.where(gap > 0, gap, 1.0)) - 2 * c), -np.inf)
    lo = np.maximum(a, -16.0)
    hi = np.maximum(lo, 0.0) + 14.0
    g, w = _gl(lo, hi, _GL64)
    with np.errstate(over="ignore"):
        denom = np.exp(np.minimum(g / z + 2 * c, 700.0)) + s[..., None]
    inner = np.maximum(1.0 - np.exp(log_k) / denom, 0.0)
    dens = np.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    return np.minimum(np.sum(w * dens * inner, axis=-1), 1.0)


def _psi_add(s: np.ndarray, z: float, steps: int, epsilon: float) -> np.ndarray:
    """E over g1 of (1 - kappa (e^{g1/z} + s))_+, kappa = e^{eps - 1/(2z^2)} / T (closed form)."""
    s = np.asarray(s, dtype=float)
    c = 0.5 / (z * z)
    kappa = math.exp(min(epsilon - c, 700.0)) / steps
    rest = 1.0 - kappa * s
    with np.errstate(divide="ignore", invalid="ignore"):
        b = z * np.log(np.where(rest > 0, rest / kappa, 1.0))
    val = rest * special.ndtr(b) - kappa * math.exp(c) * special.ndtr(b - 1.0 / z)
    return np.where(rest > 0, np.maximum(val, 0.0), 0.0)


class _SumTails:
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
        g, w = _gl(np.full(self.m.shape, -16.0), self.m, _GL400)  # (M, 400)
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
        g2, w2 = _gl(np.array(-16.0), np.array(top), _GL400)
        log_phi2 = -0.5 * g2 * g2 - 0.5 * math.log(2 * math.pi)
        e2 = log_phi2[None, :] - self.lam_left[:, None] * np.exp(g2 / z)[None, :]
        mx2 = e2.max(axis=-1, keepdims=True)
        self.log_lt = mx2[:, 0] + np.log(np.sum(w2[None, :] * np.exp(e2 - mx2), axis=-1))
        if truncate is not None:
            self.log_lt -= float(special.log_ndtr(truncate))

    def right(self, s: np.ndarray) -> np.ndarray:
        s = np.asarray(s, dtype=float)
        chern = -self.lam[None] * s[:, None, None] + self.n * self.log_mgf[None]  # (S, M, L)
        best = np.logaddexp(self.log_union[None, :], chern.min(axis=-1))  # (S, M)
        return np.minimum(np.exp(best.min(axis=-1)), 1.0)

    def left(self, s: np.ndarray) -> np.ndarray:
        s = np.asarray(s, dtype=float)
        chern = self.lam_left[None, :] * s[:, None] + self.n * self.log_lt[None, :]
        return np.minimum(np.exp(chern.min(axis=-1)), 1.0)


def _stratum_sums(z, steps, n, rng, chunk, m_star, big: bool):
    """log S for the stratum of the T - 1 other coordinates: all <= m* (big=False) or max > m*.

    Stratum "big" places the conditional maximum first (Chua et al., Alg. 10), then the rest
    i.i.d. below it.
    """
    k = steps - 1
    out = np.empty(n)
    rows = max(1, chunk // k)
    inv_z = 1.0 / z
    p_big = -math.expm1(k * float(_log_cdf(m_star)))
    for start in range(0, n, rows):
        m = min(rows, n - start)
        if big:
            u = rng.random(m)
            log_cdf_m = np.log1p(-u * p_big) / k
            bound = -special.ndtri(-np.expm1(log_cdf_m))
            g = _truncated_normals_below(bound, (m, k - 1), rng, dtype=np.float32)
            first = bound * inv_z
        else:
            g = _truncated_normals_below(np.full(m, m_star), (m, k), rng, dtype=np.float32)
            first = np.full(m, -np.inf)
        if z >= 0.15 and k > 1:  # float32 fast path: e^{g/z} < e^{13/0.15} cannot overflow
            g32 = g.astype(np.float32)
            g32 *= np.float32(inv_z)
            np.exp(g32, out=g32)
            rest = np.log(g32.sum(axis=1, dtype=np.float64))
        elif g.shape[1]:
            rest = _log_sum_exp_rows(g * inv_z)
        else:
            rest = np.full(m, -np.inf)
        out[start : start + m] = np.logaddexp(first, rest)
    return out


def _conditional_sums(z: float, steps: int, n: int, rng: np.random.Generator, chunk: int):
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
            out[start : start + m] = _log_sum_exp_rows(g * inv_z)
    return out


def _hist_range(z: float, steps: int) -> tuple[float, float]:
    """(lo, width) of the log S histogram: generous around log((T - 1) e^{1/(2z^2)})."""
    center = math.log(steps - 1) + 0.5 / (z * z)
    lo = center - 10.0 - 4.0 / z
    hi = center + 10.0 + 12.0 / z
    return lo, (hi - lo) / _HIST_BINS


class _Hist:
    """Occupied bins of a log S histogram with pessimistic and central representatives."""

    def __init__(self, hist: np.ndarray, lo: float, width: float) -> None:
        self.n = int(hist.sum())
        idx = np.flatnonzero(hist)
        self.counts = hist[idx].astype(float)
        # pessimistic representatives: upper edges for psi_remove (increasing), lower edges
        # for psi_add (decreasing); underflow bin 0 -> [0, e^lo), overflow -> [e^hi, inf)
        upper = np.exp(lo + idx * width)
        lower = np.exp(lo + (idx - 1) * width)
        self.s_up = np.where(idx == _HIST_BINS + 1, np.inf, upper)
        self.s_low = np.where(idx == 0, 0.0, lower)
        mid = np.exp(lo + (idx - 0.5) * width)
        self.s_mid = np.where(idx == 0, 0.0, np.where(idx == _HIST_BINS + 1, lower, mid))


_BIG_FRACTION = 1.0 / 16.0  # share of samples drawn from the stratum "others' max > m*"
_BIG_ERROR_SHARE = 0.1  # share of the error probability spent on that stratum's bound


def _split_level(steps: int, n_big: int, delta_ref: float, error_probability: float) -> float:
    """m*: P(max of the T - 1 others > m*) = p with p log(1/beta_B) / n_big ~ delta_ref / 20."""
    if n_big <= 0 or delta_ref <= 0.0:
        return math.inf
    beta_b = _BIG_ERROR_SHARE * error_probability
    p = min(0.5, 0.05 * delta_ref * n_big / math.log(1.0 / beta_b))
    if p < 1e-12:
        return math.inf
    k = steps - 1
    return float(-special.ndtri(-math.expm1(math.log1p(-p) / k)))


class _ConditionalLosses:
    """Histograms of log S (two strata) and the bounds of the conditional method (one epoch).

    Stratum A: all T - 1 other coordinates <= m* (probability 1 - p_big), light tails, capped
    range tau plus Chernoff tail integral. Stratum B: their maximum > m* (probability p_big,
    sampled by placing the maximum first), range 1. When both are sampled, stratum B's KL
    bound uses 10 % of the error probability and stratum A's the rest (union bound).
    """

    def __init__(self, results: list[dict[str, Any]], epoch: Epoch, error_probability: float,
                 reference_epsilon: float, m_star: float = math.inf) -> None:
        self.z, self.steps = epoch.noise_multiplier, epoch.steps
        self.lo, self.width = _hist_range(self.z, self.steps)
        hist = np.zeros(_HIST_BINS + 2, dtype=np.int64)
        hist_big = np.zeros(_HIST_BINS + 2, dtype=np.int64)
        for r in results:
            hist += r["hist"]
            hist_big += r["hist_big"]
        self.a = _Hist(hist, self.lo, self.width)
        self.b = _Hist(hist_big, self.lo, self.width)
        self.n = self.a.n
        k = self.steps - 1
        if math.isfinite(m_star):
            self.p_big = -math.expm1(k * float(_log_cdf(m_star)))
            self.tails = _SumTails(self.z, k, truncate=m_star)
        else:
            self.p_big = 0.0
            self.tails = _SumTails(self.z, k)
        both = self.p_big > 0 and self.b.n > 0
        share = _BIG_ERROR_SHARE if both else 0.0
        self.error_probability = (1.0 - share) * error_probability
        self.error_probability_big = max(share * error_probability, 1e-300)
        self._tail_grids()
        self.tau = {d: self._choose_tau(d, reference_epsilon) for d in _DIRECTIONS}
        self.weights = {d: 1.0 for d in _DIRECTIONS}

    def _psi(self, direction: str, s: np.ndarray, epsilon: float) -> np.ndarray:
        if direction == "remove":
            out = _psi_remove(np.where(np.isfinite(s), s, 0.0), self.z, self.steps, epsilon)
            return np.where(np.isfinite(s), out, 1.0)
        return _psi_add(s, self.z, self.steps, epsilon)

    def _tail_grids(self) -> None:
        """Fixed s-grids (log-spaced) with the analytic tail bounds at each point."""
        mean_s = (self.steps - 1) * math.exp(0.5 / (self.z * self.z))
        self.grid_right = mean_s * np.exp(np.linspace(-2.0, 14.0, 1601))
        self.tail_right = self.tails.right(self.grid_right)
        self.grid_left = np.concatenate((mean_s * np.exp(np.linspace(2.0, -30.0, 1601)), [0.0]))
        self.tail_left = self.tails.left(self.grid_left)

    def _tail_integrals(self, direction: str, epsilon: float, taus: np.ndarray) -> np.ndarray:
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
        return np.where(taus >= top, 0.0, out)

    def _tail_integral(self, direction: str, epsilon: float, tau: float) -> float:
        return float(self._tail_integrals(direction, epsilon, np.array([tau]))[0])

    def _choose_tau(self, direction: str, epsilon: float) -> float:
        """tau minimising (KL slack of a range-tau mean) + tail integral at epsilon."""
        slack = math.log(1.0 / self.error_probability) / self.n
        taus = np.geomspace(1e-7, 1.0, 141)
        cost = taus * slack + self._tail_integrals(direction, epsilon, taus)
        return float(taus[int(np.argmin(cost))])

    def _upper(self, d: str, epsilon: float) -> float:
        tau, beta = self.tau[d], self.error_probability
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

    def _estimate(self, d: str, epsilon: float) -> float:
        est = float(np.sum(self.a.counts * self._psi(d, self.a.s_mid, epsilon)) / self.a.n)
        if self.p_big == 0.0 or self.b.n == 0:
            return est
        est_b = float(np.sum(self.b.counts * self._psi(d, self.b.s_mid, epsilon)) / self.b.n)
        return (1.0 - self.p_big) * est + self.p_big * est_b

    def estimate(self, epsilon: float) -> float:
        return max(self._estimate(d, epsilon) for d in _DIRECTIONS)

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, str]:
        ub = {d: self._upper(d, epsilon) for d in _DIRECTIONS}
        direction = max(ub, key=lambda d: ub[d])
        return self.estimate(epsilon), ub[direction], direction

    def upper(self, epsilon: float) -> float:
        return max(self._upper(d, epsilon) for d in _DIRECTIONS)

    def by_direction(self, epsilon: float) -> tuple[tuple[float, float], tuple[float, float]]:
        est = tuple(self._estimate(d, epsilon) for d in _DIRECTIONS)
        return est, (1.0, 1.0)  # type: ignore[return-value]

    def top(self) -> float:
        return math.inf


# ---------------------------------------------------------------------------------------------
# Tilted importance sampling for several epochs (dpfy's extension; not in the paper)
# ---------------------------------------------------------------------------------------------
#
# Remove direction. For an integer order a >= 2 the tilted law R_a = P^a Q^(1-a) / M_a of one
# epoch is a finite Gaussian mixture: with counts c = (c_1..c_T), sum c = a,
#     P^a Q^(1-a) = T^-a sum_c (a! / prod c_t!) exp(sum_t c_t (c_t - 1) / (2 z^2)) N(c, z^2 I),
# and M_a = E_Q[(P/Q)^a] is that sum's total mass (DESIGN 4.3). L is symmetric in the
# coordinates, so only the multiset of counts (a partition of a) matters. Under R_a (every
# epoch), dP/dR = prod_e M_a,e exp(-(a - 1) L) with L the total loss, hence
#     E_P[(1 - e^(eps - L))_+] = B(eps) E_R[Y],   B(eps) = M exp(-(a - 1) eps) kappa_a,
#     Y = e^(-(a - 1)(L - eps)) (1 - e^(eps - L))_+ / kappa_a in [0, 1],
# kappa_a = max_{u >= 0} e^(-(a - 1) u)(1 - e^-u) = (1/a)((a - 1)/a)^(a - 1). B is the Renyi
# (order a) bound on delta, the KL confidence bound applies to the mean of Y, and the sample
# only has to resolve delta / B instead of delta. a is chosen from M_a alone (no samples).
#
# Add direction: the Chernoff (Renyi) bound E_Q[e^(lam L')] e^(-lam eps) kappa(lam), L' = -L,
# with E_Q[(Q/P)^lam] = (T e^(1/(2 z^2)))^lam E[S^-lam], S = sum_t e^(x_t / z^2), and
# E[S^-lam] = Gamma(lam)^-1 int_0^inf u^(lam - 1) E[e^(-u e^(g/z))]^T du (numerical
# quadrature), minimised over a grid of lam. It is an upper bound, not an estimate.

_MAX_TILT_ORDER = 24


def _partitions(a: int, largest: int, parts: int) -> list[tuple[int, ...]]:
    """Partitions of a into at most ``parts`` parts, each <= ``largest`` (non-increasing)."""
    if a == 0:
        return [()]
    if parts == 0:
        return []
    out = []
    for p in range(min(a, largest), 0, -1):
        out.extend((p, *rest) for rest in _partitions(a - p, p, parts - 1))
    return out


def _tilt_table(z: float, steps: int, order: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(count shapes padded to ``order`` columns, log-probabilities, log M_order) of one epoch."""
    shapes = _partitions(order, order, min(order, steps))
    counts = np.zeros((len(shapes), order))
    for i, s in enumerate(shapes):
        counts[i, : len(s)] = s
    used = counts > 0
    r = used.sum(axis=1)
    log_mult = np.zeros(len(shapes))
    for i, s in enumerate(shapes):
        _, m = np.unique(s, return_counts=True)
        log_mult[i] = special.gammaln(m + 1.0).sum()
    log_w = (
        special.gammaln(steps + 1.0) - special.gammaln(steps - r + 1.0) - log_mult
        + special.gammaln(order + 1.0) - special.gammaln(counts + 1.0).sum(axis=1)
        + (counts * (counts - 1.0)).sum(axis=1) / (2.0 * z * z) - order * math.log(steps)
    )
    log_m = float(special.logsumexp(log_w))
    return counts, log_w - log_m, log_m


def _log_kappa(lam: np.ndarray | float) -> np.ndarray:
    """log max_{u >= 0} e^(-lam u)(1 - e^-u) = log((lam/(lam+1))^lam / (lam+1)), lam > 0."""
    lam = np.asarray(lam, dtype=float)
    return lam * np.log(lam / (lam + 1.0)) - np.log1p(lam)


def _tilt_log_moments(epochs: Sequence[Epoch], orders: np.ndarray) -> np.ndarray:
    """sum over epochs of log M_a (remove direction), for each order a."""
    out = np.zeros(len(orders))
    for e, k in _group(epochs):
        out += k * np.array([_tilt_table(e.noise_multiplier, e.steps, int(a))[2] for a in orders])
    return out


def _choose_tilt_order(epochs: Sequence[Epoch], delta: float) -> int:
    """The order a minimising the Renyi epsilon bound at delta (depends on no samples)."""
    orders = np.arange(2, _MAX_TILT_ORDER + 1)
    log_m = _tilt_log_moments(epochs, orders)
    eps = (log_m + _log_kappa(orders - 1.0) - math.log(delta)) / (orders - 1.0)
    return int(orders[int(np.argmin(eps))])


def _tilted_losses(z: float, steps: int, order: int, n: int, rng, chunk: int) -> np.ndarray:
    """Remove-direction losses of one epoch under the tilted mixture R_order."""
    counts, log_p, _ = _tilt_table(z, steps, order)
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


_ADD_LAMBDAS = np.concatenate((np.geomspace(0.02, 1.0, 30, endpoint=False),
                               np.linspace(1.0, 40.0, 157)))


def _add_log_mgf(z: float, steps: int, lams: np.ndarray) -> np.ndarray:
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
        log_m[i : i + 250] = special.logsumexp(log_phi[None, :] - u * y[None, :], axis=1)
    log_m = np.minimum(np.logaddexp(log_m, float(special.log_ndtr(-12.0)) + math.log(2.0)), 0.0)
    parts = [special.logsumexp(lams[:, None] * v[None, :] + steps * log_m[None, :], axis=1)
             + math.log(dv)]
    parts.append(lams * lo_v - np.log(lams))  # int_{-inf}^{lo_v} e^(lam v) dv
    w = np.linspace(hi_v, 2000.0, 20001)
    with np.errstate(over="ignore"):
        env = np.logaddexp(special.log_ndtr(-0.5 * z * w), -np.exp(0.5 * w))
    parts.append(special.logsumexp(lams[:, None] * w[None, :] + steps * env[None, :], axis=1)
                 + math.log(w[1] - w[0]) + 1.0)  # Riemann sum of a unimodal envelope, x e
    integral = special.logsumexp(np.stack(parts), axis=0)
    return lams * (math.log(steps) + c) - special.gammaln(lams) + integral


class _TiltedLosses:
    """Remove direction by tilted importance sampling, add direction by the Renyi bound."""

    def __init__(self, results: list[dict[str, Any]], epochs: Sequence[Epoch], order: int,
                 threshold: float, error_probability: float) -> None:
        self.n = sum(r["n"] for r in results)
        self.values = np.sort(np.concatenate([r["remove"] for r in results]))
        self.order = order
        self.threshold = threshold
        self.error_probability = error_probability
        self.log_m = float(_tilt_log_moments(epochs, np.array([order]))[0])
        self.log_kappa = float(_log_kappa(order - 1.0))
        add = np.zeros(len(_ADD_LAMBDAS))
        for e, k in _group(epochs):
            add += k * _add_log_mgf(e.noise_multiplier, e.steps, _ADD_LAMBDAS)
        # quadrature safety margin: 1e-6 relative per epoch on the moment
        self.add_log_mgf = add + 1e-6 * len(epochs)

    def _scale(self, epsilon: float) -> float:
        return math.exp(self.log_m - (self.order - 1) * epsilon + self.log_kappa)

    def _mean(self, epsilon: float) -> float:
        v = self.values[self.values > epsilon]
        lam = self.order - 1
        y = np.exp(-lam * (v - epsilon) - self.log_kappa) * -np.expm1(epsilon - v)
        return float(np.minimum(y, 1.0).sum() / self.n)

    def add_bound(self, epsilon: float) -> float:
        log_b = self.add_log_mgf - _ADD_LAMBDAS * epsilon + _log_kappa(_ADD_LAMBDAS)
        return float(min(1.0, math.exp(min(0.0, float(log_b.min())))))

    def _remove(self, epsilon: float) -> tuple[float, float]:
        s, m = self._scale(epsilon), self._mean(epsilon)
        ub = s * float(kl_upper_bound(m, self.n, self.error_probability))
        return s * m, min(ub, 1.0)

    def estimate(self, epsilon: float) -> float:
        return self._remove(epsilon)[0]

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, str]:
        est, ub = self._remove(epsilon)
        add = self.add_bound(epsilon)
        return (est, ub, "remove") if ub >= add else (est, add, "add")

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def by_direction(self, epsilon: float) -> tuple[tuple[float, float], tuple[float, float]]:
        return (self.estimate(epsilon), math.nan), (self._scale(epsilon), math.nan)

    def top(self) -> float:
        return math.inf


class _HybridLosses:
    """One epoch: remove direction from the tilted sampler, add direction from the conditional.

    Each direction's bound holds with probability >= 1 - error_probability on its own; the
    dominating direction is fixed, so the maximum is a bound at that error probability.
    """

    def __init__(self, tilted: _TiltedLosses, conditional: _ConditionalLosses) -> None:
        self.tilted, self.cond = tilted, conditional
        self.error_probability = tilted.error_probability

    def estimate(self, epsilon: float) -> float:
        return max(self.tilted.estimate(epsilon), self.cond._estimate("add", epsilon))

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, str]:
        rem = self.tilted._remove(epsilon)[1]
        # the Renyi bound is certain, so the minimum keeps the conditional bound's error rate
        add = min(self.cond._upper("add", epsilon), self.tilted.add_bound(epsilon))
        return self.estimate(epsilon), max(rem, add), "remove" if rem >= add else "add"

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def by_direction(self, epsilon: float) -> tuple[tuple[float, float], tuple[float, float]]:
        est = (self.tilted.estimate(epsilon), self.cond._estimate("add", epsilon))
        return est, (self.tilted._scale(epsilon), 1.0)

    def top(self) -> float:
        return math.inf


# ---------------------------------------------------------------------------------------------
# Jobs (top-level so a process pool can run them)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Job:
    epochs: tuple[Epoch, ...]
    n: int
    seed: Any  # SeedSequence
    mode: str  # "plain" | "importance" | "order_statistics" | "conditional"
    threshold: float  # keep losses > threshold (the integrand is 0 below for eps >= threshold)
    chunk: int
    orders: tuple[np.ndarray, ...] | None = None
    m_star: float = math.inf  # conditional: split of the other coordinates' maximum
    big_fraction: float = 0.0  # conditional: share of samples from the stratum max > m_star
    tilt_order: int = 0  # tilted: the integer order a of the tilted mixture


def _run_job(job: _Job) -> dict[str, Any]:
    rng = np.random.default_rng(job.seed)
    if job.mode == "tilted":
        total = np.zeros(job.n)
        for ep in job.epochs:
            total += _tilted_losses(ep.noise_multiplier, ep.steps, job.tilt_order, job.n, rng,
                                    job.chunk)
        return {"n": job.n, "remove": np.sort(total[total > job.threshold])}
    if job.mode == "conditional":
        (ep,) = job.epochs
        z, t = ep.noise_multiplier, ep.steps
        lo, width = _hist_range(z, t)
        n_big = int(round(job.n * job.big_fraction)) if math.isfinite(job.m_star) else 0
        out: dict[str, Any] = {"n": job.n - n_big, "n_big": n_big}
        for key, size, big in (("hist", job.n - n_big, False), ("hist_big", n_big, True)):
            if math.isfinite(job.m_star):
                log_s = _stratum_sums(z, t, size, rng, job.chunk, job.m_star, big)
            else:
                log_s = _conditional_sums(z, t, size, rng, job.chunk)
            idx = np.clip(np.floor((log_s - lo) / width) + 1, 0, _HIST_BINS + 1).astype(np.int64)
            out[key] = np.bincount(idx, minlength=_HIST_BINS + 2)
        return out
    if job.mode == "importance":
        (ep,) = job.epochs
        rem, p_rem = _importance_remove(
            ep.noise_multiplier, ep.steps, job.n, job.threshold, rng, job.chunk
        )
        add, p_add = _importance_add(
            ep.noise_multiplier, ep.steps, job.n, job.threshold, rng, job.chunk
        )
        weights = {"remove": p_rem, "add": p_add}
    else:
        rem = np.zeros(job.n)
        add = np.zeros(job.n)
        for i, ep in enumerate(job.epochs):
            if job.mode == "order_statistics" and ep.steps > 2:
                assert job.orders is not None
                r, a = _order_statistic_losses(
                    ep.noise_multiplier, ep.steps, job.n, rng, job.chunk, job.orders[i]
                )
            else:
                r, a = _plain_losses(ep.noise_multiplier, ep.steps, job.n, rng, job.chunk)
            rem += r
            add += a
        weights = {"remove": 1.0, "add": 1.0}
    return {
        "n": job.n,
        "remove": np.sort(rem[rem > job.threshold]),
        "add": np.sort(add[add > job.threshold]),
        "weights": weights,
    }


# ---------------------------------------------------------------------------------------------
# Estimates
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MonteCarloEstimate:
    """A Monte Carlo (epsilon, delta) statement.

    Attributes:
      epsilon, delta: for ``monte_carlo_delta`` epsilon is the input and ``delta_*`` the output;
        for ``monte_carlo_epsilon`` delta is the input and ``epsilon_*`` the output.
      epsilon_upper / delta_upper: the bound holding with prob. >= 1 - error_probability.
      epsilon_estimate / delta_estimate: the point estimate (Monte Carlo mean).
      epsilon_lower / delta_lower: the certain (analytic) lower bound.
      direction: the adjacency direction attaining the maximum ("remove" or "add").
      samples, method, error_probability, seconds: how it was computed.
      direction_estimates: delta estimates (remove, add) at the reported epsilon.
      direction_scales: (remove, add) probability of the importance-sampling event (1 if none);
        each direction's estimate is that scale times a mean of [0, 1]-valued samples.
    """

    epsilon_upper: float
    epsilon_estimate: float
    epsilon_lower: float
    delta_upper: float
    delta_estimate: float
    delta_lower: float
    direction: str
    samples: int
    method: str
    error_probability: float
    seconds: float
    direction_estimates: tuple[float, float] = (math.nan, math.nan)
    direction_scales: tuple[float, float] = (1.0, 1.0)


class _Losses:
    """Kept loss samples of both directions, with their counts and importance weights."""

    def __init__(
        self, results: list[dict[str, Any]], threshold: float, error_probability: float
    ) -> None:
        self.error_probability = error_probability
        self.n = sum(r["n"] for r in results)
        self.threshold = threshold
        self.values = {d: np.sort(np.concatenate([r[d] for r in results])) for d in _DIRECTIONS}
        self.weights = {d: float(results[0]["weights"][d]) for d in _DIRECTIONS}

    def mean(self, direction: str, epsilon: float) -> float:
        v = self.values[direction]
        v = v[v > epsilon]
        return float(np.sum(-np.expm1(epsilon - v)) / self.n)

    def estimate(self, epsilon: float) -> float:
        """Point estimate of delta at epsilon (maximum over directions)."""
        return max(self.weights[d] * self.mean(d, epsilon) for d in _DIRECTIONS)

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, str]:
        """(estimate, upper bound, direction of the upper bound) of delta at epsilon."""
        best = (-1.0, -1.0, "remove")
        est_max = 0.0
        for d in _DIRECTIONS:
            m = self.mean(d, epsilon)
            w = self.weights[d]
            ub = w * float(kl_upper_bound(m, self.n, error_probability))
            est_max = max(est_max, w * m)
            if ub > best[1]:
                best = (w * m, ub, d)
        return est_max, best[1], best[2]

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def top(self) -> float:
        """An epsilon above every kept loss (the integrand vanishes beyond it)."""
        return max([self.threshold + 1.0] + [float(v[-1]) for v in self.values.values() if len(v)])

    def by_direction(self, epsilon: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """((remove, add) estimates, (remove, add) importance scales) at epsilon."""
        est = tuple(self.weights[d] * self.mean(d, epsilon) for d in _DIRECTIONS)
        return est, tuple(self.weights[d] for d in _DIRECTIONS)  # type: ignore[return-value]


def _smallest_epsilon(fn, delta: float, lo: float, hi: float) -> float:
    """Smallest eps in [lo, hi] with fn(eps) <= delta for non-increasing fn; inf if none."""
    if fn(lo) <= delta:
        return lo
    if fn(hi) > delta:
        return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if fn(mid) <= delta:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * max(1.0, hi):
            break
    return hi


def _choose_mode(epochs: Sequence[Epoch], method: str, threshold: float) -> str:
    if method != "auto":
        if method in ("importance", "conditional") and len(epochs) != 1:
            raise ValueError(
                f"method={method!r} applies to a single epoch (Chua et al., App. B.4), "
                f"got {len(epochs)} epochs"
            )
        if method == "conditional" and epochs[0].steps < 2:
            raise ValueError("method='conditional' needs steps >= 2 (T = 1 is a Gaussian)")
        return method
    if len(epochs) == 1:
        ep = epochs[0]
        z, t = ep.noise_multiplier, ep.steps
        p_rem = -math.expm1(t * float(_log_cdf(z * threshold - 0.5 / z)))
        p_add = math.exp(t * float(_log_cdf((0.5 + z * z * (math.log(t) - threshold)) / z)))
        if max(p_rem, p_add) < 0.25:
            return "importance"
        if t >= 16:
            return "tilted"  # remove: tilted sampler; add: conditional sampler
    if max(e.steps for e in epochs) > 20_000:
        return "order_statistics"
    if len(epochs) > 1:
        return "tilted"
    return "plain"


def default_samples(epochs: Sequence[Epoch], budget: float = 5e7) -> int:
    """Default sample count: about ``budget`` Gaussian draws, between 2^12 and 2^22 samples.

    About 2 s per idle core with NumPy; use more samples for a tighter upper bound.
    """
    cost = sum(e.steps for e in epochs)
    return int(min(2**22, max(2**12, budget // max(cost, 1))))


def _sample_losses(
    epochs: Sequence[Epoch],
    *,
    samples: int,
    threshold: float,
    mode: str,
    seed: int | None,
    executor: Executor | None,
    chunk_elements: int,
    progress: bool,
    pilot: bool = False,
    m_star: float = math.inf,
    big_fraction: float = 0.0,
    tilt_order: int = 0,
) -> list[dict[str, Any]]:
    """Run the sampling jobs; ``pilot`` draws from a stream independent of the main one."""
    orders = None
    if mode == "order_statistics":
        orders = tuple(default_orders(max(e.steps - 1, 1)) for e in epochs)
    per_sample = sum(
        (len(o) + 2) * 3 if mode == "order_statistics" else e.steps
        for e, o in zip(epochs, orders or [np.zeros(0)] * len(epochs), strict=True)
    )
    job_samples = max(1, min(samples, (1 << 24) // max(per_sample, 1)))
    n_jobs = math.ceil(samples / job_samples)
    root = np.random.SeedSequence(seed)
    seeds = root.spawn(n_jobs) if not pilot else np.random.SeedSequence(
        root.entropy, spawn_key=(1 << 30,)
    ).spawn(n_jobs)
    jobs = [
        _Job(
            tuple(epochs),
            min(job_samples, samples - i * job_samples),
            seeds[i],
            mode,
            threshold,
            chunk_elements,
            orders,
            m_star,
            big_fraction,
            tilt_order,
        )
        for i in range(n_jobs)
    ]
    return _execute(jobs, executor, progress)


def _losses(
    epochs: Sequence[Epoch],
    *,
    samples: int,
    threshold: float,
    method: str,
    seed: int | None,
    executor: Executor | None,
    chunk_elements: int,
    progress: bool,
    error_probability: float,
    delta: float | None,
) -> tuple[Any, str]:
    """Loss statistics for the chosen sampler (delta given: epsilon search, tau from a pilot)."""
    mode = _choose_mode(epochs, method, threshold)
    kw = {
        "seed": seed,
        "executor": executor,
        "chunk_elements": chunk_elements,
        "progress": progress,
        "mode": mode,
        "threshold": threshold,
    }
    if mode == "tilted":
        # the order is chosen from the analytic moments only (delta, or the lower bound's delta
        # at the threshold when epsilon is given), never from the samples
        delta_ref = delta if delta is not None else lower_bound_delta(epochs, threshold)
        order = _choose_tilt_order(epochs, min(max(delta_ref, 1e-300), 0.5))
        results = _sample_losses(epochs, samples=samples, tilt_order=order, **kw)
        tilted = _TiltedLosses(results, epochs, order, threshold, error_probability)
        if len(epochs) == 1 and epochs[0].steps >= 16:
            # one epoch: the add direction by the conditional sampler instead of the looser
            # Renyi bound (independent stream: seed + 1)
            cond, _ = _losses(epochs, samples=samples, threshold=threshold,
                              method="conditional", seed=None if seed is None else seed + 1,
                              executor=executor,
                              chunk_elements=chunk_elements, progress=progress,
                              error_probability=error_probability, delta=delta)
            return _HybridLosses(tilted, cond), mode
        return tilted, mode
    if mode != "conditional":
        results = _sample_losses(epochs, samples=samples, **kw)
        return _Losses(results, threshold, error_probability), mode
    # Split the other coordinates at m* so that the rare "some other batch has a huge value"
    # stratum is sampled directly (1/16 of the samples) and the rest has light tails.
    delta_ref = delta if delta is not None else lower_bound_delta(epochs, threshold)
    big_fraction = _BIG_FRACTION
    m_star = _split_level(epochs[0].steps, int(samples * big_fraction), delta_ref,
                          error_probability)
    if not math.isfinite(m_star):
        big_fraction = 0.0
    kw.update(m_star=m_star, big_fraction=big_fraction)
    results = _sample_losses(epochs, samples=samples, **kw)
    reference = threshold
    if delta is not None:
        # tau is tuned at a pilot estimate from an independent stream (never from the samples
        # that enter the bound), so the bound keeps its error probability
        pilot = _sample_losses(epochs, samples=max(8, samples // 16), pilot=True, **kw)
        p = _ConditionalLosses(pilot, epochs[0], error_probability, threshold, m_star)
        est = _smallest_epsilon(p.estimate, delta, threshold, max(threshold, 1.0) * 64)
        if math.isfinite(est):
            reference = max(threshold, 0.97 * est)
    return _ConditionalLosses(results, epochs[0], error_probability, reference, m_star), mode


def _execute(jobs: list[_Job], executor: Executor | None, progress: bool) -> list[dict]:
    start = time.perf_counter()
    bar = None
    task = None
    results: list[dict | None] = [None] * len(jobs)

    def tick(done: int) -> None:
        nonlocal bar, task
        if not progress:
            return
        if bar is None and time.perf_counter() - start > 2.0 and done < len(jobs):
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TimeRemainingColumn

            bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                "{task.completed}/{task.total} chunks",
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            bar.start()
            task = bar.add_task("Monte Carlo accounting", total=len(jobs))
        if bar is not None:
            bar.update(task, completed=done)

    try:
        if executor is None:
            for i, job in enumerate(jobs):
                results[i] = _run_job(job)
                tick(i + 1)
        else:
            from concurrent.futures import as_completed

            futures = {executor.submit(_run_job, job): i for i, job in enumerate(jobs)}
            for done, fut in enumerate(as_completed(futures), start=1):
                results[futures[fut]] = fut.result()
                tick(done)
    finally:
        if bar is not None:
            bar.stop()
    return [r for r in results if r is not None]


def _check_common(samples, error_probability, method) -> None:
    check_range("samples", samples, 1, None, integer=True)
    check_range(
        "error_probability", error_probability, 0.0, 1.0, low_open=True, high_open=True
    )
    if method not in _METHODS:
        allowed = ", ".join(_METHODS)
        raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")


def monte_carlo_delta(
    epochs: Sequence[Epoch],
    epsilon: float,
    *,
    samples: int | None = None,
    error_probability: float = 1e-3,
    method: Method = "auto",
    seed: int | None = None,
    executor: Executor | None = None,
    chunk_elements: int = 1 << 22,
    progress: bool = True,
) -> MonteCarloEstimate:
    """Monte Carlo delta(epsilon) of a composition of Balls-and-Bins epochs (both directions).

    Args:
      epochs: the epochs (see :func:`epochs_of_event`); a Gaussian is ``Epoch(z, 1)``.
      epsilon: epsilon >= 0.
      samples: Monte Carlo samples per direction (default :func:`default_samples`).
      error_probability: probability that ``delta_upper`` is below the true delta.
      method: ``auto``, ``plain``, ``importance``, ``order_statistics``, ``conditional`` or
        ``tilted`` (module docstring).
      seed: seed of the sampler (None: fresh OS entropy).
      executor: run chunks on this ``concurrent.futures.Executor`` (None: in this process).
      chunk_elements: Gaussian draws held in memory at once per job.
      progress: show a progress bar if the run exceeds ~2 s.
    """
    t0 = time.perf_counter()
    epochs = list(epochs)
    check_range("epsilon", epsilon, 0.0, None)
    samples = default_samples(epochs) if samples is None else samples
    _check_common(samples, error_probability, method)
    losses, mode = _losses(
        epochs,
        samples=samples,
        threshold=float(epsilon),
        method=method,
        seed=seed,
        executor=executor,
        chunk_elements=chunk_elements,
        progress=progress,
        error_probability=error_probability,
        delta=None,
    )
    est, ub, direction = losses.delta(float(epsilon), error_probability)
    by_dir, scales = losses.by_direction(float(epsilon))
    low = lower_bound_delta(epochs, float(epsilon))
    return MonteCarloEstimate(
        epsilon_upper=float(epsilon),
        epsilon_estimate=float(epsilon),
        epsilon_lower=float(epsilon),
        delta_upper=min(1.0, ub),
        delta_estimate=est,
        delta_lower=low,
        direction=direction,
        samples=samples,
        method=mode,
        error_probability=error_probability,
        seconds=time.perf_counter() - t0,
        direction_estimates=by_dir,
        direction_scales=scales,
    )


def monte_carlo_epsilon(
    epochs: Sequence[Epoch],
    delta: float,
    *,
    samples: int | None = None,
    error_probability: float = 1e-3,
    method: Method = "auto",
    seed: int | None = None,
    executor: Executor | None = None,
    chunk_elements: int = 1 << 22,
    progress: bool = True,
) -> MonteCarloEstimate:
    """Monte Carlo epsilon(delta): upper confidence bound, estimate and certain lower bound.

    ``epsilon_upper`` is the smallest epsilon whose delta upper bound is <= ``delta``; it is at
    least the true epsilon with probability >= 1 - ``error_probability``. ``inf`` means the
    samples cannot certify ``delta`` at any epsilon (use more samples). Arguments as in
    :func:`monte_carlo_delta`.
    """
    t0 = time.perf_counter()
    epochs = list(epochs)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    samples = default_samples(epochs) if samples is None else samples
    _check_common(samples, error_probability, method)
    eps_low = lower_bound_epsilon(epochs, delta)
    # Losses below the threshold cannot contribute at any epsilon >= threshold. The estimate and
    # the bound lie above the lower bound unless the sample is wildly off; half of it is margin.
    threshold = 0.5 * eps_low if math.isfinite(eps_low) else 0.0
    losses, mode = _losses(
        epochs,
        samples=samples,
        threshold=threshold,
        method=method,
        seed=seed,
        executor=executor,
        chunk_elements=chunk_elements,
        progress=progress,
        error_probability=error_probability,
        delta=float(delta),
    )
    top = losses.top()
    if not math.isfinite(top):  # conditional: grow the bracket until the bound certifies delta
        top = max(threshold, 0.5)
        while losses.upper(top) > delta and top < 1e3:
            top *= 2.0
    eps_up = _smallest_epsilon(losses.upper, delta, threshold, top)
    eps_est = _smallest_epsilon(losses.estimate, delta, threshold, top)
    at = eps_up if math.isfinite(eps_up) else top
    _, _, direction = losses.delta(at, error_probability)
    by_dir, scales = losses.by_direction(at)
    return MonteCarloEstimate(
        epsilon_upper=eps_up,
        epsilon_estimate=eps_est,
        epsilon_lower=eps_low,
        delta_upper=float(delta),
        delta_estimate=float(delta),
        delta_lower=float(delta),
        direction=direction,
        samples=samples,
        method=mode,
        error_probability=error_probability,
        seconds=time.perf_counter() - t0,
        direction_estimates=by_dir,
        direction_scales=scales,
    )


def balls_and_bins_epsilon(
    noise_multiplier: float, steps_per_epoch: int, delta: float, *, epochs: int = 1, **options
) -> MonteCarloEstimate:
    """:func:`monte_carlo_epsilon` for ``epochs`` identical Balls-and-Bins epochs.

    Example:
      >>> r = balls_and_bins_epsilon(1.0, 1, 1e-5, samples=200_000, seed=0, progress=False)
      >>> r.epsilon_lower <= r.epsilon_estimate <= r.epsilon_upper
      True
    """
    return monte_carlo_epsilon(
        [Epoch(noise_multiplier, steps_per_epoch)] * int(epochs), delta, **options
    )


def balls_and_bins_delta(
    noise_multiplier: float, steps_per_epoch: int, epsilon: float, *, epochs: int = 1, **options
) -> MonteCarloEstimate:
    """:func:`monte_carlo_delta` for ``epochs`` identical Balls-and-Bins epochs."""
    return monte_carlo_delta(
        [Epoch(noise_multiplier, steps_per_epoch)] * int(epochs), epsilon, **options
    )


# ---------------------------------------------------------------------------------------------
# Accountant
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MonteCarloAccountant:
    """The ``monte_carlo`` accountant: Balls-and-Bins epochs and Gaussians, by Monte Carlo.

    Configure and pass as ``method=`` to :func:`dpfy.accounting.epsilon` for more samples, a
    seed or an executor. Results: ``epsilon`` = upper confidence bound (``provable=False``),
    ``epsilon_estimate``, ``epsilon_lower`` (certain), ``error_probability``.

    Truncation (``TruncatedBallsAndBins``) is accounted as the untruncated mechanism here; the
    extra delta of :mod:`dpfy.accounting.truncation` is added by the public ``epsilon()``.
    """

    samples: int | None = None
    error_probability: float = 1e-3
    seed: int | None = 0
    method: Method = "auto"
    executor: Executor | None = None
    progress: bool = True
    name: str = "monte_carlo"

    def unsupported(self, event: ev.Event) -> str | None:
        return _unsupported(event)

    def _options(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "error_probability": self.error_probability,
            "method": self.method,
            "seed": self.seed,
            "executor": self.executor,
            "progress": self.progress,
        }

    def _notes(self, r: MonteCarloEstimate) -> tuple[str, ...]:
        notes = [
            f"Monte Carlo estimate ({r.method} sampling, {r.samples} samples per direction): "
            f"epsilon is an upper confidence bound holding with probability "
            f">= 1 - {r.error_probability:g}; not a provable guarantee",
            f"dominating direction: {r.direction}",
        ]
        if r.method == "order_statistics":
            notes.append("order-statistics sampling: pessimistic bound on the privacy loss")
        if r.method == "tilted":
            notes.append(
                "tilted sampling: remove direction by importance sampling; add direction by "
                + ("the conditional sampler or " if r.direction_scales[1] == 1.0 else "")
                + "its Renyi-moment bound (numerical quadrature); the estimate is "
                + ("the larger direction's" if r.direction_scales[1] == 1.0 else
                   "the remove direction's")
            )
        if math.isinf(r.epsilon_upper):
            notes.append("too few samples to certify this delta; increase samples")
        return tuple(notes)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        epochs = epochs_of_event(event)
        r = monte_carlo_epsilon(epochs, delta, **self._options())
        eps, provable, notes = r.epsilon_upper, False, self._notes(r)
        fallback = _no_amplification_epsilon(epochs, delta)
        if fallback <= eps:
            eps, provable = fallback, True
            notes = (*notes, NO_AMPLIFICATION_NOTE)
        return PrivacyResult(
            epsilon=eps,
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=provable,
            epsilon_estimate=r.epsilon_estimate,
            epsilon_lower=r.epsilon_lower,
            error_probability=None if provable else r.error_probability,
            notes=notes,
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        epochs = epochs_of_event(event)
        r = monte_carlo_delta(epochs, epsilon, **self._options())
        d, provable, notes = r.delta_upper, False, self._notes(r)
        from dpfy.accounting.gaussian import gaussian_delta

        fallback = float(gaussian_delta(_no_amplification_mu(epochs), epsilon))
        if fallback <= d:
            d, provable = fallback, True
            notes = (*notes, NO_AMPLIFICATION_NOTE)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=d,
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=provable,
            error_probability=None if provable else r.error_probability,
            notes=(
                *notes,
                f"delta estimate {r.delta_estimate:.6g}; certain lower bound {r.delta_lower:.6g}",
            ),
        )


NO_AMPLIFICATION_NOTE = (
    "the Monte Carlo bound was looser than the provable no-amplification bound (each example in "
    "one batch per epoch: exact Gaussian composition; Balls-and-Bins is at least as private as "
    "deterministic batching, Chua et al. 2025, Prop. 3.3), which is reported instead"
)


def _no_amplification_mu(epochs: Sequence[Epoch]) -> float:
    return math.sqrt(sum(1.0 / e.noise_multiplier**2 for e in epochs))


def _no_amplification_epsilon(epochs: Sequence[Epoch], delta: float) -> float:
    from dpfy.accounting.gaussian import gaussian_epsilon

    return float(gaussian_epsilon(_no_amplification_mu(epochs), delta))


register_accountant(MonteCarloAccountant(), auto=True)

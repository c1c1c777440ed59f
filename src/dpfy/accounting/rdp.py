"""Rényi DP (RDP) accounting: the subsampled Gaussian and friends, as pure vectorised functions.

An RDP curve is an array of Rényi divergences, one per order ``a > 1``, for one step of a
mechanism (the worse of the two directions of the dominating pair). Adaptive composition adds
curves; :func:`epsilon_from_rdp` turns a curve into (epsilon, delta).

Conventions: ``noise_multiplier`` is the noise standard deviation divided by the L2
sensitivity; unless stated otherwise adjacency is ``add_or_remove``. Under ``replace_one`` a
clipped sum has sensitivity 2 x clip norm, so a Gaussian event with noise multiplier ``z``
counts as one with ``z / 2`` (see :func:`rdp_of_event`).

References:
  Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
  Mechanism" (arXiv 1908.10530), Sec. 3.3 (integer and fractional orders).
  Mironov 2017, "Rényi Differential Privacy", Prop. 6 (Laplace) and Prop. 7 (Gaussian).
  Balle et al. 2020, "Hypothesis testing interpretations and Rényi DP" (AISTATS), Prop. 12
  (RDP to (epsilon, delta)); Wang, Balle, Kasiviswanathan 2019, "Subsampled Rényi DP and
  Analytical Moments Accountant" (AISTATS), Thm 9 and Cor. 10 (sampling without replacement).

Example:
  >>> import numpy as np
  >>> from dpfy.accounting.rdp import rdp_poisson_gaussian, epsilon_from_rdp, DEFAULT_ORDERS
  >>> curve = 1000 * rdp_poisson_gaussian(0.01, 1.1, DEFAULT_ORDERS)
  >>> eps, order = epsilon_from_rdp(curve, DEFAULT_ORDERS, 1e-5)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from scipy import special

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting._api import (
    PrivacyResult,
    UnsupportedEventError,
    contains,
    contains_non_private,
    register_accountant,
)

#: Dense order grid: quarter steps up to 10 (27 fractional orders), every integer to 64, then a
#: geometric-ish tail to 1024 (large orders matter for small epsilon / many steps).
DEFAULT_ORDERS: np.ndarray = np.concatenate(
    [
        np.arange(1.25, 10.0, 0.25),
        np.arange(10, 65, dtype=np.float64),
        np.array([72, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 768, 1024], float),
    ]
)
DEFAULT_ORDERS.setflags(write=False)

# Fractional-order series: stop once the first omitted term is below this fraction of A - 1
# (the truncated sum is always an upper bound, see _log_a_frac); hard cap on the terms summed.
_FRAC_RTOL = 1e-10
_FRAC_MAX_TERMS = 1 << 17
# Memory bound (number of float64 cells) for one block of the integer-order binomial sums.
_BLOCK_CELLS = 1 << 21


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------


def _check_array(name: str, arr: np.ndarray, low: float, high: float | None, **kw: bool) -> None:
    """``check_range`` for every element; the message shows the first offending value."""
    bad = np.isnan(arr) | (arr < low) | (arr == low if kw.get("low_open") else False)
    if high is not None:
        bad |= (arr > high) | (arr == high if kw.get("high_open") else False)
    if np.any(bad):
        check_range(name, float(arr[bad].flat[0]), low, high, **kw)


def _as_orders(orders: Any) -> np.ndarray:
    a = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"orders must be a non-empty 1-d sequence, got orders={orders!r}")
    _check_array("orders", a, 1.0, None, low_open=True)
    return a


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(exp(x) - 1) for x > 0 without overflow or cancellation."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore"):
        small = np.log(np.expm1(np.minimum(x, 30.0)))
    out: np.ndarray = np.where(x > 30.0, x + np.log1p(-np.exp(-np.maximum(x, 30.0))), small)
    return out


def _logsumexp_rows_split(x: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``logsumexp_rows`` (``dpfy.accounting._logsumexp``) of the entries of ``x`` where
    ``neg`` is False, and of those where it is True.

    The same arithmetic as two calls on ``np.where(neg, -inf, x)`` and ``np.where(neg, x,
    -inf)`` (same shifts, same sums, so bit for bit the same result), with one ``exp`` pass.
    """
    rows = np.arange(x.shape[0])
    x_pos, x_neg = np.where(neg, -np.inf, x), np.where(neg, x, -np.inf)
    top_pos, top_neg = x_pos.argmax(axis=1), x_neg.argmax(axis=1)
    peak_pos, peak_neg = x_pos[rows, top_pos], x_neg[rows, top_neg]
    shift_pos = np.where(np.isfinite(peak_pos), peak_pos, 0.0)
    shift_neg = np.where(np.isfinite(peak_neg), peak_neg, 0.0)
    e = np.exp(x - np.where(neg, shift_neg[:, None], shift_pos[:, None]))
    e_pos, e_neg = np.where(neg, 0.0, e), np.where(neg, e, 0.0)
    e_pos[rows, top_pos] = 0.0
    e_neg[rows, top_neg] = 0.0
    out_pos = np.where(np.isfinite(peak_pos), np.log1p(e_pos.sum(axis=1)) + shift_pos, peak_pos)
    out_neg = np.where(np.isfinite(peak_neg), np.log1p(e_neg.sum(axis=1)) + shift_neg, peak_neg)
    return out_pos, out_neg


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log|binom(n, k)| for real n and integer k >= 0 (gammaln is log|Gamma|)."""
    out: np.ndarray = (
        special.gammaln(n + 1.0) - special.gammaln(k + 1.0) - special.gammaln(n - k + 1.0)
    )
    return out


# ---------------------------------------------------------------------------------------------
# Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019)
# ---------------------------------------------------------------------------------------------


def _log_a_int(q: np.ndarray, z: np.ndarray, a: np.ndarray) -> np.ndarray:
    """log A_a for integer orders a >= 2, 0 < q <= 1; shape (len(q), len(a)).

    A_a = sum_k binom(a,k) (1-q)^(a-k) q^k exp(k(k-1)/(2z^2)). The binomial weights sum to 1
    and the k = 0, 1 terms have exp(.) = 1, so A_a - 1 = sum_{k>=2} binom(a,k) (1-q)^(a-k) q^k
    expm1(k(k-1)/(2z^2)): a sum of positive terms, summed in log space. This keeps full relative
    precision when A_a is close to 1 (tiny q or huge z), where summing A_a itself would not.
    """
    out = np.empty((q.size, a.size))
    l1 = np.log1p(-q)  # q < 1 here
    for cols, ab, k, lb in _int_tables(tuple(a.tolist())):
        # log of q^k (1-q)^(-k) expm1(k(k-1)/(2z^2)); the factor (1-q)^a leaves the sum over k.
        per_k = k * (np.log(q) - l1)[:, None] + _log_expm1(k * (k - 1.0) / (2.0 * z[:, None] ** 2))
        rows_per_block = max(1, _BLOCK_CELLS // (cols.size * k.size))
        for r0 in range(0, q.size, rows_per_block):
            terms = lb[None] + per_k[r0 : r0 + rows_per_block, None, :]
            peak = terms.max(axis=-1)
            log_sum = np.log(np.exp(terms - peak[..., None]).sum(axis=-1)) + peak
            log_a_minus_1 = log_sum + ab * l1[r0 : r0 + rows_per_block, None]
            out[r0 : r0 + rows_per_block][:, cols] = np.logaddexp(0.0, log_a_minus_1)
    return out


@functools.lru_cache(maxsize=32)
def _int_tables(orders: tuple[float, ...]) -> list[tuple[np.ndarray, ...]]:
    """Order-only tables for _log_a_int: per size bucket (cols, orders, k >= 2, log binom)."""
    a = np.asarray(orders)
    tables: list[tuple[np.ndarray, ...]] = []
    # Bucket orders by size so small orders do not pay for the largest order's k range.
    edges = [0, 16, 64, 256, 1024, math.inf]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        cols = np.flatnonzero((a > lo) & (a <= hi))
        if cols.size == 0:
            continue
        ab = a[cols]
        k = np.arange(2, int(ab.max()) + 1, dtype=np.float64)
        valid = k[None, :] <= ab[:, None]
        lb = np.where(valid, _log_binom(ab[:, None], np.minimum(k[None, :], ab[:, None])), -np.inf)
        for arr in (cols, ab, k, lb):
            arr.setflags(write=False)
        tables.append((cols, ab, k, lb))
    return tables


def _log_phi_plus_shift(x: np.ndarray, k: np.ndarray, z0: np.ndarray, z: np.ndarray) -> np.ndarray:
    """log Phi(x) + (k^2 - k)/(2 z^2) where x = +-(z0 - k)/z, without cancelling huge terms.

    For x < 0, log Phi(x) = log(erfcx(-x/sqrt 2)/2) - x^2/2 and the quadratic parts combine
    exactly: (k^2 - k - (z0 - k)^2)/(2z^2) = (k(2 z0 - 1) - z0^2)/(2 z^2). ``z0`` and ``z``
    may be per-row columns (they broadcast against ``x`` and ``k``); only the special
    functions are evaluated per branch, the quadratic parts are cheap on the whole array.
    """
    neg = x < 0
    pos = ~neg
    log_phi = np.empty(x.shape)
    log_phi[neg] = np.log(0.5 * special.erfcx(x[neg] * -math.sqrt(0.5)))
    log_phi[pos] = special.log_ndtr(x[pos])
    inv = 0.5 / z**2
    shift = np.where(neg, (k * (2.0 * z0 - 1.0) - z0**2) * inv, (k * k - k) * inv)
    out: np.ndarray = log_phi + shift
    return out


def _log_a_frac(q: np.ndarray, z: np.ndarray, a: np.ndarray) -> np.ndarray:
    """log A_a for fractional orders (flat arrays of equal length), 0 < q < 1.

    Series of Mironov, Talwar, Zhang 2019, Sec. 3.3: split the integral at z0, where the two
    mixture components' densities cross (z0 = z^2 log(1/q - 1) + 1/2), and expand each side
    binomially. Term i of the combined series is sign(binom(a, i)) u_i with
      u_i = |binom(a,i)| [ (1-q)^(a-i) q^i e^{(i^2-i)/(2z^2)} Phi((z0 - i)/z)
                           + (1-q)^i q^(a-i) e^{(j^2-j)/(2z^2)} Phi((j - z0)/z) ],  j = a - i.
    For i > floor(a) + 1 the signs alternate and u_i decreases (each bracket is an expectation
    of a power <= 1 that decreases in i), so a partial sum that ends with a positive term is an
    upper bound. We sum in growing chunks until the first omitted term is below _FRAC_RTOL of
    A_a - 1 (or below 1e-16 A_a, the float resolution), then add that term if it is positive:
    the result is always an upper bound on A_a, and RDP = log(A_a)/(a-1) is within ~1e-10
    relative of the exact value whenever the series converged within _FRAC_MAX_TERMS.
    """
    m = q.size
    log_q = np.log(q)
    log_1mq = np.log1p(-q)
    z0 = z**2 * (log_1mq - log_q) + 0.5
    floor_a = np.floor(a)
    min_terms = floor_a + 3.0
    log_pos = np.full(m, -np.inf)
    log_neg = np.full(m, -np.inf)
    result = np.full(m, np.nan)
    active = np.arange(m)
    start, chunk = 0, 64
    while active.size:
        i = np.arange(start, start + chunk + 1, dtype=np.float64)[None, :]
        oa, za, aa = a[active, None], z[active, None], z0[active, None]
        lq, l1 = log_q[active, None], log_1mq[active, None]
        j = oa - i
        lb = _log_binom(oa, i)
        t0 = lb + i * lq + j * l1 + _log_phi_plus_shift((aa - i) / za, i, aa, za)
        t1 = lb + j * lq + i * l1 + _log_phi_plus_shift((j - aa) / za, j, aa, za)
        log_u = np.logaddexp(t0, t1)
        # sign(binom(a, i)) is + for i <= floor(a) + 1 and alternates afterwards.
        excess = i - floor_a[active, None] - 1.0
        negative = (excess > 0) & (np.fmod(excess, 2.0) == 1.0)
        chunk_pos, chunk_neg = _logsumexp_rows_split(log_u[:, :-1], negative[:, :-1])
        log_pos[active] = np.logaddexp(log_pos[active], chunk_pos)
        log_neg[active] = np.logaddexp(log_neg[active], chunk_neg)
        with np.errstate(invalid="ignore"):
            log_sum = log_pos[active] + np.log1p(-np.exp(log_neg[active] - log_pos[active]))
        nxt, nxt_neg = log_u[:, -1], negative[:, -1]
        end = start + chunk
        # Stop when the next term is below _FRAC_RTOL of A - 1 (what RDP is made of), or below
        # the float resolution of A itself when A - 1 is tinier than that.
        log_a_minus_1 = log_sum + np.log(-np.expm1(-np.maximum(log_sum, 1e-300)))
        threshold = np.maximum(log_a_minus_1 + math.log(_FRAC_RTOL), log_sum + math.log(1e-16))
        done = ((end >= min_terms[active]) & (nxt < threshold)) | (end >= _FRAC_MAX_TERMS)
        upper = np.where(nxt_neg, log_sum, np.logaddexp(log_sum, nxt))
        result[active[done]] = upper[done]
        active = active[~done]
        start, chunk = end, min(2 * chunk, 1 << 14)
    # A sum that lost all precision (never observed) must not pass as small: drop that order.
    return np.where(np.isnan(result), np.inf, result)


def rdp_poisson_gaussian(
    sampling_rate: Any, noise_multiplier: Any, orders: Any = DEFAULT_ORDERS
) -> np.ndarray:
    """Per-step RDP of the Poisson-subsampled Gaussian mechanism (add_or_remove adjacency).

    Args:
      sampling_rate: q in (0, 1], scalar or array (each example is in the batch w.p. q).
      noise_multiplier: z > 0, scalar or array broadcasting with ``sampling_rate``.
      orders: Rényi orders a > 1 (integers use the exact binomial sum, other orders the
        Mironov-Talwar-Zhang series; q = 1 gives a / (2 z^2)).

    Returns:
      Array of shape ``broadcast(q, z).shape + (len(orders),)``: RDP in nats per step.

    Raises:
      ValueError: q outside (0, 1], z <= 0, or an order <= 1.

    References: Mironov, Talwar, Zhang 2019, Sec. 3.3; docs/architecture.md, 5.1.
    """
    q = np.asarray(sampling_rate, dtype=np.float64)
    z = np.asarray(noise_multiplier, dtype=np.float64)
    _check_array("sampling_rate", q, 0.0, 1.0, low_open=True)
    _check_array("noise_multiplier", z, 0.0, None, low_open=True)
    a = _as_orders(orders)
    q, z = np.broadcast_arrays(q, z)
    shape = q.shape
    qf, zf = q.ravel(), z.ravel()
    out = np.empty((qf.size, a.size))
    full = qf == 1.0
    out[full] = a[None, :] / (2.0 * zf[full, None] ** 2)
    sub = np.flatnonzero(~full)
    is_int = a == np.round(a)
    if sub.size and is_int.any():
        cols = np.flatnonzero(is_int)
        out[np.ix_(sub, cols)] = _log_a_int(qf[sub], zf[sub], a[cols]) / (a[cols] - 1.0)
    if sub.size and (~is_int).any():
        cols = np.flatnonzero(~is_int)
        qq, aa = np.meshgrid(qf[sub], a[cols], indexing="ij")
        zz = np.broadcast_to(zf[sub, None], qq.shape)
        log_a = _log_a_frac(qq.ravel(), zz.ravel(), aa.ravel()).reshape(qq.shape)
        out[np.ix_(sub, cols)] = np.maximum(log_a, 0.0) / (a[cols] - 1.0)
    return out.reshape(shape + (a.size,))


# ---------------------------------------------------------------------------------------------
# Other mechanisms
# ---------------------------------------------------------------------------------------------


def rdp_gaussian(noise_multiplier: Any, orders: Any = DEFAULT_ORDERS) -> np.ndarray:
    """RDP a / (2 z^2) of the Gaussian mechanism (Mironov 2017, Prop. 7); shape z.shape + (n,)."""
    z = np.asarray(noise_multiplier, dtype=np.float64)
    _check_array("noise_multiplier", z, 0.0, None, low_open=True)
    a = _as_orders(orders)
    return a / (2.0 * z[..., None] ** 2)


def rdp_zcdp(rho: Any, orders: Any = DEFAULT_ORDERS) -> np.ndarray:
    """RDP rho * a of a rho-zCDP mechanism (Bun & Steinke 2016, Def. 1.1)."""
    r = np.asarray(rho, dtype=np.float64)
    _check_array("rho", r, 0.0, None)
    out: np.ndarray = r[..., None] * _as_orders(orders)
    return out


def rdp_laplace(noise_multiplier: Any, orders: Any = DEFAULT_ORDERS) -> np.ndarray:
    """Exact RDP of the Laplace mechanism with scale b = noise_multiplier x L1 sensitivity.

    With e = 1/b (its pure-DP epsilon), Mironov 2017, Prop. 6:
      RDP(a) = log( a/(2a-1) e^{(a-1)e} + (a-1)/(2a-1) e^{-a e} ) / (a-1)
             = e + log1p( (a-1)/(2a-1) expm1(-(2a-1) e) ) / (a-1).
    """
    b = np.asarray(noise_multiplier, dtype=np.float64)
    _check_array("noise_multiplier", b, 0.0, None, low_open=True)
    a = _as_orders(orders)
    e = 1.0 / b[..., None]
    rdp = e + np.log1p((a - 1.0) / (2.0 * a - 1.0) * np.expm1(-(2.0 * a - 1.0) * e)) / (a - 1.0)
    return np.maximum(rdp, 0.0)  # ~ a e^2 / 2 >= 0; only rounding can make it negative


def rdp_sampled_without_replacement_gaussian(
    sampling_rate: Any, noise_multiplier: Any, orders: Any = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP bound for a Gaussian on a fixed-size sample drawn without replacement (replace_one).

    Wang, Balle, Kasiviswanathan 2019, Thm 9 with the Gaussian's eps(j) = j / (2 s^2) and
    eps(inf) = inf; for integer a >= 2 and gamma = sample_size / dataset_size:
      (a-1) RDP(a) <= log(1 + gamma^2 C(a,2) min(4 (e^{eps(2)} - 1), 2 e^{eps(2)})
                            + sum_{j=3}^{a} 2 gamma^j C(a,j) e^{(j-1) eps(j)}).
    Fractional orders interpolate (a-1) RDP(a) linearly between floor(a) and ceil(a)
    (Cor. 10; valid because the cumulant generating function is convex). The result is capped
    by the plain Gaussian's a / (2 s^2), which subsampling cannot exceed (and which is exact
    for gamma = 1).

    Args:
      sampling_rate: gamma = sample_size / dataset_size in (0, 1].
      noise_multiplier: s = noise std / *replace-one* L2 sensitivity. For a sum of examples
        clipped to C with noise std z C, the replace-one sensitivity is 2C, so pass z / 2.
      orders: Rényi orders a > 1.

    Returns:
      Array of shape ``broadcast(gamma, s).shape + (len(orders),)``.
    """
    g = np.asarray(sampling_rate, dtype=np.float64)
    s = np.asarray(noise_multiplier, dtype=np.float64)
    _check_array("sampling_rate", g, 0.0, 1.0, low_open=True)
    _check_array("noise_multiplier", s, 0.0, None, low_open=True)
    a = _as_orders(orders)
    g, s = np.broadcast_arrays(g, s)
    shape = g.shape
    gf, sf = g.ravel(), s.ravel()
    lo, hi = np.floor(a), np.ceil(a)
    ints = np.unique(np.concatenate([lo, hi]))
    ints = ints[ints >= 2]
    log_a = {}  # order -> log A for every configuration
    if ints.size:
        kmax = int(ints.max())
        k = np.arange(kmax + 1, dtype=np.float64)
        for order in ints:
            kk = k[2 : int(order) + 1]
            eps2 = 1.0 / sf**2  # eps(2) = 2 / (2 s^2)
            lb = _log_binom(order, kk)
            with np.errstate(divide="ignore"):
                first = np.minimum(math.log(4.0) + _log_expm1(eps2), math.log(2.0) + eps2)
            terms = lb[None, :] + kk[None, :] * np.log(gf)[:, None]
            terms = terms + np.where(
                kk[None, :] == 2,
                first[:, None],
                math.log(2.0) + (kk[None, :] - 1.0) * kk[None, :] / (2.0 * sf[:, None] ** 2),
            )
            log_a[order] = np.logaddexp(0.0, special.logsumexp(terms, axis=1))

    def cgf(order: float) -> np.ndarray:
        return np.zeros_like(gf) if order < 2 else log_a[order]

    out = np.empty((gf.size, a.size))
    for c, (order, f, h) in enumerate(zip(a, lo, hi, strict=True)):
        t = order - f
        out[:, c] = ((1.0 - t) * cgf(f) + t * cgf(h)) / (order - 1.0) if f != h else cgf(f) / (
            order - 1.0
        )
    # Subsampling never hurts: a replace-one WOR sample of neighbours is a mixture of identical
    # or neighbouring subsamples, and Rényi divergence is jointly quasi-convex, so the base
    # Gaussian's a / (2 s^2) is also a bound (and exact for gamma = 1).
    out = np.minimum(out, a[None, :] / (2.0 * sf[:, None] ** 2))
    return out.reshape(shape + (a.size,))


# ---------------------------------------------------------------------------------------------
# Conversion to (epsilon, delta)
# ---------------------------------------------------------------------------------------------


def epsilon_from_rdp(rdp: Any, orders: Any, delta: Any) -> tuple[Any, Any]:
    """Smallest epsilon over the orders such that the RDP curve implies (epsilon, delta)-DP.

    Balle et al. 2020, Prop. 12, per order:
      eps(a) = RDP(a) + log((a-1)/a) - (log(delta) + log(a)) / (a-1),
    and eps = 0 where the total-variation bound sqrt(1 - exp(-RDP(a))) <= delta already holds
    (TV <= sqrt(1 - exp(-D_1/2)) and D_1/2 <= D_a).

    Args:
      rdp: RDP curve(s), shape (..., len(orders)); inf allowed.
      orders: the orders the curve was computed at.
      delta: target delta in (0, 1); broadcasts against ``rdp.shape[:-1]``.

    Returns:
      (epsilon, best_order): floats for a single curve, arrays of shape rdp.shape[:-1] otherwise.
    """
    r = np.asarray(rdp, dtype=np.float64)
    a = _as_orders(orders)
    if r.shape[-1:] != a.shape:
        raise ValueError(f"rdp must have len(orders)={a.size} values last, got shape {r.shape}")
    d = np.asarray(delta, dtype=np.float64)
    _check_array("delta", d, 0.0, 1.0, low_open=True, high_open=True)
    d = d[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        eps = r + np.log1p(-1.0 / a) - (np.log(d) + np.log(a)) / (a - 1.0)
        eps = np.where(d**2 + np.expm1(-r) >= 0.0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    idx = np.argmin(eps, axis=-1)
    best = np.maximum(np.take_along_axis(eps, idx[..., None], axis=-1)[..., 0], 0.0)
    order = a[idx]
    if best.ndim == 0:
        return float(best), float(order)
    return best, order


def delta_from_rdp(rdp: Any, orders: Any, epsilon: Any) -> tuple[Any, Any]:
    """Smallest delta over the orders such that the RDP curve implies (epsilon, delta)-DP.

    Per order (Balle et al. 2020, Prop. 12, solved for delta), capped by the TV bound:
      log delta(a) = min((a-1) (RDP(a) - eps + log((a-1)/a)) - log(a),
                         0.5 log(1 - exp(-RDP(a)))).

    Returns:
      (delta, best_order), delta in [0, 1]; floats for one curve, arrays otherwise.
    """
    r = np.asarray(rdp, dtype=np.float64)
    a = _as_orders(orders)
    if r.shape[-1:] != a.shape:
        raise ValueError(f"rdp must have len(orders)={a.size} values last, got shape {r.shape}")
    e = np.asarray(epsilon, dtype=np.float64)
    _check_array("epsilon", e, 0.0, None)
    e = e[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        log_d = (a - 1.0) * (r - e + np.log1p(-1.0 / a)) - np.log(a)
        log_tv = 0.5 * np.log(-np.expm1(-r))
    log_d = np.minimum(np.where(np.isnan(log_d), np.inf, log_d), log_tv)
    idx = np.argmin(log_d, axis=-1)
    best = np.minimum(np.exp(np.take_along_axis(log_d, idx[..., None], axis=-1)[..., 0]), 1.0)
    order = a[idx]
    if best.ndim == 0:
        return float(best), float(order)
    return best, order


# ---------------------------------------------------------------------------------------------
# Continuous order optimisation
# ---------------------------------------------------------------------------------------------

#: Smallest order the search looks at: dp_accounting's smallest default order. Lower orders
#: converge slowly in the fractional series and only matter for the total-variation bound.
_MIN_SEARCH_ORDER = 1.1
#: Search stops once the bracket is this narrow relative to the order (about 1e-10 relative
#: in epsilon, quadratic near the optimum); the result is valid whatever the tolerance, since
#: every order tried gives a valid bound.
_ORDER_RTOL = 1e-5
_SEARCH_POINTS = 14  # orders per round (the two bracket ends are already known)
_SEARCH_ROUNDS = 10  # at most (each narrows the bracket ~6x)


def _per_order_log_delta(r: np.ndarray, a: np.ndarray, eps: float) -> np.ndarray:
    """log delta(a) of :func:`delta_from_rdp` for one curve, per order (nan -> inf)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        log_d = (a - 1.0) * (r - eps + np.log1p(-1.0 / a)) - np.log(a)
        log_tv = 0.5 * np.log(-np.expm1(-r))
    out: np.ndarray = np.minimum(np.where(np.isnan(log_d), np.inf, log_d), log_tv)
    return out


def _per_order_epsilon(r: np.ndarray, a: np.ndarray, delta: float) -> np.ndarray:
    """eps(a) of :func:`epsilon_from_rdp` for one curve, per order (nan -> inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
        eps = np.where(delta**2 + np.expm1(-r) >= 0.0, 0.0, eps)
    out: np.ndarray = np.where(np.isnan(eps), np.inf, eps)
    return out


def _refine_order(
    objective: Callable[[np.ndarray], np.ndarray],
    orders: np.ndarray,
    values: np.ndarray,
    floor: float,
) -> tuple[float, float]:
    """Minimise ``objective`` (a valid bound at every order) over real orders near the grid best.

    Bracket: the grid neighbours of the best grid order (down to 1.1 below the first order).
    Then a vectorised grid search: ``_SEARCH_POINTS`` orders across the bracket, the bracket
    narrowed to the best one's neighbours until it is ``_ORDER_RTOL`` of the order wide (each
    round narrows it ~6x; one RDP evaluation of all points per round). The conversion is
    quasi-convex in the order for the subsampled Gaussian ((a-1) RDP(a) is convex; Mironov,
    Talwar, Zhang 2019), so the bracket holds the minimum when the grid does. Every evaluated
    order gives a valid bound, so the smallest value seen is returned, never more than the grid
    minimum. The first round also tries the smallest order, where the total-variation bound
    (``floor``) is tightest. Nothing is searched when the grid minimum is not finite or
    already at ``floor``.
    """
    i = int(np.argmin(values))
    best, best_a = float(values[i]), float(orders[i])
    if not math.isfinite(best) or best <= floor:
        return best, best_a
    a_min = min(_MIN_SEARCH_ORDER, float(orders.min()))
    srt = np.sort(orders)
    j = int(np.searchsorted(srt, best_a))
    lo = float(srt[j - 1]) if j > 0 else a_min
    hi = float(srt[j + 1]) if j + 1 < srt.size else best_a
    extra = np.array([a_min])
    for _ in range(_SEARCH_ROUNDS):
        if hi - lo <= _ORDER_RTOL * best_a:
            break
        xs = np.concatenate([np.linspace(lo, hi, _SEARCH_POINTS)[1:-1], extra])
        extra = np.empty(0)
        vs = np.asarray(objective(xs), dtype=np.float64)
        k = int(np.argmin(vs))
        if vs[k] < best:
            best, best_a = float(vs[k]), float(xs[k])
        if best <= floor:
            break
        step = (hi - lo) / (_SEARCH_POINTS - 1)
        lo, hi = max(lo, best_a - step), min(hi, best_a + step)
    return best, best_a


def epsilon_of_event(
    event: ev.Event, delta: float, orders: Any = DEFAULT_ORDERS
) -> tuple[float, float]:
    """(epsilon, order) of an event with the order optimised continuously.

    The RDP curve is evaluated on ``orders`` to bracket the best order, then the conversion of
    :func:`epsilon_from_rdp` is minimised over real orders in that bracket, evaluating the
    event's RDP exactly at each order tried (fractional orders are exact up to a provable upper
    bound, see :func:`rdp_poisson_gaussian`). Never larger than :func:`epsilon_from_rdp` on
    ``orders``.
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    a = _as_orders(orders)
    values = _per_order_epsilon(rdp_of_event(event, a), a, delta)

    def objective(xs: np.ndarray) -> np.ndarray:
        return _per_order_epsilon(rdp_of_event(event, xs), xs, delta)

    eps, order = _refine_order(objective, a, values, floor=0.0)
    return max(eps, 0.0), order


def delta_of_event(
    event: ev.Event, epsilon: float, orders: Any = DEFAULT_ORDERS
) -> tuple[float, float]:
    """(delta, order) of an event with the order optimised continuously (as
    :func:`epsilon_of_event`, on log delta); never larger than :func:`delta_from_rdp`."""
    check_range("epsilon", epsilon, 0.0, None)
    a = _as_orders(orders)
    values = _per_order_log_delta(rdp_of_event(event, a), a, epsilon)

    def objective(xs: np.ndarray) -> np.ndarray:
        return _per_order_log_delta(rdp_of_event(event, xs), xs, epsilon)

    log_d, order = _refine_order(objective, a, values, floor=-math.inf)
    if log_d == -math.inf:
        return 0.0, order
    return min(math.exp(log_d), 1.0), order


def epsilon_poisson_gaussian(
    sampling_rate: Any,
    noise_multiplier: Any,
    steps: Any,
    delta: Any,
    orders: Any = DEFAULT_ORDERS,
) -> tuple[Any, Any]:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps, vectorised over all arguments.

    All of ``sampling_rate``, ``noise_multiplier``, ``steps`` and ``delta`` broadcast together;
    returns (epsilon, best_order) with the broadcast shape (floats if all are scalars).
    """
    t = np.asarray(steps, dtype=np.float64)
    _check_array("steps", t, 0.0, None)
    curve = rdp_poisson_gaussian(sampling_rate, noise_multiplier, orders)
    return epsilon_from_rdp(t[..., None] * curve, orders, delta)


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------

_NOT_RDP = {
    ev.BallsAndBins: "BallsAndBins: Poisson RDP does not apply to a balls-and-bins sampler",
    ev.Shuffled: "Shuffled: Poisson RDP does not apply to a shuffled sampler",
    ev.Deterministic: (
        "Deterministic: not handled by the rdp accountant (no subsampling; use method "
        "'gaussian')"
    ),
    ev.TruncatedPoisson: (
        "TruncatedPoisson: truncation to a maximum batch size costs extra delta that the rdp "
        "accountant does not account"
    ),
    ev.RepeatAndSelect: (
        "RepeatAndSelect: random-repetition tuning is not handled by the rdp accountant"
    ),
}


def _inner_z(leaf: ev.PoissonSampled | ev.FixedSizeSampled) -> float:
    """:func:`_gaussian_inner_z` of a sampled leaf that ``unsupported_reason`` admitted."""
    z = _gaussian_inner_z(leaf.event)
    if z is None:  # unsupported_reason() admits Gaussian compositions only
        raise UnsupportedEventError(f"method='rdp' cannot account the sampled event {leaf!r}")
    return z


def _gaussian_inner_z(event: ev.Event) -> float | None:
    """Equivalent noise multiplier of a composition of unsampled Gaussians on one sample.

    Gaussians of ratios 1/z_i on the same sample compose exactly to one Gaussian with
    1/z^2 = sum 1/z_i^2 (Dong, Roth, Su 2022, Cor. 3.3); None if ``event`` is not such a
    composition.
    """
    def inv_sq(e: ev.Event) -> float | None:
        if isinstance(e, ev.Gaussian):
            return 1.0 / e.noise_multiplier**2
        if isinstance(e, ev.SelfComposed):
            inner = inv_sq(e.event)
            return None if inner is None else e.count * inner
        if isinstance(e, ev.Composed):
            parts = [inv_sq(x) for x in e.events]
            known = [p for p in parts if p is not None]
            return float(sum(known)) if len(known) == len(parts) else None
        return None

    s = inv_sq(event)
    if s is None:
        return None
    return math.inf if s == 0 else 1.0 / math.sqrt(s)


def _name(event: ev.Event) -> str:
    return type(event).__name__


def _unsupported(event: ev.Event, adjacency: ev.Adjacency) -> str | None:
    if type(event) in _NOT_RDP:
        return _NOT_RDP[type(event)]
    if isinstance(event, ev.Gaussian | ev.Laplace | ev.ZCDP | ev.NonPrivate):
        return None
    if isinstance(event, ev.SelfComposed):
        return _unsupported(event.event, adjacency)
    if isinstance(event, ev.Composed):
        for e in event.events:
            reason = _unsupported(e, adjacency)
            if reason is not None:
                return reason
        return None
    if isinstance(event, ev.PoissonSampled):
        if adjacency is not ev.Adjacency.ADD_OR_REMOVE:
            return (
                f"PoissonSampled: the Poisson RDP analysis is for add_or_remove adjacency, but "
                f"this event tree is {adjacency.value}"
            )
        if not (contains(event.event, ev.NonPrivate)) and (
            _gaussian_inner_z(event.event) is None
        ):
            return (
                f"PoissonSampled({_name(event.event)}): Poisson-subsampled RDP is implemented "
                "for Gaussian sub-events only"
            )
        return None
    if isinstance(event, ev.FixedSizeSampled):
        if event.adjacency_relation is not ev.Adjacency.REPLACE_ONE:
            return (
                "FixedSizeSampled: the sampling-without-replacement RDP bound (Wang et al. "
                f"2019) is for replace_one adjacency, got adjacency={event.adjacency!r}"
            )
        if not (contains(event.event, ev.NonPrivate)) and (
            _gaussian_inner_z(event.event) is None
        ):
            return (
                f"FixedSizeSampled({_name(event.event)}): sampling-without-replacement RDP is "
                "implemented for Gaussian sub-events only"
            )
        return None
    return f"{_name(event)}: not supported by the rdp accountant"


def unsupported_reason(event: ev.Event) -> str | None:
    """None if :func:`rdp_of_event` can account the whole tree, else why not (naming the event)."""
    if not isinstance(event, ev.Event):
        raise ValueError(f"event must be a dpfy.events.Event, got event={event!r}")
    return _unsupported(event, event.adjacency_relation)


def _leaves(event: ev.Event, count: int) -> Iterator[tuple[ev.Event, int]]:
    """(leaf, multiplicity) pairs of a composition tree."""
    if isinstance(event, ev.SelfComposed):
        yield from _leaves(event.event, count * event.count)
    elif isinstance(event, ev.Composed):
        for e in event.events:
            yield from _leaves(e, count)
    elif count:
        yield event, count


def rdp_of_event(event: ev.Event, orders: Any = DEFAULT_ORDERS) -> np.ndarray:
    """RDP curve of a whole event tree (composition adds curves).

    Supported: Gaussian, Laplace, ZCDP, NonPrivate (inf), PoissonSampled(Gaussian) under
    add_or_remove, FixedSizeSampled(Gaussian) under replace_one, and SelfComposed / Composed
    of these. A sampled sub-event may itself be a composition of Gaussians on the same sample
    (one Gaussian with 1/z^2 = sum 1/z_i^2). Under replace_one adjacency every Gaussian's
    sensitivity is twice the clip norm (z counts as z/2), Laplace likewise, and zCDP's rho
    becomes 4 rho (group privacy for a replacement = removal + addition).

    Raises:
      UnsupportedEventError: some sub-event is outside this list (the message names it).
    """
    reason = unsupported_reason(event)
    if reason is not None:
        raise UnsupportedEventError(f"method='rdp' cannot account this event: {reason}")
    a = _as_orders(orders)
    scale = 2.0 if event.adjacency_relation is ev.Adjacency.REPLACE_ONE else 1.0
    total = np.zeros(a.size)
    poisson: dict[tuple[float, float], int] = {}
    wor: dict[tuple[float, float], int] = {}
    for leaf, n in _leaves(event, 1):
        if contains(leaf, ev.NonPrivate):
            return np.full(a.size, np.inf)
        if isinstance(leaf, ev.Gaussian):
            total += n * rdp_gaussian(leaf.noise_multiplier / scale, a)
        elif isinstance(leaf, ev.Laplace):
            total += n * rdp_laplace(leaf.noise_multiplier / scale, a)
        elif isinstance(leaf, ev.ZCDP):
            total += n * rdp_zcdp(leaf.rho * scale**2, a)
        elif isinstance(leaf, ev.PoissonSampled):
            z = _inner_z(leaf)
            if z != math.inf:
                key = (leaf.sampling_rate, z)
                poisson[key] = poisson.get(key, 0) + n
        elif isinstance(leaf, ev.FixedSizeSampled):
            z = _inner_z(leaf)
            if z != math.inf:
                key = (leaf.sample_size / leaf.dataset_size, z / 2.0)
                wor[key] = wor.get(key, 0) + n
    for groups, fn in ((poisson, rdp_poisson_gaussian), (wor, _wor)):
        if groups:
            keys = np.array(list(groups), dtype=np.float64)
            counts = np.array(list(groups.values()), dtype=np.float64)
            curves = fn(keys[:, 0], keys[:, 1], a)
            total += (counts[:, None] * curves).sum(axis=0)
    return total


def _wor(gamma: np.ndarray, s: np.ndarray, orders: np.ndarray) -> np.ndarray:
    return rdp_sampled_without_replacement_gaussian(gamma, s, orders)


# ---------------------------------------------------------------------------------------------
# Accountant
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RdpAccountant:
    """RDP accountant: fold the event tree into one RDP curve, convert at the best order."""

    name: str = "rdp"
    orders: tuple[float, ...] = tuple(float(x) for x in DEFAULT_ORDERS)

    def unsupported(self, event: ev.Event) -> str | None:
        return unsupported_reason(event)

    def _notes(self, event: ev.Event, order: float) -> tuple[str, ...]:
        notes = [
            f"RDP bracketed on {len(self.orders)} orders, then optimised continuously; "
            f"optimal order a={order:.6g}"
        ]
        if event.adjacency_relation is ev.Adjacency.REPLACE_ONE:
            notes.append("replace_one adjacency: Gaussian sensitivity is 2 x clip norm")
        if contains(event, ev.FixedSizeSampled):
            notes.append(
                "fixed-size sampling without replacement: Wang, Balle, Kasiviswanathan 2019, "
                "Thm 9 (an upper bound)"
            )
        return tuple(notes)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        eps, order = epsilon_of_event(event, delta, self.orders)
        return PrivacyResult(
            epsilon=eps,
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=self._notes(event, order),
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        check_range("epsilon", epsilon, 0.0, None)
        d, order = delta_of_event(event, epsilon, self.orders)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=d,
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=self._notes(event, order),
        )

    def calibration_search(self, delta: float) -> _RdpSearch:
        """Calibration's evaluator (:class:`dpfy.accounting.SearchesForCalibration`)."""
        return _RdpSearch(delta, self.orders)


#: The sparse order grid of a coarse calibration step (any subset of orders gives a valid,
#: possibly larger, epsilon).
_COARSE_ORDERS = (
    1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0,
    128.0, 256.0, 512.0, 1024.0,
)


class _RdpSearch:
    """RDP epsilon along one calibration search.

    coarse: the sparse order grid ``_COARSE_ORDERS``; fine: the accountant's orders within a
    factor 2 of the best coarse order, then the order optimised continuously in that bracket
    (a subset of orders can only give a larger, still valid, epsilon). Events with truncated
    samplers are left to the public API (None).
    """

    def __init__(self, delta: float, orders: tuple[float, ...]) -> None:
        self.delta = delta
        self.orders = np.asarray(orders, dtype=float)
        self._order: float | None = None

    def __call__(self, event: ev.Event, coarse: bool) -> float | None:
        if ev.untruncated(event) != event:
            return None
        if coarse:
            orders = np.array(_COARSE_ORDERS)
        else:
            orders = self.orders
            if self._order is not None:
                near = orders[(orders >= self._order / 2.0) & (orders <= self._order * 2.0)]
                orders = near if near.size else self.orders
        if contains_non_private(event):
            return math.inf
        if coarse:
            curve = rdp_of_event(event, orders)
            eps, order = epsilon_from_rdp(curve, orders, self.delta)
            self._order = float(order)
            return float(eps)
        return epsilon_of_event(event, self.delta, orders)[0]


register_accountant(RdpAccountant())

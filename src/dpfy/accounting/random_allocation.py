"""Provable PLD accounting of random allocation (Balls-and-Bins sampling), both directions.

Adjacency: ``add_or_remove``. Each epoch every example is allocated to exactly one of ``T``
steps uniformly at random (1-of-T random allocation, Feldman & Shenfeld 2025, "Privacy
amplification by random allocation"); each step releases a Gaussian sum with noise multiplier
``z`` (noise std / L2 sensitivity).

The pair. Over one epoch the differing example's contribution is the unit vector of its step,
so (Feldman & Shenfeld 2025, Sec. 3; Feldman & Shenfeld 2026, "Efficient privacy loss
accounting for subsampling and random allocation") the epoch is dominated by

    Q = N(0, z^2 I_T),   P = (1/T) sum_t N(e_t, z^2 I_T),
    dP/dQ (y) = S / T,   S = sum_t X_t,   X_t = exp(y_t / z^2 - 1 / (2 z^2)),

with X_1..X_T i.i.d. under Q: log X ~ N(-1/(2 z^2), 1/z^2), E_Q[X] = 1. Both hockey-stick
divergences are expectations of convex functions of S under Q:

    H_a(P || Q) = E_Q[(S/T - a)_+]   (remove),   H_a(Q || P) = E_Q[(1 - a S/T)_+]   (add),

and an epoch composition's are ``E[(prod_i S_i/T - a)_+]`` and ``E[(1 - a prod_i S_i/T)_+]``,
convex in each S_i.

How the numbers are made.

1. **S on a geometric grid** (Feldman & Shenfeld 2026, Appendix C, geometric convolution).
   X is discretised on the grid ``x_k = exp(u0 + k g)`` plus an atom at 0, and S is the T-fold
   sum, formed by repeated doubling; every sum ``x_i + x_j`` that falls between two grid
   points is re-discretised onto them.

   *Upper bound:* each split preserves mass and mean (a mean-preserving spread), so the
   discrete S dominates the exact S in the convex order (Shaked & Shanthikumar 2007, Thm.
   3.A.12: the convex order is closed under sums of independent variables); with E[S] kept
   equal the discrete pair (Q', P' = (S'/T) Q') is a valid pair that dominates the exact one in
   every hockey-stick divergence, in both directions, and so its compositions dominate
   (Zhu, Dong & Wang 2022). X above ``x_max`` is cut off: the event A that some coordinate
   exceeds it has P(A) <= E_Q[X; X > x_max] + (T - 1) Q(X > x_max) and
   Q(A) <= T Q(X > x_max), which go to +infinity (into delta) in the remove and add directions.

   *Lower bound (optimistic twin):* sums are rounded down (remove direction) or up (add
   direction) pointwise, and the cut-off mass is dropped; each composed hockey-stick value is
   monotone in every S_i, so these give lower bounds.

2. **Loss grid.** The atoms of S become the loss ``log(S/T)`` (remove, P-mass ``w s/T``) and
   ``-log(S/T)`` (add, Q-mass ``w``); they are put on the loss grid ``k h`` of our PLD engine
   (:mod:`dpfy.accounting.pld`) by connect-the-dots (upper; Doroshenko et al. 2022) or by
   rounding the loss down (lower), then epochs compose by FFT (:func:`dpfy.accounting.pld.compose`).

3. **Grids.** The geometric ratio and the loss interval are halved until two levels agree to
   the tolerance, at most ``_MAX_LEVELS`` times; every level is a valid bound and the tightest
   is reported, with the agreement reached (a note says when the tolerance was not met).

T = 1 is the Gaussian mechanism; it is answered exactly by :mod:`dpfy.accounting.gaussian`.

Floating point: FFT and summation round-off is not rigorously bounded (far below the deltas of
interest, as in :mod:`dpfy.accounting.pld`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
from scipy import special

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting import gaussian as gauss
from dpfy.accounting._api import (
    PrivacyResult,
    UnsupportedEventError,
    contains_non_private,
    register_accountant,
)
from dpfy.accounting.pld import DiscretePLD, compose

DEFAULT_TOLERANCE = 2e-3
"""Target relative gap between two successive grid levels of the upper bound."""

_TAIL = 1e-14  # per-epoch mass cut off above x_max (sent to delta in the upper bound)


@dataclasses.dataclass(frozen=True)
class AllocationSum:
    """A discrete law of S = X_1 + ... + X_T under Q on ``exp(u0 + k g)`` plus an atom at 0.

    Attributes:
      u0: log of the first grid point.
      ratio_log: g, the log spacing of the grid.
      mass: Q-masses of the grid points.
      zero: Q-mass of S = 0.
      cut: (remove, add) mass sent to +infinity: the event A and the trimmed tails (0 for a
        lower bound, which drops them).
      start: grid index of ``mass[0]`` (the point ``exp(u0 + start g)``).
      terms: how many X the sum holds (k of T).
      value: ``merge`` mode only: the exact mean of S over each bucket (the atom's position;
        ``mass[k]`` then belongs to bucket k, not to the grid point).
    """

    u0: float
    ratio_log: float
    mass: np.ndarray
    zero: float
    cut: tuple[float, float]
    start: int = 0
    terms: int = 1
    value: np.ndarray | None = None


_TRIM = 1e-18  # mass of each tail of a partial sum that may be trimmed (sent to +infinity)


def _trim(total: AllocationSum, upper: bool, steps: int) -> AllocationSum:
    """Drop the two tails of the partial sum whose weight Q-mass * (1 + s/T) is at most _TRIM
    each; the upper bound sends them to +infinity.

    A trimmed set B of partial sums (k of the T terms) has Q(B) = its mass in the add
    direction and P(B) = E_Q[S/T; B] = (E_Q[partial; B] + Q(B) (T - k)) / T in the remove one.
    """
    m = total.mass
    if total.value is not None:
        x = total.value
    else:
        x = np.exp(total.u0 + total.ratio_log * (total.start + np.arange(m.size)))
    weight = m * (1.0 + x / steps)
    head = np.cumsum(weight)
    tail = np.cumsum(weight[::-1])
    lo = int(np.searchsorted(head, _TRIM, side="right"))
    hi = m.size - int(np.searchsorted(tail, _TRIM, side="right"))
    if lo >= hi or (lo == 0 and hi == m.size):
        return total
    out_of = np.ones(m.size, dtype=bool)
    out_of[lo:hi] = False
    dropped = float(np.sum(m[out_of]))
    if not upper:
        cut = total.cut
    else:
        mean_part = float(np.sum(m[out_of] * x[out_of]))
        p_mass = (mean_part + dropped * (steps - total.terms)) / steps
        cut = (min(1.0, total.cut[0] + p_mass), min(1.0, total.cut[1] + dropped))
    value = None if total.value is None else total.value[lo:hi].copy()
    return dataclasses.replace(
        total, mass=m[lo:hi].copy(), cut=cut, start=total.start + lo, value=value
    )


def _x_law(z: float, g: float, steps: int, tail: float) -> tuple[float, int, float, float]:
    """(u0, n, log x_max, s) of the grid for one X: log X ~ N(-1/(2z^2), 1/z^2)."""
    s = 1.0 / z
    mu = -0.5 * s * s
    k = -special.ndtri(tail / (2.0 * steps))
    hi = mu + s * s + s * k  # covers the tilted (P-side) law N(+1/(2 z^2), 1/z^2) too
    lo = mu - s * k
    n = max(2, math.ceil((hi - lo) / g) + 1)
    return lo, n, lo + (n - 1) * g, s


def _cell_masses(z: float, u0: float, n: int, g: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Q-mass and Q-mean E[X; cell] of the cells [x_{k-1}, x_k) (k = 0 is [0, x_0))."""
    s = 1.0 / z
    mu = -0.5 * s * s
    u = u0 + g * np.arange(n)
    mass = _interval_probs((u - mu) / s)
    mean = _interval_probs((u - mu) / s - s)  # E[X; cell] (E[X] = 1, tilted normal)
    return mass, mean, float(u[-1])


def _interval_probs(v: np.ndarray) -> np.ndarray:
    """Standard normal masses of (-inf, v_0), [v_0, v_1), ...; differences of the lower CDF
    below 0 and of the upper tail above 0, so that no cell loses relative precision."""
    lower = special.ndtr(np.concatenate(([-np.inf], v)))
    upper = special.ndtr(-np.concatenate(([-np.inf], v)))
    left = np.concatenate(([-np.inf], v))[:-1]
    out = np.where(left < 0.0, lower[1:] - lower[:-1], upper[:-1] - upper[1:])
    clipped: np.ndarray = np.maximum(out, 0.0)
    return clipped


def _x_discrete(z: float, steps: int, g: float, mode: str) -> AllocationSum:
    """One X on the geometric grid: ``spread`` (upper), ``down`` or ``up`` (lower)."""
    u0, n, _, s = _x_law(z, g, steps, _TAIL)
    mass, mean, top = _cell_masses(z, u0, n, g)
    x = np.exp(u0 + g * np.arange(n))
    out = np.zeros(n)
    zero = 0.0
    if mode == "spread":
        # Cell [x_{k-1}, x_k): split between its ends, keeping mass and mean.
        # Cell 0 = [0, x_0): ends 0 and x_0.
        hi_share = mean[0] / x[0]
        out[0] += hi_share
        zero += max(mass[0] - hi_share, 0.0)
        xl, xh = x[:-1], x[1:]
        p_hi = (mean[1:] - mass[1:] * xl) / (xh - xl)
        p_hi = np.clip(p_hi, 0.0, mass[1:])
        out[1:] += p_hi
        out[:-1] += mass[1:] - p_hi
        q_tail = float(special.ndtr(-(top - (-0.5 * s * s)) / s))
        m_tail = float(special.ndtr(-(top - (-0.5 * s * s)) / s + s))  # E[X; X > x_max]
        cut = (min(1.0, m_tail + (steps - 1) * q_tail), min(1.0, steps * q_tail))
    elif mode == "merge":
        # Cell k -> bucket k at its conditional mean (Blackwell: the cell index is a
        # post-processing of the output, so this pair is dominated by the exact one).
        out += mass
        value = np.where(mass > 0.0, mean / np.where(mass > 0.0, mass, 1.0), x)
        return AllocationSum(u0, g, out, 0.0, (0.0, 0.0), value=value)
    elif mode == "down":
        zero += mass[0]
        out[:-1] += mass[1:]
        cut = (0.0, 0.0)
    elif mode == "up":
        out += mass  # cell k = [x_{k-1}, x_k) to x_k; cell 0 = [0, x_0) to x_0
        cut = (0.0, 0.0)
    else:  # pragma: no cover - internal
        raise ValueError(f"mode must be spread, down or up, got {mode!r}")
    return AllocationSum(u0, g, out, zero, cut)


def _hi_share(d: np.ndarray | int, g: float, frac: np.ndarray | float, mode: str) -> Any:
    """Share of a sum's mass sent to the upper of its two enclosing grid points."""
    if mode == "spread":  # keep the mean: (exp(frac g) - 1) / (exp(g) - 1)
        return np.expm1(np.multiply(frac, g)) / math.expm1(g)
    if mode == "up":
        return np.where(np.asarray(frac) > 0.0, 1.0, 0.0)
    return np.zeros_like(np.asarray(frac, dtype=float))


def _add(a: AllocationSum, b: AllocationSum, mode: str, steps: int) -> AllocationSum:
    """Law of the sum of independent a and b on the same grid (re-discretised by ``mode``).

    ``x_{j-d} + x_j = x_j exp(c_d g)`` with ``c_d = log1p(exp(-d g)) / g``: the landing point
    depends on the index gap d only. Gaps with ``c_d >= 1`` are summed one by one; for the rest
    (``c_d < 1``, the sum lands between x_j and x_{j+1}) the mean-preserving upper share is
    exactly ``exp(-d g) / (exp(g) - 1)``, a geometric kernel, summed by a linear recursion.
    """
    if mode == "merge":
        return _add_merge(a, b, steps)
    g, u0 = a.ratio_log, a.u0
    start = min(a.start, b.start)
    n0 = max(a.start + a.mass.size, b.start + b.mass.size) - start
    ma = np.zeros(n0)
    ma[a.start - start : a.start - start + a.mass.size] = a.mass
    mb = np.zeros(n0)
    mb[b.start - start : b.start - start + b.mass.size] = b.mass
    grow = math.ceil(math.log(2.0) / g) + 2
    out = np.zeros(n0 + grow + 1)
    # Zero atoms: 0 + x = x exactly.
    out[:n0] += b.zero * ma + a.zero * mb
    zero = a.zero * b.zero
    # Gaps d < d_star land at least one grid point above x_j.
    d_star = max(1, math.floor(math.log(1.0 / math.expm1(g)) / g) + 1)
    while d_star > 1 and math.log1p(math.exp(-(d_star - 1) * g)) < g:
        d_star -= 1
    while math.log1p(math.exp(-d_star * g)) >= g:
        d_star += 1
    # d = 0: x_j + x_j = x_j exp(c_0 g).
    c0 = math.log(2.0) / g
    f0 = math.floor(c0)
    p0 = float(_hi_share(0, g, c0 - f0, mode))
    v0 = ma * mb
    out[f0 : f0 + n0] += v0 * (1.0 - p0)
    out[f0 + 1 : f0 + 1 + n0] += v0 * p0
    # 0 < d < d*: gaps with the same whole part f of c_d form one short convolution kernel.
    top = min(d_star, n0)
    if top > 1:
        ds = np.arange(1, top)
        c = np.log1p(np.exp(-ds * g)) / g
        fs = np.floor(c).astype(np.int64)
        p_hi = np.asarray(_hi_share(ds, g, c - fs, mode), dtype=float)
        for f in np.unique(fs):
            sel = fs == f
            d_lo, d_hi = int(ds[sel][0]), int(ds[sel][-1])
            k_hi = p_hi[sel]
            for kernel, shift in ((1.0 - k_hi, 0), (k_hi, 1)):
                if not np.any(kernel):
                    continue
                # conv(m, kernel)[j - d_lo] = sum_d m[j - d] w_d over the group
                ca = np.convolve(ma, kernel)[: n0 - d_lo]
                cb = np.convolve(mb, kernel)[: n0 - d_lo]
                v = mb[d_lo:] * ca + ma[d_lo:] * cb
                k0 = int(f) + shift + d_lo
                out[k0 : k0 + v.size] += v
            del d_hi
    if d_star < n0:
        # plain[j] = sum_{d >= d*} m[j - d]; geo[j] = sum_{d >= d*} m[j - d] exp(-d g).
        def tails(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            plain = np.zeros(n0)
            plain[d_star:] = np.cumsum(m)[: n0 - d_star]
            geo = np.zeros(n0)
            from scipy import signal  # here: importing it costs a second of CPU at start-up

            rec = signal.lfilter([1.0], [1.0, -math.exp(-g)], m)
            geo[d_star:] = math.exp(-d_star * g) * rec[: n0 - d_star]
            return plain, geo

        plain_a, geo_a = tails(ma)
        plain_b, geo_b = tails(mb)
        pair_plain = mb * plain_a + ma * plain_b
        if mode == "spread":
            pair_hi = (mb * geo_a + ma * geo_b) / math.expm1(g)
        elif mode == "up":
            pair_hi = pair_plain
        else:
            pair_hi = np.zeros(n0)
        out[:n0] += np.maximum(pair_plain - pair_hi, 0.0)
        out[1 : n0 + 1] += pair_hi
    nz = np.flatnonzero(out > 0.0)
    last = int(nz[-1]) + 1 if nz.size else 1
    cut_r = 1.0 - (1.0 - a.cut[0]) * (1.0 - b.cut[0])
    cut_a = 1.0 - (1.0 - a.cut[1]) * (1.0 - b.cut[1])
    total = AllocationSum(u0, g, out[:last], zero, (cut_r, cut_a), start, a.terms + b.terms)
    return _trim(total, mode == "spread", steps)


def _add_merge(a: AllocationSum, b: AllocationSum, steps: int) -> AllocationSum:
    """Sum for the optimistic twin: every pair of buckets goes to one output bucket, which
    keeps the exact total mass and mean of what it received (merging atoms is a
    post-processing, so the pair stays dominated by the exact one)."""
    assert a.value is not None and b.value is not None
    g, u0 = a.ratio_log, a.u0
    start = min(a.start, b.start)
    n0 = max(a.start + a.mass.size, b.start + b.mass.size) - start

    def padded(arr: np.ndarray, s: int) -> np.ndarray:
        out = np.zeros(n0)
        out[s - start : s - start + arr.size] = arr
        return out

    ma, mb = padded(a.mass, a.start), padded(b.mass, b.start)
    ra, rb = padded(a.mass * a.value, a.start), padded(b.mass * b.value, b.start)
    grow = math.ceil(math.log(2.0) / g) + 2
    out_m = np.zeros(n0 + grow + 1)
    out_r = np.zeros(n0 + grow + 1)
    # d = 0
    f0 = round(math.log(2.0) / g)
    out_m[f0 : f0 + n0] += ma * mb
    out_r[f0 : f0 + n0] += ra * mb + ma * rb
    ds = np.arange(1, n0)
    shift = np.rint(np.log1p(np.exp(-ds * g)) / g).astype(np.int64) if n0 > 1 else ds
    for f in np.unique(shift[shift > 0]) if n0 > 1 else []:
        sel = np.flatnonzero(shift == f)
        d_lo, d_hi = int(ds[sel[0]]), int(ds[sel[-1]])
        kernel = np.ones(d_hi - d_lo + 1)

        ca, cb, cra, crb = (np.convolve(m, kernel)[: n0 - d_lo] for m in (ma, mb, ra, rb))
        k0 = int(f) + d_lo
        out_m[k0 : k0 + n0 - d_lo] += mb[d_lo:] * ca + ma[d_lo:] * cb
        out_r[k0 : k0 + n0 - d_lo] += (
            rb[d_lo:] * ca + mb[d_lo:] * cra + ra[d_lo:] * cb + ma[d_lo:] * crb
        )
    # Gaps that round to the same bucket j: plain prefix sums.
    zero_gaps = ds[shift == 0] if n0 > 1 else ds
    if zero_gaps.size:
        d0 = int(zero_gaps[0])

        def prefix(m: np.ndarray) -> np.ndarray:
            out = np.zeros(n0)
            out[d0:] = np.cumsum(m)[: n0 - d0]
            return out

        pa, pb, pra, prb = prefix(ma), prefix(mb), prefix(ra), prefix(rb)
        out_m[:n0] += mb * pa + ma * pb
        out_r[:n0] += rb * pa + mb * pra + ra * pb + ma * prb
    nz = np.flatnonzero(out_m > 0.0)
    last = int(nz[-1]) + 1 if nz.size else 1
    m = out_m[:last]
    grid = np.exp(u0 + g * (start + np.arange(last)))
    value = np.where(m > 0.0, out_r[:last] / np.where(m > 0.0, m, 1.0), grid)
    total = AllocationSum(u0, g, m, 0.0, (0.0, 0.0), start, a.terms + b.terms, value=value)
    return _trim(total, False, steps)


def allocation_sum(
    noise_multiplier: float, steps: int, ratio_log: float, mode: str
) -> AllocationSum:
    """Discrete law of S = X_1 + ... + X_steps under Q (see the module docstring).

    Args:
      noise_multiplier: z > 0.
      steps: T >= 1, the steps per epoch.
      ratio_log: g > 0, log spacing of the geometric grid.
      mode: ``spread`` (convex-order upper bound), ``down`` or ``up`` (pointwise lower/upper
        rounding, used by the optimistic twin).
    """
    one = _x_discrete(noise_multiplier, steps, ratio_log, mode)
    result: AllocationSum | None = None
    base = one
    t = steps
    while t > 0:
        if t & 1:
            result = base if result is None else _add(result, base, mode, steps)
        t >>= 1
        if t:
            base = _add(base, base, mode, steps)
    assert result is not None
    return result


def _loss_pld(
    total: AllocationSum, steps: int, h: float, direction: str, upper: bool
) -> DiscretePLD:
    """Loss PLD on grid h: remove = log(S/T) under P' (mass w s/T), add = -log(S/T) under Q."""
    g = total.ratio_log
    if total.value is not None:
        ls = np.log(np.maximum(total.value, 1e-300)) - math.log(steps)  # log(s/T), merged atoms
    else:
        ls = total.u0 + g * (total.start + np.arange(total.mass.size)) - math.log(steps)
    keep = total.mass > 0.0
    w = total.mass[keep]
    ls = ls[keep]
    if direction == "remove":
        loss = ls
        pm = w * np.exp(ls)
        inf = total.cut[0] if upper else 0.0
    else:
        loss = -ls
        pm = w
        inf = (total.cut[1] + total.zero) if upper else 0.0
    k = np.floor(loss / h)
    k0 = int(k.min())
    idx = (k - k0).astype(np.int64)
    size = int(idx.max()) + 2
    if upper:  # connect the dots: keep P- and Q-mass (Q-mass = P-mass * exp(-loss))
        a = k * h
        # p_lo e^{-a} + p_hi e^{-a-h} = p e^{-loss} and p_lo + p_hi = p
        # give p_hi = p (1 - e^{-(loss - a)}) / (1 - e^{-h}).
        share_hi = np.clip(np.expm1(-(loss - a)) / np.expm1(-h), 0.0, 1.0)
        pmf = np.bincount(idx, weights=pm * (1.0 - share_hi), minlength=size)
        pmf += np.bincount(idx + 1, weights=pm * share_hi, minlength=size)
    else:
        pmf = np.bincount(idx, weights=pm, minlength=size)
    return DiscretePLD(h, k0, pmf, float(min(1.0, inf)))


@dataclasses.dataclass(frozen=True)
class AllocationBounds:
    """Upper (provable) and lower (optimistic) figures for one query, and how far the grid
    refinement got: ``gap`` is the relative change of the upper figure between the last two
    grid levels (nan after one level, 0 where the answer is exact), ``converged`` whether it
    met the tolerance before the level limit."""

    upper: float
    lower: float
    gap: float = 0.0
    converged: bool = True


def allocation_plds(
    noise_multiplier: float,
    steps: int,
    epochs: int,
    ratio_log: float,
    interval: float,
    *,
    upper: bool,
) -> dict[str, DiscretePLD]:
    """Composed loss PLDs of ``epochs`` epochs, both directions (upper or lower bound)."""
    out: dict[str, DiscretePLD] = {}
    ones = _one_epoch(float(noise_multiplier), int(steps), float(ratio_log), float(interval), upper)
    for direction, one in ones:
        out[direction] = compose([(one, epochs)]) if upper else _compose_lower(one, epochs)
    return out


@functools.lru_cache(maxsize=32)
def _one_epoch(
    z: float, steps: int, g: float, h: float, upper: bool
) -> tuple[tuple[str, DiscretePLD], ...]:
    """One epoch's loss PLDs (cached: epoch-by-epoch histories and repeated queries reuse the
    expensive sum; the arrays are never modified in place)."""
    total = allocation_sum(z, steps, g, "spread" if upper else "merge")
    return tuple((d, _loss_pld(total, steps, h, d, upper)) for d in ("remove", "add"))


def _compose_lower(one: DiscretePLD, epochs: int) -> DiscretePLD:
    """Compose for a lower bound: the window's outside mass is dropped (not added to delta)."""
    composed = compose([(one, epochs)], tail_mass=1e-300)
    return dataclasses.replace(composed, infinity_mass=0.0)


# --------------------------------------------------------------------------------------------
# Events -> bounds
# --------------------------------------------------------------------------------------------

_FIRST_RATIO_LOG = 0.02  # g of the first level
_FIRST_INTERVAL = 2e-3  # loss grid h of the first level
_MAX_LEVELS = 3


def _flatten(event: ev.Event, count: int, out: dict[tuple[float, int], int]) -> None:
    """Collect {(z, T): epochs} (T = 1 for a plain Gaussian) for a supported event tree."""
    if count == 0:
        return
    if isinstance(event, ev.BallsAndBins):
        key = (float(event.noise_multiplier), int(event.steps_per_epoch))
        out[key] = out.get(key, 0) + count * int(event.epochs)
    elif isinstance(event, ev.Gaussian):
        key = (float(event.noise_multiplier), 1)
        out[key] = out.get(key, 0) + count
    elif isinstance(event, ev.SelfComposed):
        _flatten(event.event, count * event.count, out)
    elif isinstance(event, ev.Composed):
        for e in event.events:
            _flatten(e, count, out)
    elif not isinstance(event, ev.NonPrivate):  # pragma: no cover - guarded by unsupported
        raise ValueError(f"random_allocation cannot account {event!r}")


def _leaf_reason(event: ev.Event) -> str | None:
    if isinstance(event, ev.BallsAndBins | ev.Gaussian):
        if event.noise_multiplier < MIN_NOISE_MULTIPLIER:
            return (
                f"random_allocation needs noise multipliers >= {MIN_NOISE_MULTIPLIER}, got "
                f"noise_multiplier={event.noise_multiplier!r} in {event!r}"
            )
        return None
    if isinstance(event, ev.NonPrivate):
        return None
    return (
        f"random_allocation accounts Balls-and-Bins (and plain Gaussian) events only, got "
        f"sub-event {type(event).__name__} {event!r}"
    )


#: Below this noise multiplier exp(1/z^2) leaves float range; RDP or Monte Carlo take over.
MIN_NOISE_MULTIPLIER = 0.1


def _parts(event: ev.Event) -> dict[tuple[float, int], int]:
    parts: dict[tuple[float, int], int] = {}
    _flatten(event, 1, parts)
    return parts


def _composed(
    parts: dict[tuple[float, int], int], g: float, h: float, *, upper: bool
) -> dict[str, DiscretePLD]:
    """Both directions' composed PLDs of all parts at grid level (g, h)."""
    per_direction: dict[str, list[tuple[DiscretePLD, int]]] = {"remove": [], "add": []}
    for (z, steps), count in parts.items():
        one = allocation_plds(z, steps, 1, g, h, upper=upper)
        for direction, pld_one in one.items():
            per_direction[direction].append((pld_one, count))
    out = {}
    for direction, items in per_direction.items():
        if upper:
            out[direction] = compose(items)
        else:
            composed = compose(items, tail_mass=1e-300)
            out[direction] = dataclasses.replace(composed, infinity_mass=0.0)
    return out


def upper_plds(event: ev.Event, level: int = 0) -> tuple[DiscretePLD, ...]:
    """The provable composed PLDs of a Balls-and-Bins event (remove, add) at grid ``level``.

    Level 0 is the accountant's first (coarsest) grid; each level halves both grids. Every
    level dominates the exact pair, so anything monotone in the hockey-stick curve computed
    from it (delta, an attacker's true-positive rate) is a valid upper bound.

    Raises:
      UnsupportedEventError: a sub-event this accountant cannot account.
    """
    reason = RandomAllocationAccountant().unsupported(event)
    if reason is not None:
        raise UnsupportedEventError(reason)
    parts = _parts(event)
    if not parts:
        return ()
    z_max = max(z for z, _ in parts)
    g = min(_FIRST_RATIO_LOG, 1.0 / (25.0 * z_max)) / 2.0**level
    h = min(_FIRST_INTERVAL, 0.1 * g * 2.0**level) / 2.0**level
    return tuple(_composed(parts, g, h, upper=True).values())


def _gaussian_only(parts: dict[tuple[float, int], int]) -> float | None:
    """mu of the composition when every part is a plain Gaussian (T = 1), else None."""
    if not parts or any(steps != 1 for _, steps in parts):
        return None
    return math.sqrt(sum(count / (z * z) for (z, _), count in parts.items()))


def _bounds(
    parts: dict[tuple[float, int], int],
    query: str,
    value: float,
    tolerance: float,
    *,
    lower: bool = True,
    levels: int = _MAX_LEVELS,
) -> AllocationBounds:
    """Upper and lower epsilon (query='epsilon', value=delta) or delta (query='delta')."""

    def read(plds: dict[str, DiscretePLD]) -> float:
        if query == "epsilon":
            return max(p.epsilon(value) for p in plds.values())
        return max(p.delta(value) for p in plds.values())

    best = math.inf
    prev = None
    gap, converged = math.nan, False
    z_max = max(z for z, _ in parts)
    # The grid resolves the spread of log X (std 1/z) and the loss of one epoch.
    g = min(_FIRST_RATIO_LOG, 1.0 / (25.0 * z_max))
    h = min(_FIRST_INTERVAL, 0.1 * g)
    for _ in range(levels):
        up = read(_composed(parts, g, h, upper=True))
        best = min(best, up)
        if prev is not None:
            gap = abs(prev - up) / max(abs(up), 1e-6) if math.isfinite(up) else math.nan
            if gap <= tolerance:
                converged = True
                break
        prev = up
        g, h = g / 2.0, h / 2.0
    if not lower:
        return AllocationBounds(best, -math.inf, gap, converged)
    low = read(_composed(parts, g, h, upper=False))
    return AllocationBounds(best, min(low, best), gap, converged)


def allocation_epsilon(
    noise_multiplier: float,
    steps: int,
    epochs: int,
    delta: float,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> AllocationBounds:
    """Epsilon bounds of ``epochs`` epochs of 1-of-``steps`` random allocation at ``delta``.

    ``upper`` is provable (up to floating-point round-off); ``lower`` is the optimistic twin
    (the exact epsilon of the dominating pair lies between them). ``steps = 1`` is the Gaussian
    mechanism, answered exactly (both figures equal).
    """
    check_range("noise_multiplier", noise_multiplier, MIN_NOISE_MULTIPLIER, None)
    check_range("steps", steps, 1, None)
    check_range("epochs", epochs, 1, None)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return _epsilon_bounds({(float(noise_multiplier), int(steps)): int(epochs)}, delta, tolerance)


def _epsilon_bounds(
    parts: dict[tuple[float, int], int],
    delta: float,
    tolerance: float,
    *,
    lower: bool = True,
    levels: int = _MAX_LEVELS,
) -> AllocationBounds:
    mu = _gaussian_only(parts)
    if mu is not None:
        eps = float(gauss.gaussian_epsilon(mu, delta))
        return AllocationBounds(eps, eps)
    return _bounds(parts, "epsilon", delta, tolerance, lower=lower, levels=levels)


def epsilon_upper(
    event: ev.Event, delta: float, *, coarse: bool = False, tolerance: float = DEFAULT_TOLERANCE
) -> float:
    """The provable epsilon of a supported event alone (no optimistic twin): for calibration.

    ``coarse=True`` uses the first grid level only: looser, still a valid upper bound.
    """
    parts = _parts(event)
    levels = 1 if coarse else _MAX_LEVELS
    return _epsilon_bounds(parts, delta, tolerance, lower=False, levels=levels).upper


def _delta_bounds(
    parts: dict[tuple[float, int], int], epsilon: float, tolerance: float
) -> AllocationBounds:
    mu = _gaussian_only(parts)
    if mu is not None:
        d = float(gauss.gaussian_delta(mu, epsilon))
        return AllocationBounds(d, d)
    return _bounds(parts, "delta", epsilon, tolerance)


def allocation_delta(
    noise_multiplier: float,
    steps: int,
    epochs: int,
    epsilon: float,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> AllocationBounds:
    """Delta bounds at ``epsilon`` (>= 0); see :func:`allocation_epsilon`."""
    check_range("noise_multiplier", noise_multiplier, MIN_NOISE_MULTIPLIER, None)
    check_range("steps", steps, 1, None)
    check_range("epochs", epochs, 1, None)
    check_range("epsilon", epsilon, 0.0, None)
    return _delta_bounds({(float(noise_multiplier), int(steps)): int(epochs)}, epsilon, tolerance)


_NOTE = (
    "random allocation PLD (Feldman & Shenfeld 2026): provable upper bound; epsilon_lower is "
    "its optimistic twin"
)


def _refinement_note(b: AllocationBounds, tolerance: float, what: str) -> str:
    """What the grid refinement reached, stated either way (the upper figure is a valid bound
    at every level; the tolerance is about its tightness only)."""
    if b.converged and b.gap == 0.0:
        return f"{what} exact (Gaussian mechanism): no grid"
    if b.converged:
        return (
            f"tolerance={tolerance:g} met: the last two grid levels agree to {b.gap:.2g} "
            f"(relative) in {what}"
        )
    reached = "one level only" if math.isnan(b.gap) else f"they differ by {b.gap:.2g} (relative)"
    return (
        f"tolerance={tolerance:g} NOT met within {_MAX_LEVELS} grid levels: {reached}; the "
        f"{what} is still a valid upper bound, looser than the tolerance asked"
    )


class RandomAllocationAccountant:
    """Provable PLD accountant for Balls-and-Bins (1-of-T random allocation) events.

    Args:
      tolerance: target relative gap between two successive grid levels of the upper bound.
      lower: also compute the optimistic twin (``epsilon_lower``); calibration turns it off.
    """

    name = "random_allocation"

    def __init__(self, tolerance: float = DEFAULT_TOLERANCE, *, lower: bool = True) -> None:
        check_range("tolerance", tolerance, 0.0, 1.0, low_open=True, high_open=True)
        self.tolerance = float(tolerance)
        self.lower = bool(lower)

    def __repr__(self) -> str:
        return f"RandomAllocationAccountant(tolerance={self.tolerance!r}, lower={self.lower!r})"

    def unsupported(self, event: ev.Event) -> str | None:
        from dpfy.accounting._api import contains, first_unsupported

        if not contains(event, ev.BallsAndBins):
            return "random_allocation is for Balls-and-Bins events (none in this event)"
        return first_unsupported(event, _leaf_reason)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        b = _epsilon_bounds(_parts(event), float(delta), self.tolerance, lower=self.lower)
        return PrivacyResult(
            epsilon=b.upper,
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=True,
            epsilon_lower=b.lower if self.lower else None,
            notes=(_NOTE, _refinement_note(b, self.tolerance, "epsilon")),
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        b = _delta_bounds(_parts(event), float(epsilon), self.tolerance)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=b.upper,
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=True,
            notes=(
                _NOTE, f"delta_lower = {b.lower:.6g} (optimistic twin)",
                _refinement_note(b, self.tolerance, "delta"),
            ),
        )

    def calibration_search(self, delta: float) -> _AllocationSearch:
        """Calibration's evaluator (:class:`dpfy.accounting.SearchesForCalibration`)."""
        return _AllocationSearch(delta, self.tolerance)


@dataclasses.dataclass(frozen=True)
class _AllocationSearch:
    """The upper bound alone (no optimistic twin) along one calibration search: coarse = the
    first grid level; truncated samplers are left to the public API (None)."""

    delta: float
    tolerance: float

    def __call__(self, event: ev.Event, coarse: bool) -> float | None:
        if ev.untruncated(event) != event:
            return None
        if contains_non_private(event):
            return math.inf
        return epsilon_upper(event, self.delta, coarse=coarse, tolerance=self.tolerance)


register_accountant(RandomAllocationAccountant(), auto=True)

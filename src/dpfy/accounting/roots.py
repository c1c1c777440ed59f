"""Safe-side root finding for monotone functions: the one search every accountant uses.

Privacy searches must err on one side: an epsilon found by search may be too large but never
too small, a noise multiplier may be too large but never too small, a number of steps may be
too small but never too large. Each function here states its constraint and returns a point
that *satisfies* it (checked by evaluating the function there), within a tolerance of the
boundary; the boundary itself is never approximated from the wrong side.

* :func:`safe_root` — continuous ``x`` in a bracket ``[lo, hi]``, constraint ``f(x) <= 0``,
  ``f`` monotone. The engine is SciPy's vectorised bracketing root finder
  (:func:`scipy.optimize.elementwise.find_root`, Chandrupatla's method), which keeps a
  bracket with ``f`` of opposite signs at its ends; the end where ``f <= 0`` is returned.
* :func:`safe_log_root` — the same on ``log x`` for positive ``x`` (relative tolerance).
* :func:`smallest_true`, :func:`largest_true` — integers meeting a monotone predicate
  (binary search by :func:`bisect.bisect_left` over a ``range``, no hand-written loop);
  :func:`smallest_true_array` vectorises the former over many independent searches.

Expensive scalar calibrations (one accountant call per evaluation, with a coarse and a fine
accuracy) go through :mod:`dpfy.accounting.calibrate`, whose safeguarded secant needs fewer
evaluations than a bracketing method and verifies its answer with the public accountant.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

# scipy.optimize is imported in the two functions that solve, not here: importing it costs
# about a second, and most processes that import the accountants never search for a root.

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Which side of the root the constraint ``f(x) <= 0`` holds on, hence where the result lies:
#: ``"low"``: ``f`` non-decreasing, result <= root; ``"high"``: ``f`` non-increasing, result >=
#: root.
Side = Literal["low", "high"]

_BIG = 1e300  # stands in for +-inf so that the root finder sees finite values
_TINY = float(np.finfo(np.float64).tiny)
_EPS = float(np.finfo(np.float64).eps)


def _check_side(side: str) -> None:
    if side not in ("low", "high"):
        raise ValueError(f"side must be 'low' or 'high', got side={side!r}")


def _signed(values: Any) -> FloatArray:
    """Finite stand-ins with the same certified/uncertified split as ``values``.

    ``v <= 0`` (certified) maps to a value ``<= -tiny`` (so no end of a bracket is exactly
    zero), ``v > 0`` and NaN (not certified: the safe reading) to a positive value; +-inf to
    +-1e300. Monotonicity is kept.
    """
    v = np.asarray(values, dtype=np.float64)
    bad = np.isnan(v) | (v > 0.0)
    pos = np.minimum(np.where(np.isnan(v), _BIG, v), _BIG)
    neg = np.minimum(np.maximum(v, -_BIG), -_TINY)
    return np.where(bad, pos, neg)


@overload
def safe_root(
    f: Callable[..., Any],
    lo: float,
    hi: float,
    *,
    side: Side,
    xtol: float = ...,
    rtol: float = ...,
    args: tuple[Any, ...] = ...,
    vectorized: bool = ...,
    maxiter: int | None = ...,
) -> float: ...
@overload
def safe_root(
    f: Callable[..., Any],
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
    *,
    side: Side,
    xtol: float = ...,
    rtol: float = ...,
    args: tuple[Any, ...] = ...,
    vectorized: bool = ...,
    maxiter: int | None = ...,
) -> float | FloatArray: ...
def safe_root(
    f: Callable[..., Any],
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
    *,
    side: Side,
    xtol: float = 4.0 * _TINY,
    rtol: float = 4.0 * _EPS,
    args: tuple[Any, ...] = (),
    vectorized: bool = False,
    maxiter: int | None = None,
) -> float | FloatArray:
    """The boundary of ``{x in [lo, hi]: f(x) <= 0}`` for monotone ``f``, on the certified side.

    Args:
      f: ``f(x) -> float`` (``vectorized=False``, called once per point), or an elementwise
        ``f(x, *args) -> array`` (``vectorized=True``; ``x`` and ``args`` arrive compressed to
        the searches still running, so pass per-element data through ``args``, not a
        closure). NaN counts as "not certified" (> 0).
      lo, hi: bracket ends (scalars or broadcastable arrays), ``lo <= hi``.
      side: ``"low"`` — ``f`` is non-decreasing and ``f(lo) <= 0`` must hold; returns the
        largest certified x (to tolerance), which is <= the root. ``"high"`` — ``f`` is
        non-increasing and ``f(hi) <= 0`` must hold; returns the smallest certified x, >= the
        root. If the whole bracket is certified, the far end (``hi`` resp. ``lo``) is returned.
      xtol, rtol: the result is within ``xtol + rtol |x|`` of an uncertified point (same units
        as ``x``), unless ``maxiter`` stops the search first (the result is still certified).
      args: extra arrays for a vectorised ``f``, broadcastable with ``lo`` and ``hi``.
      maxiter: iteration cap (default: SciPy's, enough to reach float resolution).

    Returns:
      ``x`` with ``f(x) <= 0`` evaluated at exactly that ``x``: a float when ``lo``, ``hi`` and
      ``args`` are scalars, else an array of their broadcast shape.

    Raises:
      ValueError: bad ``side``, ``lo > hi``, or ``f`` > 0 (or NaN) at the end that must be
        certified.
    """
    _check_side(side)
    arrays = np.broadcast_arrays(
        np.asarray(lo, dtype=np.float64),
        np.asarray(hi, dtype=np.float64),
        *(np.asarray(a) for a in args),
    )
    a, b = arrays[0], arrays[1]
    extra = arrays[2:]
    scalar = a.ndim == 0
    if np.any(~(a <= b)):
        raise ValueError("safe_root needs lo <= hi (and no NaN ends)")

    if vectorized:
        def g(x: FloatArray, *more: Any) -> FloatArray:
            return _signed(f(x, *more))
    else:
        scalar_f = np.vectorize(lambda x, *more: float(f(x, *more)), otypes=[np.float64])

        def g(x: FloatArray, *more: Any) -> FloatArray:
            return _signed(scalar_f(x, *more))

    ga, gb = g(a, *extra), g(b, *extra)
    safe_end, far_end = (a, b) if side == "low" else (b, a)
    g_safe, g_far = (ga, gb) if side == "low" else (gb, ga)
    if np.any(g_safe > 0.0):
        end = "lo" if side == "low" else "hi"
        raise ValueError(
            f"safe_root(side={side!r}): f > 0 (or NaN) at {end}, so the bracket has no "
            "certified end; widen it"
        )
    out = np.where(g_far <= 0.0, far_end, safe_end).astype(np.float64)
    search = g_far > 0.0
    if scalar and bool(search):
        def g_scalar(x: float) -> float:
            return float(g(np.asarray(x, dtype=np.float64), *extra))

        return _scalar_root(g_scalar, float(a), float(b), side, xtol, rtol, maxiter)
    if np.any(search):
        idx = np.flatnonzero(search)
        xl = a.ravel()[idx]
        xr = b.ravel()[idx]
        more = tuple(e.ravel()[idx] for e in extra)
        tolerances = {"xatol": xtol, "xrtol": rtol, "fatol": 0.0, "frtol": 0.0}
        kwargs: dict[str, Any] = {"tolerances": tolerances, "args": more}
        if maxiter is not None:
            kwargs["maxiter"] = maxiter
        from scipy.optimize import elementwise

        res = elementwise.find_root(g, (xl, xr), **kwargs)
        (bl, br), (fl, fr) = res.bracket, res.f_bracket
        # The final bracket has f <= 0 at exactly one end (both when f hit 0): take that end.
        if side == "low":
            found = np.where(fl <= 0.0, bl, br)
        else:
            found = np.where(fr <= 0.0, br, bl)
        flat = out.ravel()
        flat[idx] = found
        out = flat.reshape(out.shape)
    if scalar:
        return float(out)
    return out


def _scalar_root(
    g: Callable[[float], float],
    a: float,
    b: float,
    side: Side,
    xtol: float,
    rtol: float,
    maxiter: int | None,
) -> float:
    """Scalar path of :func:`safe_root` (``g(a)``, ``g(b)`` of opposite signs, ``g`` never 0).

    Brent's method (SciPy's compiled ``brentq``, much cheaper per call than the vectorised
    engine), then steps of growing size towards the certified end until ``g(x) <= 0``.
    """
    from scipy import optimize

    x = float(
        optimize.brentq(
            g, a, b, xtol=xtol, rtol=max(rtol, 4.0 * _EPS), maxiter=maxiter or 500, disp=False
        )
    )
    step = xtol + rtol * abs(x)
    while g(x) > 0.0:  # brentq may stop on the uncertified side: step to the certified one
        x = max(x - step, a) if side == "low" else min(x + step, b)
        step *= 2.0
    return x


def safe_log_root(
    f: Callable[..., Any],
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
    *,
    side: Side,
    rtol: float = 4.0 * _EPS,
    args: tuple[Any, ...] = (),
    vectorized: bool = False,
    maxiter: int | None = None,
) -> float | FloatArray:
    """:func:`safe_root` for positive ``x``, searched on ``log x`` to relative tolerance ``rtol``.

    Same contract and side semantics as :func:`safe_root` (``0 < lo <= hi``); ``f`` is
    evaluated at ``exp(u)`` and exactly that value is returned, so the result is certified.
    """
    la = np.log(np.asarray(lo, dtype=np.float64))
    lb = np.log(np.asarray(hi, dtype=np.float64))
    if vectorized:
        def h(u: Any, *more: Any) -> Any:
            return f(np.exp(u), *more)
    else:
        def h(u: Any, *more: Any) -> Any:
            return f(float(np.exp(u)), *more)

    u = safe_root(
        h, la, lb, side=side, xtol=math.log1p(rtol), rtol=0.0, args=args,
        vectorized=vectorized, maxiter=maxiter,
    )
    if isinstance(u, float):
        return float(np.exp(u))
    return np.exp(u)


def smallest_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest integer k in ``[lo, hi]`` with ``pred(k)``, for ``pred`` non-decreasing in k.

    The caller vouches for ``pred(hi)`` (it is never evaluated): ``hi`` is returned when no
    smaller k qualifies. Binary search, at most ``ceil(log2(hi - lo + 1))`` calls.
    """
    if hi < lo:
        raise ValueError(f"smallest_true needs lo <= hi, got lo={lo}, hi={hi}")
    return lo + bisect.bisect_left(range(lo, hi), True, key=pred)


def largest_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest integer k in ``[lo, hi]`` with ``pred(k)``, for ``pred`` non-increasing in k.

    The caller vouches for ``pred(lo)`` (it is never evaluated): ``lo`` is returned when no
    larger k qualifies. Binary search, at most ``ceil(log2(hi - lo + 1))`` calls.
    """
    if hi < lo:
        raise ValueError(f"largest_true needs lo <= hi, got lo={lo}, hi={hi}")
    return lo + bisect.bisect_left(range(lo + 1, hi + 1), True, key=lambda k: not pred(k))


def smallest_true_array(
    pred: Callable[[IntArray, npt.NDArray[np.intp]], npt.NDArray[np.bool_]],
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
) -> IntArray:
    """:func:`smallest_true` for many independent searches at once.

    Args:
      pred: ``pred(k, index) -> bool array``: the predicate at integers ``k`` for the searches
        ``index`` (flat positions in the broadcast shape of ``lo`` and ``hi``); non-decreasing
        in k for each search. Only the searches still running are passed.
      lo, hi: integer bracket ends; ``pred`` is vouched for (never evaluated) at ``hi``.

    Returns:
      Per search, the smallest k in ``[lo, hi]`` with ``pred(k)`` (``hi`` when none smaller).
    """
    lo_a, hi_a = np.broadcast_arrays(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
    if np.any(hi_a < lo_a):
        raise ValueError("smallest_true_array needs lo <= hi")
    below = lo_a.ravel() - 1  # invariant: every k <= below is False (or below the range)
    top = hi_a.ravel().copy()  # invariant: pred(top) is True (vouched for at hi)
    while True:
        idx = np.flatnonzero(top - below > 1)
        if idx.size == 0:
            break
        mid = (below[idx] + top[idx]) // 2
        ok = np.asarray(pred(mid, idx), dtype=bool)
        top[idx] = np.where(ok, mid, top[idx])
        below[idx] = np.where(ok, below[idx], mid)
    return top.reshape(lo_a.shape)

"""Calibration: the noise multiplier, number of steps or sampling rate that meets (epsilon, delta).

Every function takes a factory ``make_event(parameter) -> Event`` and searches the parameter
by a safeguarded monotone root search (secant steps kept inside a bracket, falling back to
bisection; cheap searches use :mod:`dpfy.accounting.roots` instead). The result is
always on the SAFE side: the chosen accounting method certifies ``epsilon <= target_epsilon``
at the returned value (the noise multiplier is rounded up, steps and sampling rate down).
Adjacency and unit of privacy are those of the events ``make_event`` builds.

Speed: PLD values are valid upper bounds at any grid tolerance, so the search first runs on a
coarse PLD grid (a value certified safe there is safe), then finishes near the target with the
full tolerance; the returned value is always certified at the full tolerance or by a coarse
bound that is itself valid.

Example:
  >>> from dpfy import events as ev
  >>> make = lambda z: ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(z)), 1000)
  >>> z = calibrate_noise_multiplier(make, 2.0, 1e-5, method="rdp")
  >>> round(z, 2)
  1.02
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from dpfy import events as ev
from dpfy._validate import MAX_EPSILON, check_int, check_positive, check_range
from dpfy.accounting import _api

_COARSE_RTOL = 1e-2  # parameter resolution of the coarse phase
_MAX_EVALUATIONS = 200  # per phase; secant + bisection needs far fewer


class CalibrationError(ValueError):
    """The target cannot be met inside the allowed parameter range."""


# --------------------------------------------------------------------------------------------
# Evaluators: parameter -> epsilon upper bound, in a coarse (fast) or fine (final) mode
# --------------------------------------------------------------------------------------------


class _Evaluator:
    """epsilon(x) for one accounting method; ``coarse=True`` may be looser but is still valid.

    An accountant that declares :class:`~dpfy.accounting._api.SearchesForCalibration` gives
    one :class:`~dpfy.accounting._api.CalibrationSearch` per search: the coarse phase runs on
    it, and so does the fine phase where the search has a route of its own (the PLD, RDP and
    random-allocation accountants describe theirs). Everything else -- an accountant without
    the capability, an event the search declines (None) -- is the public accountant, both
    modes alike.
    """

    def __init__(
        self, make_event: Callable[[float], ev.Event], delta: float, method: str | _api.Accountant
    ) -> None:
        self.make_event = make_event
        self.delta = delta
        self.method = method
        accountant = _api._ACCOUNTANTS.get(method) if isinstance(method, str) else method
        self._search: _api.CalibrationSearch | None = None
        if isinstance(accountant, _api.SearchesForCalibration):
            self._search = accountant.calibration_search(delta)
        self.has_coarse = self._search is not None

    def __call__(self, x: float, coarse: bool) -> float:
        event = self.make_event(x)
        if self._search is not None and (coarse or ev.untruncated(event) == event):
            # truncation is added centrally: a fine value of a truncated event is the API's
            eps = self._search(event, coarse)
            if eps is not None:
                return eps
        return _api.epsilon(event, self.delta, method=self.method).epsilon

    def verify(self, x: float) -> float:
        """epsilon(x) exactly as the public accountant reports it."""
        return _api.epsilon(self.make_event(x), self.delta, method=self.method).epsilon


_P = TypeVar("_P", int, float)


def _methods(
    make_event: Callable[[_P], ev.Event], x0: _P, method: str | _api.Accountant
) -> list[str | _api.Accountant]:
    """Methods to calibrate with: ``auto`` means every auto accountant supporting x0."""
    event = ev.untruncated(make_event(x0))
    if not isinstance(method, str) or method != "auto":
        _api._resolve(event, method)  # raises a clear error for bad or unsupported methods
        return [method]
    return [a.name for a in _api._resolve(event, "auto")]


# --------------------------------------------------------------------------------------------
# Generic monotone search
# --------------------------------------------------------------------------------------------


def _log(x: float) -> float:
    if x <= 0.0:
        return -math.inf
    return math.log(x)


def _solve(
    f_eval: Callable[[float], float],
    points: list[tuple[float, float]],
    width: float,
    integer: bool,
    u_min: float,
    u_max: float,
    first_step: float,
    name: str,
    target: float,
) -> tuple[float, list[tuple[float, float]]]:
    """Safest-to-least-safe boundary of f(u) = log eps(u) - log target (f decreasing in u).

    Secant steps through the two latest points, aimed slightly inside the safe side,
    safeguarded by the bracket (regula falsi, then bisection when progress stalls). Returns
    the smallest u with f(u) <= 0 found, within ``width`` of a u with f > 0 (or u_min).
    """
    pts = list(points)
    step = first_step
    stalled = 0
    best_abs = math.inf
    while True:
        if len(pts) > _MAX_EVALUATIONS:
            raise CalibrationError(f"calibration of {name} did not converge")
        safe = [u for u, f in pts if f <= 0.0]
        unsafe = [u for u, f in pts if f > 0.0]
        u_s = min(safe) if safe else None
        u_u = max(unsafe) if unsafe else None
        if u_s is not None and (u_s <= u_min or (u_u is not None and u_s - u_u <= width)):
            return u_s, pts
        if u_u is not None and u_u >= u_max:
            f_top = max(f for u, f in pts if u == u_u)
            raise CalibrationError(
                f"target_epsilon={target!r} cannot be met: epsilon is "
                f"{target * math.exp(f_top):.6g} even at the end of the allowed {name} range"
            )
        (ua, fa), (ub, fb) = pts[-2], pts[-1]
        slope = (fb - fa) / (ub - ua) if ub != ua else 0.0
        if abs(fb) < 0.5 * best_abs:
            stalled = 0
        else:
            stalled += 1
        best_abs = min(best_abs, abs(fb))
        cand = None
        if slope < 0.0 and math.isfinite(slope):
            aim = -0.3 * width * abs(slope)  # land just inside the safe side
            cand = ub + (aim - fb) / slope
            if fb <= 0.0 and ub == u_s and fb >= -2.0 * width * abs(slope):
                cand = u_s - 0.9 * width  # close to the boundary: probe just past it
        if u_s is not None and u_u is not None:
            bracket = u_s - u_u
            lo, hi = u_u + 0.02 * bracket, u_s - 0.02 * bracket
            if cand is None or not lo <= cand <= hi:
                f_u = max(f for u, f in pts if u == u_u)
                f_s = min(f for u, f in pts if u == u_s)
                ratio = f_u / (f_u - f_s) if f_u - f_s > 0 else 0.5
                cand = u_u + bracket * (ratio if math.isfinite(ratio) else 0.5)
                cand = min(max(cand, lo), hi)
            if stalled >= 3:
                cand, stalled = 0.5 * (u_u + u_s), 0
        elif u_s is not None:  # only safe points: move towards less safe (smaller u)
            if cand is None or cand >= u_s:
                cand = u_s - step
                step *= 2.0
            cand = max(cand, u_min)
        else:  # only unsafe points: move towards safer (larger u)
            assert u_u is not None  # pts is never empty
            if cand is None or cand <= u_u:
                cand = u_u + step
                step *= 2.0
            cand = min(cand, u_max)
        if integer:
            cand = float(round(cand))
            if u_s is not None and u_u is not None:
                cand = min(max(cand, u_u + 1.0), u_s - 1.0)
        if any(cand == u for u, _ in pts):  # no new information: bisect instead
            if u_s is not None and u_u is not None:
                cand = 0.5 * (u_u + u_s)
                cand = float(round(cand)) if integer else cand
            elif u_s is not None:
                cand = max(u_s - step, u_min)
            else:
                assert u_u is not None  # pts is never empty
                cand = min(u_u + step, u_max)
            if any(cand == u for u, _ in pts):
                if u_s is not None:
                    return u_s, pts
                raise CalibrationError(f"calibration of {name} did not converge")
        pts.append((cand, f_eval(cand)))


def _calibrate(
    evaluate: _Evaluator,
    target: float,
    from_u: Callable[[float], float],
    u_start: float,
    u_step: float,
    u_min: float,
    u_max: float,
    resolution: float,
    integer: bool,
    name: str,
) -> float:
    """Find a certified-safe u near the boundary (larger u is safer); return the parameter."""
    lt = math.log(target)

    def f_at(u: float, coarse: bool) -> float:
        return _log(evaluate(from_u(u), coarse)) - lt

    def first_two(coarse: bool, u0: float, step: float) -> list[tuple[float, float]]:
        f0 = f_at(u0, coarse)
        u1 = u0 - step if f0 <= 0.0 else u0 + step
        u1 = min(max(u1, u_min), u_max)
        if integer:
            u1 = float(round(u1))
        if u1 == u0:
            return [(u0, f0)]
        return [(u0, f0), (u1, f_at(u1, coarse))]

    u0 = min(max(u_start, u_min), u_max)
    coarse = evaluate.has_coarse
    width = max(resolution, _COARSE_RTOL) if coarse else resolution
    pts = first_two(coarse, u0, u_step)
    if len(pts) == 1:
        pts.append(pts[0])
    u_safe, pts = _solve(
        lambda v: f_at(v, coarse), pts, width, integer, u_min, u_max, u_step, name, target
    )
    if not coarse:
        return from_u(u_safe)
    # Fine phase. Coarse bounds are valid but looser, so the true boundary lies at or on the
    # unsafe side of the coarse one. Start at the coarse boundary and jump along the coarse
    # slope to the predicted fine boundary.
    slope = -1.0
    near = sorted(pts, key=lambda p: abs(p[0] - u_safe))[:2]
    if len(near) == 2 and near[0][0] != near[1][0]:
        slope = (near[1][1] - near[0][1]) / (near[1][0] - near[0][0])
    f0 = f_at(u_safe, False)
    fine = [(u_safe, f0)]
    if slope < 0.0:
        u1 = u_safe + (-0.3 * resolution * abs(slope) - f0) / slope
    else:
        u1 = u_safe - resolution
    if not math.isfinite(u1):  # an epsilon of 0 or inf at the coarse boundary: no slope
        u1 = u_safe - resolution
    u1 = min(max(u1, u_min), u_max)
    if integer:
        u1 = float(round(u1))
    if u1 != u_safe:
        fine.append((u1, f_at(u1, False)))
    else:
        fine.append(fine[0])
    u_safe, _ = _solve(
        lambda v: f_at(v, False),
        fine,
        resolution,
        integer,
        u_min,
        u_max,
        max(resolution, abs(u1 - u_safe)),
        name,
        target,
    )
    # Verify with exactly what the public accountant reports; step to the safe side if needed.
    step = resolution
    while evaluate.verify(from_u(u_safe)) > target:
        if u_safe >= u_max:
            raise CalibrationError(
                f"target_epsilon={target!r} cannot be met within the allowed {name} range"
            )
        u_safe = min(u_safe + step, u_max)
        if integer:
            u_safe = float(round(u_safe))
        step *= 2.0
    return from_u(u_safe)


def _check_common(target_epsilon: float, delta: float) -> None:
    check_positive("target_epsilon", target_epsilon, MAX_EPSILON)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def calibrate_noise_multiplier(
    make_event: Callable[[float], ev.Event],
    target_epsilon: float,
    delta: float,
    method: str | _api.Accountant = "auto",
    *,
    bracket: tuple[float, float] = (0.05, 1e4),
    rtol: float = 1e-4,
) -> float:
    """Smallest noise multiplier (to ``rtol``) whose epsilon at ``delta`` is <= the target.

    Args:
      make_event: noise multiplier z -> event; epsilon must not increase with z.
      target_epsilon: target epsilon (> 0).
      delta: target delta in (0, 1).
      method: ``auto`` (the smallest z any applicable method certifies), an accountant name,
        or a configured accountant instance.
      bracket: allowed range (z_min, z_max). If even z_min meets the target, z_min is returned.
      rtol: relative resolution of the returned z (the result is never below the boundary).

    Returns:
      z with epsilon(make_event(z), delta) <= target_epsilon for the chosen method.

    Raises:
      CalibrationError: even z_max does not meet the target.
      ValueError: bad arguments, or the method does not apply to the event.
    """
    z, _ = calibrate_with_method(
        make_event, target_epsilon, delta, method, bracket=bracket, rtol=rtol
    )
    return z


def calibrate_with_method(
    make_event: Callable[[float], ev.Event],
    target_epsilon: float,
    delta: float,
    method: str | _api.Accountant = "auto",
    *,
    bracket: tuple[float, float] = (0.05, 1e4),
    rtol: float = 1e-4,
) -> tuple[float, str]:
    """:func:`calibrate_noise_multiplier`, and the name of the accountant that certifies z.

    With ``method="auto"`` every applicable auto accountant is calibrated and the smallest z
    wins (the first in the registry's order on a tie), so the name is the tightest accountant
    the event supports at that target.
    """
    _check_common(target_epsilon, delta)
    lo, hi = bracket
    check_range("bracket[0]", lo, 0.0, None, low_open=True)
    check_range("bracket[1]", hi, lo, None, low_open=True)
    check_range("rtol", rtol, 0.0, 1.0, low_open=True, high_open=True)
    start = min(max(1.0, lo), hi)
    best, best_name = math.inf, ""
    for m in _methods(make_event, start, method):
        z = _calibrate(
            _Evaluator(make_event, delta, m),
            target_epsilon,
            math.exp,
            math.log(start),
            math.log(2.0),
            math.log(lo),
            math.log(hi),
            math.log1p(rtol),
            False,
            "noise_multiplier",
        )
        if z < best:
            best, best_name = z, m if isinstance(m, str) else m.name
    return best, best_name


def calibrate_steps(
    make_event: Callable[[int], ev.Event],
    target_epsilon: float,
    delta: float,
    method: str | _api.Accountant = "auto",
    *,
    max_steps: int = 10**8,
) -> int:
    """Largest number of steps T in [1, max_steps] whose epsilon at ``delta`` is <= the target.

    Args:
      make_event: steps T -> event; epsilon must not decrease with T.
      target_epsilon, delta, method: as in :func:`calibrate_noise_multiplier`.
      max_steps: upper end of the search; returned if it already meets the target.

    Raises:
      CalibrationError: even one step exceeds the target.
    """
    _check_common(target_epsilon, delta)
    check_int("max_steps", max_steps)
    max_steps = int(max_steps)
    best = 0
    for m in _methods(make_event, 1, method):
        evaluate = _Evaluator(lambda x: make_event(int(round(x))), delta, m)
        try:
            t = _calibrate(
                evaluate,
                target_epsilon,
                lambda u: -u,
                -1.0,
                1.0,
                -float(max_steps),
                -1.0,
                1.0,  # adjacent integers
                True,
                "steps",
            )
        except CalibrationError:
            continue
        best = max(best, int(round(t)))
    if best == 0:
        raise CalibrationError(
            f"target_epsilon={target_epsilon!r} cannot be met: even steps=1 exceeds it"
        )
    return best


def calibrate_sampling_rate(
    make_event: Callable[[float], ev.Event],
    target_epsilon: float,
    delta: float,
    method: str | _api.Accountant = "auto",
    *,
    min_sampling_rate: float = 1e-8,
    rtol: float = 1e-4,
) -> float:
    """Largest sampling rate q in [min_sampling_rate, 1] whose epsilon is <= the target.

    Args:
      make_event: sampling rate q -> event; epsilon must not decrease with q.
      target_epsilon, delta, method: as in :func:`calibrate_noise_multiplier`.
      min_sampling_rate: lower end of the search.
      rtol: relative resolution of q (the result is never above the boundary).

    Raises:
      CalibrationError: even ``min_sampling_rate`` exceeds the target.
    """
    _check_common(target_epsilon, delta)
    check_range("min_sampling_rate", min_sampling_rate, 0.0, 1.0, low_open=True)
    check_range("rtol", rtol, 0.0, 1.0, low_open=True, high_open=True)
    best = 0.0
    for m in _methods(make_event, min(1.0, max(0.01, min_sampling_rate)), method):
        try:
            q = _calibrate(
                _Evaluator(make_event, delta, m),
                target_epsilon,
                lambda u: min(1.0, math.exp(-u)),
                -math.log(0.01),
                math.log(4.0),
                0.0,
                -math.log(min_sampling_rate),
                math.log1p(rtol),
                False,
                "sampling_rate",
            )
        except CalibrationError:
            continue
        best = max(best, q)
    if best == 0.0:
        raise CalibrationError(
            f"target_epsilon={target_epsilon!r} cannot be met: even "
            f"sampling_rate={min_sampling_rate!r} exceeds it"
        )
    return best

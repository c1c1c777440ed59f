"""Exact accounting for compositions of (unsampled) Gaussian mechanisms: GDP and zCDP.

A Gaussian mechanism whose noise std is ``z`` times its L2 sensitivity is exactly
``mu``-GDP with ``mu = 1/z``, and an adaptive composition of such mechanisms is exactly
``mu``-GDP with ``mu^2 = sum_i mu_i^2`` (Dong, Roth, Su 2022, Cor. 3.3). Its tight privacy profile
is (Balle & Wang 2018, Thm 8):

    delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) Phi(-eps/mu - mu/2).

This is tighter than going through zCDP (rho = mu^2 / 2) or RDP, so it is the right tool for
DP-LS / DP-Newton / DP-FC (:mod:`dpfy.features.accounting`) and for the no-amplification bound
of deterministic and shuffled batching (each example is in exactly one batch per epoch).

Adjacency: add_or_remove unless the event tree says otherwise; under replace_one a clipped
sum's sensitivity is twice the clip norm, so every ``mu`` doubles (``zero_out`` keeps it).

Example:
  >>> from dpfy.accounting.gaussian import gaussian_epsilon, gaussian_delta
  >>> eps = gaussian_epsilon(1.0, 1e-5)
  >>> bool(gaussian_delta(1.0, eps) <= 1e-5)
  True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy import special

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting import roots
from dpfy.accounting._api import (
    PrivacyResult,
    UnsupportedEventError,
    contains,
    register_accountant,
)

#: Note attached to every result that accounts a Shuffled event with this method.
SHUFFLE_NOTE = "no amplification by shuffling assumed; upper bound"

FloatArray = npt.NDArray[np.float64]

# Orders (a - 1 log-spaced) over which the zCDP -> (eps, delta) conversion is optimised.
_ZCDP_ORDERS = 1.0 + np.geomspace(1e-5, 1e9, 6000)


def _scalar_or_array(x: np.ndarray) -> Any:
    return float(x) if x.ndim == 0 else x


def _check(name: str, arr: np.ndarray, low: float, high: float | None, **kw: bool) -> None:
    bad = np.isnan(arr) | (arr < low) | ((arr == low) if kw.get("low_open") else False)
    if high is not None:
        bad |= (arr > high) | ((arr == high) if kw.get("high_open") else False)
    if np.any(bad):
        check_range(name, float(arr[bad].flat[0]), low, high, **kw)


def _log_delta(m: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Unchecked log delta(eps) of mu-GDP for broadcast arrays (inf/0 edge cases handled)."""
    safe_m = np.where((m > 0) & np.isfinite(m), m, 1.0)
    safe_e = np.where(np.isfinite(e), e, 0.0)
    la = special.log_ndtr(-safe_e / safe_m + safe_m / 2.0)
    lb = special.log_ndtr(-safe_e / safe_m - safe_m / 2.0)
    with np.errstate(divide="ignore"):
        out = la + np.log(-np.expm1(np.minimum(safe_e + lb - la, 0.0)))
    out = np.where(m == 0, -np.inf, out)
    out = np.where(np.isinf(m), 0.0, out)
    out = np.where(np.isinf(e), -np.inf, out)
    return np.minimum(out, 0.0)


def gaussian_log_delta(mu: Any, epsilon: Any) -> Any:
    """log of :func:`gaussian_delta`, finite even where delta underflows (huge epsilon / mu)."""
    m = np.asarray(mu, dtype=np.float64)
    e = np.asarray(epsilon, dtype=np.float64)
    _check("mu", m, 0.0, None)
    _check("epsilon", e, 0.0, None)
    return _scalar_or_array(_log_delta(*np.broadcast_arrays(m, e)))


def gaussian_delta(mu: Any, epsilon: Any) -> Any:
    """Tight delta(epsilon) of mu-GDP (Balle & Wang 2018, Thm 8), vectorised.

    Computed as Phi(a) (1 - exp(eps + log Phi(b) - log Phi(a))) with a = -eps/mu + mu/2,
    b = -eps/mu - mu/2, so it stays accurate (relative) for large epsilon; where delta itself
    underflows use :func:`gaussian_log_delta`.

    Args:
      mu: GDP parameter(s) >= 0 (inf allowed: delta = 1).
      epsilon: epsilon(s) >= 0 (inf allowed: delta = 0); broadcasts with ``mu``.

    Returns:
      delta in [0, 1]: a float for scalar input, else an array.
    """
    m = np.asarray(mu, dtype=np.float64)
    e = np.asarray(epsilon, dtype=np.float64)
    _check("mu", m, 0.0, None)
    _check("epsilon", e, 0.0, None)
    return _scalar_or_array(np.exp(_log_delta(*np.broadcast_arrays(m, e))))


def gaussian_epsilon(mu: Any, delta: Any) -> Any:
    """Smallest epsilon >= 0 with gaussian_delta(mu, epsilon) <= delta (safe side), vectorised.

    Root search (:func:`dpfy.accounting.roots.safe_root`) on [0, mu^2/2 + mu sqrt(2 log(1/delta))]
    (the zCDP bound is a valid upper end) down to floating-point resolution; the returned
    value always satisfies the target, so it errs on the side of a larger epsilon.

    Args:
      mu: GDP parameter(s) >= 0 (inf gives inf).
      delta: target delta(s) in (0, 1); broadcasts with ``mu``.

    Returns:
      epsilon in nats: a float for scalar input, else an array.
    """
    m = np.asarray(mu, dtype=np.float64)
    d = np.asarray(delta, dtype=np.float64)
    _check("mu", m, 0.0, None)
    _check("delta", d, 0.0, 1.0, low_open=True, high_open=True)
    m, d = np.broadcast_arrays(m, d)
    finite = np.isfinite(m)
    mf = np.where(finite, m, 1.0)
    hi = mf**2 / 2.0 + mf * np.sqrt(2.0 * np.log(1.0 / d))

    def excess(eps: FloatArray, mu_: FloatArray, d_: FloatArray) -> FloatArray:
        # <= 0 exactly when the test gaussian_delta(mu_, eps) <= d_ passes (non-increasing)
        out: FloatArray = np.exp(_log_delta(mu_, eps)) - d_
        return out

    # Make sure the upper end is feasible (it is in exact arithmetic); widen if rounding bites.
    for _ in range(60):
        bad = excess(hi, mf, d) > 0.0
        if not bad.any():
            break
        hi = np.where(bad, hi * 2.0 + 1e-12, hi)
    out = roots.safe_root(excess, np.zeros(m.shape), hi, side="high", args=(mf, d), vectorized=True)
    out = np.where(finite, out, np.inf)
    return _scalar_or_array(out)


def zcdp_rho(mu: Any) -> Any:
    """rho = mu^2 / 2: a mu-GDP Gaussian composition is rho-zCDP (Bun & Steinke 2016, Prop 1.6)."""
    m = np.asarray(mu, dtype=np.float64)
    _check("mu", m, 0.0, None)
    return _scalar_or_array(m**2 / 2.0)


def _zcdp_curves(rho: np.ndarray) -> np.ndarray:
    return rho[..., None] * _ZCDP_ORDERS


def zcdp_epsilon(rho: Any, delta: Any) -> Any:
    """Epsilon of a rho-zCDP mechanism at ``delta`` (RDP conversion of Balle et al. 2020).

    rho-zCDP is (a, rho a)-RDP for every a > 1; the conversion is minimised over a dense
    grid of orders (every order gives a valid bound, so the result is always safe).
    """
    from dpfy.accounting.rdp import epsilon_from_rdp

    r = np.asarray(rho, dtype=np.float64)
    _check("rho", r, 0.0, None)
    eps, _ = epsilon_from_rdp(_zcdp_curves(r), _ZCDP_ORDERS, delta)
    return _scalar_or_array(np.asarray(eps, dtype=np.float64))


def zcdp_delta(rho: Any, epsilon: Any) -> Any:
    """Delta of a rho-zCDP mechanism at ``epsilon`` (RDP conversion, minimised over orders)."""
    from dpfy.accounting.rdp import delta_from_rdp

    r = np.asarray(rho, dtype=np.float64)
    _check("rho", r, 0.0, None)
    d, _ = delta_from_rdp(_zcdp_curves(r), _ZCDP_ORDERS, epsilon)
    return _scalar_or_array(np.asarray(d, dtype=np.float64))


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


def _name(event: ev.Event) -> str:
    return type(event).__name__


def _reason(event: ev.Event, allow_zcdp: bool) -> str | None:
    if isinstance(event, ev.Deterministic | ev.Shuffled):
        return epoch_adjacency_reason(event)
    if isinstance(event, ev.Gaussian | ev.NonPrivate):
        return None
    if isinstance(event, ev.MatrixMechanism):
        if event.adjacency_relation is ev.Adjacency.ADD_OR_REMOVE:
            return (
                "MatrixMechanism with add_or_remove adjacency: the participation schema fixes "
                "each example's steps, which removing an example would shift (use zero_out)"
            )
        return None
    if isinstance(event, ev.ZCDP):
        return None if allow_zcdp else "ZCDP: a zCDP event is not a Gaussian mechanism"
    if isinstance(event, ev.SelfComposed):
        return _reason(event.event, allow_zcdp)
    if isinstance(event, ev.Composed):
        for e in event.events:
            r = _reason(e, allow_zcdp)
            if r is not None:
                return r
        return None
    if isinstance(event, ev.PoissonSampled | ev.FixedSizeSampled | ev.TruncatedPoisson):
        return (
            f"{_name(event)}: the exact Gaussian accountant does not model subsampling "
            "(use method 'rdp' or 'pld')"
        )
    if isinstance(event, ev.BallsAndBins):
        return "BallsAndBins: the exact Gaussian accountant does not model balls-and-bins sampling"
    return f"{_name(event)}: not a composition of Gaussian mechanisms"


def epoch_adjacency_reason(event: ev.Deterministic | ev.Shuffled) -> str | None:
    """Why a fixed-size epoch sampler's event has no no-amplification bound (None if it has).

    The bound "one Gaussian per example per epoch" needs the other examples' batches to stay
    put when the differing example changes: true under ``zero_out`` and ``replace_one``, not
    under ``add_or_remove``, where removing an example shifts later examples between batches.
    """
    if event.adjacency_relation is ev.Adjacency.ADD_OR_REMOVE:
        return (
            f"{type(event).__name__} with add_or_remove adjacency: removing an example shifts "
            "later examples between fixed-size batches, which the no-amplification bound does "
            "not cover (use zero_out adjacency)"
        )
    return None


def unsupported_reason(event: ev.Event) -> str | None:
    """None if the ``gaussian`` accountant can account ``event``, else why not (naming it)."""
    if not isinstance(event, ev.Event):
        raise ValueError(f"event must be a dpfy.events.Event, got event={event!r}")
    return _reason(event, allow_zcdp=True)


def _sum_sq(event: ev.Event) -> tuple[float, float]:
    """(sum of mu_i^2 over Gaussian parts, sum of rho over ZCDP parts), add_or_remove units."""
    if isinstance(event, ev.Gaussian):
        return 1.0 / event.noise_multiplier**2, 0.0
    if isinstance(event, ev.Deterministic | ev.Shuffled):
        return event.epochs / event.noise_multiplier**2, 0.0
    if isinstance(event, ev.MatrixMechanism):
        return (event.sensitivity / event.noise_multiplier) ** 2, 0.0
    if isinstance(event, ev.ZCDP):
        return 0.0, event.rho
    if isinstance(event, ev.NonPrivate):
        return math.inf, 0.0
    if isinstance(event, ev.SelfComposed):
        g, r = _sum_sq(event.event)
        return (event.count * g if event.count else 0.0), event.count * r
    if isinstance(event, ev.Composed):
        parts = [_sum_sq(e) for e in event.events]
        return float(sum(p[0] for p in parts)), float(sum(p[1] for p in parts))
    raise UnsupportedEventError(_reason(event, allow_zcdp=True) or _name(event))


def _scale(event: ev.Event) -> float:
    return 2.0 if event.adjacency_relation is ev.Adjacency.REPLACE_ONE else 1.0


def mu_of_event(event: ev.Event) -> float:
    """GDP parameter mu of a composition of unsampled Gaussian mechanisms.

    Gaussian(z): 1/z. Deterministic(z, steps_per_epoch, epochs): each example is in one batch
    per epoch, so sqrt(epochs)/z. Shuffled: the same no-amplification *upper bound* (no
    tight amplification bound for shuffling is known). SelfComposed/Composed: sqrt(sum mu_i^2).
    MatrixMechanism: sensitivity/z, the whole correlated-noise run as one Gaussian.
    Under replace_one adjacency the sensitivity doubles, so mu doubles. NonPrivate gives inf.

    Raises:
      UnsupportedEventError: a sub-event is not an unsampled Gaussian (the message names it).
    """
    reason = _reason(event, allow_zcdp=False) if isinstance(event, ev.Event) else "not an event"
    if reason is not None:
        raise UnsupportedEventError(f"mu_of_event cannot handle this event: {reason}")
    g, _ = _sum_sq(event)
    return _scale(event) * math.sqrt(g)


# ---------------------------------------------------------------------------------------------
# Accountant
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GaussianAccountant:
    """Exact GDP accounting of Gaussian compositions (zCDP conversion if ZCDP events occur)."""

    name: str = "gaussian"

    def unsupported(self, event: ev.Event) -> str | None:
        return unsupported_reason(event)

    def _parts(self, event: ev.Event) -> tuple[float, float, tuple[str, ...]]:
        reason = unsupported_reason(event)
        if reason is not None:
            raise UnsupportedEventError(f"method='gaussian' cannot account this event: {reason}")
        g, r = _sum_sq(event)
        s = _scale(event)
        mu, rho = s * math.sqrt(g), s**2 * r
        notes = []
        if rho > 0:
            notes.append(
                f"zCDP composition: rho = {rho + mu**2 / 2:.6g} (Gaussian parts mu^2/2 + ZCDP "
                "events), converted to (epsilon, delta) via RDP"
            )
        else:
            notes.append(f"exact Gaussian composition: mu-GDP with mu = {mu:.6g}")
        if s != 1.0:
            notes.append("replace_one adjacency: Gaussian sensitivity is 2 x clip norm")
        if contains(event, ev.Shuffled):
            notes.append(SHUFFLE_NOTE)
        return mu, rho, tuple(notes)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        mu, rho, notes = self._parts(event)
        if rho > 0:
            eps = zcdp_epsilon(rho + mu**2 / 2.0, delta)
        else:
            eps = gaussian_epsilon(mu, delta)
        return PrivacyResult(
            epsilon=float(eps),
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=notes,
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        check_range("epsilon", epsilon, 0.0, None)
        mu, rho, notes = self._parts(event)
        if rho > 0:
            d = zcdp_delta(rho + mu**2 / 2.0, epsilon)
        else:
            d = gaussian_delta(mu, epsilon)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=float(d),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=notes,
        )


register_accountant(GaussianAccountant())

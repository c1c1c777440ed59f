"""What a privacy guarantee means for a membership-inference attacker: the trade-off curve.

An attacker who sees the released output and must decide whether a target example was in the
training data (hypothesis test between neighbouring datasets) cannot beat the trade-off curve
of the mechanism's dominating pair: at false-positive rate (FPR) alpha, its true-positive rate
(TPR) is at most ``1 - f(alpha)`` (Dong, Roth, Su 2022, "Gaussian differential privacy";
Kulynych et al. 2024, "Attack-aware noise calibration for differential privacy"). This module
turns an event into those TPR bounds.

Two methods, the tightest available one is used:

* ``pld``: the Neyman-Pearson test on the pessimistic composed privacy loss distribution
  (:func:`dpfy.accounting.pld.composed_plds`). A discrete PLD with losses ``l_k`` and masses
  ``p_k`` under the first distribution P is a pair (P, Q) with ``Q(l_k) = p_k exp(-l_k)`` (the
  rest of Q where P is 0) and P's mass at +infinity; the most powerful test rejects the
  highest losses first (randomised at the boundary), which gives the exact trade-off curve of
  the discrete pair. The discrete pair dominates the exact one (its hockey-stick curve is
  above at every epsilon), so its TPR is an upper bound on every attacker's. The grid is
  halved until the TPRs change by at most ``tolerance`` (relative); the maximum over the
  add and remove directions is reported.
* ``epsilon-delta``: for events only other accountants handle (e.g. tuning, accounted in RDP),
  the bound of the (epsilon, delta) curve: for every (epsilon, delta) the event satisfies,
  ``TPR <= min(exp(eps) alpha + delta, 1 - exp(-eps) (1 - delta - alpha))``
  (Kairouz, Oh, Viswanath 2015), minimised over 24 deltas from 1e-12 to 0.5 (epsilon from the
  tightest accountant at each). Valid, usually looser.

Truncated samplers: with over-full-batch probability p (a coupling with the untruncated
mechanism), ``TPR(alpha) <= TPR_untruncated(alpha + p) + p``; truncated Poisson also through its
mixture PLD (docs/architecture.md, 5.2), keeping the smaller TPR at each FPR.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting import pld as _pld
from dpfy.accounting._api import (
    _CLAMP_NOTE,
    EventSource,
    UnsupportedEventError,
    _as_event,
    _tame,
)
from dpfy.accounting._api import epsilon as _epsilon

#: The false-positive rates a report shows (the low-FPR regime matters most, Carlini et al.
#: 2022, "Membership inference attacks from first principles").
FPRS = (1e-3, 1e-2, 0.1)

_CURVE = tuple(np.geomspace(1e-4, 1.0, 41))
_LABELS = {"pld": "Poisson-subsampled Gaussian", "random_allocation": "random-allocation"}


@dataclasses.dataclass(frozen=True)
class AttackRisk:
    """Upper bounds on a membership-inference attacker's TPR at given FPRs.

    Attributes:
      fpr: the false-positive rates, increasing, in (0, 1].
      tpr: the TPR bound at each; ``tpr[i] >= fpr[i]`` (random guessing reaches the diagonal).
      method: ``"pld"``, ``"epsilon-delta"`` (see the module docstring), ``"unavailable"`` (no
        provable accountant) or ``"none"`` (a non-private release).
      notes: how the numbers were made.
    """

    fpr: tuple[float, ...]
    tpr: tuple[float, ...]
    method: str
    notes: tuple[str, ...] = ()

    @classmethod
    def unavailable(cls, reason: str, fpr: Sequence[float] = FPRS) -> AttackRisk:
        """No bound better than TPR <= 1 (e.g. only a Monte Carlo estimate of epsilon)."""
        return cls(tuple(sorted(float(a) for a in fpr)), tuple(1.0 for _ in fpr),
                   "unavailable", (reason,))

    def at(self, fpr: float) -> float:
        """The TPR bound at one of :attr:`fpr`."""
        for a, t in zip(self.fpr, self.tpr, strict=True):
            if math.isclose(a, fpr, rel_tol=1e-9):
                return t
        raise KeyError(f"fpr={fpr!r} is not one of {self.fpr}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "tpr_at_fpr": {f"{a:g}": t for a, t in zip(self.fpr, self.tpr, strict=True)},
            "method": self.method,
            "notes": list(self.notes),
        }


def tpr_from_pld(pld: _pld.DiscretePLD, fpr: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Most powerful test's TPR at each ``fpr`` for the pair a discrete PLD describes.

    The pair: P has mass ``pmf[k]`` at loss ``(offset + k) * interval`` and
    ``infinity_mass`` at +infinity; Q has ``pmf[k] * exp(-loss_k)`` (and its remaining mass
    where P is 0). Rejecting the highest losses first, randomised at the boundary loss, is
    most powerful (Neyman-Pearson).
    """
    alpha = np.asarray(fpr, dtype=float)
    losses = (pld.offset + np.arange(pld.pmf.size)) * pld.interval
    p = pld.pmf[::-1]
    q = p * np.exp(-losses[::-1])
    # Cumulative (Q, P) after rejecting the k highest grid losses; +infinity comes first.
    cq = np.concatenate(([0.0], np.cumsum(q)))
    cp = np.concatenate(([0.0], np.cumsum(p))) + pld.infinity_mass
    i = np.searchsorted(cq, alpha, side="right")  # cq[i-1] <= alpha < cq[i]
    full = i >= cq.size  # alpha beyond all of Q's mass on the grid: reject everything
    j = np.minimum(i, cq.size - 1)
    lo_q, hi_q = cq[j - 1], cq[j]
    lo_p, hi_p = cp[j - 1], cp[j]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(hi_q > lo_q, (alpha - lo_q) / (hi_q - lo_q), 1.0)
    tpr = lo_p + np.clip(frac, 0.0, 1.0) * (hi_p - lo_p)
    tpr = np.where(full, cp[-1], tpr)
    out: npt.NDArray[np.float64] = np.clip(np.maximum(tpr, alpha), 0.0, 1.0)
    return out


def tpr_from_epsilon_delta(
    alpha: npt.ArrayLike, epsilons: Sequence[float], deltas: Sequence[float]
) -> npt.NDArray[np.float64]:
    """TPR bound at each ``alpha`` from (epsilon, delta) pairs that all hold (both orders)."""
    a = np.asarray(alpha, dtype=float)[:, None]
    e = np.asarray(epsilons, dtype=float)[None, :]
    d = np.asarray(deltas, dtype=float)[None, :]
    one = np.exp(e) * a + d
    two = 1.0 - np.exp(-e) * (1.0 - d - a)
    best = np.min(np.minimum(one, two), axis=1)
    out: npt.NDArray[np.float64] = np.clip(np.maximum(best, a[:, 0]), 0.0, 1.0)
    return out


def attack_risk(
    event: ev.Event | EventSource,
    fpr: Sequence[float] = FPRS,
    *,
    tolerance: float = 1e-3,
    method: str = "auto",
) -> AttackRisk:
    """Upper bounds on a membership-inference attacker's TPR at each ``fpr``.

    Args:
      event: an event or anything with ``to_event()`` (a ledger).
      fpr: false-positive rates in (0, 1].
      tolerance: relative change of the PLD-based TPRs between grid halvings at which to stop
        (every grid gives a valid bound; this controls tightness only).
      method: the accountant for the (epsilon, delta) curve when the PLD cannot account the
        event. A method that is not provable (a Monte Carlo estimate) gives no bound: TPR 1.

    Returns:
      An :class:`AttackRisk`. A non-private release gives TPR 1 at every FPR.
    """
    from dpfy.accounting.truncation import event_truncation_probability

    alphas = tuple(float(a) for a in fpr)
    if not alphas:
        raise ValueError("fpr must hold at least one false-positive rate in (0, 1]")
    for a in alphas:
        check_range("fpr", a, 0.0, 1.0, low_open=True)
    check_range("tolerance", tolerance, 0.0, 1.0, low_open=True, high_open=True)
    order = np.argsort(alphas)
    alphas = tuple(alphas[i] for i in order)
    event = _as_event(event)
    from dpfy.accounting._api import contains_non_private

    if contains_non_private(event):
        note = "the event contains a non-private release: an attacker can be certain"
        return AttackRisk(alphas, tuple(1.0 for _ in alphas), "none", (note,))
    p = event_truncation_probability(event)
    tamed, clamped, tiny = _tame(ev.untruncated(event))
    if tiny:
        note = "a noise multiplier too small to represent: no bound on the attacker"
        return AttackRisk(alphas, tuple(1.0 for _ in alphas), "unavailable", (note,))
    shifted = np.minimum(np.asarray(alphas) + p, 1.0)
    notes: list[str] = []
    exact = _gdp_tpr(tamed, np.asarray(alphas)) if p == 0.0 and not clamped else None
    if exact is not None:  # unsampled Gaussians: the exact trade-off curve, no grid
        tpr, gdp_note = exact
        return AttackRisk(alphas, tuple(float(t) for t in np.maximum(tpr, alphas)),
                          "gaussian", (gdp_note,))
    try:
        tpr, pld_notes, method_used = _pld_tpr(tamed, shifted, tolerance)
        notes.extend(pld_notes)
        if clamped:
            notes.append(_CLAMP_NOTE)
        if p > 0.0:
            tpr = np.minimum(tpr + p, 1.0)
            notes.append(
                f"batches truncated: P(some batch over-full) <= {p:.3g}; TPR(a) <= "
                "TPR_untruncated(a + p) + p (coupling)"
            )
            native = _native_truncated_tpr(event, np.asarray(alphas), tolerance)
            if native is not None and np.any(native < tpr):
                tpr = np.minimum(tpr, native)
                notes.append(
                    "truncated Poisson also through its mixture PLD (docs/architecture.md, 5.2); "
                    "the smaller TPR of the two bounds at each FPR"
                )
    except UnsupportedEventError:
        tpr, ed_notes = _epsilon_delta_tpr(event, np.asarray(alphas), method)
        method_used = "epsilon-delta" if np.any(tpr < 1.0) else "unavailable"
        notes.extend(ed_notes)
    tpr = np.maximum(tpr, np.asarray(alphas))
    return AttackRisk(alphas, tuple(float(t) for t in tpr), method_used, tuple(notes))


def _gdp_tpr(
    event: ev.Event, alphas: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], str] | None:
    """The exact TPR bound of a composition of unsampled Gaussians, or None for another event.

    Such a composition is mu-GDP (Dong, Roth, Su 2022, Corollary 3.3), whose trade-off curve
    is f(a) = Phi(Phi^-1(1 - a) - mu): TPR(a) = 1 - f(a) = Phi(Phi^-1(a) + mu).
    """
    from scipy.stats import norm

    from dpfy.accounting.gaussian import mu_of_event

    try:
        mu = mu_of_event(event)
    except UnsupportedEventError:
        return None
    if not math.isfinite(mu):
        return None
    note = (f"the event is mu-GDP with mu = {mu:.6g} (unsampled Gaussians; a shuffled epoch "
            "without amplification), so TPR(a) <= Phi(Phi^-1(a) + mu), the exact trade-off "
            "curve of mu-GDP (Dong, Roth, Su 2022)")
    return np.asarray(norm.cdf(norm.ppf(alphas) + mu), dtype=float), note


def _native_truncated_tpr(
    event: ev.Event, alphas: npt.NDArray[np.float64], tolerance: float
) -> npt.NDArray[np.float64] | None:
    """TPR bound of a truncated-Poisson event from the PLD's own mixture step, or None."""
    tamed, _, tiny = _tame(event)
    if tiny or _pld.PLDAccountant().unsupported(tamed) is not None:
        return None
    return _pld_tpr(tamed, alphas, tolerance)[0]


def attack_curve(event: ev.Event | EventSource, method: str = "auto") -> AttackRisk:
    """:func:`attack_risk` on 41 log-spaced FPRs from 1e-4 to 1 (for figures)."""
    return attack_risk(event, _CURVE, method=method)


def _pld_tpr(
    event: ev.Event, alphas: npt.NDArray[np.float64], tolerance: float
) -> tuple[npt.NDArray[np.float64], list[str], str]:
    """Max over directions of the discrete pair's TPR, on finer grids until converged.

    The Poisson/Gaussian PLD engine first; Balls-and-Bins events through the random-allocation
    PLD (Feldman & Shenfeld), whose upper PLDs dominate the exact pair in the same way.
    """
    from dpfy.accounting import random_allocation

    try:
        h0 = _pld.first_interval(event)  # raises UnsupportedEventError first

        def plds(level: int) -> tuple[_pld.DiscretePLD, ...]:
            return _pld.composed_plds(event, h0 / 2.0**level)

        name, levels = "pld", 14
    except UnsupportedEventError:

        def plds(level: int) -> tuple[_pld.DiscretePLD, ...]:
            return random_allocation.upper_plds(event, level)

        plds(0)  # raises UnsupportedEventError when neither engine applies
        name, levels = "random_allocation", 3
    best = np.ones_like(alphas)
    prev: npt.NDArray[np.float64] | None = None
    used = 0
    for level in range(levels):
        try:
            pair = plds(level)
        except ValueError:  # the grid outgrew its limit: keep the finest finished level
            break
        if not pair:
            return np.asarray(alphas, dtype=float), ["no release"], name
        tpr = np.max([tpr_from_pld(d, alphas) for d in pair], axis=0)
        best = np.minimum(best, tpr)
        used = level
        if prev is not None and np.all(np.abs(prev - tpr) <= 3.0 * tolerance * tpr):
            break
        prev = tpr
    note = (
        f"Neyman-Pearson test on the pessimistic composed {_LABELS[name]} PLD (maximum over "
        f"the add and remove directions), grid level {used}"
    )
    return best, [note], name


def _epsilon_delta_tpr(
    event: ev.Event, alphas: npt.NDArray[np.float64], method: str
) -> tuple[npt.NDArray[np.float64], list[str]]:
    deltas = np.geomspace(1e-12, 0.5, 24)
    first = _epsilon(event, float(deltas[-1]), method)
    if not first.provable:
        note = (
            f"the {first.method!r} accountant is an estimate, not a proof: no provable bound "
            "on the attacker (TPR <= 1 only)"
        )
        return np.ones_like(alphas), [note]
    results = [_epsilon(event, float(d), method) for d in deltas]
    eps = [r.epsilon for r in results]
    finite = [i for i, e in enumerate(eps) if math.isfinite(e)]
    if not finite:
        return np.ones_like(alphas), ["no finite epsilon: no bound on the attacker"]
    method = results[finite[0]].method
    note = (
        f"from the (epsilon, delta) curve of the {method!r} accountant at {len(finite)} deltas "
        "(the PLD cannot account this event): a valid, usually looser bound"
    )
    pairs_e = [eps[i] for i in finite]
    pairs_d = [float(deltas[i]) for i in finite]
    return tpr_from_epsilon_delta(alphas, pairs_e, pairs_d), [note]

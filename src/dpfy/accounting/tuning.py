"""Accounting for hyperparameter tuning on private data.

Ponomareva et al. 2023, Sec. 5.4.2 and Table 4.

A report can cover the *final run only* or the *final run plus tuning*. The options of the
guide's Table 4 map onto events and functions here:

============================================  ===============================================
Table 4 option                                dpfy
============================================  ===============================================
simple (sequential) composition               :func:`sequential_composition` (sum of epsilons
                                              and deltas of separately accounted runs)
RDP / PLD composition of all runs             :func:`all_runs` -> ``Composed`` event, accounted
                                              by ``rdp`` or ``pld`` like any other event
random number of trials, best run released    :func:`random_trials` -> ``RepeatAndSelect``
(Papernot & Steinke 2022, Poisson and         accounted in RDP by :func:`rdp_repeat_and_select`
truncated negative binomial)                  (the ``rdp_tuning`` accountant)
============================================  ===============================================

Assumptions of Papernot & Steinke (must hold for ``RepeatAndSelect`` to be valid):
  * the number of trials ``K`` is really drawn from the stated distribution (Poisson(mean), or
    truncated negative binomial with the stated mean and shape) — use
    :func:`draw_number_of_trials`;
  * trials are independent (hyperparameters drawn i.i.d., not chosen adaptively from earlier
    results — adaptive search is covered only by composition);
  * the inner event covers *everything* a trial releases to the selector, including its score if
    the score uses private validation data;
  * only the selected trial's output is released.

References: N. Papernot, T. Steinke, "Hyperparameter Tuning with Renyi Differential Privacy",
ICLR 2022 (arXiv 2110.03620): Theorem 2 (truncated negative binomial, including logarithmic
``shape=0`` and geometric ``shape=1``) and Theorem 6 (Poisson, ``shape=inf``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting import rdp as _rdp
from dpfy.accounting import roots
from dpfy.accounting._api import (
    PrivacyResult,
    UnsupportedEventError,
    contains,
    contains_non_private,
    register_accountant,
)
from dpfy.accounting._api import (
    epsilon as _epsilon,
)

# --------------------------------------------------------------------------------------------
# The distribution of the number of trials
# --------------------------------------------------------------------------------------------


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """Mean of the truncated negative binomial ``D_{shape,gamma}`` (Papernot & Steinke, Def. 1).

    ``P(K = k) ∝ binom(k + shape - 1, k) (1 - gamma)^k`` for ``k >= 1``; ``shape = 0`` is the
    logarithmic distribution (mean ``(1-gamma) / (gamma log(1/gamma))``), ``shape = 1`` the
    geometric (mean ``1/gamma``), otherwise the mean is
    ``shape (1 - gamma) / (gamma (1 - gamma^shape))``.
    """
    check_range("gamma", gamma, 0.0, 1.0, low_open=True)
    check_range("shape", shape, 0.0, None, high_open=True)
    if gamma == 1.0:
        return 1.0
    log_g = math.log(gamma)
    one_minus_g = -math.expm1(log_g)
    if shape == 0.0:
        return one_minus_g / (gamma * -log_g)
    return shape * one_minus_g / (gamma * -math.expm1(shape * log_g))


@functools.lru_cache(maxsize=256)
def truncated_negative_binomial_gamma(shape: float, mean: float) -> float:
    """The ``gamma`` whose truncated negative binomial has the given ``mean`` (>= 1).

    Solved on ``log(gamma)`` by :func:`dpfy.accounting.roots.safe_log_root` to float
    resolution; the result errs on the side of a *smaller* gamma (mean at least the target),
    which can only increase the privacy bound.
    """
    check_range("shape", shape, 0.0, None, high_open=True)
    check_range("mean", mean, 1.0, None, high_open=True)
    if shape == 1.0:
        return 1.0 / mean
    if mean == 1.0:
        return 1.0
    lo = 0.5  # gamma = 1: mean 1 < target; halve gamma until the mean reaches the target
    while truncated_negative_binomial_mean(lo, shape) < mean:
        lo *= lo

    def shortfall(gamma: float) -> float:  # <= 0 iff the mean reaches the target (increasing)
        return mean - truncated_negative_binomial_mean(gamma, shape)

    return float(roots.safe_log_root(shortfall, lo, 1.0, side="low"))


# --------------------------------------------------------------------------------------------
# RDP of repeat-and-select (Papernot & Steinke 2022)
# --------------------------------------------------------------------------------------------


def rdp_repeat_and_select(
    orders: ArrayLike,
    rdp: ArrayLike,
    mean: float,
    shape: float = math.inf,
    delta_hat: ArrayLike | None = None,
) -> np.ndarray:
    """RDP of running a mechanism a random number of times and releasing only the best run.

    Args:
      orders: Renyi orders (> 1) of the single-run RDP curve.
      rdp: the single-run RDP at each order (same length).
      mean: expected number of runs, >= 1.
      shape: ``inf`` for Poisson(mean) (Theorem 6); ``>= 0`` for the truncated negative
        binomial with this shape (Theorem 2; 0 logarithmic, 1 geometric).
      delta_hat: Poisson only: for each order ``a``, a delta the single run is known to meet at
        ``eps_hat = log(1 + 1/(a-1))`` by another valid bound (e.g. :func:`pld_delta_hat`);
        the smaller of it and the delta the RDP curve implies is used. None: the RDP curve's.

    Returns:
      The RDP of the whole tuning procedure at each order.

    Notes:
      Theorem 6 (Poisson) at order ``a``: ``r_a + mean * delta_hat + log(mean) / (a - 1)`` with
      ``delta_hat`` the single run's delta at ``eps_hat = log(1 + 1/(a-1))``. Theorem 2 at order
      ``a``: ``r_a + (1 + shape) * min_b [(1 - 1/b) r_b + log(1/gamma)/b] + log(mean)/(a - 1)``,
      then RDP's monotonicity in the order is applied (a bound at a higher order holds at a lower
      one). These are the same formulas dp_accounting 0.6.0 uses, so with ``delta_hat`` None
      the results agree with its ``RepeatAndSelectDpEvent`` for the same curve and orders.
      Theorem 6 holds for any ``(eps_hat, delta_hat)`` guarantee of the single run, so a
      tighter valid ``delta_hat`` gives a smaller, equally valid bound.
    """
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if a.shape != r.shape or a.ndim != 1:
        raise ValueError(f"orders and rdp must be 1-d of equal length, got {a.shape}, {r.shape}")
    if np.any(~(a > 1)):
        check_range("orders", float(a[~(a > 1)][0]), 1.0, None, low_open=True)
    check_range("mean", mean, 1.0, None, high_open=True)
    check_range("shape", shape, 0.0, None)
    above_one = a > 1.0
    out = np.full(a.shape, np.inf)
    log_mean_term = np.full(a.shape, np.inf)
    log_mean_term[above_one] = math.log(mean) / (a[above_one] - 1.0)
    if math.isinf(shape):
        eps_hat = np.full(a.shape, np.inf)
        eps_hat[above_one] = np.log1p(1.0 / (a[above_one] - 1.0))
        d_hat = np.ones(a.shape)
        d_hat[above_one] = _rdp.delta_from_rdp(r, a, eps_hat[above_one])[0]
        if delta_hat is not None:
            given = np.asarray(delta_hat, dtype=np.float64)
            if given.shape != a.shape or np.any(~(given >= 0.0)):
                raise ValueError(f"delta_hat must be {a.size} values >= 0 (one per order), got "
                                 f"shape {given.shape}")
            d_hat = np.minimum(d_hat, given)
        out[above_one] = r[above_one] + mean * d_hat[above_one] + log_mean_term[above_one]
        return out
    gamma = truncated_negative_binomial_gamma(shape, mean)
    const = (1.0 + shape) * float(np.min((1.0 - 1.0 / a) * r - math.log(gamma) / a))
    out[above_one] = r[above_one] + log_mean_term[above_one] + const
    # Monotonicity of RDP in the order: the bound at order a is the minimum over orders >= a.
    sorted_a = np.sort(a)
    suffix_min = np.minimum.accumulate(out[np.argsort(a, kind="stable")][::-1])[::-1]
    return suffix_min[np.searchsorted(sorted_a, a, side="left")]


def pld_delta_hat(event: ev.Event, orders: ArrayLike) -> np.ndarray | None:
    """Theorem 6's ``delta_hat`` of a single run from its pessimistic PLD, one per order.

    For each order ``a > 1``, the delta ``event`` meets at ``eps_hat = log(1 + 1/(a-1))`` under
    its own adjacency: the larger over the directions :func:`dpfy.accounting.pld.composed_plds`
    composes (remove and add when a step is subsampled) of their hockey-stick divergences. Each
    of those PLDs dominates the exact pair of its direction (the pessimistic discretisation of
    docs/architecture.md 5.2), so every value is a valid upper bound. The grid is an eighth of
    the PLD engine's first interval (coarser if that grid is too large); only tightness depends
    on it. Orders <= 1 get 1.

    Returns:
      The deltas, or None when the PLD engine cannot account ``event`` (the caller keeps the
      delta the RDP curve implies).
    """
    from dpfy.accounting import pld
    from dpfy.accounting.pld_events import unsupported

    a = np.asarray(orders, dtype=np.float64)
    if unsupported(event) is not None or contains_non_private(event):
        return None
    out = np.ones(a.shape)
    above_one = a > 1.0
    start = pld.first_interval(event)
    for factor in (8.0, 4.0, 2.0, 1.0):
        try:
            plds = pld.composed_plds(event, start / factor)
        except pld.GridTooLarge:
            continue
        if not plds:  # no release: the run meets (0, 0)
            return np.where(above_one, 0.0, 1.0)
        for i in np.flatnonzero(above_one):
            eps_hat = math.log1p(1.0 / (a[i] - 1.0))
            out[i] = min(1.0, max(p.delta(eps_hat) for p in plds))
        return out
    return None


# --------------------------------------------------------------------------------------------
# The accountant for trees containing RepeatAndSelect
# --------------------------------------------------------------------------------------------


class RdpTuningAccountant:
    """RDP accounting of event trees that contain :class:`dpfy.events.RepeatAndSelect`.

    Composition nodes (``Composed``, ``SelfComposed``) add RDP; a ``RepeatAndSelect`` node maps
    its inner event's RDP curve through :func:`rdp_repeat_and_select`; every other sub-event is
    handed to the ``rdp`` accountant (:func:`dpfy.accounting.rdp.rdp_of_event`). Trees without a
    ``RepeatAndSelect`` are left to the ``rdp`` accountant itself. Results name the method
    ``"rdp_tuning"``, so that ``method=result.method`` accounts the same tree again.

    With a Poisson number of trials, Theorem 6's ``delta_hat`` of the single run is taken from
    its pessimistic PLD where the PLD engine accounts the run (:func:`pld_delta_hat`; the
    smaller of that and the RDP curve's), which tightens the bound by several percent;
    ``pld_delta_hat=False`` keeps the RDP curve's alone (dp_accounting's formula).
    """

    name = "rdp_tuning"

    def __init__(
        self, orders: Sequence[float] | None = None, *, pld_delta_hat: bool = True
    ) -> None:
        self._orders = None if orders is None else np.asarray(orders, dtype=np.float64)
        self._pld_delta_hat = pld_delta_hat

    @property
    def orders(self) -> np.ndarray:
        return np.asarray(_rdp.DEFAULT_ORDERS if self._orders is None else self._orders)

    def unsupported(self, event: ev.Event) -> str | None:
        if not contains(event, ev.RepeatAndSelect):
            return "the event has no RepeatAndSelect node (use the 'rdp' accountant)"
        return self._unsupported_node(event, event.adjacency_relation)

    def _unsupported_node(self, event: ev.Event, adjacency: ev.Adjacency) -> str | None:
        if isinstance(event, ev.Composed):
            for child in event.events:
                reason = self._unsupported_node(child, adjacency)
                if reason is not None:
                    return reason
            return None
        if isinstance(event, ev.SelfComposed):
            return self._unsupported_node(event.event, adjacency)
        if isinstance(event, ev.RepeatAndSelect):
            if event.mean < 1.0:
                return f"RepeatAndSelect needs mean >= 1, got mean={event.mean!r}"
            return self._unsupported_node(event.event, adjacency)
        if event.adjacency_relation is not adjacency:
            # The rdp accountant rescales sensitivities by the adjacency of the whole tree; a
            # sub-tree accounted on its own would lose that, so mixed trees are refused.
            return (
                f"{type(event).__name__}: its adjacency {event.adjacency_relation.value} differs "
                f"from the tree's {adjacency.value}"
            )
        return _rdp.unsupported_reason(event)

    def rdp(self, event: ev.Event) -> np.ndarray:
        """The RDP curve of ``event`` at :attr:`orders`."""
        reason = self._unsupported_node(event, event.adjacency_relation)
        if reason is not None:
            raise UnsupportedEventError(f"method='rdp_tuning' cannot account this event: {reason}")
        return self._rdp(event)

    def _rdp(self, event: ev.Event) -> np.ndarray:
        if isinstance(event, ev.Composed):
            total = np.zeros_like(self.orders)
            for child in event.events:
                total = total + self._rdp(child)
            return total
        if isinstance(event, ev.SelfComposed):
            if event.count == 0:
                return np.zeros_like(self.orders)
            return event.count * self._rdp(event.event)
        if isinstance(event, ev.RepeatAndSelect):
            inner = self._rdp(event.event)
            d_hat = (pld_delta_hat(event.event, self.orders)
                     if self._pld_delta_hat and math.isinf(event.shape) else None)
            return rdp_repeat_and_select(self.orders, inner, event.mean, event.shape, d_hat)
        return np.asarray(_rdp.rdp_of_event(event, self.orders), dtype=np.float64)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        curve = self.rdp(event)
        eps, order = _rdp.epsilon_from_rdp(curve, self.orders, delta)
        return PrivacyResult(
            epsilon=float(eps),
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=self._notes(event) + (f"best RDP order {float(order):g}",),
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        check_range("epsilon", epsilon, 0.0, None)
        curve = self.rdp(event)
        d, _ = _rdp.delta_from_rdp(curve, self.orders, epsilon)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=float(d),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            notes=self._notes(event),
        )

    def _notes(self, event: ev.Event) -> tuple[str, ...]:
        if not (self._pld_delta_hat and _has_poisson_trials(event)):
            return _NOTES
        return _NOTES + ("Poisson number of trials (Thm. 6): the single run's delta_hat from "
                         "its pessimistic PLD where the PLD engine accounts it",)


def _has_poisson_trials(event: ev.Event) -> bool:
    if isinstance(event, ev.RepeatAndSelect) and math.isinf(event.shape):
        return True
    return any(_has_poisson_trials(c) for c in ev._children(event))


_NOTES = (
    "hyperparameter tuning accounted with Papernot & Steinke 2022 (random number of trials, "
    "only the best trial released, trials independent)",
)


register_accountant(RdpTuningAccountant())


# --------------------------------------------------------------------------------------------
# A search calibrated to a total budget
# --------------------------------------------------------------------------------------------


def search_event(
    trial: ev.Event, final: ev.Event | None, mean: float, shape: float | None
) -> tuple[ev.Event, str]:
    """The event of a whole search and the accountant that states it: ``(event, method)``.

    ``shape`` None: a fixed number ``K = mean`` of trials, every trial and the final release
    composed (Ponomareva et al. 2023, Table 4, "RDP/PLD composition": valid for any search),
    accounted by ``auto``. Otherwise K random (Papernot & Steinke 2022, Thm. 2 and 6): the
    trials as ``RepeatAndSelect(trial, mean, shape)``, then the final release, by
    ``rdp_tuning``. ``trial`` covers everything a trial releases (its training and its score);
    ``final`` None: no release after the trials.
    """
    last = () if final is None else (final,)
    if shape is None:
        check_int("mean", mean, 1, 1000)
        return ev.Composed((*(trial,) * int(mean), *last)), "auto"
    return ev.Composed((ev.RepeatAndSelect(trial, float(mean), float(shape)), *last)), (
        "rdp_tuning")


@dataclasses.dataclass(frozen=True, slots=True)
class SearchBudget:
    """What :func:`calibrate_search` found.

    Attributes:
      per_run_epsilon: the target each run (every trial's training, the final release) is
        calibrated to alone.
      epsilon: the whole search's epsilon at that per-run target (<= ``total_epsilon``).
      total_epsilon, delta: the budget of the whole search.
      method: the accountant of ``epsilon`` (:func:`search_event`).
    """

    per_run_epsilon: float
    epsilon: float
    total_epsilon: float
    delta: float
    method: str


def calibrate_search(
    events: Callable[[float], tuple[ev.Event, ev.Event]],
    total_epsilon: float,
    delta: float,
    *,
    mean: float,
    shape: float | None,
    floor: ev.Event | None = None,
    rtol: float = 1e-4,
    margin: float = 0.0,
) -> SearchBudget:
    """The largest per-run target whose whole search meets ``(total_epsilon, delta)``.

    Args:
      events: ``per_run_epsilon -> (trial, final)``: a trial's event (its training calibrated
        to the per-run target, and its noisy score) and the final release's; a ``ValueError``
        from it (a target no noise can meet) counts as an unmet budget.
      total_epsilon, delta: the budget of the whole search (trials, scores, choice, release).
      mean, shape: the number of trials (:func:`search_event`).
      floor: what a trial releases whatever its per-run target (its score): a search of this
        alone that spends ``total_epsilon`` already is refused at once.
      rtol: relative tolerance of the per-run target.
      margin: calibrate to ``total_epsilon * (1 - margin)``, in [0, 1): room for an accounting
        of the same events that differs in the last digits.

    Returns:
      The per-run target found by Brent's method (:func:`dpfy.accounting.roots.safe_root`) on
      ``epsilon(search_event(*events(r))) - total_epsilon``, which is non-decreasing in ``r``
      (a larger per-run target means less noise in every run), taken on the certified side:
      the search's epsilon at it, evaluated exactly there, is at most ``total_epsilon``.

    Raises:
      ValueError: a bad budget, or one that no per-run target meets (the scores' noise or the
        number of trials alone spend more), naming ``total_epsilon``.
    """
    check_range("total_epsilon", total_epsilon, 0.0, None, low_open=True, high_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    check_range("margin", margin, 0.0, 1.0, high_open=True)
    aim = total_epsilon * (1.0 - margin)
    spent: dict[float, float] = {}
    why: list[str] = []

    def epsilon_at(per_run: float) -> float:
        if per_run not in spent:
            try:
                trial, final = events(per_run)
            except ValueError as err:  # the per-run target itself is out of reach
                why[:] = [str(err)]
                spent[per_run] = math.inf
            else:
                event, method = search_event(trial, final, mean, shape)
                spent[per_run] = _epsilon(event, delta, method=method).epsilon
        return spent[per_run]

    method = "auto" if shape is None else "rdp_tuning"
    if floor is not None:
        least = _epsilon(search_event(floor, None, mean, shape)[0], delta, method=method).epsilon
        if least >= aim:
            raise ValueError(
                f"total_epsilon={total_epsilon!r} cannot be met at delta={delta!r}: the trials' "
                f"scores alone spend {least:.4g} whatever the runs' noise; raise total_epsilon "
                "or the score noise, or plan fewer trials")
    hi = float(total_epsilon)
    trial, final = events(hi)  # a configuration error surfaces as itself, not as a budget
    spent[hi] = _epsilon(search_event(trial, final, mean, shape)[0], delta, method=method).epsilon
    if epsilon_at(hi) <= aim:
        return SearchBudget(hi, epsilon_at(hi), float(total_epsilon), float(delta), method)
    # every run at most total / (runs + 1) is a first guess of the certified end (then halved)
    lo = hi / (1.0 + (mean if shape is None else 2.0 * mean))
    while epsilon_at(lo) > aim:
        if lo < total_epsilon * 2.0**-20:
            reason = f" ({why[0]})" if why else ""
            raise ValueError(
                f"total_epsilon={total_epsilon!r} cannot be met at delta={delta!r}: even a "
                f"per-run target of {lo:.3g} spends {epsilon_at(lo):.4g} in all (the scores' "
                f"noise or the number of trials alone cost more); raise total_epsilon or the "
                f"score noise, or plan fewer trials{reason}")
        hi, lo = lo, lo / 2.0
    per_run = float(roots.safe_root(lambda r: epsilon_at(r) - aim, lo, hi,
                                    side="low", xtol=1e-12, rtol=rtol))
    return SearchBudget(per_run, epsilon_at(per_run), float(total_epsilon), float(delta),
                        method)


# --------------------------------------------------------------------------------------------
# Table 4 as events and functions
# --------------------------------------------------------------------------------------------


def all_runs(runs: Sequence[ev.Event]) -> ev.Composed:
    """RDP/PLD composition of every tuning run (Table 4: "RDP or PLD composition")."""
    runs = tuple(runs)
    if not runs:
        raise ValueError("runs must contain at least one event")
    return ev.Composed(runs)


def random_trials(run: ev.Event, mean: float, shape: float = math.inf) -> ev.RepeatAndSelect:
    """Papernot & Steinke tuning: a random number of i.i.d. trials of ``run``, best released.

    ``shape=inf`` (default) draws the number of trials from Poisson(mean); ``shape=0``
    logarithmic, ``shape=1`` geometric, other ``shape >= 0`` truncated negative binomial.
    """
    check_range("mean", mean, 1.0, None, high_open=True)
    return ev.RepeatAndSelect(run, mean, shape)


def with_tuning(final: ev.Event, tuning: ev.Event) -> ev.Composed:
    """The event for "final run plus tuning": the tuning procedure, then the final training.

    If the released model *is* the selected trial of a ``RepeatAndSelect`` (no retraining),
    account ``tuning`` alone instead.
    """
    return ev.Composed((tuning, final))


def coverage(
    final: ev.Event,
    tuning: ev.Event,
    delta: float,
    *,
    final_is_selected: bool = False,
    method: str = "auto",
) -> dict[str, PrivacyResult]:
    """The two statements a report can make: "final run only" and "final run plus tuning".

    Args:
      final: the released training run (e.g. ``ledger.to_event()``).
      tuning: the tuning procedure's event (:func:`all_runs`, :func:`random_trials`, ...).
      delta: target delta.
      final_is_selected: True when the released model *is* the selected trial of ``tuning``
        (no retraining): then "plus tuning" is ``tuning`` alone; else tuning then ``final``.
      method: accountant for both statements.
    """
    total = tuning if final_is_selected else with_tuning(final, tuning)
    return {
        "final run only": _epsilon(final, delta, method=method),
        "final run plus tuning": _epsilon(total, delta, method=method),
    }


def sequential_composition(
    runs: Sequence[ev.Event], delta: float, method: str = "auto"
) -> PrivacyResult:
    """Simple composition (Table 4): each run accounted alone at ``delta / n``, epsilons summed.

    Always valid (also for adaptively chosen runs) and always looser than :func:`all_runs`.
    """
    runs = tuple(runs)
    if not runs:
        raise ValueError("runs must contain at least one event")
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    per_run = delta / len(runs)
    results = [_epsilon(r, per_run, method=method) for r in runs]
    methods = sorted({r.method for r in results})
    return PrivacyResult(
        epsilon=float(sum(r.epsilon for r in results)),
        delta=float(delta),
        method="sequential+" + "/".join(methods),
        adjacency=runs[0].adjacency_relation.value,
        notes=(f"simple composition of {len(runs)} runs, each at delta={per_run:.3g}",),
    )


def draw_number_of_trials(mean: float, shape: float, randomness: Any) -> int:
    """Draw the number of tuning trials ``K`` for :func:`random_trials`.

    Args:
      mean: expected number of trials (>= 1).
      shape: ``inf`` for Poisson(mean), else truncated negative binomial shape (>= 0).
      randomness: a :class:`dpfy.randomness.Randomness` (its ``uniform`` drives an inverse-CDF
        draw, so secure mode carries over).

    Returns:
      ``K >= 0`` for Poisson (``K = 0`` means: release nothing), ``K >= 1`` otherwise.
    """
    check_range("mean", mean, 1.0, None, high_open=True)
    check_range("shape", shape, 0.0, None)
    u = float(np.asarray(randomness.uniform(1)).reshape(-1)[0])
    if math.isinf(shape):
        log_p = -mean  # P(K=0)
        k = 0
        cdf = math.exp(log_p)
        while cdf < u and k < 100_000_000:
            k += 1
            log_p += math.log(mean) - math.log(k)
            cdf += math.exp(log_p)
        return k
    gamma = truncated_negative_binomial_gamma(shape, mean)
    if gamma == 1.0:
        return 1
    log_1mg = math.log1p(-gamma)
    # Unnormalised log-weights w_k = log binom(k+shape-1, k) + k log(1-gamma), k >= 1.
    if shape == 0.0:
        log_norm = math.log(-math.log(gamma))  # sum_k (1-g)^k / k = log(1/g)
    else:
        log_norm = math.log(-math.expm1(shape * math.log(gamma))) - shape * math.log(gamma)
    k, cdf = 0, 0.0
    while cdf < u and k < 100_000_000:
        k += 1
        if shape == 0.0:
            log_w = k * log_1mg - math.log(k)
        else:
            log_w = (
                math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1) + k * log_1mg
            )
        cdf += math.exp(log_w - log_norm)
    return k


@dataclasses.dataclass(frozen=True, slots=True)
class TuningOption:
    """One row of the tuning comparison: how a guarantee covering tuning would read."""

    name: str
    epsilon: float
    delta: float
    method: str
    covers: str  # "final run only" | "final run plus tuning"
    note: str = ""
    event: ev.Event | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "epsilon": "inf" if math.isinf(self.epsilon) else self.epsilon,
            "delta": self.delta,
            "method": self.method,
            "covers": self.covers,
            "note": self.note,
            "event": None if self.event is None else self.event.to_dict(),
        }


def compare_tuning(
    run: ev.Event,
    trials: int,
    delta: float,
    *,
    final: ev.Event | None = None,
    methods: Sequence[str] = ("rdp", "pld"),
) -> list[TuningOption]:
    """The guide's Table 4 / Appendix C comparison for ``trials`` runs of ``run``.

    Rows: the final run alone; simple composition; RDP and PLD composition of all trials (each
    method only if registered); Papernot & Steinke with Poisson, geometric and logarithmic
    numbers of trials of mean ``trials``. If ``final`` is given (a retraining after tuning), the
    tuning rows also include it; otherwise the best trial is the released model.
    """
    from dpfy.accounting import _api

    check_int("trials", trials)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    trials = int(trials)
    released = final if final is not None else run
    known = set(_api.accountants())

    def total(tuning: ev.Event) -> ev.Event:
        return tuning if final is None else with_tuning(final, tuning)

    alone = _epsilon(released, delta)
    rows = [
        TuningOption(
            "final run only", alone.epsilon, delta, alone.method, "final run only",
            "tuning not accounted", released,
        )
    ]
    seq_runs = [run] * trials + ([final] if final is not None else [])
    seq = sequential_composition(seq_runs, delta)
    rows.append(
        TuningOption(
            "simple composition", seq.epsilon, delta, seq.method, "final run plus tuning",
            "always valid, loosest",
        )
    )
    composed = total(ev.SelfComposed(run, trials))
    for m in methods:
        if m in known and _api._ACCOUNTANTS[m].unsupported(composed) is None:
            res = _epsilon(composed, delta, method=m)
            rows.append(
                TuningOption(
                    f"{m.upper()} composition of all runs", res.epsilon, delta, res.method,
                    "final run plus tuning", "valid for adaptive search", composed,
                )
            )
    for label, shape in (("Poisson", math.inf), ("geometric", 1.0), ("logarithmic", 0.0)):
        event = total(random_trials(run, float(trials), shape))
        res = _epsilon(event, delta)
        rows.append(
            TuningOption(
                f"random number of trials ({label}, mean {trials})", res.epsilon, delta,
                res.method, "final run plus tuning",
                "Papernot & Steinke 2022: K random, trials i.i.d., best released", event,
            )
        )
    return rows

"""Group privacy: what an (epsilon, delta) guarantee for one unit says about k units.

If a mechanism is (epsilon, delta)-DP for neighbouring datasets, datasets k neighbouring steps
apart satisfy, chaining the definition k times,

    P[M(D_0) in S] <= e^{k eps} P[M(D_k) in S] + delta (1 + e^eps + ... + e^{(k-1) eps}),

i.e. (k eps, delta sum_{i<k} e^{i eps})-DP (Dwork & Roth 2014, Thm. 2.2, in the form of Vadhan
2017, Lemma 2.2; the sum is at most the familiar k e^{(k-1) eps} delta, so this is the tighter
of the two).

User-level runs use it with k = 2 for the *example-level* reading of a user-level guarantee
(:mod:`dpfy.training.users`): adding or removing one example changes one user's data, which is
"remove that user, add it back with the example added or removed", two user-level steps
(whatever the cap on examples per user). :func:`group_epsilon` picks the unit-level delta_u
that gives the smallest k-fold epsilon at a target delta: the largest delta_u with
delta_u sum_{i<k} e^{i eps(delta_u)} <= delta, found by bisection on log delta_u; only
delta_u values that satisfy the constraint are ever returned, so the result is a valid bound
whatever the search does.

For k = 2 there is a second route, in Renyi DP: the weak triangle inequality of Mironov
2017 (Prop. 11 with p = q = 2), D_a(P||R) <= (a - 1/2)/(a - 1) D_{2a}(P||Q) + D_{2a-1}(Q||R),
turns the unit-level RDP curve eps(.) (which bounds both directions of an add/remove pair for
the subsampled Gaussian; Mironov, Talwar, Zhang 2019) into the curve
(a - 1/2)/(a - 1) eps(2a) + eps(2a - 1) of datasets two steps apart, converted to (epsilon,
delta) by Balle et al. 2020, Prop. 12. :func:`group_epsilon` reports the smaller of the two
routes (each is a valid bound) and names the one it used.

NumPy/SciPy only, like every accountant; no torch, no ledger.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting._api import Accountant, EventSource, _as_event, epsilon
from dpfy.events import untruncated


def group_delta_factor(epsilon_unit: float, k: int) -> float:
    """sum_{i<k} e^{i eps}: the factor on delta of k-fold group privacy (inf on overflow)."""
    check_range("epsilon_unit", epsilon_unit, 0.0, None)
    check_int("k", k)
    if epsilon_unit == 0.0:
        return float(k)
    if (k - 1) * epsilon_unit > 700.0:
        return math.inf
    return math.expm1(k * epsilon_unit) / math.expm1(epsilon_unit)


def group_privacy(epsilon_unit: float, delta_unit: float, k: int) -> tuple[float, float]:
    """(k eps, delta sum_{i<k} e^{i eps}): k-fold group privacy of (eps, delta)-DP."""
    check_range("delta_unit", delta_unit, 0.0, 1.0)
    factor = group_delta_factor(epsilon_unit, k)
    return k * epsilon_unit, min(1.0, delta_unit * factor)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPrivacy:
    """A k-fold group-privacy statement derived from a unit-level accountant.

    Attributes:
      epsilon, delta: the group-level guarantee ((k eps_u, delta_u sum e^{i eps_u}) <= delta).
      k: group size in units.
      epsilon_unit, delta_unit: the unit-level pair it was derived from.
      method: the unit-level accountant.
      route: ``"approximate-dp"`` (the (eps, delta) chain above) or ``"rdp"`` (the weak
        triangle inequality, k = 2; ``epsilon_unit``/``delta_unit`` are then NaN/0).
    """

    epsilon: float
    delta: float
    k: int
    epsilon_unit: float
    delta_unit: float
    method: str
    route: str = "approximate-dp"


def group_epsilon(
    event: ev.Event | EventSource,
    delta: float,
    k: int = 2,
    method: str | Accountant = "auto",
    *,
    iterations: int = 40,
) -> GroupPrivacy:
    """The smallest k-fold group epsilon at ``delta`` over unit-level deltas (module docstring).

    Args:
      event: the unit-level event (or a ledger).
      delta: target delta of the group statement, in (0, 1).
      k: group size (2 for the example-level reading of a user-level run).
      method: the unit-level accountant.
      iterations: bisection steps on log delta_u.

    Returns:
      :class:`GroupPrivacy`; ``epsilon = inf`` when no tried delta_u satisfies the constraint.
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    check_int("k", k)
    check_int("iterations", iterations, 1, 200)

    def unit_eps(d: float) -> tuple[float, str]:
        r = epsilon(event, d, method)
        return float(r.epsilon), r.method

    if k == 1:
        e1, name = unit_eps(delta)
        return GroupPrivacy(e1, delta, 1, e1, delta, name)
    best = _approximate_dp_route(unit_eps, delta, k, int(iterations))
    if k == 2:
        rdp_eps = group2_rdp_epsilon(event, delta)
        if rdp_eps is not None and rdp_eps < best.epsilon:
            return GroupPrivacy(rdp_eps, delta, 2, math.nan, 0.0, "rdp", "rdp")
    return best


def group2_rdp_epsilon(event: ev.Event | EventSource, delta: float) -> float | None:
    """Epsilon at ``delta`` for datasets two add/remove steps apart, via RDP (module docstring).

    None when the RDP accountant does not cover the event (or it carries a truncation term).
    """
    import numpy as np

    from dpfy.accounting import rdp

    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    e = _as_event(event)
    if untruncated(e) != e or rdp.unsupported_reason(e) is not None:
        return None
    a = np.asarray(rdp.DEFAULT_ORDERS, dtype=np.float64)
    try:
        far = rdp.rdp_of_event(e, 2.0 * a)
        near = rdp.rdp_of_event(e, 2.0 * a - 1.0)
    except (ValueError, TypeError):
        return None
    curve = (a - 0.5) / (a - 1.0) * far + near
    eps, _ = rdp.epsilon_from_rdp(curve, a, delta)
    return float(eps)


def _approximate_dp_route(
    unit_eps: Callable[[float], tuple[float, str]], delta: float, k: int, iterations: int
) -> GroupPrivacy:
    """The (k eps, delta sum e^{i eps}) route at the best unit-level delta (bisection)."""
    lo, hi = math.log(delta) - math.log(1e12), math.log(delta / k)
    best: GroupPrivacy | None = None
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        d_u = math.exp(mid)
        e_u, name = unit_eps(d_u)
        g_eps, g_delta = group_privacy(e_u, d_u, k) if math.isfinite(e_u) else (math.inf, 1.0)
        if g_delta <= delta:
            if best is None or g_eps < best.epsilon:
                best = GroupPrivacy(g_eps, g_delta, k, e_u, d_u, name)
            lo = mid  # feasible: try a larger delta_u (smaller epsilon_u)
        else:
            hi = mid
        if hi - lo < 1e-3:
            break
    if best is None:
        d_u = math.exp(lo)
        e_u, name = unit_eps(d_u)
        g_eps, g_delta = group_privacy(e_u, d_u, k) if math.isfinite(e_u) else (math.inf, 1.0)
        if g_delta <= delta:
            return GroupPrivacy(g_eps, g_delta, k, e_u, d_u, name)
        return GroupPrivacy(math.inf, delta, k, e_u, d_u, name)
    return best

"""The accountant interface: one registry, one dispatch, one result type.

An accountant is a thin object over pure math functions. It says which events it supports
(naming the sub-event it cannot handle) *before* computing anything, and returns a
:class:`PrivacyResult` that names the method and adjacency that produced the number.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

from dpfy import events as ev
from dpfy._validate import check_range


class UnsupportedEventError(ValueError):
    """The chosen accounting method's assumptions do not hold for (part of) the event."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrivacyResult:
    """An (epsilon, delta) statement and where it came from.

    ``float(result)`` is the epsilon of a result of :func:`epsilon` (also in an f-string:
    ``f"{result:.2f}"``). A result of :func:`delta` answers the other question (the delta at a
    given epsilon), so ``float()`` refuses it rather than return a number that could be read as
    either: read ``.delta`` or ``.epsilon`` by name.

    Attributes:
      epsilon: the reported epsilon (for Monte Carlo: the upper confidence bound); for a
        result of :func:`delta`, the epsilon it was asked at.
      delta: the delta it holds at (including any extra delta, e.g. from truncation); for a
        result of :func:`delta`, the computed delta.
      method: accountant name (``rdp``, ``pld``, ``gaussian``, ``monte_carlo``, ...).
      adjacency: the neighbouring relation (``add_or_remove``, ``replace_one``, ``zero_out``).
      provable: False when the figure holds only with probability 1 - error_probability.
      epsilon_estimate / epsilon_lower / error_probability: Monte Carlo and bound details.
      notes: assumptions a reader must know (e.g. "no amplification assumed").
      solved_for: which of the two was computed: ``"epsilon"`` (by :func:`epsilon`) or
        ``"delta"`` (by :func:`delta`).
    """

    epsilon: float
    delta: float
    method: str
    adjacency: str = ev.Adjacency.ADD_OR_REMOVE.value
    provable: bool = True
    epsilon_estimate: float | None = None
    epsilon_lower: float | None = None
    error_probability: float | None = None
    notes: tuple[str, ...] = ()
    solved_for: Literal["epsilon", "delta"] = "epsilon"

    def __float__(self) -> float:
        """The epsilon of an epsilon result; a ``TypeError`` for a delta result."""
        if self.solved_for != "epsilon":
            raise TypeError(
                "float() of a PrivacyResult is its epsilon, but this result is from "
                f"accounting.delta(): delta={self.delta!r} at the given epsilon="
                f"{self.epsilon!r}; read .delta or .epsilon by name"
            )
        return float(self.epsilon)

    def __format__(self, spec: str) -> str:
        """``f"{result:.2f}"`` formats the epsilon (as ``float(result)``); no spec: ``str``."""
        return format(float(self), spec) if spec else str(self)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["notes"] = list(self.notes)
        for k, v in list(out.items()):
            if isinstance(v, float) and math.isinf(v):
                out[k] = "inf"
        return out


class Accountant(Protocol):
    """What an accounting method provides (see ``register_accountant``)."""

    @property
    def name(self) -> str:
        """The registry key (``method=name``)."""

    def unsupported(self, event: ev.Event) -> str | None:
        """None if the whole event tree is supported, else a reason naming the sub-event."""

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult: ...

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult: ...


class CalibrationSearch(Protocol):
    """epsilon at one delta along one calibration search (:mod:`dpfy.accounting.calibrate`).

    One object serves one search, so it may keep what an earlier call learned (a grid
    interval, a best order) to make the values a smooth function of the searched parameter.
    """

    def __call__(self, event: ev.Event, coarse: bool) -> float | None:
        """An upper bound on ``event``'s epsilon; ``coarse=True`` may be looser (faster) but
        must stay valid. None where the accountant has no route of its own for this event
        (e.g. one with truncated samplers): the search then uses the public :func:`epsilon`.
        ``coarse=False`` is only asked of events without truncated samplers."""


@runtime_checkable
class SearchesForCalibration(Protocol):
    """The capability of an accountant with a cheaper valid epsilon for calibration searches:
    calibration runs a coarse phase with it before finishing at the full precision. An
    accountant without it is calibrated with its public ``epsilon`` alone."""

    def calibration_search(self, delta: float) -> CalibrationSearch:
        """A fresh evaluator for one search at ``delta``."""
        ...


_ACCOUNTANTS: dict[str, Accountant] = {}
_AUTO: list[str] = []


def register_accountant(
    accountant: Accountant, *, auto: bool = True, replace: bool = False
) -> Accountant:
    """Add an accountant under ``accountant.name``.

    Args:
      accountant: the accounting method.
      auto: let ``method='auto'`` consider it.
      replace: allow taking over a name that is already registered (e.g. a built-in); the
        replacement keeps the old one's place among the auto methods when ``auto`` is True
        and leaves them when it is False. Re-registering the very same object is a no-op.

    Raises:
      ValueError: the name is taken by another accountant and ``replace`` is False (a
        silently replaced accountant would change every epsilon computed under that name).
    """
    name = accountant.name
    current = _ACCOUNTANTS.get(name)
    if current is not None and current is not accountant and not replace:
        raise ValueError(
            f"an accountant named {name!r} is already registered ({current!r}); pass "
            "replace=True to replace it"
        )
    _ACCOUNTANTS[name] = accountant
    if auto and name not in _AUTO:
        _AUTO.append(name)
    elif not auto and replace and name in _AUTO:
        _AUTO.remove(name)
    return accountant


def accountants() -> tuple[str, ...]:
    """Names of the registered accounting methods."""
    return tuple(_ACCOUNTANTS)


def contains(event: ev.Event, kind: type | tuple[type, ...]) -> bool:
    """True if ``event`` or any sub-event is an instance of ``kind``."""
    if isinstance(event, kind):
        return True
    return any(contains(c, kind) for c in ev._children(event))


def first_unsupported(
    event: ev.Event, leaf: Callable[[ev.Event], str | None]
) -> str | None:
    """Walk ``SelfComposed``/``Composed`` nodes; ``leaf`` judges every other node.

    Returns the first reason ``leaf`` gives (naming the sub-event), or None if all pass.
    """
    if isinstance(event, ev.SelfComposed):
        return first_unsupported(event.event, leaf)
    if isinstance(event, ev.Composed):
        for e in event.events:
            reason = first_unsupported(e, leaf)
            if reason is not None:
                return reason
        return None
    return leaf(event)


def contains_non_private(event: ev.Event) -> bool:
    """True if any sub-event is :class:`dpfy.events.NonPrivate`."""
    return contains(event, ev.NonPrivate)


def _resolve(event: ev.Event, method: str | Accountant) -> list[Accountant]:
    if not isinstance(event, ev.Event):
        raise ValueError(f"event must be a dpfy.events.Event, got event={event!r}")
    if not isinstance(method, str) and not callable(getattr(method, "unsupported", None)):
        allowed = ", ".join(("auto", *_ACCOUNTANTS))
        raise ValueError(
            f"method must be one of {{{allowed}}} or an accountant, got method={method!r}"
        )
    if not isinstance(method, str):  # a configured accountant instance, e.g. Monte Carlo options
        reason = method.unsupported(event)
        if reason is not None:
            raise UnsupportedEventError(
                f"method={method.name!r} cannot account this event: {reason}"
            )
        return [method]
    if method == "auto":
        chosen = [_ACCOUNTANTS[m] for m in _AUTO if _ACCOUNTANTS[m].unsupported(event) is None]
        if not chosen:
            reasons = "; ".join(
                f"{m}: {_ACCOUNTANTS[m].unsupported(event)}" for m in _ACCOUNTANTS
            )
            raise UnsupportedEventError(f"no accounting method supports this event ({reasons})")
        return chosen
    if method not in _ACCOUNTANTS:
        allowed = ", ".join(("auto", *_ACCOUNTANTS))
        raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")
    acc = _ACCOUNTANTS[method]
    reason = acc.unsupported(event)
    if reason is not None:
        raise UnsupportedEventError(f"method={method!r} cannot account this event: {reason}")
    return [acc]


def _infinite(event: ev.Event, method: str, delta: float) -> PrivacyResult:
    return PrivacyResult(
        epsilon=math.inf,
        delta=delta,
        method=method,
        adjacency=event.adjacency_relation.value,
        notes=("the event contains a non-private release: no finite epsilon holds",),
    )


#: Noise multipliers outside [MIN_NOISE, MAX_NOISE] are not handed to an accountant. Above,
#: epsilon is accounted at MAX_NOISE: epsilon never increases with the noise, so that is a valid
#: (and, at about 1e-5 per step, negligible) upper bound. Below, 1/z^2 leaves float range and
#: the only float that bounds epsilon is inf.
MAX_NOISE = 1e6
MIN_NOISE = 1e-6
_NOISY = (
    ev.Gaussian, ev.BallsAndBins, ev.Shuffled, ev.Deterministic, ev.TruncatedPoisson,
    ev.TruncatedBallsAndBins,
)


def _tame(event: ev.Event) -> tuple[ev.Event, bool, bool]:
    """(event with every finite noise multiplier above MAX_NOISE set to MAX_NOISE, whether one
    was, whether some noise multiplier is below MIN_NOISE)."""
    if isinstance(event, _NOISY):
        z = event.noise_multiplier
        if z < MIN_NOISE:
            return event, False, True
        if MAX_NOISE < z < math.inf:
            return dataclasses.replace(event, noise_multiplier=MAX_NOISE), True, False
    changed = tiny = False
    updates: dict[str, Any] = {}
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        if isinstance(value, ev.Event):
            new, c, t = _tame(value)
            changed, tiny = changed or c, tiny or t
            if c:
                updates[field.name] = new
        elif isinstance(value, tuple) and value and all(isinstance(v, ev.Event) for v in value):
            parts = [_tame(v) for v in value]
            tiny = tiny or any(t for _, _, t in parts)
            if any(c for _, c, _ in parts):
                changed = True
                updates[field.name] = tuple(p for p, _, _ in parts)
    return (dataclasses.replace(event, **updates) if updates else event), changed, tiny


_CLAMP_NOTE = (
    f"noise multipliers above {MAX_NOISE:g} accounted as {MAX_NOISE:g} (epsilon never "
    "increases with the noise: an upper bound)"
)


def _numerically_safe(
    mechanism: ev.Event, method: str | Accountant, delta: float
) -> tuple[ev.Event, tuple[str, ...], PrivacyResult | None]:
    """The mechanism with extreme noise multipliers tamed (see MAX_NOISE), its notes, and the
    result when no accountant is needed (a noise multiplier below MIN_NOISE: epsilon = inf)."""
    tamed, clamped, tiny = _tame(mechanism)
    if tiny:
        return tamed, (), PrivacyResult(
            epsilon=math.inf,
            delta=delta,
            method=_method_name(method),
            adjacency=mechanism.adjacency_relation.value,
            notes=(f"a noise multiplier below {MIN_NOISE:g}: no finite epsilon is representable",),
        )
    return tamed, ((_CLAMP_NOTE,) if clamped else ()), None


def _run(acc: Accountant, call: Callable[[], PrivacyResult], others: int) -> PrivacyResult | None:
    """``call()``; a numerical overflow inside one accountant is None when ``others`` remain
    (auto uses them) and a ValueError naming the accountant otherwise, never a crash."""
    try:
        return call()
    except (OverflowError, ZeroDivisionError, FloatingPointError, RecursionError) as err:
        if others:
            return None
        raise ValueError(
            f"method={acc.name!r} cannot account this event at these parameters (numerical "
            f"overflow: {err}); delta and noise multipliers closer to 1 or method='rdp' work"
        ) from None


def _truncated_result(
    acc: Accountant, mechanism: ev.Event, delta: float, probability: float
) -> PrivacyResult:
    from dpfy.accounting.truncation import truncated_epsilon

    epsilon_of_delta = functools.partial(_epsilon_at, acc, mechanism)
    eps = truncated_epsilon(epsilon_of_delta, delta, probability)
    base = acc.epsilon(mechanism, delta)
    return dataclasses.replace(
        base, epsilon=eps, notes=(*base.notes, _truncation_note(probability))
    )


def _native_truncated(acc: Accountant, event: ev.Event) -> ev.Event | None:
    """``event`` (noise tamed) when ``acc`` accounts its truncated samplers itself.

    An accountant that sets ``accounts_truncation = True`` and supports the event with its
    truncated nodes kept gets it as is; :func:`epsilon` and :func:`delta` keep whichever of
    this and the coupling bound (untruncated mechanism plus the truncation term) is smaller.
    """
    if not getattr(acc, "accounts_truncation", False):
        return None
    tamed, _, tiny = _tame(event)
    if tiny or acc.unsupported(tamed) is not None:
        return None
    return tamed


def _native_result(
    acc: Accountant, event: ev.Event, call: Callable[[Accountant, ev.Event], PrivacyResult]
) -> PrivacyResult | None:
    """``call(acc, event)`` with the truncated samplers kept, or None when ``acc`` does not
    account them itself or fails numerically (the coupling bound then stands alone)."""
    native = _native_truncated(acc, event)
    if native is None:
        return None
    try:
        return call(acc, native)
    except (ValueError, ArithmeticError, RecursionError):
        return None


def _method_name(method: str | Accountant) -> str:
    if isinstance(method, str):
        if method != "auto" and method not in _ACCOUNTANTS:
            allowed = ", ".join(("auto", *_ACCOUNTANTS))
            raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")
        return method
    return method.name


def _truncation_note(probability: float) -> str:
    return (
        f"batches truncated to a maximum size: P(some batch over-full) <= {probability:.3g}, "
        "added as (1 + e^epsilon) x that probability to delta (coupling bound)"
    )


class EventSource(Protocol):
    """Anything that describes its privacy event, e.g. a :class:`dpfy.ledger.Ledger`."""

    def to_event(self) -> ev.Event: ...


def _as_event(source: ev.Event | EventSource) -> ev.Event:
    """``source`` itself if it is an event, else ``source.to_event()``."""
    if isinstance(source, ev.Event):
        return source
    to_event = getattr(source, "to_event", None)
    event = to_event() if callable(to_event) else None
    if not isinstance(event, ev.Event):
        raise ValueError(
            "event must be a dpfy.events.Event or have a to_event() method returning one "
            f"(e.g. a ledger), got event={source!r}"
        )
    return event


def epsilon(
    event: ev.Event | EventSource, delta: float, method: str | Accountant = "auto"
) -> PrivacyResult:
    """Smallest epsilon the chosen method certifies for ``event`` at ``delta``.

    Truncated samplers (``TruncatedPoisson``, ``TruncatedBallsAndBins``) are accounted as their
    untruncated mechanism plus the truncation term of :mod:`dpfy.accounting.truncation`, so the
    returned epsilon holds at the stated delta *including* the cost of truncation.

    An event (or source) containing a :class:`dpfy.events.NonPrivate` release gets
    ``epsilon = inf`` whatever the method, with a note saying why.

    Args:
      event: a :mod:`dpfy.events` tree, or an :class:`EventSource` such as a ledger
        (accounted as ``event.to_event()``).
      delta: target delta, in (0, 1).
      method: ``auto`` (tightest valid registered method), an accountant name, or a configured
        accountant instance (e.g. a Monte Carlo accountant with its own sample size and seed).

    Raises:
      ValueError: bad delta or method; ``UnsupportedEventError`` if the method does not apply.
    """
    from dpfy.accounting.truncation import event_truncation_probability

    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    event = _as_event(event)
    if contains_non_private(event):
        return _infinite(event, _method_name(method), float(delta))
    mechanism, notes, settled = _numerically_safe(ev.untruncated(event), method, float(delta))
    if settled is not None:
        return settled
    accs = _resolve(mechanism, method)
    probability = event_truncation_probability(event)
    results: list[PrivacyResult] = []
    for i, acc in enumerate(accs):
        others = len(accs) - 1 - i + len(results)
        if probability == 0.0:
            res = _run(acc, functools.partial(acc.epsilon, mechanism, float(delta)), others)
        else:
            res = _run(
                acc,
                functools.partial(_truncated_result, acc, mechanism, float(delta), probability),
                others,
            )
            alt = _native_result(acc, event, lambda a, e: a.epsilon(e, float(delta)))
            if alt is not None and (res is None or alt.epsilon < res.epsilon):
                res = alt
        if res is not None:
            results.append(dataclasses.replace(res, notes=(*res.notes, *notes)) if notes else res)
    # Ties go to the provable result, then to the one that also states a lower bound.
    return min(results, key=lambda r: (r.epsilon, not r.provable, r.epsilon_lower is None))


def _epsilon_at(acc: Accountant, mechanism: ev.Event, delta: float) -> float:
    return acc.epsilon(mechanism, delta).epsilon


def delta(
    event: ev.Event | EventSource, epsilon: float, method: str | Accountant = "auto"
) -> PrivacyResult:
    """Smallest delta the chosen method certifies for ``event`` at ``epsilon`` (>= 0).

    ``event``: an event or an :class:`EventSource` (e.g. a ledger). Includes the truncation
    term for truncated samplers; a non-private release gives ``delta = 1`` (see
    :func:`epsilon`).
    """
    from dpfy.accounting.truncation import event_truncation_probability, truncated_delta

    check_range("epsilon", epsilon, 0.0, None)
    event = _as_event(event)
    if contains_non_private(event):
        res = _infinite(event, _method_name(method), 1.0)
        return dataclasses.replace(res, epsilon=float(epsilon), solved_for="delta")
    mechanism = ev.untruncated(event)
    accs = _resolve(mechanism, method)
    probability = event_truncation_probability(event)
    results = []
    for acc in accs:
        base = acc.delta(mechanism, float(epsilon))
        if probability > 0.0:
            base = dataclasses.replace(
                base,
                delta=truncated_delta(base.delta, float(epsilon), probability),
                notes=(*base.notes, _truncation_note(probability)),
            )
            alt = _native_result(acc, event, lambda a, e: a.delta(e, float(epsilon)))
            if alt is not None and alt.delta < base.delta:
                base = alt
        results.append(base)
    best = min(results, key=lambda r: (r.delta, not r.provable))
    return dataclasses.replace(best, solved_for="delta")


def compare(event: ev.Event | EventSource, delta: float) -> dict[str, PrivacyResult | str]:
    """Every registered method's epsilon at ``delta``, or the reason it does not apply.

    ``event``: an event or an :class:`EventSource` (e.g. a ledger).
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    event = _as_event(event)
    out: dict[str, PrivacyResult | str] = {}
    mechanism = ev.untruncated(event)
    for name, acc in _ACCOUNTANTS.items():
        reason = acc.unsupported(mechanism)
        out[name] = reason if reason is not None else epsilon(event, delta, method=name)
    return out

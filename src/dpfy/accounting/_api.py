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
from typing import Any, Protocol

from dpfy import events as ev
from dpfy._validate import check_range

__all__ = [
    "PrivacyResult",
    "Accountant",
    "EventSource",
    "UnsupportedEventError",
    "register_accountant",
    "accountants",
    "epsilon",
    "delta",
    "compare",
    "contains",
    "contains_non_private",
    "first_unsupported",
    "untruncated",
]


class UnsupportedEventError(ValueError):
    """The chosen accounting method's assumptions do not hold for (part of) the event."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrivacyResult:
    """An (epsilon, delta) statement and where it came from.

    Attributes:
      epsilon: the reported epsilon (for Monte Carlo: the upper confidence bound).
      delta: the delta it holds at (including any extra delta, e.g. from truncation).
      method: accountant name (``rdp``, ``pld``, ``gaussian``, ``monte_carlo``, ...).
      adjacency: the neighbouring relation (``add_or_remove``, ``replace_one``, ``zero_out``).
      provable: False when the figure holds only with probability 1 - error_probability.
      epsilon_estimate / epsilon_lower / error_probability: Monte Carlo and bound details.
      notes: assumptions a reader must know (e.g. "no amplification assumed").
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


def _method_name(method: str | Accountant) -> str:
    if isinstance(method, str):
        if method != "auto" and method not in _ACCOUNTANTS:
            allowed = ", ".join(("auto", *_ACCOUNTANTS))
            raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")
        return method
    return method.name


# ``untruncated`` lives with the events (dpfy.events); re-exported here for old imports.
untruncated = ev.untruncated


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
    from dpfy.accounting.truncation import event_truncation_probability, truncated_epsilon

    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    event = _as_event(event)
    if contains_non_private(event):
        return _infinite(event, _method_name(method), float(delta))
    mechanism = untruncated(event)
    accs = _resolve(mechanism, method)
    probability = event_truncation_probability(event)
    results = []
    for acc in accs:
        if probability == 0.0:
            results.append(acc.epsilon(mechanism, float(delta)))
            continue
        epsilon_of_delta = functools.partial(_epsilon_at, acc, mechanism)
        eps = truncated_epsilon(epsilon_of_delta, float(delta), probability)
        base = acc.epsilon(mechanism, float(delta))
        results.append(
            dataclasses.replace(
                base, epsilon=eps, notes=(*base.notes, _truncation_note(probability))
            )
        )
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
        return dataclasses.replace(res, epsilon=float(epsilon))
    mechanism = untruncated(event)
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
        results.append(base)
    return min(results, key=lambda r: (r.delta, not r.provable))


def compare(event: ev.Event | EventSource, delta: float) -> dict[str, PrivacyResult | str]:
    """Every registered method's epsilon at ``delta``, or the reason it does not apply.

    ``event``: an event or an :class:`EventSource` (e.g. a ledger).
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    event = _as_event(event)
    out: dict[str, PrivacyResult | str] = {}
    mechanism = untruncated(event)
    for name, acc in _ACCOUNTANTS.items():
        reason = acc.unsupported(mechanism)
        out[name] = reason if reason is not None else epsilon(event, delta, method=name)
    return out

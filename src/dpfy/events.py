"""Privacy events: a vocabulary that *describes* mechanisms, never computes with them.

An event says what a mechanism did (which noise, which sampling, how often); the accountants in
:mod:`dpfy.accounting` turn events into (epsilon, delta). Events are frozen dataclasses that
validate on construction and round-trip through JSON (``to_dict`` / ``event_from_dict``).

Promise: the meaning of an event type never changes once released. A new analysis gets a new
event type, so a ledger written today is re-accounted tomorrow with the same semantics.

Composition helpers: :class:`EventBuilder` (and :func:`compose`, :func:`repeat`) fold
consecutive repetitions of one mechanism into a single count and flatten nested ``Composed``;
:func:`untruncated` strips the truncation of truncated samplers.

Conventions (``docs/architecture.md``, "Privacy events"):
  * ``noise_multiplier`` is the noise standard deviation divided by the L2 sensitivity.
  * Unless an event names another, adjacency is ``add_or_remove`` (one example added or removed).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, ClassVar

from dpfy._validate import check_int, check_range

__all__ = [
    "Adjacency",
    "Event",
    "Gaussian",
    "Laplace",
    "NonPrivate",
    "ZCDP",
    "PoissonSampled",
    "FixedSizeSampled",
    "BallsAndBins",
    "Shuffled",
    "Deterministic",
    "MatrixMechanism",
    "TruncatedPoisson",
    "TruncatedBallsAndBins",
    "SelfComposed",
    "Composed",
    "RepeatAndSelect",
    "EventBuilder",
    "compose",
    "repeat",
    "untruncated",
    "event_from_dict",
]


class Adjacency(enum.StrEnum):
    """Neighbouring-dataset relation an epsilon refers to."""

    ADD_OR_REMOVE = "add_or_remove"
    REPLACE_ONE = "replace_one"
    ZERO_OUT = "zero_out"


_REGISTRY: dict[str, type[Event]] = {}


def _register(cls: type[Event], *, replace: bool = False) -> type[Event]:
    """Make ``cls`` the event type for its ``kind`` (used as a class decorator).

    Raises:
      ValueError: another class already has this ``kind`` and ``replace`` is False
        (``event_from_dict`` would otherwise build the wrong type without a word).
    """
    current = _REGISTRY.get(cls.kind)
    if current is not None and current is not cls and not replace:
        raise ValueError(
            f"event kind {cls.kind!r} is already registered to {current.__qualname__}; pass "
            "replace=True to replace it"
        )
    _REGISTRY[cls.kind] = cls
    return cls


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """Base class of all privacy events."""

    kind: ClassVar[str] = "event"
    #: Name of the integer field that counts repetitions of this mechanism (``epochs`` or
    #: ``steps``), so that ``n`` runs of it are the same event with the field times ``n``;
    #: None when repetitions are expressed with :class:`SelfComposed`.
    count_field: ClassVar[str | None] = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; ``event_from_dict`` inverts it."""
        out: dict[str, Any] = {"type": self.kind}
        for f in dataclasses.fields(self):
            out[f.name] = _encode(getattr(self, f.name))
        return out

    @property
    def adjacency_relation(self) -> Adjacency:
        """The adjacency this event's guarantee refers to (add_or_remove unless stated)."""
        adj = getattr(self, "adjacency", None)
        if adj is not None:
            return Adjacency(adj)
        children = _children(self)
        for child in children:
            a = child.adjacency_relation
            if a is not Adjacency.ADD_OR_REMOVE:
                return a
        return Adjacency.ADD_OR_REMOVE


def _encode(value: Any) -> Any:
    if isinstance(value, Event):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _children(event: Event) -> tuple[Event, ...]:
    out: list[Event] = []
    for f in dataclasses.fields(event):
        v = getattr(event, f.name)
        if isinstance(v, Event):
            out.append(v)
        elif isinstance(v, tuple):
            out.extend(x for x in v if isinstance(x, Event))
    return tuple(out)


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from ``Event.to_dict()`` output (validating it again)."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"an event dict needs a 'type' key, got {data!r}")
    kind = data["type"]
    cls = _REGISTRY.get(kind)
    if cls is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"event type must be one of {{{known}}}, got type={kind!r}")
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key == "type":
            continue
        if key not in names:
            raise ValueError(f"unknown field {key!r} for event type {kind!r}")
        kwargs[key] = _decode(value)
    return cls(**kwargs)


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if value == "inf":
        return math.inf
    if value == "-inf":
        return -math.inf
    return value


def _as_adjacency(value: Adjacency | str) -> str:
    try:
        return Adjacency(value).value
    except ValueError:
        allowed = ", ".join(a.value for a in Adjacency)
        raise ValueError(
            f"adjacency must be one of {{{allowed}}}, got adjacency={value!r}"
        ) from None


def _validate_epochs(event: BallsAndBins | Shuffled | Deterministic) -> None:
    """Shared validation of the epoch-structured sampler events (noise, steps, epochs)."""
    check_range("noise_multiplier", event.noise_multiplier, 0.0, None, low_open=True)
    check_int("steps_per_epoch", event.steps_per_epoch)
    check_int("epochs", event.epochs)
    object.__setattr__(event, "noise_multiplier", float(event.noise_multiplier))
    object.__setattr__(event, "steps_per_epoch", int(event.steps_per_epoch))
    object.__setattr__(event, "epochs", int(event.epochs))
    object.__setattr__(event, "adjacency", _as_adjacency(event.adjacency))


# --------------------------------------------------------------------------------------------
# Base mechanisms
# --------------------------------------------------------------------------------------------


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class Gaussian(Event):
    """Gaussian mechanism with noise std = ``noise_multiplier`` x L2 sensitivity."""

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class Laplace(Event):
    """Laplace mechanism with scale = ``noise_multiplier`` x L1 sensitivity (pure epsilon)."""

    noise_multiplier: float
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class NonPrivate(Event):
    """A release without a privacy guarantee: every accountant reports epsilon = infinity."""

    reason: str = ""
    kind: ClassVar[str] = "non_private"


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class ZCDP(Event):
    """A mechanism known to satisfy ``rho``-zero-concentrated DP."""

    rho: float
    kind: ClassVar[str] = "zcdp"

    def __post_init__(self) -> None:
        check_range("rho", self.rho, 0.0, None)
        object.__setattr__(self, "rho", float(self.rho))


# --------------------------------------------------------------------------------------------
# Sampling: each sampler of dpfy.sampling names one of these
# --------------------------------------------------------------------------------------------


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class PoissonSampled(Event):
    """``event`` applied to a Poisson sample: each example included independently w.p. q."""

    sampling_rate: float
    event: Event
    kind: ClassVar[str] = "poisson_sampled"

    def __post_init__(self) -> None:
        check_range("sampling_rate", self.sampling_rate, 0.0, 1.0, low_open=True)
        object.__setattr__(self, "sampling_rate", float(self.sampling_rate))
        _check_event("event", self.event)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class FixedSizeSampled(Event):
    """``event`` applied to ``sample_size`` examples drawn without replacement.

    Adjacency is ``replace_one`` (the dataset size is public), so a sum query's sensitivity is
    2 x clip norm when one example is swapped for another; the inner event states the noise
    relative to the clip norm, and accountants account the replace-one relation.
    """

    sample_size: int
    dataset_size: int
    event: Event
    adjacency: str = Adjacency.REPLACE_ONE.value
    kind: ClassVar[str] = "fixed_size_sampled"

    def __post_init__(self) -> None:
        check_int("dataset_size", self.dataset_size)
        check_range("sample_size", self.sample_size, 1, self.dataset_size, integer=True)
        object.__setattr__(self, "sample_size", int(self.sample_size))
        object.__setattr__(self, "dataset_size", int(self.dataset_size))
        object.__setattr__(self, "adjacency", _as_adjacency(self.adjacency))
        _check_event("event", self.event)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class BallsAndBins(Event):
    """Balls-and-Bins sampling (Chua et al. 2025) with a Gaussian sum query per step.

    Each epoch every example lands in exactly one of ``steps_per_epoch`` batches, uniformly at
    random; each step releases a Gaussian sum with the given ``noise_multiplier``.
    """

    noise_multiplier: float
    steps_per_epoch: int
    epochs: int = 1
    adjacency: str = Adjacency.ADD_OR_REMOVE.value
    kind: ClassVar[str] = "balls_and_bins"
    count_field: ClassVar[str | None] = "epochs"

    def __post_init__(self) -> None:
        _validate_epochs(self)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class Shuffled(Event):
    """Shuffle each epoch, cut into fixed-size batches, Gaussian sum query per step.

    No tight upper bound with amplification is known: accountants give the no-amplification
    upper bound (each example is used once per epoch) and the lower bound of Chua et al. 2024a.
    Adjacency is ``zero_out`` (the differing example is replaced by a zero-weight placeholder,
    so no other example changes batch): removing it outright would shift later examples into
    other batches, which these bounds do not cover.
    """

    noise_multiplier: float
    steps_per_epoch: int
    epochs: int = 1
    adjacency: str = Adjacency.ZERO_OUT.value
    kind: ClassVar[str] = "shuffled"
    count_field: ClassVar[str | None] = "epochs"

    def __post_init__(self) -> None:
        _validate_epochs(self)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class Deterministic(Event):
    """Fixed order, fixed-size batches: each example is used once per epoch, no amplification.

    Adjacency is ``zero_out``, as for :class:`Shuffled`.
    """

    noise_multiplier: float
    steps_per_epoch: int
    epochs: int = 1
    adjacency: str = Adjacency.ZERO_OUT.value
    kind: ClassVar[str] = "deterministic"
    count_field: ClassVar[str | None] = "epochs"

    def __post_init__(self) -> None:
        _validate_epochs(self)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class MatrixMechanism(Event):
    """A correlated-noise (DP-FTRL / matrix-factorization) release over a whole run.

    The run releases ``C x + z`` (``z ~ N(0, sigma^2 I)``, ``sigma`` = ``noise_multiplier`` x
    clip norm) for the strategy ``C`` named by ``strategy`` over ``steps`` steps; one example's
    contributions under the participation ``schema`` move ``C x`` by at most ``sensitivity``
    x clip norm (:func:`dpfy.correlated.schemas.sensitivity`). The whole run is one Gaussian
    mechanism with ``mu = sensitivity / noise_multiplier`` (Denisov et al. 2022; Choquette-Choo
    et al. 2023). Adjacency is ``zero_out`` as for :class:`Shuffled`: the schema fixes each
    example's steps, which removing an example outright would shift. ``band`` is the strategy's
    band width or buffer count (0 when not applicable); ``strategy`` and ``schema`` are descriptive
    names (e.g. ``"bandmf"``, ``"cyclic(period=100)"``) recorded for the report.
    """

    noise_multiplier: float
    sensitivity: float
    steps: int
    strategy: str
    schema: str
    band: int = 0
    adjacency: str = Adjacency.ZERO_OUT.value
    kind: ClassVar[str] = "matrix_mechanism"

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_range("sensitivity", self.sensitivity, 0.0, None, low_open=True)
        check_int("steps", self.steps)
        check_int("band", self.band, low=0)
        for name in ("strategy", "schema"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "sensitivity", float(self.sensitivity))
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "band", int(self.band))
        object.__setattr__(self, "adjacency", _as_adjacency(self.adjacency))


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class TruncatedPoisson(Event):
    """``steps`` Poisson-sampled Gaussian steps whose batches are truncated to ``max_batch_size``.

    Truncation (a random subset of an over-full batch) costs extra delta; accountants add it
    to every delta they report for this event (``dpfy.accounting.truncation``).
    """

    sampling_rate: float
    noise_multiplier: float
    steps: int
    dataset_size: int
    max_batch_size: int
    kind: ClassVar[str] = "truncated_poisson"
    count_field: ClassVar[str | None] = "steps"

    def __post_init__(self) -> None:
        check_range("sampling_rate", self.sampling_rate, 0.0, 1.0, low_open=True)
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_int("steps", self.steps, 0)
        check_int("dataset_size", self.dataset_size)
        check_int("max_batch_size", self.max_batch_size)
        object.__setattr__(self, "sampling_rate", float(self.sampling_rate))
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "dataset_size", int(self.dataset_size))
        object.__setattr__(self, "max_batch_size", int(self.max_batch_size))


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class TruncatedBallsAndBins(Event):
    """:class:`BallsAndBins` whose batches are truncated to ``max_batch_size`` (random subset).

    The mechanism part is accounted as ``BallsAndBins(noise_multiplier, steps_per_epoch,
    epochs)``; truncation adds the extra delta of ``dpfy.accounting.truncation`` (each batch is
    marginally Binomial(dataset_size, 1/steps_per_epoch), Chua et al. 2025, App. C).
    """

    noise_multiplier: float
    steps_per_epoch: int
    epochs: int
    dataset_size: int
    max_batch_size: int
    adjacency: str = Adjacency.ADD_OR_REMOVE.value
    kind: ClassVar[str] = "truncated_balls_and_bins"
    count_field: ClassVar[str | None] = "epochs"

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_int("steps_per_epoch", self.steps_per_epoch)
        check_int("epochs", self.epochs)
        check_int("dataset_size", self.dataset_size)
        check_int("max_batch_size", self.max_batch_size)
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "steps_per_epoch", int(self.steps_per_epoch))
        object.__setattr__(self, "epochs", int(self.epochs))
        object.__setattr__(self, "dataset_size", int(self.dataset_size))
        object.__setattr__(self, "max_batch_size", int(self.max_batch_size))
        object.__setattr__(self, "adjacency", _as_adjacency(self.adjacency))

    def untruncated(self) -> BallsAndBins:
        """The mechanism without truncation (its delta excludes the truncation cost)."""
        return _untruncated_balls_and_bins(self)


# --------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class SelfComposed(Event):
    """``event`` run ``count`` times (adaptively) on the same data."""

    event: Event
    count: int
    kind: ClassVar[str] = "self_composed"

    def __post_init__(self) -> None:
        _check_event("event", self.event)
        check_int("count", self.count, 0)
        object.__setattr__(self, "count", int(self.count))


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class Composed(Event):
    """Adaptive composition of several events on the same data."""

    events: tuple[Event, ...]
    kind: ClassVar[str] = "composed"

    def __post_init__(self) -> None:
        events = tuple(self.events)
        for i, e in enumerate(events):
            _check_event(f"events[{i}]", e)
        object.__setattr__(self, "events", events)


@_register
@dataclasses.dataclass(frozen=True, slots=True)
class RepeatAndSelect(Event):
    """Papernot & Steinke (2022): run ``event`` a random number of times, release the best.

    The number of runs is truncated negative binomial with the given ``mean`` and ``shape``;
    ``shape = inf`` means Poisson(mean) (Ponomareva et al. 2023, Sec. 5.4.2, Table 4;
    dp_accounting's RepeatAndSelectDpEvent uses the same parametrisation).
    """

    event: Event
    mean: float
    shape: float = math.inf
    kind: ClassVar[str] = "repeat_and_select"

    def __post_init__(self) -> None:
        _check_event("event", self.event)
        check_range("mean", self.mean, 0.0, None, low_open=True)
        check_range("shape", self.shape, 0.0, None)
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "shape", float(self.shape))


def _check_event(name: str, value: Any) -> None:
    if not isinstance(value, Event):
        raise ValueError(f"{name} must be a dpfy.events.Event, got {name}={value!r}")


# --------------------------------------------------------------------------------------------
# Building composed events
# --------------------------------------------------------------------------------------------


def _split_count(event: Event) -> tuple[Event, int]:
    """(one repetition, number of repetitions) of ``event``; exact, no rounding.

    ``SelfComposed(e, n)`` is ``n`` times ``e`` (recursively), and an event with a
    :attr:`Event.count_field` of value ``n >= 1`` is ``n`` times the same event with that field
    set to 1. Anything else is one repetition of itself.
    """
    if isinstance(event, SelfComposed) and event.count >= 1:
        inner, n = _split_count(event.event)
        return inner, n * event.count
    field = event.count_field
    if field is not None:
        n = int(getattr(event, field))
        if n >= 1:
            return dataclasses.replace(event, **{field: 1}), n
    return event, 1


def repeat(event: Event, count: int) -> Event:
    """``event`` run ``count`` times: the counted field scaled, else ``SelfComposed``.

    ``repeat(e, 1)`` is ``e``; ``repeat(BallsAndBins(z, T, 1), 3)`` is ``BallsAndBins(z, T, 3)``;
    ``repeat(Gaussian(z), 3)`` is ``SelfComposed(Gaussian(z), 3)``.
    """
    check_int("count", count)
    if count == 1:
        return event
    unit, n = _split_count(event)
    field = unit.count_field
    if field is not None and getattr(unit, field) == 1:
        return dataclasses.replace(unit, **{field: n * int(count)})
    return SelfComposed(event, int(count))


class EventBuilder:
    """Adaptive composition built step by step, in order (idea as dp_accounting's builder).

    :meth:`add` appends an event; consecutive repetitions of one mechanism are folded into one
    count (``SelfComposed`` or the event's own ``epochs`` / ``steps`` field, see :func:`repeat`)
    and a nested ``Composed`` is flattened. Both are exact rewrites of the same composition.
    :meth:`build` returns the single event, or ``Composed`` of the parts (``Composed(())`` when
    nothing was added).

    Example:
        >>> step = PoissonSampled(0.01, Gaussian(1.0))
        >>> EventBuilder().add(step, 3).add(SelfComposed(step, 2)).build()
        SelfComposed(event=PoissonSampled(sampling_rate=0.01, event=Gaussian(noise_multiplier=1.0)), count=5)
    """  # noqa: E501

    def __init__(self) -> None:
        self._parts: list[tuple[Event, int]] = []

    def add(self, event: Event, count: int = 1) -> EventBuilder:
        """Append ``event`` run ``count`` (>= 1) times; returns the builder."""
        _check_event("event", event)
        check_int("count", count)
        if isinstance(event, Composed) and count == 1:
            for part in event.events:
                self.add(part)
            return self
        unit, n = _split_count(event)
        n *= int(count)
        if self._parts and self._parts[-1][0] == unit:
            self._parts[-1] = (unit, self._parts[-1][1] + n)
        else:
            self._parts.append((unit, n))
        return self

    def compose(self, *events: Event) -> EventBuilder:
        """Append each of ``events`` once, in order; returns the builder."""
        for event in events:
            self.add(event)
        return self

    def build(self) -> Event:
        """The composed event (see the class docstring)."""
        out = tuple(repeat(unit, n) for unit, n in self._parts)
        return out[0] if len(out) == 1 else Composed(out)


def compose(*events: Event) -> Event:
    """``EventBuilder().compose(*events).build()``: the events in order, repetitions folded."""
    return EventBuilder().compose(*events).build()


def untruncated(event: Event) -> Event:
    """The event with every truncated sampler replaced by its untruncated mechanism.

    ``TruncatedPoisson`` becomes ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)`` and
    ``TruncatedBallsAndBins`` becomes ``BallsAndBins``; the truncation's extra delta is then
    added by the caller (``dpfy.accounting.truncation``).
    """
    if isinstance(event, TruncatedPoisson):
        inner = PoissonSampled(event.sampling_rate, Gaussian(event.noise_multiplier))
        return SelfComposed(inner, event.steps)
    if isinstance(event, TruncatedBallsAndBins):
        return _untruncated_balls_and_bins(event)
    if isinstance(event, SelfComposed):
        return SelfComposed(untruncated(event.event), event.count)
    if isinstance(event, Composed):
        return Composed(tuple(untruncated(e) for e in event.events))
    if isinstance(event, PoissonSampled):
        return PoissonSampled(event.sampling_rate, untruncated(event.event))
    return event


def _untruncated_balls_and_bins(event: TruncatedBallsAndBins) -> BallsAndBins:
    e = event
    return BallsAndBins(e.noise_multiplier, e.steps_per_epoch, e.epochs, e.adjacency)

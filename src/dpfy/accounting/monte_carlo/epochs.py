"""Balls-and-Bins epochs and their extraction from event trees (Chua et al. 2025).

An :class:`Epoch` of T steps with noise multiplier z is the Monte Carlo accountant's unit of
composition; a plain Gaussian mechanism (sensitivity 1) is the epoch with T = 1.
``TruncatedBallsAndBins`` is accounted as the untruncated mechanism here (its extra delta is
added by :mod:`dpfy.accounting.truncation` through the public ``epsilon()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting._api import first_unsupported


@dataclasses.dataclass(frozen=True, slots=True)
class Epoch:
    """One Balls-and-Bins epoch: ``steps`` steps with noise multiplier ``noise_multiplier``.

    ``steps = 1`` is a plain Gaussian mechanism with sensitivity 1.
    """

    noise_multiplier: float
    steps: int

    def __post_init__(self) -> None:
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_int("steps", self.steps)


def unsupported(event: ev.Event) -> str | None:
    """None if the Monte Carlo accountant handles ``event``, else a reason naming the part."""
    reason = first_unsupported(event, _unsupported_leaf)
    if reason is None and not _has_balls_and_bins(event):
        # pure Gaussian compositions are the exact "gaussian" accountant's job
        return f"{type(event).__name__} contains no Balls-and-Bins epoch"
    return reason


def _has_balls_and_bins(event: ev.Event) -> bool:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        return event.epochs > 0
    if isinstance(event, ev.SelfComposed):
        return event.count > 0 and _has_balls_and_bins(event.event)
    if isinstance(event, ev.Composed):
        return any(_has_balls_and_bins(e) for e in event.events)
    return False


def _unsupported_leaf(event: ev.Event) -> str | None:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        if event.adjacency == ev.Adjacency.REPLACE_ONE.value:
            return f"{type(event).__name__} with replace_one adjacency"
        return None
    if isinstance(event, ev.Gaussian):
        return None
    return f"{type(event).__name__} is not a Balls-and-Bins epoch or a Gaussian"


def epochs_of_event(event: ev.Event) -> list[Epoch]:
    """The epochs of a supported event tree (``TruncatedBallsAndBins`` counts as untruncated).

    Raises:
      ValueError: for an unsupported sub-event (named in the message).
    """
    reason = unsupported(event)
    if reason is not None:
        raise ValueError(f"monte_carlo cannot account this event: {reason}")
    return _epochs(event)


def _epochs(event: ev.Event) -> list[Epoch]:
    if isinstance(event, ev.BallsAndBins | ev.TruncatedBallsAndBins):
        return [Epoch(event.noise_multiplier, event.steps_per_epoch)] * event.epochs
    if isinstance(event, ev.Gaussian):
        return [Epoch(event.noise_multiplier, 1)]
    if isinstance(event, ev.SelfComposed):
        return _epochs(event.event) * event.count
    if not isinstance(event, ev.Composed):  # excluded by unsupported()
        raise TypeError(f"{type(event).__name__} is not a Balls-and-Bins epoch or a Gaussian")
    out: list[Epoch] = []
    for e in event.events:
        out.extend(_epochs(e))
    return out


def group_epochs(epochs: Sequence[Epoch]) -> list[tuple[Epoch, int]]:
    """(epoch, count) for each distinct epoch, in order of first appearance."""
    counts: dict[Epoch, int] = {}
    for e in epochs:
        counts[e] = counts.get(e, 0) + 1
    return list(counts.items())

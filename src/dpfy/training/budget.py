"""The budget guard: how training asks the accountant what a run has spent.

Training code never computes epsilon itself; it reaches accounting in two places only: noise
calibration before the run (:func:`dpfy.accounting.calibrate.calibrate_noise_multiplier`) and
this module, which reads the *ledger* (the source of truth: resumed runs and extra queries
count) and asks the accountant

* before a step or an epoch, whether the ledger plus the steps to come stays within the target
  (:class:`BudgetGuard`);
* what the ledger has spent so far, for monitoring and for the final statement
  (:func:`spent`).
"""

from __future__ import annotations

from collections.abc import Callable

from dpfy import accounting
from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting.roots import largest_true
from dpfy.ledger import Ledger


class BudgetExceededError(RuntimeError):
    """A step was refused because the ledger's epsilon would pass the target."""


class BudgetGuard:
    """Refuses steps whose ledger epsilon would exceed ``target_epsilon`` at ``delta``.

    The guard asks the accountant about the ledger *plus* the steps to come, before they run:
    ``epsilon(Composed(ledger.to_event(), next_steps_event), delta, method)``. The ledger is
    the source of truth, so anything recorded (resumed runs, extra queries) counts.

    Args:
      target_epsilon: budget, > 0.
      delta: target delta in (0, 1).
      method: accountant name (the method the final statement uses).

    Example:
        >>> guard = BudgetGuard(3.0, 1e-5, method="rdp")
        >>> guard.check(ledger, sampler.privacy_event(z, steps=1))  # doctest: +SKIP
    """

    def __init__(self, target_epsilon: float, delta: float, *, method: str = "auto") -> None:
        check_range("target_epsilon", target_epsilon, 0.0, None, low_open=True)
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        self.target_epsilon = float(target_epsilon)
        self.delta = float(delta)
        self.method = method

    def epsilon_after(self, ledger: Ledger, next_event: ev.Event | None) -> float:
        """Epsilon of the ledger followed by ``next_event`` (None: the ledger alone)."""
        events = [e for e in (_ledger_event(ledger), next_event) if e is not None]
        if not events:
            return 0.0
        event = events[0] if len(events) == 1 else _compose(events[0], events[1])
        return float(accounting.epsilon(event, self.delta, self.method).epsilon)

    def check(self, ledger: Ledger, next_event: ev.Event) -> None:
        """Raise :class:`BudgetExceededError` if ``next_event`` would pass the target."""
        eps = self.epsilon_after(ledger, next_event)
        if eps > self.target_epsilon:
            raise BudgetExceededError(self._message(ledger, eps))

    def allowed_steps(
        self, ledger: Ledger, make_event: Callable[[int], ev.Event], max_steps: int
    ) -> int:
        """Largest k in [0, max_steps] with epsilon(ledger + make_event(k)) <= target.

        ``make_event(k)`` is the event of the next k steps (e.g.
        ``lambda k: sampler.privacy_event(z, steps=k)``); epsilon is non-decreasing in k.
        One accountant call when all ``max_steps`` fit, a binary search otherwise.
        """
        if max_steps <= 0:
            return 0
        if self.epsilon_after(ledger, make_event(max_steps)) <= self.target_epsilon:
            return max_steps
        def fits(k: int) -> bool:
            return self.epsilon_after(ledger, make_event(k)) <= self.target_epsilon

        # k = 0 fits (checked by the caller), k = max_steps does not: search in between.
        return largest_true(fits, 0, max_steps - 1)

    def _message(self, ledger: Ledger, eps: float) -> str:
        return (
            f"budget guard: the next step would raise the ledger's epsilon to {eps:.4g} > "
            f"target_epsilon={self.target_epsilon!r} (delta={self.delta!r}, "
            f"method={self.method!r}) after {ledger.iteration} recorded steps; the step was "
            "refused. Raise the target, add noise, or train fewer steps."
        )

    def __repr__(self) -> str:
        return (
            f"BudgetGuard(target_epsilon={self.target_epsilon}, delta={self.delta}, "
            f"method={self.method!r})"
        )


def _compose(first: ev.Event, second: ev.Event) -> ev.Event:
    """``first`` then ``second``; repetitions of one mechanism are merged into one count.

    Merging is exact (it is the same composition) and lets the accountant see the run as the
    calibration saw it (``SelfComposed(step, n + k)`` rather than two discretised parts); see
    :class:`dpfy.events.EventBuilder`.
    """
    return ev.EventBuilder().compose(first, second).build()


def _ledger_event(ledger: Ledger) -> ev.Event | None:
    """The ledger's event, or None when it records no cost (``Composed(())``)."""
    event = ledger.to_event()
    if isinstance(event, ev.Composed) and not event.events:
        return None
    return event


def spent(
    ledger: Ledger, delta: float, method: str, *, fallback: str | None = None
) -> float:
    """Epsilon of ``ledger`` at ``delta`` (0 for an empty ledger).

    ``fallback`` is used when ``method`` does not apply to the ledger's event (e.g. a cheap
    monitoring method that does not know the sampler).
    """
    if ledger.iteration == 0:
        return 0.0
    try:
        return float(accounting.epsilon(ledger, delta, method).epsilon)
    except accounting.UnsupportedEventError:
        if fallback is None:
            raise
        return float(accounting.epsilon(ledger, delta, fallback).epsilon)


def statement(ledger: Ledger, delta: float, method: str) -> accounting.PrivacyResult:
    """The final privacy statement of a run: the ledger accounted with ``method``."""
    return accounting.epsilon(ledger, delta, method)

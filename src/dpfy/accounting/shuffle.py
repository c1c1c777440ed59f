"""The honest statement for shuffled and deterministic batches.

Chua et al. 2024a; Ponomareva et al. 2023, Sec. 4.3.

No amplification-by-shuffling bound for DP-SGD close to Poisson subsampling is known, and
Chua et al. (2024a, "How private are DP-SGD implementations?", ICML) show shuffling can be far
less private than Poisson accounting claims. So the ``shuffle`` accountant reports:

* upper bound (provable): no amplification. Each example is in exactly one batch per epoch, so
  E epochs are an adaptive composition of E Gaussian mechanisms: exactly mu-GDP with
  mu = sqrt(E) / z (plus any plain Gaussians composed with it), converted exactly
  (:mod:`dpfy.accounting.gaussian`). This assumes the other examples' batches do not depend on
  the differing example, as under zero-out adjacency (it is replaced by a zero-weight
  placeholder) -- the setting of Chua et al.; the guide (Sec. 2) treats zero-out and
  add/remove as essentially equivalent.
* lower bound (shuffle only): the pair of Chua et al. (2024a) that a shuffled run dominates.
  With the non-differing examples' gradients -1 and the differing one +1 (vs. zeroed out), the
  batch sums shifted by the batch size are
      P_S = (1/T) sum_t N(2 e_t, z^2 I_T)   vs   Q_S = (1/T) sum_t N(e_t, z^2 I_T).
  Any post-processing gives a lower bound; we use the bit 1{max_t x_t > c} per epoch (epochs
  shuffle independently), whose counts are binomial, maximised over c and both directions
  (:mod:`dpfy.accounting.lower_bounds`, shared with the Balls-and-Bins lower bound).
  For a deterministic run the same construction gives exactly the upper bound (tight).

A Poisson RDP/PLD number for a shuffled run is refused by those accountants
(``UnsupportedEventError``); the report can show it beside these bounds as what it is not.
"""

from __future__ import annotations

import dataclasses
import math

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting._api import (
    PrivacyResult,
    UnsupportedEventError,
    contains,
    first_unsupported,
    register_accountant,
)
from dpfy.accounting.gaussian import epoch_adjacency_reason, gaussian_delta, gaussian_epsilon
from dpfy.accounting.lower_bounds import (
    MaxBitPair,
    epsilon_from_lower_delta,
    max_bit_lower_delta,
)

UPPER_NOTE = (
    "upper bound without amplification: each example is in one batch per epoch (exact Gaussian "
    "composition, mu = sqrt(epochs)/z); assumes the other examples' batches do not depend on "
    "the differing example (zero-out adjacency)"
)
LOWER_NOTE = (
    "epsilon_lower: a max-bit lower bound on the shuffled-epoch pair of Chua et al. (2024a) "
    "(zero-out adjacency): a threshold test on each epoch's largest coordinate, composed over "
    "epochs by counting; it is weaker than Chua et al.'s own bound over several epochs, so "
    "the true epsilon may lie higher still; no tight upper bound with amplification is known "
    "for shuffling"
)


def _unsupported(event: ev.Event) -> str | None:
    return first_unsupported(event, _unsupported_leaf)


def _unsupported_leaf(event: ev.Event) -> str | None:
    if isinstance(event, ev.Shuffled | ev.Deterministic):
        reason = epoch_adjacency_reason(event)
        if reason is not None:
            return reason
    if isinstance(event, ev.Shuffled | ev.Deterministic | ev.Gaussian):
        if event.adjacency_relation is ev.Adjacency.REPLACE_ONE:
            return f"{type(event).__name__} with replace_one adjacency"
        return None
    return f"{type(event).__name__} is not a shuffled/deterministic run or a Gaussian"


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    kind: str  # "shuffle" or "gaussian" (a deterministic epoch is one Gaussian use)
    noise_multiplier: float
    steps: int


def _parts(event: ev.Event) -> list[tuple[_Part, int]]:
    """(part, count) pairs; a Deterministic epoch is a Gaussian with shift 1."""
    if isinstance(event, ev.Shuffled):
        return [(_Part("shuffle", event.noise_multiplier, event.steps_per_epoch), event.epochs)]
    if isinstance(event, ev.Deterministic):
        return [(_Part("gaussian", event.noise_multiplier, 1), event.epochs)]
    if isinstance(event, ev.Gaussian):
        return [(_Part("gaussian", event.noise_multiplier, 1), 1)]
    if isinstance(event, ev.SelfComposed):
        return [(p, k * event.count) for p, k in _parts(event.event)]
    out: list[tuple[_Part, int]] = []
    if not isinstance(event, ev.Composed):  # the caller checked the tree (_unsupported)
        raise TypeError(f"{type(event).__name__} is not a shuffled/deterministic run or a Gaussian")
    for e in event.events:
        out.extend(_parts(e))
    return out


def _merge(parts: list[tuple[_Part, int]]) -> list[tuple[_Part, int]]:
    counts: dict[_Part, int] = {}
    for p, k in parts:
        counts[p] = counts.get(p, 0) + k
    return [(p, k) for p, k in counts.items() if k > 0]


def no_amplification_mu(event: ev.Event) -> float:
    """mu of the no-amplification bound: sqrt(sum over epochs and Gaussians of 1/z^2)."""
    reason = _unsupported(event)
    if reason is not None:
        raise UnsupportedEventError(f"method='shuffle' cannot account this event: {reason}")
    return math.sqrt(sum(k / p.noise_multiplier**2 for p, k in _parts(event)))


def _max_bit_pair(part: _Part) -> MaxBitPair:
    """The pair of one use, for the shared max-bit lower bound (:mod:`.lower_bounds`).

    A shuffled epoch puts the differing example's coordinate at mean 2 (P) or 1 (Q) on top of
    the other batches' shift (Chua et al. 2024a); a Gaussian use is shift 1 against 0.
    """
    if part.kind == "shuffle":
        return MaxBitPair(part.noise_multiplier, part.steps, shift_p=2.0, shift_q=1.0)
    return MaxBitPair(part.noise_multiplier, 1, shift_p=1.0, shift_q=0.0)


def shuffle_lower_bound_delta(event: ev.Event, epsilon: float, *, grid: int = 513) -> float:
    """A certain lower bound on delta(epsilon) of a shuffled/deterministic run: the max-bit
    post-processing (:mod:`.lower_bounds`) of each epoch's pair of Chua et al. 2024a, composed
    over epochs by counting (weaker than their multi-epoch bound, never above the truth).

    Example:
      >>> e = ev.Shuffled(1.0, steps_per_epoch=100)
      >>> 0.0 < shuffle_lower_bound_delta(e, 1.0) < 1.0
      True
    """
    check_range("epsilon", epsilon, 0.0, None)
    reason = _unsupported(event)
    if reason is not None:
        raise UnsupportedEventError(f"method='shuffle' cannot account this event: {reason}")
    groups = [(_max_bit_pair(p), k) for p, k in _merge(_parts(event))]
    return max_bit_lower_delta(groups, epsilon, grid=grid, s_min=-8.0)


def shuffle_lower_bound_epsilon(event: ev.Event, delta: float) -> float:
    """Largest epsilon certainly spent at ``delta`` (root of the lower-bound delta curve)."""
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return epsilon_from_lower_delta(lambda e: shuffle_lower_bound_delta(event, e), delta)


def _has_shuffle(event: ev.Event) -> bool:
    return any(p.kind == "shuffle" for p, _ in _parts(event))


@dataclasses.dataclass(frozen=True)
class ShuffleAccountant:
    """``shuffle``: no-amplification upper bound (provable) + a max-bit lower bound on the
    shuffled-epoch pair of Chua et al. 2024a."""

    name: str = "shuffle"

    def unsupported(self, event: ev.Event) -> str | None:
        reason = _unsupported(event)
        if reason is None and not contains(event, (ev.Shuffled, ev.Deterministic)):
            return (
                f"{type(event).__name__} has no shuffled or deterministic epoch (pure Gaussian "
                "compositions belong to the exact 'gaussian' accountant)"
            )
        return reason

    def _notes(self, event: ev.Event, mu: float) -> tuple[str, ...]:
        notes = [f"{UPPER_NOTE}; mu = {mu:.6g}"]
        if _has_shuffle(event):
            notes.append(LOWER_NOTE)
        else:
            notes.append("deterministic batches: the lower bound equals the upper bound")
        return tuple(notes)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        mu = no_amplification_mu(event)
        upper = float(gaussian_epsilon(mu, delta))
        lower = shuffle_lower_bound_epsilon(event, delta) if _has_shuffle(event) else upper
        return PrivacyResult(
            epsilon=upper,
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=True,
            epsilon_lower=min(lower, upper),
            notes=self._notes(event, mu),
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        check_range("epsilon", epsilon, 0.0, None)
        mu = no_amplification_mu(event)
        upper = float(gaussian_delta(mu, epsilon))
        notes = self._notes(event, mu)
        if _has_shuffle(event):
            low = min(shuffle_lower_bound_delta(event, epsilon), upper)
            notes = (*notes, f"delta lower bound (Chua et al. 2024a): {low:.6g}")
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=upper,
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=True,
            notes=notes,
        )


register_accountant(ShuffleAccountant(), auto=True)

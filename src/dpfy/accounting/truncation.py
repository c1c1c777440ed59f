"""The extra delta of truncating batches to a maximum batch size.

Chua et al. 2024b, Prop. 3.2; ``docs/architecture.md``, section 5.10.

Fixed-shape training cuts a batch longer than ``max_batch_size`` down to a random subset of that
size. The truncated mechanism behaves exactly like the untruncated one unless some batch is
over-full, so (Chua et al. 2024b, "Scalable DP-SGD: Shuffling vs. Poisson subsampling",
Prop. 3.2; Chua et al. 2025, App. C, for Balls-and-Bins) its guarantee is the untruncated one
plus a term driven by

    p = P(some batch of the run exceeds max_batch_size)
      <= steps * P(Binomial(dataset_size + 1, sampling_rate) > max_batch_size)     (union bound)

where every batch is marginally Binomial(N, q) (Poisson with rate q; Balls-and-Bins with
q = 1 / steps_per_epoch) and N + 1 covers the larger of two add/remove-neighbouring datasets.

How p enters delta. Couple the truncated run A with the untruncated run M on the same coins;
they differ only when a batch is over-full. For neighbours D, D' and any set S:
    A(D)(S) <= M(D)(S) + p <= e^eps M(D')(S) + delta_M + p
            <= e^eps A(D')(S) + delta_M + (1 + e^eps) p.
So A is (eps, delta_M(eps) + (1 + e^eps) p)-DP: :func:`truncated_delta` states this, and
:func:`truncated_epsilon` solves it for epsilon at a target delta. This is the safe generic
coupling bound; tighter mixture analyses exist (dp_accounting's
TruncatedSubsampledGaussianDpEvent), but this one needs nothing of the mechanism.

Central wiring: accountants account the mechanism of ``TruncatedPoisson`` /
``TruncatedBallsAndBins`` as if untruncated; the public ``epsilon()`` / ``delta()`` add the
truncation term using :func:`event_truncation_probability` of the whole event tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dpfy import events as ev
from dpfy._validate import check_int, check_range


def truncation_delta(
    sampling_rate: float, dataset_size: int, max_batch_size: int, steps: int
) -> float:
    """Probability that at least one of ``steps`` batches exceeds ``max_batch_size``.

    Each batch is (marginally) Binomial(dataset_size + 1, sampling_rate); the union bound over
    steps is computed stably with ``scipy.stats.binom.sf`` (accurate far into the tail).

    Args:
      sampling_rate: per-step inclusion probability q (Balls-and-Bins: 1 / steps_per_epoch).
      dataset_size: number of examples N (the bound uses N + 1, the larger neighbour).
      max_batch_size: the truncation threshold B_max.
      steps: number of batches drawn (all epochs).

    Returns:
      ``min(1, steps * P(Bin(N + 1, q) > B_max))``.

    Example:
      >>> truncation_delta(0.01, 60_000, 800, 6_000) < 1e-10  # q N = 600, 6000 steps
      True
    """
    check_range("sampling_rate", sampling_rate, 0.0, 1.0, low_open=True)
    check_int("dataset_size", dataset_size)
    check_int("max_batch_size", max_batch_size)
    check_int("steps", steps, 0)
    from scipy import stats

    per_step = float(stats.binom.sf(int(max_batch_size), int(dataset_size) + 1, sampling_rate))
    return min(1.0, int(steps) * per_step)


def event_truncation_probability(event: ev.Event) -> float:
    """Union bound of the over-full-batch probability over every truncated sub-event.

    ``TruncatedPoisson`` and ``TruncatedBallsAndBins`` contribute :func:`truncation_delta`;
    ``SelfComposed`` multiplies by its count; other events contribute 0.
    """
    if isinstance(event, ev.TruncatedPoisson):
        return truncation_delta(
            event.sampling_rate, event.dataset_size, event.max_batch_size, event.steps
        )
    if isinstance(event, ev.TruncatedBallsAndBins):
        return truncation_delta(
            1.0 / event.steps_per_epoch,
            event.dataset_size,
            event.max_batch_size,
            event.steps_per_epoch * event.epochs,
        )
    if isinstance(event, ev.SelfComposed):
        return min(1.0, event.count * event_truncation_probability(event.event))
    return min(1.0, sum(event_truncation_probability(c) for c in ev._children(event)))


def truncated_delta(mechanism_delta: float, epsilon: float, probability: float) -> float:
    """Delta of the truncated run: ``mechanism_delta + (1 + e^epsilon) * probability`` (<= 1)."""
    check_range("epsilon", epsilon, 0.0, None)
    return min(1.0, mechanism_delta + (1.0 + math.exp(min(epsilon, 700.0))) * probability)


def truncated_epsilon(
    epsilon_of_delta: Callable[[float], float],
    delta: float,
    probability: float,
    *,
    tol: float = 1e-9,
) -> float:
    """Smallest epsilon with ``mechanism_delta + (1 + e^eps) p <= delta`` (safe side).

    ``epsilon_of_delta(d)`` is the mechanism's epsilon at delta ``d`` (non-increasing in ``d``).
    The budget left to the mechanism, ``delta - (1 + e^eps) p``, shrinks as epsilon grows, so
    the answer is the least fixed point ``eps = epsilon_of_delta(delta - (1 + e^eps) p)``
    (returned slightly above it, so it is certified); ``inf`` if there is none.
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    check_range("probability", probability, 0.0, 1.0)
    if probability == 0.0:
        return float(epsilon_of_delta(delta))
    if 2.0 * probability >= delta:
        return math.inf

    def g(eps: float) -> float:  # the mechanism's epsilon at the delta left by truncation
        rest = delta - (1.0 + math.exp(min(eps, 700.0))) * probability
        return math.inf if rest <= 0.0 else float(epsilon_of_delta(rest))

    # g is non-decreasing, so iterating from g(0) climbs monotonically to the least fixed point
    # e* = g(e*) (every eps >= g(eps) is certified); a run-away sequence means no fixed point.
    eps = g(0.0)
    for _ in range(500):
        if not math.isfinite(eps):
            return math.inf
        step = eps + tol * max(1.0, eps)
        if g(step) <= step:
            return step
        eps = g(step)
    return math.inf

"""The estimator over kept loss samples (plain, importance and order-statistics sampling).

For each direction the integrand (1 - e^(eps - L))_+ is a [0, 1]-valued function of a loss
sample L, so delta = weight x its mean over the n draws, with the KL upper confidence bound
of :mod:`.confidence` (Chua et al. 2025, Alg. 4). ``weight`` is 1, or the exact probability of
the importance-sampling event (Chua et al. 2025, Alg. 5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dpfy.accounting.monte_carlo.base import (
    DIRECTIONS,
    Direction,
    DirectionPair,
    FloatArray,
    Job,
    LossSamples,
)
from dpfy.accounting.monte_carlo.confidence import kl_upper_bound
from dpfy.accounting.monte_carlo.epochs import Epoch

EpochLosses = Callable[[int, Epoch], tuple[FloatArray, FloatArray]]
"""(epoch index, epoch) -> (remove, add) loss samples of that epoch, n each."""


def summed_losses(job: Job, per_epoch: EpochLosses) -> LossSamples:
    """Total (remove, add) losses over the job's epochs (losses add under composition), kept
    above the job's threshold and sorted."""
    rem = np.zeros(job.n)
    add = np.zeros(job.n)
    for i, ep in enumerate(job.epochs):
        r, a = per_epoch(i, ep)
        rem += r
        add += a
    return LossSamples(
        job.n, np.sort(rem[rem > job.threshold]), np.sort(add[add > job.threshold])
    )


class EmpiricalLosses:
    """Kept loss samples of both directions, with their counts and importance weights."""

    def __init__(
        self, results: Sequence[LossSamples], threshold: float, error_probability: float
    ) -> None:
        self._error_probability = error_probability
        self.n = sum(r.n for r in results)
        self.threshold = threshold
        self.values = {
            d: np.sort(np.concatenate([r.values(d) for r in results])) for d in DIRECTIONS
        }
        self.weights = {d: float(results[0].weight(d)) for d in DIRECTIONS}

    @property
    def error_probability(self) -> float:
        return self._error_probability

    def mean(self, direction: Direction, epsilon: float) -> float:
        """Mean of (1 - e^(eps - L))_+ over the n draws (dropped losses contribute 0)."""
        v = self.values[direction]
        v = v[v > epsilon]
        return float(np.sum(-np.expm1(epsilon - v)) / self.n)

    def estimate(self, epsilon: float) -> float:
        """Point estimate of delta at epsilon (maximum over directions)."""
        return max(self.weights[d] * self.mean(d, epsilon) for d in DIRECTIONS)

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, Direction]:
        """(estimate, upper bound, direction of the upper bound) of delta at epsilon."""
        best: tuple[float, float, Direction] = (-1.0, -1.0, "remove")
        est_max = 0.0
        for d in DIRECTIONS:
            m = self.mean(d, epsilon)
            w = self.weights[d]
            ub = w * float(kl_upper_bound(m, self.n, error_probability))
            est_max = max(est_max, w * m)
            if ub > best[1]:
                best = (w * m, ub, d)
        return est_max, best[1], best[2]

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def top(self) -> float:
        """An epsilon above every kept loss (the integrand vanishes beyond it)."""
        return max([self.threshold + 1.0] + [float(v[-1]) for v in self.values.values() if len(v)])

    def by_direction(self, epsilon: float) -> tuple[DirectionPair, DirectionPair]:
        """((remove, add) estimates, (remove, add) importance scales) at epsilon."""
        rem, add = (self.weights[d] * self.mean(d, epsilon) for d in DIRECTIONS)
        return (rem, add), (self.weights["remove"], self.weights["add"])

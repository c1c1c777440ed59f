"""One epoch, each direction from its best estimator: remove from the tilted sampler
(:mod:`.tilted`), add from the conditional sampler (:mod:`.conditional`) or the tilted
sampler's certain Renyi bound, whichever is smaller.
"""

from __future__ import annotations

import math

from dpfy.accounting.monte_carlo.base import Direction, DirectionPair
from dpfy.accounting.monte_carlo.conditional import ConditionalLosses
from dpfy.accounting.monte_carlo.tilted import TiltedLosses


class HybridLosses:
    """One epoch: remove direction from the tilted sampler, add direction from the conditional.

    Each direction's bound holds with probability >= 1 - error_probability on its own; the
    dominating direction is fixed, so the maximum is a bound at that error probability.
    """

    def __init__(self, tilted: TiltedLosses, conditional: ConditionalLosses) -> None:
        self.tilted, self.cond = tilted, conditional

    @property
    def error_probability(self) -> float:
        return self.tilted.error_probability

    def estimate(self, epsilon: float) -> float:
        return max(self.tilted.estimate(epsilon), self.cond.direction_estimate("add", epsilon))

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, Direction]:
        rem = self.tilted.remove(epsilon)[1]
        # the Renyi bound is certain, so the minimum keeps the conditional bound's error rate
        add = min(self.cond.direction_upper("add", epsilon), self.tilted.add_bound(epsilon))
        return self.estimate(epsilon), max(rem, add), "remove" if rem >= add else "add"

    def upper(self, epsilon: float) -> float:
        return self.delta(epsilon, self.error_probability)[1]

    def by_direction(self, epsilon: float) -> tuple[DirectionPair, DirectionPair]:
        est = (self.tilted.estimate(epsilon), self.cond.direction_estimate("add", epsilon))
        return est, (self.tilted.scale(epsilon), 1.0)

    def top(self) -> float:
        return math.inf

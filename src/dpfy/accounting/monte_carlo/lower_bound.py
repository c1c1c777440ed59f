"""The certain lower bound of Balls-and-Bins epochs (Chua et al. 2025, Eq. 6, extended to
several epochs): each epoch mapped onto the shared max-bit bound of
:mod:`dpfy.accounting.lower_bounds`, whose pair for one epoch is
P = (1/T) sum_t N(e_t, z^2 I_T) vs Q = N(0, z^2 I_T) (shift 1 against 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from dpfy._validate import check_range
from dpfy.accounting.lower_bounds import (
    MaxBitPair,
    epsilon_from_lower_delta,
    max_bit_lower_delta,
)
from dpfy.accounting.monte_carlo.epochs import Epoch, group_epochs


def lower_bound_delta(epochs: Sequence[Epoch], epsilon: float, *, grid: int = 513) -> float:
    """A certain lower bound on the Balls-and-Bins delta(epsilon) (both directions).

    Each epoch is post-processed to the bit 1{max_t x_t > c}; groups of identical epochs give
    binomial counts, whose hockey-stick divergence is exact. Different groups use thresholds
    c = z * s + 1/2 with one shared s, and are composed by pairing their count distributions.
    The best s on a grid (refined once) is returned; any s gives a valid lower bound.
    """
    check_range("epsilon", epsilon, 0.0, None)
    groups = [(MaxBitPair(e.noise_multiplier, e.steps), k) for e, k in group_epochs(epochs)]
    return max_bit_lower_delta(groups, epsilon, grid=grid, s_min=-6.0)


def lower_bound_epsilon(epochs: Sequence[Epoch], delta: float) -> float:
    """Largest epsilon certainly spent at ``delta``: the root of ``lower_bound_delta = delta``."""
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return epsilon_from_lower_delta(lambda e: lower_bound_delta(epochs, e), delta)

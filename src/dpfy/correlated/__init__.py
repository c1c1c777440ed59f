"""Correlated-noise (DP-FTRL / matrix-factorization) mechanisms: the strategy math.

A matrix mechanism releases the prefix sums ``A x`` of clipped gradients ``x`` (``A`` the
lower-triangular all-ones workload, :mod:`.workload`) through a factorisation ``A = B C``:
it releases ``C x + z`` with ``z ~ N(0, sigma^2 I)`` and decodes ``B (C x + z) = A x + B z``.
In training the same release is obtained by adding the per-step noise ``C^{-1} z`` to each
step's clipped sum (Denisov et al. 2022; Choquette-Choo et al. 2023).

Strategies (one module each): tree aggregation (:mod:`.tree`, Kairouz et al. 2021), the full
tree with Honaker's efficient estimator (:mod:`.tree_efficient`, Honaker 2015), banded
Toeplitz matrix factorization (:mod:`.bandmf`, Choquette-Choo et al. 2023) and buffered
linear Toeplitz (:mod:`.blt`, McMahan et al. 2024). Each module registers its strategy
class (:func:`register_strategy`, :mod:`.strategy`): its matrix, sensitivity and noise stream.
Participation schemas and the exact sensitivity of a strategy under them live in
:mod:`.schemas`.

NumPy/SciPy only: no torch, no ledger, no training (checked by ``tests/test_architecture.py``);
the noise streams work on the tensors, and the tensor library (``xp``), they are handed.
"""

from __future__ import annotations

from dpfy.correlated.strategy import Strategy, register_strategy

# The built-in strategies, in registry order: each module registers its class on import.
# isort: off
from dpfy.correlated.bandmf import BandMF
from dpfy.correlated.blt import BLT
from dpfy.correlated.tree import TreeAggregation
from dpfy.correlated import tree_efficient as _tree_efficient  # noqa: F401  (registers it)
# isort: on
from dpfy.correlated.plan import CorrelatedPlan, make_plan
from dpfy.correlated.schemas import Cyclic, MinSeparation, SingleEpoch

__all__ = [
    "make_plan",
    "CorrelatedPlan",
    "Cyclic",
    "SingleEpoch",
    "MinSeparation",
    "BandMF",
    "BLT",
    "TreeAggregation",
    "Strategy",
    "register_strategy",
]

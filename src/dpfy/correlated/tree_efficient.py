"""Tree aggregation with the efficient estimator (Honaker 2015, "Efficient use of
differentially private binary trees"; Kairouz et al. 2021, "Practical and private (deep)
learning without sampling or shuffling", the appendix on the efficient tree estimator).

The strategy is the FULL binary tree of :class:`~dpfy.correlated.tree.TreeAggregation`:
every dyadic node ``[j 2^l, (j + 1) 2^l)`` with ``(j + 1) 2^l <= T`` is released, with fresh
noise ``N(0, sigma^2)``, at the step its interval completes. At step ``t`` (``n = t + 1``)
those are the nodes ending at ``n``: one per level ``l`` with ``2^l | n`` (levels
``0..low(n)``, ``low(n)`` the index of the lowest set bit of ``n``). ``C`` is the
``nodes x T`` indicator matrix of the full tree, so the sensitivity equals the plain tree's
(same ``C``), only the decoder ``B`` changes.

Decoder (streaming BLUE). Per unit ``sigma^2``, a completed node of level ``l`` gets the
estimate ``h = v_l y + (1 - v_l) (h_left + h_right)`` (its own noisy value ``y`` and its two
children's estimates, inverse-variance weighted), whose variance is
``v_0 = 1, v_l = 1 / (1 + 1 / (2 v_{l-1}))`` (:func:`level_variances`). The prefix sum of
steps ``0..t`` is estimated by the sum of the estimates of the decomposition nodes of ``n``
(one per set bit), so its variance is ``sum_{bits l of n} v_l`` (:func:`prefix_variances`).

Why this is the least-squares (best linear unbiased) estimate from all nodes completed by
step ``t``:

1. *The completed nodes are exactly the subtrees under the decomposition nodes of n.* A
   decomposition node ``D`` of level ``l`` starts at ``s``, the sum of the bits of ``n``
   above ``l``, a multiple of ``2^{l+1}``; so its parent is ``[s, s + 2^{l+1})``, which ends
   beyond ``n`` (the bits of ``n`` below ``l`` sum to less than ``2^l``) and is not complete.
   Dyadic intervals are nested or disjoint, the decomposition nodes tile ``[0, n)``, and no
   completed node strictly contains one of them (it would contain its parent); so every
   completed node lies inside exactly one decomposition node.
2. *Within one full subtree, the bottom-up recursion is the BLUE of its root's sum*
   (induction on the level). Level 0: the node's own value is the only measurement of that
   leaf. Level ``l``: any linear unbiased estimator of the root sum ``S = S_L + S_R`` reads
   ``a y + f_L + f_R`` with ``f_L`` (``f_R``) linear in the measurements of the left (right)
   subtree. Its mean ``a S + E f_L + E f_R`` must equal ``S_L + S_R`` for every input, and
   ``E f_L`` depends on the left leaves only, so ``E f_L = (1 - a) S_L``, ``E f_R = (1 - a)
   S_R``: ``f_L / (1 - a)`` is unbiased for ``S_L`` and has variance ``>= v_{l-1}`` (induction),
   with equality for the children's estimates. The three parts are independent, so the
   variance is ``>= a^2 + 2 (1 - a)^2 v_{l-1}``, minimised at ``a = v_l`` with value ``v_l``,
   attained by the recursion.
3. *The prefix estimate is the BLUE of the prefix sum.* By 1 the measurements split into
   independent groups, one per decomposition node, each depending on that node's inputs only;
   the same argument as in 2 (each group's part must be unbiased for its own sum) makes the
   sum of the per-subtree BLUEs the BLUE of the total.

So row ``t`` of ``B`` equals ``a_n^T pinv(C_n)`` (``C_n`` the rows of the completed nodes,
``a_n`` the prefix indicator; checked numerically in the tests) and ``B C = A``. In training
the per-step noise is the difference of consecutive prefix estimates; the registered strategy
:class:`EfficientTree` (``"tree-efficient"``) streams it (:class:`EfficientTreeStream`) with
one buffer per level (``O(log T x params)`` memory, never a ``T x T`` matrix).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from dpfy._validate import check_int
from dpfy.correlated.schemas import Schema
from dpfy.correlated.strategy import (
    AddNoise,
    NoiseStream,
    Params,
    Strategy,
    Tensor,
    register_strategy,
)
from dpfy.correlated.tree import TreeAggregation


def level_variances(levels: int) -> np.ndarray:
    """``v_0..v_{levels-1}``: variance of a level-``l`` node's estimate per unit ``sigma^2``.

    ``v_l`` is also the weight of the node's own noisy value in its estimate (the children's
    sum gets ``1 - v_l``). Decreasing from 1 towards 1/2.
    """
    check_int("levels", levels)
    v = np.empty(levels)
    v[0] = 1.0
    for level in range(1, levels):
        v[level] = 1.0 / (1.0 + 1.0 / (2.0 * v[level - 1]))
    return v


def prefix_variances(steps: int) -> np.ndarray:
    """Variance of the estimated prefix noise at each step, per unit ``sigma^2``
    (``sum_{set bits l of t + 1} v_l``); the plain tree's is ``popcount(t + 1)``."""
    check_int("steps", steps)
    v = level_variances(steps.bit_length())
    n = np.arange(1, steps + 1)
    bits = (n[:, None] >> np.arange(v.size)[None, :]) & 1
    return np.asarray(bits @ v, dtype=float)


def efficient_decoder_matrix(steps: int) -> np.ndarray:
    """``B`` (``T x nodes``, node order of :class:`TreeAggregation`): row ``t`` is the
    streaming BLUE of the prefix sum of steps ``0..t`` from the nodes completed by then."""
    tree = TreeAggregation(steps)
    index = {node: i for i, node in enumerate(tree.nodes)}
    v = level_variances(steps.bit_length())
    est: dict[tuple[int, int], np.ndarray] = {}
    for level, j in sorted(tree.nodes):
        row = np.zeros(len(tree.nodes))
        row[index[(level, j)]] = v[level]
        if level:
            row += (1.0 - v[level]) * (est[(level - 1, 2 * j)] + est[(level - 1, 2 * j + 1)])
        else:
            row[index[(level, j)]] = 1.0
        est[(level, j)] = row
    b = np.zeros((steps, len(tree.nodes)))
    for t in range(steps):
        for node in tree.decomposition(t):
            b[t] += est[node]
    return b


def efficient_noise_map(steps: int) -> np.ndarray:
    """``G = A^{-1} B`` (``T x nodes``): the per-step noise is ``G z``, ``z`` the node noises;
    ``G C = I`` (``B C = A``), so the model's prefix sums are ``A x + B z``."""
    b = efficient_decoder_matrix(steps)
    return np.asarray(np.diff(b, axis=0, prepend=0.0))


@register_strategy
class EfficientTree(Strategy):
    """The full tree with the efficient estimator (``"tree-efficient"``; no numbers).

    ``C`` is the ``nodes x T`` matrix of :class:`TreeAggregation` (not square), the same
    column norms and sensitivity as the plain tree; the per-step noise is ``G z`` with
    ``G = A^{-1} B`` (:func:`efficient_noise_map`), ``G C = I``. Its prefix noise has
    variance ``sum_{bits l of t + 1} v_l`` instead of the plain tree's ``popcount(t + 1)``.
    """

    name = "tree-efficient"

    @classmethod
    def from_params(cls, params: Params, steps: int) -> EfficientTree:
        return cls()

    @classmethod
    def optimised(
        cls, steps: int, schema: Schema, *, band: int, buffers: int, maxiter: int
    ) -> EfficientTree:
        return cls()

    def params(self) -> dict[str, tuple[float, ...]]:
        return {}

    def strategy_matrix(self, steps: int) -> np.ndarray:
        return TreeAggregation(steps).strategy_matrix()

    def noise_map(self, steps: int) -> np.ndarray:
        return efficient_noise_map(steps)

    def apply(self, u: np.ndarray) -> np.ndarray:
        """Each level's complete blocks (node order of :class:`TreeAggregation`)."""
        u = np.asarray(u, dtype=float)
        steps = u.size
        prefix = np.concatenate(([0.0], np.cumsum(u)))
        return np.concatenate([
            prefix[np.arange(1, (steps >> lv) + 1) << lv]
            - prefix[np.arange(0, steps >> lv) << lv]
            for lv in range(steps.bit_length())
        ])

    def sensitivity(self, steps: int) -> float:
        return float(np.sqrt(steps.bit_length()))  # step 0 is in one complete node per level

    def prefix_error(self, steps: int) -> float:
        return float(prefix_variances(steps).sum())  # sum_{bits l of t + 1} v_l

    def state_rows(self, steps: int) -> int:
        return max(steps.bit_length(), 1)

    def stream(
        self, steps: int, size: int, like: Tensor, xp: ModuleType
    ) -> EfficientTreeStream:
        return EfficientTreeStream(steps, size, self.state_rows(steps), like)


class EfficientTreeStream(NoiseStream):
    """``low(t + 1) + 1`` fresh node noises per step (the nodes ending at ``t + 1``, level 0
    first), folded bottom-up into the estimate ``h <- v_l z + (1 - v_l) (h + est_{l-1})``;
    ``w_t = h - sum_{l < low} est_l``, then ``est_low = h`` (row ``l`` holds ``est_l``)."""

    def __init__(self, steps: int, size: int, rows: int, like: Tensor) -> None:
        super().__init__(steps, size, rows, like)
        #: v_l, the weight of a level-l node's own value in its estimate
        self.weights: list[float] = level_variances(max(rows, 1)).tolist()

    def draws(self) -> int:
        n = self.step + 1
        return (n & -n).bit_length()

    def _next(self, z: Tensor, refill: Callable[[], None] | None, add: AddNoise | None) -> Tensor:
        low = self.draws() - 1
        if low and refill is None:
            raise ValueError(f"step {self.step} needs {low + 1} fresh draws: pass refill")
        w, buf = self.w, self.buf
        w.copy_(z)  # the leaf's estimate
        for level in range(1, low + 1):
            assert refill is not None
            refill()  # the node of this level: its own noisy value
            v = self.weights[level]
            w.add_(buf[level - 1]).mul_(1.0 - v).add_(z, alpha=v)
        buf[low].copy_(w)
        if low:
            w.sub_(buf[:low].sum(0))
            buf[:low].zero_()
        return w

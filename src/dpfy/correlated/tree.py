"""Tree aggregation (Kairouz et al. 2021, "Practical and private (deep) learning without
sampling or shuffling", Sec. 3; the binary-tree mechanism of Dwork et al. 2010).

Each node of a binary tree over the steps holds the sum of a dyadic interval
``[j 2^l, (j + 1) 2^l)`` of clipped gradients plus fresh Gaussian noise; a node is released when
its interval is complete (``(j + 1) 2^l <= T``). The prefix sum up to step ``t`` is read off the
nodes of the binary decomposition of ``t + 1`` (one per set bit), so its noise has variance
``popcount(t + 1) sigma^2``. One example in one step touches one node per level:
single-epoch sensitivity ``sqrt(floor(log2 T) + 1)`` (:func:`tree_sensitivity`).

:class:`TreeAggregation` is the full tree (every complete node; the ``C`` of the efficient
estimator, :mod:`.tree_efficient`). A training run streams the square form, :class:`Tree`
(``"tree"``): one node per step, one noise buffer per level (``O(log T x params)`` memory), the
per-step noise the difference of consecutive prefix noises (:class:`TreeStream`).
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


def tree_sensitivity(steps: int) -> float:
    """Closed-form single-epoch sensitivity of tree aggregation: ``sqrt(floor(log2 T) + 1)``."""
    check_int("steps", steps)
    return float(np.sqrt(steps.bit_length()))


class TreeAggregation:
    """The tree-aggregation factorisation ``A = B C`` for ``steps`` steps.

    Args:
        steps: number of steps ``T`` (``>= 1``).
    """

    def __init__(self, steps: int) -> None:
        check_int("steps", steps)
        self.steps = steps
        self.nodes: list[tuple[int, int]] = [
            (level, j) for level in range(steps.bit_length()) for j in range(steps >> level)
        ]
        self._index = {node: i for i, node in enumerate(self.nodes)}

    def strategy_matrix(self) -> np.ndarray:
        """``C`` (``nodes x T``): row of node ``(l, j)`` is the indicator of its interval."""
        c = np.zeros((len(self.nodes), self.steps))
        for i, (level, j) in enumerate(self.nodes):
            c[i, j << level : (j + 1) << level] = 1.0
        return c

    def decomposition(self, step: int) -> list[tuple[int, int]]:
        """The nodes summing to the prefix sum of steps ``0..step`` (one per set bit of step+1)."""
        check_int("step", step, low=0, high=self.steps - 1)
        n, out, start = step + 1, [], 0
        for level in range(n.bit_length() - 1, -1, -1):
            if n >> level & 1:
                out.append((level, start >> level))
                start += 1 << level
        return out

    def decoder_matrix(self) -> np.ndarray:
        """``B`` (``T x nodes``) with ``B C = A``, the prefix-sum workload."""
        b = np.zeros((self.steps, len(self.nodes)))
        for t in range(self.steps):
            for node in self.decomposition(t):
                b[t, self._index[node]] = 1.0
        return b


@register_strategy
class Tree(Strategy):
    """Tree aggregation in its square form (``"tree"``; a plan records no numbers).

    At step ``t`` (``n = t + 1``) exactly one node of the binary decomposition of a prefix is
    completed, the node ``[n - lowbit(n), n)``; the nodes no prefix uses are never drawn. Row
    ``t`` of ``C`` is the indicator of that interval, its column norms are those of the full
    tree (``sqrt(floor(log2 T) + 1)`` for the first step), and the per-step noise
    ``C^{-1} z`` is the difference of consecutive prefix noises (Kairouz et al. 2021).
    """

    name = "tree"

    @classmethod
    def from_params(cls, params: Params, steps: int) -> Tree:
        return cls()

    @classmethod
    def optimised(
        cls, steps: int, schema: Schema, *, band: int, buffers: int, maxiter: int
    ) -> Tree:
        return cls()

    def params(self) -> dict[str, tuple[float, ...]]:
        return {}

    def strategy_matrix(self, steps: int) -> np.ndarray:
        c = np.zeros((steps, steps))
        for n in range(1, steps + 1):
            c[n - 1, n - (n & -n) : n] = 1.0
        return c

    def noise_map(self, steps: int) -> np.ndarray:
        return np.asarray(np.linalg.inv(self.strategy_matrix(steps)))

    def apply(self, u: np.ndarray) -> np.ndarray:
        u = np.asarray(u, dtype=float)
        n = np.arange(1, u.size + 1)
        prefix = np.concatenate(([0.0], np.cumsum(u)))
        return np.asarray(prefix[n] - prefix[n - (n & -n)])

    def sensitivity(self, steps: int) -> float:
        n = np.arange(1, steps + 1)  # how many drawn nodes hold each step
        cover = np.zeros(steps + 1)
        np.add.at(cover, n - (n & -n), 1.0)
        np.add.at(cover, n, -1.0)
        return float(np.sqrt(np.cumsum(cover)[:steps].max()))

    def prefix_error(self, steps: int) -> float:
        # prefix t is the sum of popcount(t + 1) node noises
        return float(sum(bin(t).count("1") for t in range(1, steps + 1)))

    def state_rows(self, steps: int) -> int:
        return max(steps.bit_length(), 1)

    def stream(self, steps: int, size: int, like: Tensor, xp: ModuleType) -> TreeStream:
        return TreeStream(steps, size, self.state_rows(steps), like)


class TreeStream(NoiseStream):
    """The node noise of each level of the current binary decomposition (row ``l``):
    ``w_t = z_t - sum_{l < low(t + 1)} node_l``, then ``node_low = z_t``."""

    def _next(self, z: Tensor, refill: Callable[[], None] | None, add: AddNoise | None) -> Tensor:
        n = self.step + 1
        low = (n & -n).bit_length() - 1  # the level of the node completed at this step
        w, buf = self.w, self.buf
        w.copy_(z)
        if low:
            w.sub_(buf[:low].sum(0))
            buf[:low].zero_()
        buf[low].copy_(z)
        return w

"""Tree aggregation (Kairouz et al. 2021, "Practical and private (deep) learning without
sampling or shuffling", Sec. 3; the binary-tree mechanism of Dwork et al. 2010).

Each node of a binary tree over the steps holds the sum of a dyadic interval
``[j 2^l, (j + 1) 2^l)`` of clipped gradients plus fresh Gaussian noise; a node is released when
its interval is complete (``(j + 1) 2^l <= T``). The prefix sum up to step ``t`` is read off the
nodes of the binary decomposition of ``t + 1`` (one per set bit), so its noise has variance
``popcount(t + 1) sigma^2``. One example in one step touches one node per level:
single-epoch sensitivity ``sqrt(floor(log2 T) + 1)`` (:func:`tree_sensitivity`).

The streaming generator keeps one noise buffer per level (``O(log T x params)`` memory) and
returns the per-step noise (difference of consecutive prefix noises) to add to the clipped sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpfy._validate import check_finite_nonneg, check_int


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


class TreeNoise:
    """Streaming per-step noise of tree aggregation, ``O(log T)`` buffers of ``shape``.

    ``sum_{s <= t}`` of the returned noises equals the prefix noise ``B z`` at step ``t``.

    Args:
        shape: shape of one step's noise (the parameters).
        noise_std: standard deviation of each node's noise (clip norm x noise multiplier).
        rng: the NumPy generator the node noises are drawn from.
    """

    def __init__(self, shape: tuple[int, ...], noise_std: float, rng: np.random.Generator) -> None:
        check_finite_nonneg("noise_std", noise_std)
        self.shape = tuple(shape)
        self.noise_std = float(noise_std)
        self.rng = rng
        self.step_index = 0
        #: noise of the node at each level in the current binary decomposition
        self.levels: dict[int, np.ndarray] = {}

    def next(self) -> np.ndarray:
        """The noise to add to the current step's clipped sum; advances one step."""
        n = self.step_index + 1
        low = (n & -n).bit_length() - 1  # the level of the node completed at this step
        fresh = self.noise_std * self.rng.standard_normal(self.shape)
        out = fresh.copy()
        for level in range(low):
            out -= self.levels.pop(level)
        self.levels[low] = fresh
        self.step_index = n
        return out

    def state_dict(self) -> dict[str, Any]:
        """The stream's state (buffers, step, generator state). Secret: whoever holds it can
        subtract future noise, so it belongs only in a private checkpoint."""
        return {
            "step_index": self.step_index,
            "levels": {k: v.copy() for k, v in self.levels.items()},
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: the stream continues bit for bit."""
        self.step_index = int(state["step_index"])
        self.levels = {int(k): np.array(v) for k, v in state["levels"].items()}
        self.rng.bit_generator.state = state["rng"]

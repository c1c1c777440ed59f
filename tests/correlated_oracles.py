"""NumPy noise streams of the correlated-noise strategies: the tests' independent oracle.

Each class draws ``z`` from a NumPy generator and returns the per-step noise ``(C^{-1} z)_t``
written straight from its strategy's recursion, with none of the training stream's tricks
(no ring buffer, no fused chunks, no flat buffer): the tests check these against the dense
matrices, and the torch streams (``Strategy.stream``) against these and the matrices.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from dpfy.correlated import BLT, BandMF
from dpfy.correlated.tree_efficient import level_variances


class TreeNoise:
    """Tree aggregation (Kairouz et al. 2021): ``sum_{s <= t}`` of the returned noises is the
    prefix noise ``B z`` at step ``t``; one buffer per level of the current decomposition."""

    def __init__(self, shape: tuple[int, ...], noise_std: float, rng: np.random.Generator) -> None:
        self.shape, self.noise_std, self.rng = tuple(shape), float(noise_std), rng
        self.step_index = 0
        #: noise of the node at each level in the current binary decomposition
        self.levels: dict[int, np.ndarray] = {}

    def next(self) -> np.ndarray:
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
        return {
            "step_index": self.step_index,
            "levels": {k: v.copy() for k, v in self.levels.items()},
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = int(state["step_index"])
        self.levels = {int(k): np.array(v) for k, v in state["levels"].items()}
        self.rng.bit_generator.state = state["rng"]


class BandMFNoise:
    """BandMF (Choquette-Choo et al. 2023): ``w_t = (z_t - sum_{k>=1} c_k w_{t-k}) / c_0``."""

    def __init__(
        self, strategy: BandMF, shape: tuple[int, ...], noise_std: float, rng: np.random.Generator
    ) -> None:
        self.coeffs, self.shape = strategy.coeffs, tuple(shape)
        self.noise_std, self.rng = float(noise_std), rng
        self.history: deque[np.ndarray] = deque(maxlen=max(strategy.band - 1, 1))

    def next(self) -> np.ndarray:
        w = self.noise_std * self.rng.standard_normal(self.shape)
        for k, prev in enumerate(reversed(self.history), start=1):
            if k >= self.coeffs.size:
                break
            w -= self.coeffs[k] * prev
        w /= self.coeffs[0]
        if self.coeffs.size > 1:
            self.history.append(w)
        return w

    def state_dict(self) -> dict[str, Any]:
        return {"history": [h.copy() for h in self.history], "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(np.array(h) for h in state["history"])
        self.rng.bit_generator.state = state["rng"]


class BLTNoise:
    """BLT (McMahan et al. 2024): ``w_t = z_t + sum_i omega_i s_i``, then
    ``s_i <- theta_i s_i + z_t``."""

    def __init__(
        self, strategy: BLT, shape: tuple[int, ...], noise_std: float, rng: np.random.Generator
    ) -> None:
        self.strategy, self.shape = strategy, tuple(shape)
        self.noise_std, self.rng = float(noise_std), rng
        self.buffers = np.zeros((strategy.buffers, *self.shape))

    def next(self) -> np.ndarray:
        z = self.noise_std * self.rng.standard_normal(self.shape)
        om = self.strategy.omega.reshape((-1,) + (1,) * len(self.shape))
        th = self.strategy.theta.reshape((-1,) + (1,) * len(self.shape))
        w = z + (om * self.buffers).sum(axis=0)
        self.buffers = th * self.buffers + z
        return np.asarray(w)

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": self.buffers.copy(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = np.array(state["buffers"])
        self.rng.bit_generator.state = state["rng"]


class EfficientTreeNoise:
    """The full tree with Honaker's efficient estimator: at step ``t`` it draws the nodes
    ending at ``t + 1``, level 0 first; ``sum_{s <= t}`` of the returned noises is the
    prefix estimate's noise ``(B z)_t``."""

    def __init__(self, shape: tuple[int, ...], noise_std: float, rng: np.random.Generator) -> None:
        self.shape, self.noise_std, self.rng = tuple(shape), float(noise_std), rng
        self.step_index = 0
        #: estimate of the decomposition node at each level of the current prefix
        self.levels: dict[int, np.ndarray] = {}

    def next(self) -> np.ndarray:
        n = self.step_index + 1
        low = (n & -n).bit_length() - 1
        v = level_variances(low + 1)
        est = self.noise_std * self.rng.standard_normal(self.shape)  # the leaf
        for level in range(1, low + 1):
            fresh = self.noise_std * self.rng.standard_normal(self.shape)
            est = v[level] * fresh + (1.0 - v[level]) * (est + self.levels[level - 1])
        out = est - sum((self.levels.pop(level) for level in range(low)), np.zeros(self.shape))
        self.levels[low] = est
        self.step_index = n
        return np.asarray(out)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step_index": self.step_index,
            "levels": {k: v.copy() for k, v in self.levels.items()},
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = int(state["step_index"])
        self.levels = {int(k): np.array(v) for k, v in state["levels"].items()}
        self.rng.bit_generator.state = state["rng"]

"""Injected randomness for sampling and noise: seeded for tests, secure for production.

Every sampler and query takes a :class:`Randomness` instead of touching global RNG state.

* ``Randomness(seed=0)`` is reproducible (NumPy PCG64 / a seeded ``torch.Generator``) and fast.
* ``Randomness.secure()`` draws every bit from the operating system's CSPRNG (``os.urandom``).
  Gaussian noise is then produced in float64 by the Box-Muller transform and, as a mitigation of
  floating-point attacks on noise (Mironov 2012), as the normalised sum of four independent
  draws before rounding to the working dtype (the approach Opacus' secure mode also takes).
  Secure mode refuses to save or restore generator state: there is none to leak.

NumPy only at import time; torch is imported lazily by :meth:`Randomness.torch_normal`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["Randomness"]

_TWO_POW_53 = float(2**53)


class Randomness:
    """A source of uniform, integer and Gaussian randomness (seeded or secure).

    Args:
      seed: seed of the reproducible generator; ``None`` draws a fresh seed from the OS.
      secure: use the OS CSPRNG for every draw (slower; no reproducibility).
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False) -> None:
        self.secure = bool(secure)
        self.seed = None if secure else (seed if seed is not None else _fresh_seed())
        self._np = None if secure else np.random.Generator(np.random.PCG64(self.seed))
        self._torch_gen: Any = None

    @classmethod
    def secure_mode(cls) -> Randomness:
        """A CSPRNG-backed source (``os.urandom``)."""
        return cls(secure=True)

    # -- uniform and integers ---------------------------------------------------------------
    def uniform(self, size: int | tuple[int, ...]) -> np.ndarray:
        """Uniform float64 samples in [0, 1)."""
        if self._np is not None:
            return self._np.random(size)
        n = int(np.prod(size))
        words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
        return ((words >> np.uint64(11)).astype(np.float64) / _TWO_POW_53).reshape(size)

    def bernoulli(self, p: float, size: int) -> np.ndarray:
        """Boolean mask, each entry True independently with probability ``p``."""
        return self.uniform(size) < p

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of ``range(n)``."""
        if self._np is not None:
            return self._np.permutation(n)
        keys = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
        return np.argsort(keys, kind="stable")

    def choice(self, n: int, k: int) -> np.ndarray:
        """``k`` distinct indices from ``range(n)``, uniformly at random, in random order."""
        if self._np is not None:
            return self._np.choice(n, size=k, replace=False)
        return self.permutation(n)[:k]

    def binomial(self, n: int, p: float) -> int:
        """One Binomial(n, p) draw (secure mode: inverse CDF of a CSPRNG uniform)."""
        if self._np is not None:
            return int(self._np.binomial(n, p))
        from scipy import stats

        u = float(self.uniform(1)[0])
        return int(stats.binom.ppf(u, n, p))

    # -- Gaussian noise ---------------------------------------------------------------------
    def normal(self, size: int | tuple[int, ...], std: float = 1.0) -> np.ndarray:
        """Float64 N(0, std^2) samples."""
        if self._np is not None:
            return self._np.normal(0.0, std, size)
        n = int(np.prod(size))
        total = np.zeros(n)
        for _ in range(4):
            total += _box_muller(self.uniform(n), self.uniform(n))
        return (total * (std / 2.0)).reshape(size)

    def torch_normal(self, shape: tuple[int, ...], std: float, *, dtype=None, device=None):
        """A torch tensor of N(0, std^2) noise of the given shape, dtype and device."""
        import torch

        dtype = dtype or torch.get_default_dtype()
        if self._np is None:
            n = int(math.prod(shape))
            noise = torch.from_numpy(self.normal(n, std)).reshape(shape)
            return noise.to(dtype=dtype, device=device)
        if self._torch_gen is None:
            self._torch_gen = torch.Generator(device="cpu")
            self._torch_gen.manual_seed(int(self._np.integers(0, 2**63 - 1)))
        # In place: one allocation, no temporary for the scaling (noise is on the hot path).
        noise = torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=self._torch_gen)
        return noise.to(device) if device is not None else noise

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Generator state for checkpoint/resume (seeded mode only)."""
        if self._np is None:
            raise RuntimeError("secure randomness has no state to save; resume draws fresh bits")
        state: dict[str, Any] = {"seed": self.seed, "numpy": self._np.bit_generator.state}
        if self._torch_gen is not None:
            state["torch"] = self._torch_gen.get_state().tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._np is None:
            raise RuntimeError("secure randomness cannot load a saved state")
        self.seed = state["seed"]
        self._np.bit_generator.state = state["numpy"]
        if "torch" in state:
            import torch

            self._torch_gen = torch.Generator(device="cpu")
            self._torch_gen.set_state(torch.tensor(state["torch"], dtype=torch.uint8))
        else:
            self._torch_gen = None

    def __repr__(self) -> str:
        return "Randomness(secure=True)" if self.secure else f"Randomness(seed={self.seed})"


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def _box_muller(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    # 1 - u1 lies in (0, 1], so the log is finite.
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)

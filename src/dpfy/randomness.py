"""Injected randomness for sampling and noise: seeded for tests, secure for production.

Every sampler and query takes a :class:`Randomness` instead of touching global RNG state.

* ``Randomness(seed=0)`` is reproducible and fast: a NumPy PCG64 stream for sampling and an
  SFC64 stream (split off from it; about 30 % faster per word) for noise. Float32 noise
  tensors are filled by the Box-Muller transform evaluated with vectorised torch operations
  on the noise words: 31 bits for the radius (so ``|z|`` is at most 6.66, against 5.77 for
  ``torch.normal_``) and 32 bits for the angle. When the tensors tile one flat buffer and
  share one std (a model's gradient buffer), the std and the addend are fused into the
  transform's last pass. Other float dtypes use NumPy's ziggurat in float64. Seeded noise is
  for experiments and tests; its tails are cut where the bits run out, like every float
  generator's. (Drawing the bits on a second thread was measured slower inside a training
  step, where torch's OpenMP workers compete.)
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
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Randomness"]

_TWO_POW_53 = float(2**53)
_TWO_PI = 2.0 * math.pi


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
        self._noise: np.random.BitGenerator | None = None  # noise stream, split off at first use
        self._work: Any = None  # reused work buffers of the noise transform
        self._values: Any = None

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

        noise = torch.empty(shape, dtype=dtype or torch.get_default_dtype())
        self.normal_([noise], [std])
        return noise.to(device) if device is not None else noise

    def normal_(
        self,
        tensors: Sequence[Any],
        stds: Sequence[float],
        *,
        add: Sequence[Any] | None = None,
    ) -> None:
        """Overwrite torch tensors in place with ``add[i] + N(0, stds[i]^2)`` noise.

        All values of one call are drawn together (one pass of the transform for the whole
        model). ``add`` (optional, same shapes) is added in the same pass. Secure mode draws
        float64 values from the OS CSPRNG, scales them in float64 and only then rounds to each
        tensor's dtype.
        """
        import torch

        tensors, stds = list(tensors), [float(s) for s in stds]
        adds = [None] * len(tensors) if add is None else list(add)
        if not len(stds) == len(adds) == len(tensors):
            raise ValueError(
                f"got {len(tensors)} tensors, {len(stds)} stds and {len(adds)} tensors to add"
            )
        for i, (t, sd, a) in enumerate(zip(tensors, stds, adds, strict=True)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                kind = f"a tensor of dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"tensors[{i}] must be a floating-point torch.Tensor, got {kind}")
            if not (sd >= 0.0 and math.isfinite(sd)):
                raise ValueError(f"stds[{i}] must be in [0, inf), got stds[{i}]={sd!r}")
            if a is not None and (not isinstance(a, torch.Tensor) or a.shape != t.shape):
                raise ValueError(f"add[{i}] must be a tensor of shape {tuple(t.shape)}")
        if not tensors:
            return
        if self._np is not None and _all_equal(stds):
            span = _flat_span(tensors)
            base = None if add is None else _flat_span(adds)
            if span is not None and (add is None or base is not None):
                # One contiguous float32 span (e.g. a model's flat gradient buffer) with one std:
                # std and the addend are fused into the transform's last pass.
                self._normal32_into(span, stds[0], base)
                return
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        if self._np is None:
            values = torch.from_numpy(self.normal(total))
        elif all(t.dtype == torch.float32 for t in tensors):
            values = self._standard_normal32(total)
        else:
            rng = np.random.Generator(self._noise_stream())
            values = torch.from_numpy(rng.standard_normal(total))
        start = 0
        for t, sd, a, n in zip(tensors, stds, adds, sizes, strict=True):
            part = values[start : start + n].view(t.shape)
            start += n
            if self._np is None or part.dtype != t.dtype or t.device.type != "cpu":
                t.copy_(part * sd)  # scale in the generator's precision, then round
                if a is not None:
                    t.add_(a)
            elif a is None:
                torch.mul(part, sd, out=t)
            else:
                torch.add(a, part, alpha=sd, out=t)

    def _noise_stream(self) -> np.random.BitGenerator:
        if self._noise is None:
            self._noise = np.random.SFC64(int(self._np.integers(0, 2**63 - 1)))
        return self._noise

    def _standard_normal32(self, n: int):
        """``n`` float32 N(0, 1) values (Box-Muller on the noise words), in a reused buffer."""
        import torch

        if self._values is None or self._values.numel() < n:
            self._values = torch.empty(n, dtype=torch.float32)
        out = self._values[:n]
        self._normal32_into(out, 1.0, None)
        return out

    def _normal32_into(self, out, std: float, add) -> None:
        """``out = add + std * N(0, 1)`` for a contiguous float32 tensor (``add`` may be None)."""
        import torch

        m = (out.numel() + 1) // 2
        # m 64-bit words = 2m 32-bit halves: the first m for radii, the last m for angles
        bits32 = torch.from_numpy(self._noise_stream().random_raw(m).view(np.int32))
        if self._work is None or self._work[0].numel() < m:
            self._work = (
                torch.empty(m, dtype=torch.int32),
                torch.empty(m, dtype=torch.float32),  # radius
                torch.empty(m, dtype=torch.float32),  # angle
            )
        flat_add = None if add is None else add.view(-1)
        _box_muller32(bits32, out.view(-1), *(x[:m] for x in self._work), std=std, add=flat_add)

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Generator state for checkpoint/resume (seeded mode only)."""
        if self._np is None:
            raise RuntimeError("secure randomness has no state to save; resume draws fresh bits")
        state: dict[str, Any] = {"seed": self.seed, "numpy": self._np.bit_generator.state}
        if self._noise is not None:
            state["noise"] = self._noise.state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._np is None:
            raise RuntimeError("secure randomness cannot load a saved state")
        self.seed = state["seed"]
        self._np.bit_generator.state = state["numpy"]
        self._noise = None
        if "torch" in state and "noise" not in state:
            warnings.warn(
                "this Randomness state comes from an older dpfy (torch generator noise); its "
                "noise stream cannot be continued and starts afresh from the sampling stream",
                stacklevel=2,
            )
        if "noise" in state:
            kind = state["noise"].get("bit_generator", "PCG64")
            if kind not in ("PCG64", "SFC64"):
                raise ValueError(f"unknown noise generator {kind!r} in the saved state")
            self._noise = getattr(np.random, kind)()
            self._noise.state = state["noise"]

    def __repr__(self) -> str:
        return "Randomness(secure=True)" if self.secure else f"Randomness(seed={self.seed})"


def _box_muller32(bits32, out, bits, radius, theta, *, std: float = 1.0, add=None) -> None:
    """Box-Muller on 2m random int32 ``bits32`` into float32 ``out`` (n <= 2m values).

    ``m``-sized scratch ``bits``, ``radius`` and ``theta``. The first m words give the radius:
    31 bits k, u = (k + 1/2) 2^-31 in (0, 1] after float32 rounding (exact near 0, where the
    tail comes from, since k < 2^24 is exact), radius r = sqrt(-2 log u) >= 0 (u = 1
    gives 0, never NaN). The last m give the angle theta = s 2 pi 2^-32 in [-pi, pi).
    ``out[:m] = add + std r cos(theta)``, ``out[m:] = add + std r sin(theta)`` (the second
    half cut to n - m values); ``add`` (same shape as ``out``, may be ``out`` itself) is
    optional.
    """
    import torch

    m = radius.numel()
    n = out.numel()
    if not m <= n <= 2 * m:
        raise ValueError(f"out must hold between {m} and {2 * m} values, got {n}")
    radius.copy_(torch.bitwise_and(bits32[:m], 0x7FFFFFFF, out=bits))
    radius.add_(0.5).mul_(2.0**-31).log_().mul_(-2.0).sqrt_()
    theta.copy_(bits32[m : 2 * m]).mul_(_TWO_PI * 2.0**-32)
    trig_out = bits.view(torch.float32)  # the bits are spent: reuse the buffer
    for dst, trig, lo, hi in ((out[:m], torch.cos, 0, m), (out[m:], torch.sin, m, n)):
        k = hi - lo
        t = trig(theta[:k], out=trig_out[:k])
        if add is not None:
            torch.addcmul(add[lo:hi], t, radius[:k], value=std, out=dst)
        elif std == 1.0:
            torch.mul(t, radius[:k], out=dst)
        else:
            torch.mul(t, radius[:k], out=dst).mul_(std)


def _flat_span(tensors):
    """The 1-D float32 CPU tensor that ``tensors`` tile in order, or ``None``.

    True for consecutive contiguous views of one buffer (a model's flat gradient buffer) or a
    single contiguous tensor.
    """
    import torch

    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return None
    ptr = first.data_ptr()
    for t in tensors:
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype == torch.float32
            and t.is_cpu
            and t.data_ptr() == ptr
            and t.is_contiguous()
        ):
            return None
        ptr += 4 * t.numel()
    if len(tensors) == 1:
        return first.view(-1)
    start = first.storage_offset()
    total = (ptr - first.data_ptr()) // 4
    if first.untyped_storage().nbytes() < 4 * (start + total):
        return None  # adjacent memory of another buffer
    return first.as_strided((total,), (1,), start)


def _all_equal(stds) -> bool:
    return bool(stds) and all(s == stds[0] for s in stds)


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def _box_muller(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    # 1 - u1 lies in (0, 1], so the log is finite.
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)

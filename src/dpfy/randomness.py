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
* ``Randomness.secure_mode()`` (or ``Randomness(secure=True)``) draws every bit from an
  AES-256-CTR keystream (the ``cryptography`` package) keyed with 32 bytes from the operating
  system's CSPRNG (``os.urandom``), re-keyed every 64 GiB and after a fork. Float32 noise goes
  through the same vectorised Box-Muller transform as the seeded path (fused path included),
  with two changes that are part of the guarantee (``docs/randomness.md``):

  - tails: a radius word whose 31 bits are all zero (probability 2^-31) is refined with two
    more 32-bit words, so the radius has 95 bits and the Gaussian mass cut per radius is
    2^-95 (:meth:`Randomness.tail_mass` returns the total for a run, to be added to delta);
  - floating-point attacks on the noise (Mironov 2012): every value is the normalised sum of
    two independent Box-Muller draws, ``(z1 + z2) / sqrt(2)``, the mitigation of Holohan and
    Braghin 2021 (Opacus' secure mode sums four). It is a mitigation, not a proof.

  Sampling draws (uniform, bernoulli, permutation, choice, binomial) come from the same
  keystream. Secure mode refuses to save or restore generator state: there is none to leak.

* Tensors off the CPU (``device_noise``): float32 noise is made on their device. Seeded bits
  come from Philox4x32-10 in torch integer ops (``dpfy._philox``; state: key and block
  counter, resumable bit for bit), secure bits from the host keystream, written into a
  pinned buffer and copied asynchronously; the same Box-Muller transform runs on the device
  and reads no value back (docs/randomness.md, "Noise on the parameters' device").

NumPy only at import time; torch and ``cryptography`` are imported lazily.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpfy._philox import PhiloxStream, philox_key

__all__ = [
    "Randomness",
]

_TWO_POW_53 = float(2**53)
_TWO_PI = 2.0 * math.pi

#: Box-Muller draws summed (and normalised) per secure noise value: the floating-point mitigation.
SECURE_DRAWS = 2
#: Bits behind one secure radius: 31, and 32 + 32 more when the first 31 are all zero.
SECURE_RADIUS_BITS = 95
#: Bits behind one seeded float32 radius.
SEEDED_RADIUS_BITS = 31
#: How ledgers and reports name the secure generator (:meth:`Randomness.describe`).
SECURE_DESCRIPTION = "secure (AES-256-CTR, OS key)"


#: Domain separation of a key commitment (docs/randomness.md, "Key commitments").
KEY_COMMITMENT_DOMAIN = b"dpfy-keystream-key-commitment\0"


def key_commitment(key: bytes) -> str:
    """The commitment to one keystream key: SHA-256 (hex) of :data:`KEY_COMMITMENT_DOMAIN`
    followed by the 32 key bytes. Recording it reveals nothing usable about a uniform 256-bit
    key (finding a preimage is as hard as guessing the key); two runs that drew one key have
    equal commitments."""
    return hashlib.sha256(KEY_COMMITMENT_DOMAIN + bytes(key)).hexdigest()


def _max_radius(bits: int) -> float:
    """The largest Box-Muller radius from ``bits`` radius bits: u = 2^-(bits+1), the midpoint
    of the bottom cell [0, 2^-bits)."""
    return math.sqrt(2.0 * (bits + 1) * math.log(2.0))


#: Values transformed per block by the host noise path (even; 8 MB of float32 output,
#: 12 MB of scratch): large enough that the per-block overhead is negligible.
NOISE_BLOCK = 1 << 21

class Randomness:
    """A source of uniform, integer and Gaussian randomness (seeded or secure).

    Args:
      seed: seed of the reproducible generator; ``None`` draws a fresh seed from the OS.
      secure: draw every bit from an AES-256-CTR keystream keyed from the OS (no
        reproducibility; what a DP release needs, docs/randomness.md).
      device_noise: where the float32 noise transform runs. ``None`` (default): on the
        tensors' device when they are not on the CPU, on the host otherwise; ``True``: always
        the device path, also for CPU tensors (how tests exercise it); ``False``: always the
        host path (noise drawn on the CPU and copied). On the device path seeded bits come
        from Philox4x32-10 generated on the device (``dpfy._philox``), secure bits from the
        host keystream copied asynchronously; float32 values in either case.
    """

    def __init__(
        self, seed: int | None = None, *, secure: bool = False, device_noise: bool | None = None
    ) -> None:
        if device_noise not in (None, True, False):
            raise ValueError(f"device_noise must be None, True or False, got {device_noise!r}")
        self.secure = bool(secure)
        self.device_noise = device_noise
        self.seed = None if secure else (seed if seed is not None else _fresh_seed())
        self._np = None if secure else np.random.Generator(np.random.PCG64(self.seed))
        self._stream = _Keystream() if secure else None
        self._draws = SECURE_DRAWS if secure else 1  # Box-Muller draws summed per value
        self._noise: np.random.BitGenerator | None = None  # noise stream, split off at first use
        self._work: Any = None  # reused work buffers of the noise transform
        self._values: Any = None
        self._words: np.ndarray | None = None  # reused buffer of secure noise words
        self._philox: PhiloxStream | None = None  # seeded device stream, keyed at first use
        self._device: _DeviceScratch | None = None  # device path buffers (docs/randomness.md)

    @classmethod
    def secure_mode(cls) -> Randomness:
        """A CSPRNG-backed source: an AES-256-CTR keystream keyed from ``os.urandom``."""
        return cls(secure=True)

    def describe(self) -> str:
        """What a ledger records about this source: ``"secure (AES-256-CTR, OS key)"`` or
        ``"seeded (seed N)"`` (a seeded run is reproducible by anyone who knows N)."""
        return SECURE_DESCRIPTION if self.secure else f"seeded (seed {self.seed})"

    def key_commitments(self) -> tuple[str, ...]:
        """Commitments (:func:`key_commitment`) to every key this secure source has drawn, in
        order; it draws its first key now when it has none in this process yet (so a run can
        record and register it before it starts). A seeded source has none: ``()``."""
        if self._stream is None:
            return ()
        self._stream.ensure_keyed()
        return tuple(self._stream.commitments)

    # -- tails ------------------------------------------------------------------------------
    @property
    def max_abs_z(self) -> float:
        """The largest ``|z|`` a float32 Box-Muller noise value can take (std 1).

        Secure: sqrt(2) * 11.54 = 16.32 (two draws of 95-bit radii); seeded: 6.66 (31 bits).
        """
        bits = SECURE_RADIUS_BITS if self.secure else SEEDED_RADIUS_BITS
        return math.sqrt(self._draws) * _max_radius(bits)

    def tail_mass(self, num_values: int | float) -> float:
        """Upper bound on the Gaussian mass cut from ``num_values`` noise values.

        Each Box-Muller radius comes from a uniform on cells of width 2^-b (b radius bits);
        the bottom cell [0, 2^-b), i.e. radii beyond sqrt(2 b ln 2), is collapsed onto one
        value, so the generator differs from the ideal one only on an event of probability
        2^-b = P(R > sqrt(2 b ln 2)) per radius (R the radius of a 2-D standard Gaussian).
        A value uses at most ``draws`` radii (a pair of values shares one per draw), so
        ``num_values`` values (a whole run: steps x coordinates, in any number of calls) cut
        at most ``draws * num_values * 2^-b``: b = 95, draws = 2 in secure mode (1.1e-17
        for 1e4 steps of 2.26e7 coordinates), b = 31, draws = 1 for seeded float32 noise.
        A mechanism whose noise is within total variation eta of the ideal one is
        (eps, delta + (1 + e^eps) eta)-DP when the ideal one is (eps, delta)-DP.
        """
        n = float(num_values)
        if not (n >= 0.0 and math.isfinite(n)):
            raise ValueError(f"num_values must be a finite number >= 0, got {num_values!r}")
        bits = SECURE_RADIUS_BITS if self.secure else SEEDED_RADIUS_BITS
        return self._draws * n * 2.0**-bits

    # -- uniform and integers ---------------------------------------------------------------
    def uniform(self, size: int | tuple[int, ...]) -> np.ndarray:
        """Uniform float64 samples in [0, 1)."""
        if self._np is not None:
            return self._np.random(size)
        n = int(np.prod(size))
        words = self._secure_words(n)
        return ((words >> np.uint64(11)).astype(np.float64) / _TWO_POW_53).reshape(size)

    def bernoulli(self, p: float, size: int) -> np.ndarray:
        """Boolean mask, each entry True independently with probability ``p``."""
        return self.uniform(size) < p

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of ``range(n)``."""
        if self._np is not None:
            return self._np.permutation(n)
        # Sorting 64-bit keys: uniform unless two keys tie (probability below n^2 / 2^65).
        return np.argsort(self._secure_words(n), kind="stable")

    def choice(self, n: int, k: int) -> np.ndarray:
        """``k`` distinct indices from ``range(n)``, uniformly at random, in random order."""
        if self._np is not None:
            return self._np.choice(n, size=k, replace=False)
        return self.permutation(n)[:k]

    def binomial(self, n: int, p: float) -> int:
        """One Binomial(n, p) draw (secure mode: inverse CDF of a 53-bit keystream uniform)."""
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
        k = self._draws
        m = (k * n + 1) // 2  # Box-Muller pairs
        words = self._secure_words(3 * m).reshape(3, m)
        z = _box_muller64(words)[: k * n].reshape(k, n)
        out: np.ndarray = (z.sum(axis=0) * (std / math.sqrt(k))).reshape(size)
        return out

    def _secure_words(self, n: int) -> np.ndarray:
        """``n`` fresh uint64 keystream words (secure mode)."""
        if self._stream is None:
            raise RuntimeError("seeded randomness has no keystream")
        out = np.empty(n, dtype=np.uint64)
        self._stream.fill(out)
        return out

    def torch_normal(
        self, shape: tuple[int, ...], std: float, *, dtype: Any = None, device: Any = None
    ) -> Any:
        """A torch tensor of N(0, std^2) noise of the given shape, dtype and device."""
        import torch

        noise = torch.empty(shape, dtype=dtype or torch.get_default_dtype(), device=device)
        self.normal_([noise], [std])
        return noise

    def normal_(
        self,
        tensors: Sequence[Any],
        stds: Sequence[float],
        *,
        add: Sequence[Any] | None = None,
    ) -> None:
        """Overwrite torch tensors in place with ``add[i] + N(0, stds[i]^2)`` noise.

        All values of one call are drawn together (one pass of the transform for the whole
        model). ``add`` (optional, same shapes) is added in the same pass. Secure mode fills
        float32 tensors with the same transform on keystream words (each value the normalised
        sum of two draws); other dtypes get float64 values, scaled in float64 and only then
        rounded to the tensor's dtype.
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
        if self._device_path(tensors):
            self._device_normal_(tensors, stds, adds)
            return
        if _all_equal(stds):
            span = _flat_span(tensors)
            base = None if add is None else _flat_span(adds)
            if span is not None and (add is None or base is not None):
                # One contiguous float32 span (e.g. a model's flat gradient buffer) with one std:
                # std and the addend are fused into the transform's last pass.
                self._normal32_into(span, stds[0], base)
                return
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        if all(t.dtype == torch.float32 for t in tensors):
            values = self._standard_normal32(total)
        elif self._np is None:
            values = torch.from_numpy(self.normal(total))
        else:
            rng = np.random.Generator(self._noise_stream())
            values = torch.from_numpy(rng.standard_normal(total))
        start = 0
        for t, sd, a, n in zip(tensors, stds, adds, sizes, strict=True):
            part = values[start : start + n].view(t.shape)
            start += n
            if part.dtype != t.dtype or t.device.type != "cpu":
                t.copy_(part * sd)  # scale in the generator's precision, then round
                if a is not None:
                    t.add_(a)
            elif a is None:
                torch.mul(part, sd, out=t)
            else:
                torch.add(a, part, alpha=sd, out=t)

    def _noise_stream(self) -> np.random.BitGenerator:
        if self._noise is None:
            assert self._np is not None
            self._noise = np.random.SFC64(int(self._np.integers(0, 2**63 - 1)))
        return self._noise

    def _noise_words(self, m: int) -> np.ndarray:
        """``m`` 64-bit noise words as ``2m`` int32 (secure: in a reused buffer)."""
        if self._stream is None:
            return self._noise_stream().random_raw(m).view(np.int32)
        if self._words is None or self._words.size < 2 * m:
            self._words = np.empty(2 * m, dtype=np.int32)
        words = self._words[: 2 * m]
        self._stream.fill(words)
        return words

    def _deep_radii(self, count: int) -> np.ndarray:
        """Radii for ``count`` secure radius words whose 31 bits were all zero (u < 2^-31)."""
        assert self._stream is not None
        w = np.empty(2 * count, dtype=np.uint32)
        self._stream.fill(w)
        return _refined_radius(w[:count], w[count:])

    def _standard_normal32(self, n: int) -> Any:
        """``n`` float32 N(0, 1) values (Box-Muller on the noise words), in a reused buffer."""
        import torch

        if self._values is None or self._values.numel() < n:
            self._values = torch.empty(n, dtype=torch.float32)
        out = self._values[:n]
        self._normal32_into(out, 1.0, None)
        return out

    def _normal32_into(self, out: Any, std: float, add: Any) -> None:
        """``out = add + std * N(0, 1)`` for a contiguous float32 tensor (``add`` may be None,
        or ``out`` itself).

        Secure mode: ``add + std z1 / sqrt(2) + std z2 / sqrt(2)``, two passes of the
        transform (the second adds to the first's output). The span is transformed in blocks
        of :data:`NOISE_BLOCK` values, so the scratch memory (noise words, radii, angles) is a
        few MB whatever the model's size, not several bytes per parameter.
        """
        import torch

        flat = out.view(-1)
        n = flat.numel()
        block = max(2, min(NOISE_BLOCK, n + (n & 1)))
        half = block // 2
        if self._work is None or self._work[0].numel() < half:
            self._work = (
                torch.empty(half, dtype=torch.int32),
                torch.empty(half, dtype=torch.float32),  # radius
                torch.empty(half, dtype=torch.float32),  # angle
            )
        base = None if add is None else add.view(-1)
        scale = std / math.sqrt(self._draws)  # std itself when seeded (one draw)
        deep = None if self._stream is None else self._deep_radii
        for _ in range(self._draws):
            for start in range(0, n, block):
                dst = flat[start : start + block]
                m = (dst.numel() + 1) // 2
                # m 64-bit words = 2m 32-bit halves: the first m for radii, the last m for angles
                bits32 = torch.from_numpy(self._noise_words(m))
                work = (x[:m] for x in self._work)
                addend = None if base is None else base[start : start + block]
                _box_muller32(bits32, dst, *work, std=scale, add=addend, deep_tail=deep)
            base = flat

    # -- the device path (docs/randomness.md, "Noise on the parameters' device") -----------
    def _device_path(self, tensors: Sequence[Any]) -> bool:
        if self.device_noise is not None:
            return self.device_noise
        return any(t.device.type != "cpu" for t in tensors)

    def _device_normal_(self, tensors: list[Any], stds: list[float], adds: list[Any]) -> None:
        """:meth:`normal_` with float32 values made on ``tensors[0]``'s device.

        No host synchronisation: seeded bits are generated on the device, secure bits are
        copied to it asynchronously; nothing reads a device value back.
        """
        import torch

        device = tensors[0].device
        no_add = all(a is None for a in adds)
        if _all_equal(stds):
            span = _flat_span(tensors, device)
            base = None if no_add else _flat_span(adds, device)
            if span is not None and (no_add or base is not None):
                self._device_normal32_into(span, stds[0], base)
                return
        values = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
        self._device_normal32_into(values, 1.0, None)
        start = 0
        for t, sd, a in zip(tensors, stds, adds, strict=True):
            part = values[start : start + t.numel()].view(t.shape)
            start += t.numel()
            t.copy_(part * sd)  # scaled in float32, then rounded to t's dtype (and device)
            if a is not None:
                t.add_(a)

    def _device_normal32_into(self, out: Any, std: float, add: Any) -> None:
        """``out = add + std * N(0, 1)`` on ``out``'s device (contiguous float32 ``out``)."""
        m = (out.numel() + 1) // 2
        scratch = self._device
        if scratch is None or scratch.device != out.device or scratch.size < m:
            scratch = self._device = _DeviceScratch(out.device, m, self._device)
        flat = out.view(-1)
        base = None if add is None else add.view(-1)
        scale = std / math.sqrt(self._draws)
        if self._stream is None:
            if self._philox is None:
                assert self.seed is not None
                self._philox = PhiloxStream(philox_key(self.seed))
            draws = [(self._philox.words(2 * m, out.device), None)]
        else:
            draws = self._secure_device_words(m, scratch)
        work = [x[:m] for x in scratch.work]
        for words, deep in draws:
            _box_muller32(words, flat, *work, std=scale, add=base, deep_radii=deep)
            base = flat

    def _secure_device_words(self, m: int, scratch: _DeviceScratch) -> list[tuple[Any, Any]]:
        """Per draw: ``2m`` keystream words on the device, and the deep radii (indices, values).

        The words are written by the keystream into a (pinned, on CUDA) host buffer and copied
        with ``non_blocking``; the radius words whose 31 bits are all zero are found on the
        host, where the words are, and refined from the keystream right after their draw (the
        order of the host path).
        """
        import torch

        assert self._stream is not None
        host = scratch.staging(self._draws * 2 * m)
        draws = []
        for d in range(self._draws):
            words = host[d * 2 * m : (d + 1) * 2 * m]
            self._stream.fill(words.numpy())
            zero = np.flatnonzero((words.numpy()[:m] & 0x7FFFFFFF) == 0)
            deep = None
            if zero.size:
                radii = self._deep_radii(zero.size).astype(np.float32)
                deep = (
                    scratch.to_device(torch.from_numpy(zero)),
                    scratch.to_device(torch.from_numpy(radii)),
                )
            draws.append((scratch.to_device(words), deep))
        return draws

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Generator state for checkpoint/resume (seeded mode only)."""
        if self._np is None:
            raise RuntimeError("secure randomness has no state to save; resume draws fresh bits")
        state: dict[str, Any] = {"seed": self.seed, "numpy": self._np.bit_generator.state}
        if self._noise is not None:
            state["noise"] = self._noise.state
        if self._philox is not None:
            state["device_noise"] = self._philox.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._np is None:
            raise RuntimeError("secure randomness cannot load a saved state")
        self.seed = state["seed"]
        self._np.bit_generator.state = state["numpy"]
        self._noise = None
        dev = state.get("device_noise")
        self._philox = None if dev is None else PhiloxStream.from_state(dev)
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


def _box_muller32(
    bits32: Any,
    out: Any,
    bits: Any,
    radius: Any,
    theta: Any,
    *,
    std: float = 1.0,
    add: Any = None,
    deep_tail: Callable[[int], np.ndarray] | None = None,
    deep_radii: tuple[Any, Any] | None = None,
) -> None:
    """Box-Muller on 2m random int32 ``bits32`` into float32 ``out`` (n <= 2m values).

    ``m``-sized scratch ``bits``, ``radius`` and ``theta``. The first m words give the radius:
    31 bits k, u = (k + 1/2) 2^-31 in (0, 1] after float32 rounding (exact near 0, where the
    tail comes from, since k < 2^24 is exact), radius r = sqrt(-2 log u) >= 0 (u = 1
    gives 0, never NaN). The last m give the angle theta = s 2 pi 2^-32 in [-pi, pi).
    ``out[:m] = add + std r cos(theta)``, ``out[m:] = add + std r sin(theta)`` (the second
    half cut to n - m values); ``add`` (same shape as ``out``, may be ``out`` itself) is
    optional. ``deep_tail`` (secure mode) maps a count c to c float64 radii drawn from more
    bits; it replaces the radius of every word whose 31 bits are all zero (u < 2^-31).
    ``deep_radii`` (the device path) gives those replacements precomputed: (indices, float32
    radii) on ``out``'s device, so nothing here reads a device value.
    """
    import torch

    m = radius.numel()
    n = out.numel()
    if not m <= n <= 2 * m:
        raise ValueError(f"out must hold between {m} and {2 * m} values, got {n}")
    radius.copy_(torch.bitwise_and(bits32[:m], 0x7FFFFFFF, out=bits))
    deep = None
    if deep_tail is not None and m and int(bits.min()) == 0:
        deep = torch.nonzero(bits == 0).view(-1)
    radius.add_(0.5).mul_(2.0**-31).log_().mul_(-2.0).sqrt_()
    if deep_tail is not None and deep is not None:
        radius[deep] = torch.from_numpy(deep_tail(deep.numel())).to(torch.float32)
    if deep_radii is not None:
        radius.index_put_((deep_radii[0],), deep_radii[1])
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


def _flat_span(tensors: Sequence[Any], device: Any = None) -> Any:
    """The 1-D float32 tensor on ``device`` (default the CPU) that ``tensors`` tile in order,
    or ``None``.

    True for consecutive contiguous views of one buffer (a model's flat gradient buffer) or a
    single contiguous tensor.
    """
    import torch

    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return None
    want = torch.device("cpu") if device is None else torch.device(device)
    ptr = first.data_ptr()
    for t in tensors:
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype == torch.float32
            and t.device == want
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


def _all_equal(stds: Sequence[float]) -> bool:
    return bool(stds) and all(s == stds[0] for s in stds)


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def _refined_radius(k2: np.ndarray, k3: np.ndarray) -> np.ndarray:
    """Radius for u in the bottom cell [0, 2^-31), from two more uint32 words.

    u = (k2 + 1/2) 2^-63 when k2 > 0, else (k3 + 1/2) 2^-95 (so the bottom cell of the whole
    95-bit radius is [0, 2^-95), represented by u = 2^-96: radius 11.54).
    """
    a, b = k2.astype(np.float64), k3.astype(np.float64)
    u = np.where(a > 0, (a + 0.5) * 2.0**-63, (b + 0.5) * 2.0**-95)
    return np.asarray(np.sqrt(-2.0 * np.log(u)))


def _box_muller64(words: np.ndarray) -> np.ndarray:
    """Float64 Box-Muller on a (3, m) uint64 array: 2m values (m cosines, then m sines).

    Rows 0 and 1 give a 95-bit radius uniform u = (hi + (lo + 1/2) 2^-42) 2^-53 in (0, 1]
    (53 bits of ``hi``, 42 of ``lo``: the same bottom cell [0, 2^-95) as the float32
    secure path), row 2 a 53-bit angle.
    """
    hi = (words[0] >> np.uint64(11)).astype(np.float64)
    lo = (words[1] >> np.uint64(22)).astype(np.float64)
    u = (hi + (lo + 0.5) * 2.0**-42) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u))
    theta = (words[2] >> np.uint64(11)).astype(np.float64) * (_TWO_PI / _TWO_POW_53)
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])


class _Keystream:
    """AES-256-CTR keystream: the encryption of zeros under a key from ``os.urandom``.

    The 128-bit counter starts at 0 for every key, so no block repeats within a key; the key is
    replaced from the OS after 2^36 bytes (2^32 blocks, keeping the distance from uniform
    bits, about blocks^2 / 2^129, below 2^-65) and in a forked child, which must not
    replay its parent's stream.
    """

    _CHUNK = 1 << 20  # bytes per call into OpenSSL (a reused buffer of zeros)
    _REKEY = 1 << 36

    def __init__(self) -> None:
        self._enc: Any = None
        self._pid = -1
        self._used = 0
        self._zeros = memoryview(bytes(self._CHUNK))
        self.commitments: list[str] = []  # key_commitment of every key drawn, in order

    def ensure_keyed(self) -> None:
        """Draw a key now unless this process holds one (what :meth:`fill` does first)."""
        if self._enc is None or self._used >= self._REKEY or self._pid != os.getpid():
            self._rekey()

    def _rekey(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        key = os.urandom(32)
        self.commitments.append(key_commitment(key))
        cipher = Cipher(algorithms.AES(key), modes.CTR(bytes(16)))
        self._enc = cipher.encryptor()
        self._pid = os.getpid()
        self._used = 0

    def fill(self, out: np.ndarray) -> None:
        """Overwrite the contiguous array ``out`` with fresh keystream bytes."""
        view = memoryview(out).cast("B")  # type: ignore[arg-type]
        n, pos = len(view), 0
        while pos < n:
            self.ensure_keyed()
            k = min(self._CHUNK, n - pos, self._REKEY - self._used)
            if pos + k + 15 <= n:  # OpenSSL wants block_size - 1 spare bytes after the output
                self._enc.update_into(self._zeros[:k], view[pos : pos + k + 15])
            else:
                view[pos : pos + k] = self._enc.update(self._zeros[:k])
            pos += k
            self._used += k


class _DeviceScratch:
    """Reused buffers of the device path on one device.

    ``work``: the transform's scratch (int32 bits, float32 radius and angle, ``size`` each).
    ``staging``: a host buffer for secure keystream words, pinned when the device is a CUDA
    device, copied by :meth:`to_device` on a side CUDA stream with ``non_blocking`` (the copy
    waits for no compute queued before it; the compute stream waits for the copy on the
    device). Before the staging buffer is refilled, the host waits for the copy out of it
    (issued one call earlier: only the PCIe transfer, not the training step's kernels).
    """

    def __init__(self, device: Any, size: int, old: _DeviceScratch | None = None) -> None:
        import torch

        self.device, self.size = device, size
        self.work = (
            torch.empty(size, dtype=torch.int32, device=device),
            torch.empty(size, dtype=torch.float32, device=device),  # radius
            torch.empty(size, dtype=torch.float32, device=device),  # angle
        )
        self._host: Any = None
        self._copied: Any = None  # CUDA event: the last copy out of the staging buffer is done
        self._side: Any = None
        if old is not None:
            old.wait()

    @property
    def cuda(self) -> bool:
        return bool(self.device.type == "cuda")

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def staging(self, n: int) -> Any:
        """A host int32 buffer of ``n`` words, free to overwrite."""
        import torch

        self.wait()
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(n, dtype=torch.int32, pin_memory=self.cuda)
        return self._host[:n]

    def to_device(self, host: Any) -> Any:
        """``host`` on the device, copied asynchronously (the CPU device: ``host`` itself)."""
        import torch

        if self.device.type == "cpu":
            return host
        if not self.cuda:
            return host.to(self.device, non_blocking=True)
        if not host.is_pinned():
            host = host.pin_memory()
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._side):
            dev = host.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record(self._side)
        main.wait_stream(self._side)
        dev.record_stream(main)
        return dev

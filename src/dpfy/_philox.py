"""Philox4x32-10 (Salmon et al. 2011) in torch integer ops: a counter-based generator on any device.

Seeded noise for tensors that live off the CPU is drawn where they live (docs/randomness.md,
"The device generator"): block ``j`` of the stream is ``Philox4x32-10(key, counter)`` with the
128-bit counter ``(j mod 2^32, j div 2^32, 0, 0)``, and its four 32-bit output words are
words ``4j .. 4j + 3`` of the stream. The state is ``(key, next block)``, so a run resumed from
a saved state continues the stream bit for bit, on any device.

uint32 arithmetic is emulated in int64 tensors (values in [0, 2^32)): the 32 x 32 -> 64-bit
products of a round are split on the 16-bit halves of the round constant so that no
intermediate exceeds 2^49. This runs unchanged on CPU and CUDA (torch's uint32 dtype lacks
multiplication kernels on both). :func:`philox4x32_reference` is a scalar pure-Python
implementation written from the paper, checked against the Random123 known-answer vectors,
that the tensor version is tested against.
"""

from __future__ import annotations

from typing import Any

_MASK = 0xFFFFFFFF
#: Philox4x32 round multipliers and Weyl key increments (Salmon et al. 2011, Random123).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
#: The largest block index the int64 counter arithmetic accepts (2^62 blocks = 2^66 bytes).
MAX_BLOCK = 1 << 62
#: Domain tag mixed into the key derivation, so the key differs from the seed's other streams.
_KEY_TAG = 0x50484C58  # "PHLX"


def philox_key(seed: int) -> tuple[int, int]:
    """The 64-bit Philox key (two uint32 words) of a ``Randomness`` seed.

    ``numpy.random.SeedSequence(seed, spawn_key=(0x50484C58,)).generate_state(2, uint32)``:
    a hash of the seed, distinct from the seed's PCG64 sampling stream.
    """
    import numpy as np

    words = np.random.SeedSequence(seed, spawn_key=(_KEY_TAG,)).generate_state(2, np.uint32)
    return int(words[0]), int(words[1])


def philox4x32_reference(
    counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = ROUNDS
) -> tuple[int, int, int, int]:
    """One Philox4x32 block on Python ints (the reference for tests; slow)."""
    c0, c1, c2, c3 = (int(c) & _MASK for c in counter)
    k0, k1 = (int(k) & _MASK for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & _MASK, (k1 + W1) & _MASK
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK
    return c0, c1, c2, c3


def _mulhilo(a: Any, m: int) -> tuple[Any, Any]:
    """High and low 32 bits of ``a * m`` for an int64 tensor ``a`` in [0, 2^32), ``m < 2^32``.

    With x = a (m mod 2^16) and y = a (m div 2^16), both below 2^48: a m = y 2^16 + x, so
    hi = (y + x div 2^16) div 2^16 and lo = ((y mod 2^16) 2^16 + x) mod 2^32.
    """
    x = a * (m & 0xFFFF)
    y = a * (m >> 16)
    hi = (y + (x >> 16)) >> 16
    lo = ((y & 0xFFFF) << 16).add_(x).bitwise_and_(_MASK)
    return hi, lo


def philox4x32(counters: tuple[Any, Any, Any, Any], key: tuple[int, int]) -> tuple[Any, ...]:
    """Philox4x32-10 on int64 tensors of counter words (each in [0, 2^32), any device).

    Returns the four output words as int64 tensors in [0, 2^32), shaped like the counters.
    """
    c0, c1, c2, c3 = counters
    k0, k1 = (int(k) & _MASK for k in key)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & _MASK, (k1 + W1) & _MASK
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0 = hi1.bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = hi0.bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = lo1, lo0
    return c0, c1, c2, c3


class PhiloxStream:
    """The device noise stream: 32-bit words of Philox4x32-10 under one key, block by block.

    Args:
      key: two uint32 words (:func:`philox_key` of the seed).
      block: index of the next unused block (the counter); 0 for a fresh stream.
    """

    def __init__(self, key: tuple[int, int], block: int = 0) -> None:
        if not (len(key) == 2 and all(0 <= int(k) <= _MASK for k in key)):
            raise ValueError(f"key must be two integers in [0, 2^32), got {key!r}")
        if not 0 <= int(block) < MAX_BLOCK:
            raise ValueError(f"block must be in [0, 2^62), got {block!r}")
        self.key = (int(key[0]), int(key[1]))
        self.block = int(block)

    def words(self, n: int, device: Any = None) -> Any:
        """The next ``n`` words of the stream as an int32 tensor on ``device`` (bit pattern of
        the uint32 word; ``n`` rounded up to whole blocks, the spare words are skipped)."""
        import torch

        blocks = (int(n) + 3) // 4
        if self.block + blocks > MAX_BLOCK:
            raise RuntimeError("the Philox stream is exhausted (2^62 blocks); use a new seed")
        j = torch.arange(self.block, self.block + blocks, dtype=torch.int64, device=device)
        zero = torch.zeros_like(j)
        out = philox4x32((j & _MASK, j >> 32, zero, zero), self.key)
        self.block += blocks
        w = torch.stack(out, dim=1).view(-1)[:n]
        # uint32 bit pattern -> int32 (two's complement), as the host path views its words
        return w.sub_((w >> 31) << 32).to(torch.int32)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": "philox4x32-10", "key": list(self.key), "block": self.block}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PhiloxStream:
        if state.get("generator") != "philox4x32-10":
            raise ValueError(f"unknown device noise generator {state.get('generator')!r}")
        return cls(tuple(state["key"]), state["block"])

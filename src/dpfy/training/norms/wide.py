"""Norms and sums of parameter-sized tensors accumulated in float64, one block at a time.

``torch.linalg.vector_norm(t, dtype=torch.float64)`` and ``t.sum(dtype=torch.float64)`` cast the
whole tensor first: a float64 copy, twice the size of an fp32 gradient (90 MB for the word
embeddings of all-MiniLM-L6-v2), made where the first step's checks already hold the most
memory (:mod:`dpfy.training.norms.coverage`, :mod:`dpfy.training.norms.attribution`). Here the
flattened tensor is cast in blocks of :data:`BLOCK` elements: the same float64 accumulation
(each block's terms summed in float64, then the blocks' partial sums), with at most one
block's float64 copy alive. The checks' tolerances (relative 1e-3 in fp32, 1e-8 in float64)
are far above the few float64 roundings the block order changes.
"""

from __future__ import annotations

import torch

#: Elements cast to float64 at a time (8 MB of float64).
BLOCK = 1 << 20


def _blocks(t: torch.Tensor) -> list[torch.Tensor]:
    flat = t.reshape(-1)
    return [flat[i : i + BLOCK] for i in range(0, flat.numel(), BLOCK)]


def norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``t`` (any shape and floating dtype), float64 0-d, on ``t``'s device."""
    acc = torch.zeros((), dtype=torch.float64, device=t.device)
    for block in _blocks(t):
        acc += block.double().square().sum()
    return acc.sqrt()


def difference_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||a - b||`` (float64 0-d): each block's difference formed in ``a``'s dtype (one
    rounding, as ``a - b.to(a.dtype)`` would), then squared and summed in float64."""
    if a.shape != b.shape:
        raise ValueError(f"a and b must have one shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    acc = torch.zeros((), dtype=torch.float64, device=a.device)
    for x, y in zip(_blocks(a), _blocks(b), strict=True):
        acc += (x - y.to(x.dtype)).double().square().sum()
    return acc.sqrt()


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``[L2 norm, sum, L1 norm]`` of ``t`` in float64 ([3], on ``t``'s device)."""
    acc = torch.zeros(3, dtype=torch.float64, device=t.device)
    for block in _blocks(t):
        x = block.double()
        acc += torch.stack([x.square().sum(), x.sum(), x.abs().sum()])
    return torch.stack([acc[0].sqrt(), acc[1], acc[2]])

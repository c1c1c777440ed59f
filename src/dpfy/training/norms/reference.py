"""Slow, obviously-correct per-example gradients: the oracle the fast rules are tested against.

One forward/backward pass per example (``model(x[i:i+1])``), no hooks, no tricks. Use it to
check a new norm rule or a model the fast path handles; never in training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dpfy.training.norms.registry import tensor_sum


def per_example_gradients(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: [B, *shape]}`` gradients of each example's loss, by a loop over examples."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    batch = targets.shape[0]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for i in range(batch):
        x = tree_map(lambda t, i=i: t[i : i + 1] if isinstance(t, torch.Tensor) else t, inputs)
        y = targets[i : i + 1]
        if isinstance(x, dict):
            out = model(**x)
        elif isinstance(x, tuple | list):
            out = model(*x)
        else:
            out = model(x)
        loss = loss_fn(out, y).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads, strict=True):
            rows[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in rows.items()}


def clipped_sum_reference(
    per_example: dict[str, torch.Tensor],
    clip_norm: float | dict[str, float] | None,
    *,
    weights: torch.Tensor | None = None,
    groups: dict[str, tuple[str, ...]] | None = None,
    microbatch_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Clip each example's (or microbatch average's) gradient and sum.

    Args:
      per_example: ``{name: [B, *shape]}``.
      clip_norm: flat C, ``{group: C_g}`` with ``groups``, or ``None`` (no clipping).
      weights: 0/1 row weights (padding rows 0).
      groups: ``{group: names}`` for separate clipping per group.
      microbatch_size: k > 1 clips averages ``(1/k) sum w_i g_i`` of consecutive rows.
    """
    first = next(iter(per_example.values()))
    batch = first.shape[0]
    w = (torch.ones(batch, dtype=torch.float64) if weights is None else weights.double()).to(
        first.device)
    k = microbatch_size
    units = {}
    for n, g in per_example.items():
        g = g.double() * w.reshape(-1, *([1] * (g.dim() - 1)))
        units[n] = g.reshape(batch // k, k, *g.shape[1:]).sum(1) / k
    groups = groups or {"all": tuple(per_example)}
    clips = clip_norm if isinstance(clip_norm, dict) else dict.fromkeys(groups, clip_norm)
    out = {}
    for gname, names in groups.items():
        sq = tensor_sum(units[n].reshape(units[n].shape[0], -1).pow(2).sum(1) for n in names)
        norm = sq.sqrt()
        c = clips[gname]
        scale = torch.ones_like(norm) if c is None else torch.clamp(c / norm, max=1.0)
        for n in names:
            out[n] = (units[n] * scale.reshape(-1, *([1] * (units[n].dim() - 1)))).sum(0)
    return out

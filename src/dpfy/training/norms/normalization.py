"""Affine parameters of LayerNorm, GroupNorm and RMSNorm: cheap materialised per-example grads.

With ``x_hat`` the normalised input (recomputed from the saved input), the per-example
gradients are ``sum_positions g * x_hat`` (weight) and ``sum_positions g`` (bias): tensors of
the parameter's size per example, so materialising them is cheaper than any ghost trick.
GroupNorm normalises within each example, so it never mixes examples (unlike BatchNorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpfy.training.norms.registry import Capture, MaterializedGrads, fold_rows, register_norm_rule

__all__ = ["layer_norm_rule", "group_norm_rule", "rms_norm_rule"]


def _affine_grads(
    module: nn.Module,
    xhat_and_grads: list[tuple[torch.Tensor, torch.Tensor]],
    reduce_dims: tuple[int, ...],
    group_size: int,
) -> MaterializedGrads:
    def reduce(t: torch.Tensor) -> torch.Tensor:
        return t.sum(reduce_dims) if reduce_dims else t  # sum(()) would reduce everything

    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    grads: dict[str, torch.Tensor] = {}
    if weight is not None and weight.requires_grad:
        gw = sum(reduce(gy * xh) for xh, gy in xhat_and_grads)
        grads["weight"] = fold_rows(gw, group_size)
    if bias is not None and bias.requires_grad:
        gb = sum(reduce(gy) for _, gy in xhat_and_grads)
        grads["bias"] = fold_rows(gb, group_size)
    return MaterializedGrads(grads)


@register_norm_rule(nn.LayerNorm)
def layer_norm_rule(module: nn.LayerNorm, captures: list[Capture], group_size: int):
    """Rule for ``nn.LayerNorm`` (elementwise affine) on inputs [B, ..., *normalized_shape]."""
    pairs = []
    for cap in captures:
        x = cap.args[0]
        xhat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        pairs.append((xhat, cap.grad_outputs[0]))
    k = len(module.normalized_shape)
    dims = tuple(range(1, captures[0].args[0].dim() - k))
    return _affine_grads(module, pairs, dims, group_size)


@register_norm_rule(nn.GroupNorm)
def group_norm_rule(module: nn.GroupNorm, captures: list[Capture], group_size: int):
    """Rule for ``nn.GroupNorm`` (affine) on inputs [B, C, *spatial]."""
    pairs = []
    for cap in captures:
        x = cap.args[0]
        xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
        pairs.append((xhat, cap.grad_outputs[0]))
    dims = tuple(range(2, captures[0].args[0].dim()))
    return _affine_grads(module, pairs, dims, group_size)


if hasattr(nn, "RMSNorm"):

    @register_norm_rule(nn.RMSNorm)
    def rms_norm_rule(module: nn.RMSNorm, captures: list[Capture], group_size: int):
        """Rule for ``nn.RMSNorm`` (elementwise affine) on inputs [B, ..., *normalized_shape]."""
        pairs = []
        for cap in captures:
            x = cap.args[0]
            xhat = F.rms_norm(x, module.normalized_shape, None, module.eps)
            pairs.append((xhat, cap.grad_outputs[0]))
        k = len(module.normalized_shape)
        dims = tuple(range(1, captures[0].args[0].dim() - k))
        return _affine_grads(module, pairs, dims, group_size)

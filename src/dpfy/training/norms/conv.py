"""Convolutions (Conv1d, Conv2d): unfold to linear form, then ghost or materialised norms.

A convolution is a Linear layer applied at every output position to the unfolded input patch
(``F.unfold``), with weight [C_out, C_in/groups, *kernel] seen as ``groups`` blocks of shape
[C_out/groups, C_in/groups * prod(kernel)]. Any stride, padding (ints, ``"same"``,
``"valid"``; every ``padding_mode``), dilation and groups are supported. Conv1d runs as a
Conv2d of height 1. The per-layer choice between ghost norms (T x T Gram matrices over the T
output positions) and materialised per-example gradients is made by
:func:`dpfy.training.norms.linear.choose_mode` from the shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpfy.training.norms.linear import LinearForm, fold_linear_form
from dpfy.training.norms.registry import Capture, register_norm_rule

__all__ = ["conv_rule", "unfold_conv_input"]


def _explicit_padding(module: nn.Conv1d | nn.Conv2d) -> list[int]:
    """Padding as F.pad's list (last dim first: left, right, top, bottom)."""
    kernel, dilation = module.kernel_size, module.dilation
    if isinstance(module.padding, str):
        if module.padding == "valid":
            pads = [(0, 0)] * len(kernel)
        else:  # "same" (stride 1): total = dilation * (k - 1), extra on the right/bottom
            pads = []
            for k, dl in zip(kernel, dilation, strict=True):
                total = dl * (k - 1)
                pads.append((total // 2, total - total // 2))
    else:
        pads = [(p, p) for p in module.padding]
    flat: list[int] = []
    for lo, hi in reversed(pads):
        flat += [lo, hi]
    return flat


def unfold_conv_input(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches as [B, groups, L, C_in/groups * prod(kernel)] (L output positions)."""
    pad = _explicit_padding(module)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)
        kernel, dilation, stride = (1, *module.kernel_size), (1, *module.dilation), (
            1,
            *module.stride,
        )
    else:
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # [B, C_in*k, L]
    b, ck, length = cols.shape
    groups = module.groups
    return cols.reshape(b, groups, ck // groups, length).transpose(2, 3)


@register_norm_rule(nn.Conv1d, nn.Conv2d)
def conv_rule(module: nn.Conv1d | nn.Conv2d, captures: list[Capture], group_size: int):
    """Rule for ``nn.Conv1d`` / ``nn.Conv2d`` on batched inputs [B, C, *spatial]."""
    acts, grads = [], []
    groups = module.groups
    for cap in captures:
        x, gy = cap.args[0], cap.grad_outputs[0]
        if x.dim() != (3 if isinstance(module, nn.Conv1d) else 4):
            raise ValueError(
                f"{type(module).__name__} input must be batched; got shape {tuple(x.shape)}"
            )
        acts.append(unfold_conv_input(module, x))
        b, c_out = gy.shape[:2]
        g = gy.reshape(b, groups, c_out // groups, -1).transpose(2, 3)  # [B, groups, L, o]
        grads.append(g)
    a = acts[0] if len(acts) == 1 else torch.cat(acts, dim=2)
    g = grads[0] if len(grads) == 1 else torch.cat(grads, dim=2)
    a, g = fold_linear_form(a, g, group_size)
    return LinearForm(
        a,
        g,
        module.weight.shape,
        weight_name="weight" if module.weight.requires_grad else None,
        bias_name="bias" if module.bias is not None and module.bias.requires_grad else None,
    )

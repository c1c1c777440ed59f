"""Convolutions (Conv1d, Conv2d): materialised per-example gradients or ghost norms, by cost.

A convolution is a Linear layer applied at every output position to the unfolded input patch
(``F.unfold``), with weight [C_out, C_in/groups, *kernel] seen as ``groups`` blocks of shape
[C_out/groups, C_in/groups * prod(kernel)]. The per-layer choice (Bu et al. 2023, mixed
ghost clipping) is made by :func:`dpfy.training.norms.linear.choose_mode` from the shapes:

* materialise (few channels, many positions -- small images): every example's weight
  gradient comes from *one* grouped weight-gradient call with the batch folded into the
  groups (no unfold; as fast as the ordinary weight gradient);
* ghost (many channels, few positions): unfold to the linear form and take T x T Gram
  matrices of the T output positions; the clipped sum is the book-keeping contraction.

Any stride, padding (ints, ``"same"``, ``"valid"``; every ``padding_mode``), dilation and
groups are supported. Conv1d runs as a Conv2d of height 1 in the unfold path.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dpfy.training.norms.linear import LinearForm, choose_mode, fold_linear_form
from dpfy.training.norms.registry import (
    Capture,
    MaterializedGrads,
    fold_rows,
    register_norm_rule,
    tensor_sum,
)


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


def _padded_as_2d(
    module: nn.Conv1d | nn.Conv2d, x: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The input padded as the module pads it, a Conv1d seen as a Conv2d of height 1.

    Returns ``(x [B, C, H, W], kernel, dilation, stride)`` with 2-D kernel, dilation, stride.
    """
    pad = _explicit_padding(module)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    if isinstance(module, nn.Conv1d):
        return (
            x.unsqueeze(2),
            (1, *module.kernel_size),
            (1, *module.dilation),
            (1, *module.stride),
        )
    return x, module.kernel_size, module.dilation, module.stride


def unfold_conv_input(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Input patches as [B, groups, L, C_in/groups * prod(kernel)] (L output positions)."""
    x, kernel, dilation, stride = _padded_as_2d(module, x)
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # [B, C_in*k, L]
    b, ck, length = cols.shape
    groups = module.groups
    return cols.reshape(b, groups, ck // groups, length).transpose(2, 3)


#: The module types :func:`conv_rule` handles (typed so the rule may take either).
_CONV_TYPES: tuple[type[nn.Conv1d | nn.Conv2d], ...] = (nn.Conv1d, nn.Conv2d)

#: Below this many input channels per group the grouped weight-gradient call is slow with
#: several threads (oneDNN splits tiny groups); patches are then copied and multiplied.
GROUPED_MIN_CHANNELS = 16


def per_example_conv_grads(
    module: nn.Conv1d | nn.Conv2d,
    x: torch.Tensor,
    gy: torch.Tensor,
    *,
    weight: bool = True,
    bias: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-example weight [B, *weight.shape] and bias [B, C_out] gradients.

    Picks :func:`_grouped_conv_grads` (one grouped weight-gradient call) for layers with at
    least ``GROUPED_MIN_CHANNELS`` input channels per group, else
    :func:`_patch_conv_grads` (strided patch copy and one batched matmul).
    """
    if module.in_channels // module.groups >= GROUPED_MIN_CHANNELS:
        return _grouped_conv_grads(module, x, gy, weight=weight, bias=bias)
    return _patch_conv_grads(module, x, gy, weight=weight, bias=bias)


def _patch_conv_grads(
    module: nn.Conv1d | nn.Conv2d,
    x: torch.Tensor,
    gy: torch.Tensor,
    *,
    weight: bool = True,
    bias: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-example gradients from a strided view of the input patches and one matmul."""
    b = x.shape[0]
    pw = None
    if weight:
        x, kernel, dil, stride = _padded_as_2d(module, x)
        x = x.contiguous()
        gy4 = gy.unsqueeze(2) if isinstance(module, nn.Conv1d) else gy
        c = x.shape[1]
        ho, wo = gy4.shape[2:]
        sb, sc, sh, sw = x.stride()
        patches = x.as_strided(
            (b, c, kernel[0], kernel[1], ho, wo),
            (sb, sc, dil[0] * sh, dil[1] * sw, stride[0] * sh, stride[1] * sw),
        )
        g = module.groups
        a = patches.reshape(b, g, (c // g) * kernel[0] * kernel[1], ho * wo)  # copies once
        gg = gy4.reshape(b, g, gy4.shape[1] // g, ho * wo)
        pw = torch.matmul(gg, a.transpose(-1, -2)).reshape(b, *module.weight.shape)
    pb = gy.flatten(2).sum(2) if bias else None
    return pw, pb


def _grouped_conv_grads(
    module: nn.Conv1d | nn.Conv2d,
    x: torch.Tensor,
    gy: torch.Tensor,
    *,
    weight: bool = True,
    bias: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-example weight and bias gradients in one grouped weight-gradient call.

    The batch is folded into the channels (``[1, B*C_in, ...]``) and the convolution is seen
    as ``B * groups`` independent groups, so the library's (oneDNN) weight-gradient kernel
    returns every example's gradient at the cost of one ordinary weight gradient; the bias
    gradient of the folded convolution is the per-example bias gradient.
    """
    b = x.shape[0]
    pad = _explicit_padding(module)
    symmetric = all(pad[i] == pad[i + 1] for i in range(0, len(pad), 2))
    if module.padding_mode != "zeros" or not symmetric:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
        padding = [0] * (len(pad) // 2)
    else:
        padding = pad[::2][::-1]
    spatial = x.shape[2:]
    xg = x.reshape(1, b * x.shape[1], *spatial)
    gg = gy.reshape(1, b * gy.shape[1], *gy.shape[2:])
    w_shape = (b * module.out_channels, *module.weight.shape[1:])
    w_dummy = torch.empty(w_shape, dtype=x.dtype, device=x.device)
    _, grad_w, grad_b = torch.ops.aten.convolution_backward(
        gg,
        xg,
        w_dummy,
        [b * module.out_channels] if bias else None,
        list(module.stride),
        padding,
        list(module.dilation),
        False,
        [0] * len(spatial),
        b * module.groups,
        [False, weight, bias],
    )
    pw = grad_w.reshape(b, *module.weight.shape) if weight else None
    pb = grad_b.reshape(b, module.out_channels) if bias else None
    return pw, pb


@register_norm_rule(*_CONV_TYPES)
def conv_rule(
    module: nn.Conv1d | nn.Conv2d, captures: list[Capture], group_size: int
) -> MaterializedGrads | LinearForm:
    """Rule for ``nn.Conv1d`` / ``nn.Conv2d`` on batched inputs [B, C, *spatial].

    Materialises per-example weight gradients with one grouped weight-gradient call when that
    is cheaper than ghost norms over the T output positions (most convolutions of small
    images); otherwise unfolds to the linear form and uses Gram matrices (ghost norms).
    """
    want_w = module.weight.requires_grad
    want_b = module.bias is not None and module.bias.requires_grad
    ndim = 3 if isinstance(module, nn.Conv1d) else 4
    for cap in captures:
        if cap.args[0].dim() != ndim:
            raise ValueError(
                f"{type(module).__name__} input must be batched; got shape "
                f"{tuple(cap.args[0].shape)}"
            )
    n = captures[0].args[0].shape[0]
    positions = sum(math.prod(c.grad_outputs[0].shape[2:]) for c in captures)
    groups = module.groups
    d = module.weight[0].numel()
    o = module.out_channels // groups
    mode = choose_mode(
        n // group_size, groups, positions * group_size, d, o, module.weight.element_size()
    )
    if mode == "materialize":
        parts = [
            per_example_conv_grads(
                module, c.args[0], c.grad_outputs[0], weight=want_w, bias=want_b
            )
            for c in captures
        ]
        # per_example_conv_grads returns a tensor for each gradient it was asked for
        grads: dict[str, torch.Tensor] = {}
        if want_w:
            pws = (cast(torch.Tensor, p[0]) for p in parts)
            grads["weight"] = fold_rows(tensor_sum(pws), group_size)
        if want_b:
            pbs = (cast(torch.Tensor, p[1]) for p in parts)
            grads["bias"] = fold_rows(tensor_sum(pbs), group_size)
        return MaterializedGrads(grads)
    acts, gys = [], []
    for cap in captures:
        x, gy = cap.args[0], cap.grad_outputs[0]
        acts.append(unfold_conv_input(module, x))
        b, c_out = gy.shape[:2]
        gys.append(gy.reshape(b, groups, c_out // groups, -1).transpose(2, 3))  # [B, g, L, o]
    a = acts[0] if len(acts) == 1 else torch.cat(acts, dim=2)
    g = gys[0] if len(gys) == 1 else torch.cat(gys, dim=2)
    a, g = fold_linear_form(a, g, group_size)
    return LinearForm(
        a,
        g,
        module.weight.shape,
        weight_name="weight" if want_w else None,
        bias_name="bias" if want_b else None,
        mode="ghost",
    )

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
from torch.nn.utils import parametrizations
from torch.nn.utils.spectral_norm import SpectralNorm

from dpfy.training.norms.registry import (
    Capture,
    MaterializedGrads,
    fold_rows,
    register_norm_rule,
    register_norm_rule_by_name,
    register_unsupported,
    tensor_sum,
)


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
        gw = tensor_sum(reduce(gy * xh) for xh, gy in xhat_and_grads)
        grads["weight"] = fold_rows(gw, group_size)
    if bias is not None and bias.requires_grad:
        gb = tensor_sum(reduce(gy) for _, gy in xhat_and_grads)
        grads["bias"] = fold_rows(gb, group_size)
    return MaterializedGrads(grads)


@register_norm_rule(nn.LayerNorm)
def layer_norm_rule(
    module: nn.LayerNorm, captures: list[Capture], group_size: int
) -> MaterializedGrads:
    """Rule for ``nn.LayerNorm`` (elementwise affine) on inputs [B, ..., *normalized_shape]."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for cap in captures:
        x = cap.args[0]
        xhat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        pairs.append((xhat, cap.grad_outputs[0]))
    k = len(module.normalized_shape)
    dims = tuple(range(1, captures[0].args[0].dim() - k))
    return _affine_grads(module, pairs, dims, group_size)


@register_norm_rule(nn.GroupNorm)
def group_norm_rule(
    module: nn.GroupNorm, captures: list[Capture], group_size: int
) -> MaterializedGrads:
    """Rule for ``nn.GroupNorm`` (affine) on inputs [B, C, *spatial].

    GroupNorm's statistics are per example, so a batch of B examples is one example with
    B*C channels and B*groups groups: the library's GroupNorm backward on that view returns
    per-example ``sum_spatial g * x_hat`` and ``sum_spatial g`` (its per-channel reductions)
    without forming ``x_hat`` or ``g * x_hat``.
    """
    want_w = module.weight is not None and module.weight.requires_grad
    want_b = module.bias is not None and module.bias.requires_grad
    gw_sum: torch.Tensor | None = None
    gb_sum: torch.Tensor | None = None
    for cap in captures:
        x, gy = cap.args[0], cap.grad_outputs[0]
        b, c = x.shape[:2]
        hw = x[0, 0].numel()
        xx = x.reshape(1, b * c, hw)
        if cap.extra is not None:  # statistics autograd saved in the forward pass
            mean, rstd = (t.reshape(1, -1) for t in cap.extra)
        else:
            _, mean, rstd = torch.ops.aten.native_group_norm(
                xx, None, None, 1, b * c, hw, b * module.num_groups, module.eps
            )
        ones = torch.ones(b * c, dtype=x.dtype, device=x.device)
        _, gw, gb = torch.ops.aten.native_group_norm_backward(
            gy.reshape(1, b * c, hw), xx, mean, rstd, ones, 1, b * c, hw,
            b * module.num_groups, [False, want_w, want_b],
        )
        if want_w:
            gw_sum = gw.reshape(b, c) if gw_sum is None else gw_sum + gw.reshape(b, c)
        if want_b:
            gb_sum = gb.reshape(b, c) if gb_sum is None else gb_sum + gb.reshape(b, c)
    grads: dict[str, torch.Tensor] = {}
    if gw_sum is not None:
        grads["weight"] = fold_rows(gw_sum, group_size)
    if gb_sum is not None:
        grads["bias"] = fold_rows(gb_sum, group_size)
    return MaterializedGrads(grads)


def _group_norm_stats(
    module: nn.GroupNorm, x: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-(example, group) mean and 1/std that autograd saved for GroupNorm's backward."""
    fn = output.grad_fn
    if fn is None or type(fn).__name__ != "NativeGroupNormBackward0":
        return None
    try:
        # saved tensors are attributes of the generated node classes, absent from torch's stubs
        mean: torch.Tensor = fn._saved_result1  # type: ignore[attr-defined]
        rstd: torch.Tensor = fn._saved_result2  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    expected = (x.shape[0], module.num_groups)
    if tuple(mean.shape) != expected or tuple(rstd.shape) != expected:
        return None
    return mean.detach(), rstd.detach()


# A rule's optional forward hook is a function attribute (see register_norm_rule).
group_norm_rule.on_forward = _group_norm_stats  # type: ignore[attr-defined]


if hasattr(nn, "RMSNorm"):

    @register_norm_rule(nn.RMSNorm)
    def rms_norm_rule(
        module: nn.RMSNorm, captures: list[Capture], group_size: int
    ) -> MaterializedGrads:
        """Rule for ``nn.RMSNorm`` (elementwise affine) on inputs [B, ..., *normalized_shape]."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for cap in captures:
            x = cap.args[0]
            xhat = F.rms_norm(x, module.normalized_shape, None, module.eps)
            pairs.append((xhat, cap.grad_outputs[0]))
        k = len(module.normalized_shape)
        dims = tuple(range(1, captures[0].args[0].dim() - k))
        return _affine_grads(module, pairs, dims, group_size)


#: ``transformers``' RMSNorm copies (one class per model family, same computation):
#: ``weight * (x * rsqrt(mean(x^2) + eps))`` (Gemma: ``(1 + weight) * ...``), in float32.
#: Any of them has per-example weight gradient ``sum_positions g * x_hat``.
HF_RMS_NORMS = tuple(
    f"transformers.models.{pkg}.modeling_{pkg}.{cls}"
    for pkg, cls in (
        ("llama", "LlamaRMSNorm"),
        ("mistral", "MistralRMSNorm"),
        ("mixtral", "MixtralRMSNorm"),
        ("qwen2", "Qwen2RMSNorm"),
        ("qwen3", "Qwen3RMSNorm"),
        ("phi3", "Phi3RMSNorm"),
        ("gemma", "GemmaRMSNorm"),
        ("gemma2", "Gemma2RMSNorm"),
        ("olmo2", "Olmo2RMSNorm"),
        ("t5", "T5LayerNorm"),
    )
)


@register_norm_rule_by_name(*HF_RMS_NORMS)
def hf_rms_norm_rule(
    module: nn.Module, captures: list[Capture], group_size: int
) -> MaterializedGrads:
    """Rule for ``transformers``' RMSNorm layers (``LlamaRMSNorm`` and its per-model copies)."""
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for cap in captures:
        x = cap.args[0]
        x32 = x.to(torch.float32)
        xhat = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        gy = cap.grad_outputs[0]
        pairs.append((xhat.to(gy.dtype), gy))
    dims = tuple(range(1, captures[0].args[0].dim() - 1))
    return _affine_grads(module, pairs, dims, group_size)


# Spectral normalisation (Miyato et al. 2018, Alg. 1) runs a step of power iteration in each
# training forward pass and writes its vectors u, v into buffers: each use of the weight
# divides by a different sigma. The generic rule would recompute the call with yet another
# sigma and advance the buffers once more, and even a loop over the examples would see a
# different weight per example; there is no per-example gradient to match.
_SPECTRAL = (
    "spectral normalisation updates its power-iteration buffers (u, v) in every training "
    "forward pass, so each use of the weight divides by a different sigma and no "
    "recomputation per example can reproduce the weight the batch used."
)
register_unsupported(
    parametrizations._SpectralNorm,
    reason=_SPECTRAL,
    fix=(
        "remove the parametrization before training (torch.nn.utils.parametrize."
        "remove_parametrizations(module, 'weight')), or freeze the module "
        "(module.requires_grad_(False))."
    ),
)
register_unsupported(
    SpectralNorm,
    reason=_SPECTRAL,
    fix=(
        "remove it before training (torch.nn.utils.remove_spectral_norm(module)), or freeze "
        "the module (module.requires_grad_(False))."
    ),
)

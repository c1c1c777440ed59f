"""Multi-head attention (``nn.MultiheadAttention``): exact per-example gradients of all its
parameters from the one backward pass of the step.

MHA uses its parameters inside one call -- ``in_proj_weight`` as three projections,
``out_proj.weight`` functionally (``out_proj`` is never called), ``bias_k``/``bias_v`` as an
extra key/value position -- so the gradient of its output alone does not give them. The rule
is registered with ``recompute=``: in the forward hook :func:`recompute_attention` re-runs the
call with the arithmetic of ``F.multi_head_attention_forward`` (batch-first layout inside) and
makes these tensors the *targets* whose gradients the rule gets:

* each in-projection block's output ``x W_blk^T + b_blk`` [B, T, o]: with the block's input
  ``x`` [B, T, d] a :class:`~dpfy.training.norms.linear.LinearForm` (ghost or materialised by
  its cost model). Self-attention with packed weights (``query is key is value``) is one block
  of 3E rows (its three maps share ``x``, so one linear form with ``o = 3E`` is exact);
  ``key is value`` gives a query block and one key-value block of 2E rows; otherwise there is
  one block per map (rows of ``in_proj_weight``, or ``q/k/v_proj_weight`` when ``kdim`` or
  ``vdim`` differ from ``embed_dim``), with the matching rows of ``in_proj_bias``;
* the rows of ``bias_k``/``bias_v`` expanded over the batch [B, 1, E]: row ``b``'s gradient is
  example ``b``'s gradient of the bias (materialised, E numbers per example);
* the output projection's output [B, L, E]: a linear form with the attention context
  [B, L, E] (kept detached from the recomputation) as activations.

Examples never mix in attention (each batch row attends within itself), so these per-example
gradients are exact. Everything the module supports on batched input is reproduced:
``key_padding_mask`` and ``attn_mask`` (2-D and 3-D, bool and float), ``is_causal``,
``add_zero_attn``, ``need_weights`` with ``average_attn_weights``, ``batch_first`` either way,
dropout (drawn anew: the recomputed output replaces the module's). Without ``need_weights``
attention runs in ``F.scaled_dot_product_attention``; with it, as an explicit softmax.
Unbatched (2-D) input is refused: per-example clipping needs a batch dimension.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from dpfy.training.norms.composite import CompositeGrads, Slot
from dpfy.training.norms.linear import LinearForm, fold_linear_form
from dpfy.training.norms.registry import (
    Capture,
    LayerGrads,
    MaterializedGrads,
    Recomputed,
    fold_rows,
    register_norm_rule,
    tensor_sum,
)


class ProjectionBlock(NamedTuple):
    """One linear map of the in-projection and where its parameters lie.

    Attributes:
      weight: local name of the weight parameter (``"in_proj_weight"``, ``"q_proj_weight"``...).
      start, stop: its rows of that weight (``stop - start`` outputs).
      bias_start: its first row of ``in_proj_bias`` (rows ``[bias_start, bias_start + o)``).
    """

    weight: str
    start: int
    stop: int
    bias_start: int


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionCall:
    """What the rule needs of one recomputed call besides the target gradients (detached).

    Attributes:
      blocks: the in-projection blocks, in the order of the first targets.
      inputs: each block's input, batch first: [B, T, d] (T = L for the query, S otherwise).
      context: the output projection's input (attention context) [B, L, E].
    """

    blocks: tuple[ProjectionBlock, ...]
    inputs: tuple[torch.Tensor, ...]
    context: torch.Tensor


_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward).parameters
_ARG_NAMES = tuple(_SIGNATURE)[1:]  # without self
_DEFAULTS = {n: p.default for n, p in _SIGNATURE.items() if p.default is not p.empty}


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments of one ``MultiheadAttention.forward`` call by name, defaults filled in."""
    call = dict(_DEFAULTS)
    call.update(zip(_ARG_NAMES, args, strict=False))
    call.update(kwargs)
    return call


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True: masked) as an additive float mask (-inf there, 0 elsewhere)."""
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"only bool and floating attention masks are supported, got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _blocks(module: nn.MultiheadAttention, packing: int) -> tuple[ProjectionBlock, ...]:
    """In-projection blocks: ``packing`` 1 (q|k|v packed), 2 (q, k|v) or 3 (q, k, v)."""
    e = module.embed_dim
    if not module._qkv_same_embed_dim:
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        return tuple(ProjectionBlock(n, 0, e, i * e) for i, n in enumerate(names))
    if packing == 1:
        return (ProjectionBlock("in_proj_weight", 0, 3 * e, 0),)
    if packing == 2:
        return (
            ProjectionBlock("in_proj_weight", 0, e, 0),
            ProjectionBlock("in_proj_weight", e, 3 * e, e),
        )
    return tuple(ProjectionBlock("in_proj_weight", i * e, (i + 1) * e, i * e) for i in range(3))


def _project(
    module: nn.MultiheadAttention,
    blocks: tuple[ProjectionBlock, ...],
    inputs: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    """Each block's projection ``x W_blk^T + b_blk`` [B, T, o] (the rule's first targets)."""
    out = []
    for blk, x in zip(blocks, inputs, strict=True):
        weight: torch.Tensor = getattr(module, blk.weight)[blk.start : blk.stop]
        bias: torch.Tensor | None = module.in_proj_bias
        if bias is not None:
            bias = bias[blk.bias_start : blk.bias_start + blk.stop - blk.start]
        out.append(F.linear(x, weight, bias))
    return tuple(out)


def _chunks(x: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Views of ``x`` [..., m * width] as m tensors [..., width]."""
    return [x[..., i : i + width] for i in range(0, x.shape[-1], width)]


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, E] -> [B, heads, T, E / heads]."""
    return x.reshape(*x.shape[:2], num_heads, -1).transpose(1, 2)


def _attention_mask(
    attn_mask: torch.Tensor | None, batch: int, num_heads: int
) -> torch.Tensor | None:
    """An additive [L, S] or [B * heads, L, S] mask as [1, 1, L, S] or [B, heads, L, S]."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        return attn_mask[None, None]
    return attn_mask.view(batch, num_heads, *attn_mask.shape[1:])


def _pad_key(mask: torch.Tensor | None) -> torch.Tensor | None:
    """One more key position, unmasked (for bias_k/bias_v or the zero attention position)."""
    return None if mask is None else F.pad(mask, (0, 1))


def recompute_attention(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Recompute one ``MultiheadAttention`` call with its parameter-gradient targets.

    Args:
      module: the ``nn.MultiheadAttention``.
      args, kwargs: the call's inputs as the module got them (not detached); query [L, B, E]
        and key/value [S, B, kdim / vdim], or [B, L, E] etc. with ``batch_first``.
      output: the module's own output (unused: the recomputation replaces it).

    Returns:
      ``output``: ``(attn_output, attn_weights or None)`` as the module returns them;
      ``targets``: the in-projection blocks' outputs [B, T, o], then (with ``add_bias_kv``)
      ``bias_k`` and ``bias_v`` expanded to [B, 1, E], then the output projection's output
      [B, L, E]; ``extra``: an :class:`AttentionCall`. ``None`` when autograd is off.

    Raises:
      ValueError: unbatched (2-D) or nested input.
    """
    mha = cast(nn.MultiheadAttention, module)
    if not torch.is_grad_enabled():
        return None
    call = _bind(args, kwargs)
    query, key, value = call["query"], call["key"], call["value"]
    if query.is_nested or key.is_nested or value.is_nested:
        raise ValueError(
            "MultiheadAttention on nested tensors cannot be clipped per example; pass padded "
            "tensors with a key_padding_mask"
        )
    if query.dim() != 3:
        raise ValueError(
            "MultiheadAttention input must be batched ([L, B, E], or [B, L, E] with batch_first) "
            f"to clip per example; got query of shape {tuple(query.shape)}"
        )
    packing = 1 if query is key and key is value else 2 if key is value else 3
    blocks = _blocks(mha, packing)
    sources = (query, key, value)[: len(blocks)]
    inputs = sources if mha.batch_first else tuple(x.transpose(0, 1) for x in sources)
    projections = _project(mha, blocks, inputs)
    e = mha.embed_dim
    q, k, v = (t for p in projections for t in _chunks(p, e))
    batch, tgt_len = q.shape[:2]
    dtype = query.dtype

    need_weights: bool = call["need_weights"]
    kpm = _additive(call["key_padding_mask"], dtype)
    is_causal = bool(call["is_causal"]) and kpm is None and not need_weights
    attn_mask = None if is_causal else _additive(call["attn_mask"], dtype)
    mask = _attention_mask(attn_mask, batch, mha.num_heads)

    bias_targets: tuple[torch.Tensor, ...] = ()
    if mha.bias_k is not None and mha.bias_v is not None:
        bias_targets = (mha.bias_k.expand(batch, 1, e), mha.bias_v.expand(batch, 1, e))
        k = torch.cat([k, bias_targets[0]], 1)
        v = torch.cat([v, bias_targets[1]], 1)
        mask, kpm = _pad_key(mask), _pad_key(kpm)
    qh, kh, vh = (_heads(t, mha.num_heads) for t in (q, k, v))
    if mha.add_zero_attn:
        kh = torch.cat([kh, kh.new_zeros(*kh.shape[:2], 1, kh.shape[3])], 2)
        vh = torch.cat([vh, vh.new_zeros(*vh.shape[:2], 1, vh.shape[3])], 2)
        mask, kpm = _pad_key(mask), _pad_key(kpm)
    if kpm is not None:
        kpm = kpm.view(batch, 1, 1, kpm.shape[-1])
        mask = kpm if mask is None else mask + kpm
    dropout_p = mha.dropout if mha.training else 0.0

    weights: torch.Tensor | None = None
    if need_weights:
        scores = torch.matmul(qh * math.sqrt(1.0 / qh.shape[-1]), kh.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        ctx = torch.matmul(weights, vh)
        if call["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        ctx = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
    context = ctx.transpose(1, 2).reshape(batch, tgt_len, e)
    out = F.linear(context, mha.out_proj.weight, mha.out_proj.bias)
    attn_output = out if mha.batch_first else out.transpose(0, 1)
    extra = AttentionCall(blocks, tuple(x.detach() for x in inputs), context.detach())
    return Recomputed((attn_output, weights), (*projections, *bias_targets, out), extra)


def _split(
    entries: list[tuple[ProjectionBlock, torch.Tensor, torch.Tensor]], rows: int
) -> list[tuple[ProjectionBlock, torch.Tensor, torch.Tensor]]:
    """Blocks of several maps (q|k|v, k|v) split into one block per map of ``rows`` outputs."""
    out = []
    for blk, a, g in entries:
        for i, gi in enumerate(_chunks(g, rows)):
            start = blk.start + i * rows
            sub = ProjectionBlock(blk.weight, start, start + rows, blk.bias_start + i * rows)
            out.append((sub, a, gi))
    return out


def _linear_part(
    a: torch.Tensor,
    g: torch.Tensor,
    group_size: int,
    weight: tuple[str, slice | None] | None,
    bias: tuple[str, slice | None] | None,
) -> tuple[LayerGrads, dict[str, Slot]] | None:
    """A linear form from A [B, T, d] and G [B, T, o] filling ``weight``/``bias`` slots.

    A is brought to G's dtype: under autocast the recorded activations may be bf16/fp16 while
    the step hands the rule upcast fp32 gradients.
    """
    if weight is None and bias is None:
        return None
    a4, g4 = fold_linear_form(a.to(g.dtype).unsqueeze(1), g.unsqueeze(1), group_size)
    form = LinearForm(
        a4,
        g4,
        (g.shape[-1], a.shape[-1]),
        weight_name=None if weight is None else "weight",
        bias_name=None if bias is None else "bias",
    )
    slots = {k: s for k, s in (("weight", weight), ("bias", bias)) if s is not None}
    return form, slots


def _rows(start: int, stop: int, total: int) -> slice | None:
    return None if (start, stop) == (0, total) else slice(start, stop)


@register_norm_rule(nn.MultiheadAttention, recompute=recompute_attention, subtree=True)
def attention_rule(
    module: nn.MultiheadAttention, captures: list[Capture], group_size: int
) -> CompositeGrads:
    """Rule for ``nn.MultiheadAttention`` (all its trainable parameters, ``out_proj`` included).

    Each capture comes from :func:`recompute_attention` (``extra`` an :class:`AttentionCall`,
    ``grad_outputs`` the gradients of its targets). Several calls of the module add up per
    example: their blocks are stacked along the position axis (split into one block per map
    first when the calls' packings differ) and their bias gradients summed.
    """
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    shapes = {n: p.shape for n, p in params.items()}
    calls = []
    bias_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for cap in captures:
        info = cast(AttentionCall, cap.extra)
        nb = len(info.blocks)
        calls.append(list(zip(info.blocks, info.inputs, cap.grad_outputs[:nb], strict=True)))
        if module.bias_k is not None:
            bias_grads.append((cap.grad_outputs[nb], cap.grad_outputs[nb + 1]))
        outs.append((info.context, cap.grad_outputs[-1]))
    if any([b for b, _, _ in c] != [b for b, _, _ in calls[0]] for c in calls):
        calls = [_split(c, module.embed_dim) for c in calls]

    parts: list[tuple[LayerGrads, dict[str, Slot]]] = []
    bias_total = 3 * module.embed_dim
    for j, (blk, _, _) in enumerate(calls[0]):
        a = torch.cat([c[j][1] for c in calls], 1) if len(calls) > 1 else calls[0][j][1]
        g = torch.cat([c[j][2] for c in calls], 1) if len(calls) > 1 else calls[0][j][2]
        rows = blk.stop - blk.start
        weight_slot = (
            (blk.weight, _rows(blk.start, blk.stop, shapes[blk.weight][0]))
            if blk.weight in params
            else None
        )
        bias_slot = (
            ("in_proj_bias", _rows(blk.bias_start, blk.bias_start + rows, bias_total))
            if "in_proj_bias" in params
            else None
        )
        part = _linear_part(a, g, group_size, weight_slot, bias_slot)
        if part is not None:
            parts.append(part)

    dense = {}
    for i, name in enumerate(("bias_k", "bias_v")):
        if name in params and bias_grads:
            g = tensor_sum(bg[i] for bg in bias_grads)
            dense[name] = fold_rows(g.unsqueeze(1), group_size)
    if dense:
        parts.append((MaterializedGrads(dense), {n: (n, None) for n in dense}))

    a = torch.cat([c for c, _ in outs], 1) if len(outs) > 1 else outs[0][0]
    g = torch.cat([g for _, g in outs], 1) if len(outs) > 1 else outs[0][1]
    part = _linear_part(
        a,
        g,
        group_size,
        ("out_proj.weight", None) if "out_proj.weight" in params else None,
        ("out_proj.bias", None) if "out_proj.bias" in params else None,
    )
    if part is not None:
        parts.append(part)
    return CompositeGrads(parts, shapes)

"""Per-example losses of sequence models, ready for :meth:`PrivateGradient.accumulate`.

DP-SGD clips one gradient per example, so ``loss_fn(outputs, targets)`` must return one loss
per example, shape [B]. Sequence models produce one loss per *token*; these helpers reduce
the tokens of each example (``reduction="mean"``: over its non-ignored tokens, the usual
language-model loss, so the gradient scale does not grow with the example's length; or
``"sum"``). The clip bounds whatever the per-example loss is, so the privacy guarantee does
not depend on the choice -- only the effective clip norm per token does.

Padding: a position whose label is ``ignore_index`` (-100, as ``transformers`` pads labels)
contributes exactly zero to the loss and therefore to every gradient; with the model's
``attention_mask`` zero on the same positions, no other position reads them either. An
example without any labelled token has loss 0 (not NaN).

``outputs`` may be a logits tensor, a ``transformers`` model output (its ``.logits``) or a
tuple whose first element is the logits, so the helpers plug straight in as ``loss_fn``::

    pg.accumulate(batch, batch["labels"], causal_lm_loss)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

Reduction = Literal["mean", "sum"]


def _logits(outputs: Any) -> torch.Tensor:
    logits = getattr(outputs, "logits", None)
    if logits is None:
        logits = outputs[0] if isinstance(outputs, tuple | list) else outputs
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"expected logits (a tensor or an output with .logits), got {outputs!r}")
    return logits


def token_classification_loss(
    outputs: Any,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Per-example cross-entropy over tokens, logits [B, T, C] and labels [B, T] -> [B].

    Positions labelled ``ignore_index`` contribute exactly zero; ``reduction="mean"`` divides
    each example's sum by its number of labelled tokens (1 if it has none), ``"sum"`` does not.
    Masked-language-model losses are this with the model's MLM labels.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got reduction={reduction!r}")
    logits = _logits(outputs)
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, C] and labels [B, T], got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    per_token = F.cross_entropy(
        logits.transpose(1, 2), labels, ignore_index=ignore_index, reduction="none"
    )  # [B, T]; exactly 0 where ignored
    total = per_token.sum(1)
    if reduction == "sum":
        return total
    count = (labels != ignore_index).sum(1).clamp_(min=1).to(total.dtype)
    return total / count


def causal_lm_loss(
    outputs: Any,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Per-example next-token loss: logits [B, T, V] at position t predict ``labels[:, t+1]``.

    ``labels`` are the input ids with ``ignore_index`` on positions not to learn (padding,
    prompt): they are shifted here, as ``transformers`` does inside its models. See
    :func:`token_classification_loss` for ``reduction``.
    """
    logits = _logits(outputs)
    return token_classification_loss(
        logits[:, :-1], labels[:, 1:], ignore_index=ignore_index, reduction=reduction
    )


def sequence_classification_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-example loss of one label per sequence: logits [B, C] -> [B].

    Integer labels: cross-entropy; floating labels: squared error summed over the last
    dimension (regression heads, ``num_labels=1`` with labels [B] or [B, 1]).
    """
    logits = _logits(outputs)
    if labels.is_floating_point():
        target = labels.reshape(logits.shape).to(logits.dtype)
        return (logits - target).square().reshape(logits.shape[0], -1).sum(1)
    return F.cross_entropy(logits, labels, reduction="none")

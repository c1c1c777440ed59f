"""A classification head on mean-pooled token states, for sentence encoders.

all-MiniLM-L6-v2 was trained as a sentence encoder whose embedding is the attention-mask-weighted
mean of its last hidden states (Reimers & Gurevych 2019); its ``[CLS]`` state and BERT pooler are
not part of the checkpoint. ``transformers``' ``BertForSequenceClassification`` puts a freshly
initialised 384 x 384 pooler (tanh) and a head on ``[CLS]``: under DP noise those 148k fresh
parameters start from nothing and take much of the signal's budget. :class:`MeanPooledClassifier`
reads the representation the encoder was trained to produce and adds only a linear head,
initialised to zero, so the model starts at "both classes equally likely" and the first
private steps move the head along the (noisy) logistic-regression gradient of the pretrained
embeddings: the fine-tuning starts where DP learning on frozen features would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``hidden`` [B, T, d] over the tokens where ``attention_mask`` [B, T] is 1.

    A row with no attended token pools to zeros (never a division by zero).
    """
    if attention_mask is None:
        return hidden.mean(1)
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


class MeanPooledClassifier(nn.Module):
    """``encoder`` -> masked mean of the last hidden state -> ``nn.Linear(width, num_labels)``.

    Args:
      encoder: a ``transformers`` encoder (or a ``peft`` model around one) whose output has
        ``last_hidden_state`` [B, T, width] (or is that tensor, or a tuple starting with it).
      width: the hidden size.
      num_labels: classes of the head (zero-initialised weight and bias).

    ``forward(input_ids, attention_mask=None, **kwargs)`` returns an object with ``logits``
    [B, num_labels] (``transformers.modeling_outputs.SequenceClassifierOutput``), so code
    written for ``*ForSequenceClassification`` models reads it unchanged. Every row is one
    example: the pooling never mixes rows (per-example clipping stays per example).
    """

    def __init__(self, encoder: nn.Module, width: int, num_labels: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(width, num_labels)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if isinstance(out, torch.Tensor):
            hidden = out
        elif isinstance(out, tuple):
            hidden = out[0]
        else:
            hidden = out.last_hidden_state
        logits = self.head(mean_pool(hidden, attention_mask))
        return SequenceClassifierOutput(logits=logits)

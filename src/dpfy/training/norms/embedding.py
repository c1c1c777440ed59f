"""Embedding: per-example norms of row-sparse gradients without a [N, V, d] tensor.

Example n's gradient is ``sum_t onehot(idx_nt) g_nt^T``: rows of the table that the example
used, each the sum of the output gradients at the positions that used it. The rule adds the
output gradients of equal (example, index) pairs (``torch.unique`` + ``index_add``; O(N T d))
and takes squared norms of the resulting rows; the clipped sum is one ``index_add`` of the
weighted output gradients into the table. ``padding_idx`` rows get no gradient, as in PyTorch.
``scale_grad_by_freq`` rescales by counts over the whole batch, which mixes examples, and is
refused.
"""

from __future__ import annotations

import torch
from torch import nn

from dpfy.training.norms.registry import Capture, register_norm_rule

__all__ = ["EmbeddingGrads", "embedding_rule"]


class EmbeddingGrads:
    """LayerGrads of an embedding table from indices [N, T] and output gradients [N, T, d]."""

    def __init__(self, idx: torch.Tensor, g: torch.Tensor, num_embeddings: int) -> None:
        self.idx, self.g, self.num_embeddings = idx, g, num_embeddings

    def squared_norms(self) -> dict[str, torch.Tensor]:
        n, t = self.idx.shape
        key = (torch.arange(n, device=self.idx.device)[:, None] * self.num_embeddings + self.idx)
        uniq, inverse = torch.unique(key.reshape(-1), return_inverse=True)
        rows = self.g.new_zeros(uniq.shape[0], self.g.shape[-1])
        rows.index_add_(0, inverse, self.g.reshape(n * t, -1))
        sq_rows = rows.square().sum(1)
        out = self.g.new_zeros(n)
        out.index_add_(0, torch.div(uniq, self.num_embeddings, rounding_mode="floor"), sq_rows)
        return {"weight": out}

    def zero_rows(self, rows: torch.Tensor) -> None:
        keep = (~rows).reshape(-1, 1, 1)
        self.g = torch.where(keep, self.g, torch.zeros((), dtype=self.g.dtype))

    def weighted_sum(
        self, weights: dict[str, torch.Tensor], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        n, t = self.idx.shape
        w = weights["weight"].to(self.g.dtype)
        if out is None:
            table = self.g.new_zeros(self.num_embeddings, self.g.shape[-1])
        else:
            table = out["weight"]
        table.index_add_(0, self.idx.reshape(-1), (self.g * w[:, None, None]).reshape(n * t, -1))
        return {"weight": table} if out is None else out


@register_norm_rule(nn.Embedding)
def embedding_rule(
    module: nn.Embedding, captures: list[Capture], group_size: int
) -> EmbeddingGrads:
    """Rule for ``nn.Embedding`` on index tensors [B, ...]."""
    if module.scale_grad_by_freq:
        raise ValueError(
            "nn.Embedding(scale_grad_by_freq=True) scales gradients by index counts over the "
            "whole batch, which mixes examples; use scale_grad_by_freq=False"
        )
    first = captures[0].args[0]
    if first.dim() < 1:
        raise ValueError("Embedding input must be batched [B, ...]")
    n = first.shape[0]
    idx = torch.cat([c.args[0].reshape(n, -1) for c in captures], dim=1)
    d = module.embedding_dim
    g = torch.cat([c.grad_outputs[0].reshape(n, -1, d) for c in captures], dim=1)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    if group_size > 1:
        m = n // group_size
        idx = idx.reshape(m, -1)
        g = g.reshape(m, -1, d)
    return EmbeddingGrads(idx, g, module.num_embeddings)

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

from dpfy.training.norms.linear import LinearForm
from dpfy.training.norms.registry import Capture, register_cross_term, register_norm_rule


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

    def per_example(self, name: str) -> torch.Tensor:
        """Dense per-example gradients [N, V, d] (memory N V d: for checks and rare pairings)."""
        n, t = self.idx.shape
        d = self.g.shape[-1]
        rows = torch.arange(n, device=self.idx.device)[:, None] * self.num_embeddings + self.idx
        dense = self.g.new_zeros(n * self.num_embeddings, d)
        dense.index_add_(0, rows.reshape(-1), self.g.reshape(n * t, d))
        return dense.reshape(n, self.num_embeddings, d)

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


@register_cross_term(EmbeddingGrads, EmbeddingGrads)
def _embedding_cross(
    a: EmbeddingGrads, name_a: str, b: EmbeddingGrads, name_b: str
) -> torch.Tensor:
    """One table read by two embedding modules: from the norm of the combined lookups."""
    both = EmbeddingGrads(
        torch.cat([a.idx, b.idx], 1), torch.cat([a.g, b.g], 1), a.num_embeddings
    )
    sq_a, sq_b = a.squared_norms()["weight"], b.squared_norms()["weight"]
    return (both.squared_norms()["weight"] - sq_a - sq_b) / 2


@register_cross_term(EmbeddingGrads, LinearForm)
def _embedding_linear_cross(
    emb: EmbeddingGrads, name_e: str, lin: LinearForm, name_l: str
) -> torch.Tensor:
    """Tied input embedding and output projection (Press & Wolf 2017) without [V, d] per example.

    Example n's embedding gradient is ``sum_s onehot(i_s) e_s^T`` and its output-layer
    gradient ``sum_t g_t a_t^T`` (g_t over the vocabulary), so their inner product is
    ``sum_{s,t} (e_s . a_t) g_t[i_s]``: a T_s x T_t Gram matrix and a gather, O(N T^2 d).
    """
    n, h = lin.a.shape[:2]
    if name_l != lin.weight_name or h != 1 or lin.transposed:
        da, db = emb.per_example(name_e), lin.per_example(name_l)
        return (da.reshape(n, -1) * db.reshape(n, -1)).sum(1)
    a, g = lin.a[:, 0], lin.g[:, 0]  # [N, T, d], [N, T, V]
    gram = torch.matmul(emb.g, a.transpose(1, 2))  # [N, T_s, T_t]
    t_out = g.shape[1]
    picked = torch.gather(g, 2, emb.idx[:, None, :].expand(n, t_out, emb.idx.shape[1]))
    return (gram * picked.transpose(1, 2)).sum((1, 2))

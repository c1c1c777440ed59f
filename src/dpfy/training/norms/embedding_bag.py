"""EmbeddingBag: exact per-example norms of row-sparse gradients without a [N, V, d] tensor.

Bag ``b`` is example ``b``: row ``b`` of a 2-D input [B, L], or, for a 1-D input [E] with
``offsets``, the entries from ``offsets[b]`` to the next offset (the last bag runs to the end
of the input, as PyTorch reads it; with ``include_last_offset=True`` there are
``len(offsets) - 1`` bags). With ``g_b`` [d] the gradient of the loss w.r.t. the bag's output,
example ``b``'s gradient of the table is

* ``mode="sum"``: ``sum_{j in b} w_j onehot(i_j) g_b^T`` (``w_j`` the per-sample weight, else 1);
* ``mode="mean"``: the same with ``w_j = 1 / |b|`` (``|b|`` counts the non-padding entries);
* ``mode="max"``: coordinate ``c`` of row ``argmax_j W[i_j, c]`` gets ``g_b[c]``.

Entries equal to ``padding_idx`` get no gradient (and do not count in ``|b|``); an empty bag
gets none. Sum and mean are linear combinations of the output gradients: with ``S_{u,r,s}``
the summed weights of row ``r`` among the entries of source ``s`` of unit ``u`` (a source is
one bag in one call of the module; a unit of ``group_size`` k has ``m = k * calls`` of them),
unit ``u``'s squared norm is ``sum_r S_{u,r,:}^T Gram_u S_{u,r,:}`` with ``Gram_u`` [m, m] the
sources' output-gradient Gram matrix: one ``torch.unique`` over (unit, row) pairs, O(E m + B m d)
arithmetic for E entries, no per-entry d-vectors. In max mode each (bag, coordinate) touches
one element of the table; elements shared by sources of one unit are summed first. The
clipped sum is one ``index_add`` of weighted output gradients (chunked) into the table.

The rule is registered with ``recompute=`` only to see the whole call (``offsets`` and
``per_sample_weights``, positional or keyword) and, in max mode, the argmax rows
(``torch.embedding_bag``'s ``max_indices``, taken in the forward hook with the weights of the
forward pass); the module's own output is handed on unchanged. ``sparse=True``, ``max_norm``
and ``scale_grad_by_freq=True`` are refused by the model validation, not here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from dpfy.training.norms.registry import Capture, Recomputed, register_norm_rule

#: Most elements of the temporary [entries, d] tensor that one ``index_add`` of
#: :meth:`BagGrads.weighted_sum` builds (larger inputs are added in chunks).
CHUNK_ELEMENTS = 1 << 24

_ARG_NAMES = ("input", "offsets", "per_sample_weights")


class _Bags(NamedTuple):
    """One call's bags in flat form.

    Attributes:
      indices: table rows of the entries [E] (int64).
      offsets: bag starts as ``torch.embedding_bag`` takes them [B] (or [B + 1]).
      include_last: whether ``offsets`` carries the end of the last bag.
      bag: bag (example) of each entry [E] (int64).
      weights: per-sample weights [E], or ``None``.
      batch: number of bags B.
    """

    indices: torch.Tensor
    offsets: torch.Tensor
    include_last: bool
    bag: torch.Tensor
    weights: torch.Tensor | None
    batch: int


def _call_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of ``EmbeddingBag.forward``, however passed."""
    values: dict[str, Any] = dict(zip(_ARG_NAMES, args, strict=False))
    values.update(kwargs)
    return values["input"], values.get("offsets"), values.get("per_sample_weights")


def _bags(module: nn.EmbeddingBag, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Bags:
    """The call's bags: 2-D input [B, L] (a bag per row) or 1-D input [E] with ``offsets``."""
    inp, offsets, psw = _call_inputs(args, kwargs)
    if inp.is_nested:
        raise ValueError("EmbeddingBag with a nested-tensor input is not supported per example")
    if inp.dim() == 2:
        batch, length = inp.shape
        idx = inp.reshape(-1).long()
        starts = torch.arange(0, batch * length, max(length, 1), device=idx.device)
        bag = torch.arange(batch, device=idx.device).repeat_interleave(length)
        w = None if psw is None else psw.reshape(-1)
        return _Bags(idx, starts, False, bag, w, batch)
    if inp.dim() != 1 or offsets is None or offsets.dim() != 1:
        raise ValueError(
            "EmbeddingBag input must be 2-D [B, L], or 1-D [E] with 1-D offsets; got input of "
            f"shape {tuple(inp.shape)}"
        )
    idx, off = inp.long(), offsets.long()
    include_last = bool(module.include_last_offset)
    batch = off.shape[0] - 1 if include_last else off.shape[0]
    positions = torch.arange(idx.shape[0], device=idx.device)
    bag = torch.searchsorted(off[:batch].contiguous(), positions, right=True) - 1
    w = None if psw is None else psw.reshape(-1)
    return _Bags(idx, off, include_last, bag, w, batch)


def _max_indices(module: nn.EmbeddingBag, bags: _Bags) -> torch.Tensor:
    """Argmax row of each (bag, coordinate) [B, d], as the forward pass of max mode picks it."""
    with torch.no_grad():
        out = torch.embedding_bag(
            module.weight.detach(),
            bags.indices,
            bags.offsets,
            False,
            2,
            False,
            None,
            bags.include_last,
            module.padding_idx,
        )
    return out[3]


def recompute_embedding_bag(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Record the call as is: the output is its own target; max mode keeps the argmax rows."""
    assert isinstance(module, nn.EmbeddingBag)
    if not isinstance(output, torch.Tensor) or not output.requires_grad:
        return None
    extra = _max_indices(module, _bags(module, args, kwargs)) if module.mode == "max" else None
    return Recomputed(output, (output,), extra)


class BagGrads:
    """LayerGrads of a table read by sum/mean bags: weighted rows of output gradients.

    Unit ``u``'s gradient is ``sum_e coef[e] onehot(rows[e]) g[unit[e], src[e]]^T``.

    Attributes:
      g: output gradients [U, m, d] (U units, m sources per unit: bags x calls).
      unit, src, rows, coef: per entry [E]: its unit, source within the unit, table row and
        scalar coefficient (per-sample weight, 1, or 1 / bag size); padding entries removed.
      num_embeddings: rows of the table V.
    """

    def __init__(
        self,
        g: torch.Tensor,
        unit: torch.Tensor,
        src: torch.Tensor,
        rows: torch.Tensor,
        coef: torch.Tensor,
        num_embeddings: int,
    ) -> None:
        self.g, self.unit, self.src, self.rows, self.coef = g, unit, src, rows, coef
        self.num_embeddings = num_embeddings

    def squared_norms(self) -> dict[str, torch.Tensor]:
        n, m, _ = self.g.shape
        g = self.g if self.g.dtype in (torch.float32, torch.float64) else self.g.float()
        key = self.unit * self.num_embeddings + self.rows
        uniq, inverse = torch.unique(key, return_inverse=True)
        coef = g.new_zeros(uniq.shape[0], m)  # S: summed coefficients per (unit, row, source)
        coef.index_put_((inverse, self.src), self.coef.to(g.dtype), accumulate=True)
        pair_unit = torch.div(uniq, self.num_embeddings, rounding_mode="floor")
        if m == 1:
            per_pair = coef[:, 0].square() * g[:, 0].square().sum(1)[pair_unit]
        else:
            gram = torch.bmm(g, g.transpose(1, 2))  # [U, m, m]
            per_pair = torch.einsum("pi,pij,pj->p", coef, gram[pair_unit], coef).clamp_(min=0)
        out = g.new_zeros(n)
        out.index_add_(0, pair_unit, per_pair)
        return {"weight": out}

    def zero_rows(self, rows: torch.Tensor) -> None:
        keep = (~rows).reshape(-1, 1, 1)
        self.g = torch.where(keep, self.g, torch.zeros((), dtype=self.g.dtype))

    def _entries(self, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Entries ``start:stop`` as rows ``scale[e] * g[unit[e], src[e]]`` [stop - start, d]."""
        unit, src = self.unit[start:stop], self.src[start:stop]
        return self.g[unit, src].to(scale.dtype) * scale[start:stop, None]

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        d = self.g.shape[-1]
        table = _table(self.g, self.num_embeddings, out, overwrite)
        scale = weights["weight"].to(table.dtype)[self.unit] * self.coef.to(table.dtype)
        step = max(1, CHUNK_ELEMENTS // max(d, 1))
        for start in range(0, self.rows.shape[0], step):
            stop = start + step
            table.index_add_(0, self.rows[start:stop], self._entries(scale, start, stop))
        return {"weight": table} if out is None else out

    def per_example(self, name: str) -> torch.Tensor:
        """Dense per-example gradients [U, V, d] (memory U V d: for tied weights and checks)."""
        n, _, d = self.g.shape
        dense = self.g.new_zeros(n * self.num_embeddings, d)
        coef = self.coef.to(self.g.dtype)
        dense.index_add_(
            0, self.unit * self.num_embeddings + self.rows, self._entries(coef, 0, len(coef))
        )
        return dense.reshape(n, self.num_embeddings, d)


class BagMaxGrads:
    """LayerGrads of a table read by max bags: one table element per (source, coordinate).

    Unit ``u``'s gradient has ``g[u, s, c]`` at element ``(rows[u, s, c], c)``, summed over
    its sources ``s`` and coordinates ``c``.

    Attributes:
      g: output gradients [U, m, d], zero where a source has no argmax (empty bag, padding).
      rows: argmax table rows [U, m, d] (int64; 0 where ``g`` was zeroed).
      num_embeddings: rows of the table V.
    """

    def __init__(self, g: torch.Tensor, rows: torch.Tensor, num_embeddings: int) -> None:
        self.g, self.rows, self.num_embeddings = g, rows, num_embeddings

    def _coords(self) -> torch.Tensor:
        d = self.g.shape[-1]
        return torch.arange(d, device=self.rows.device).expand_as(self.rows)

    def squared_norms(self) -> dict[str, torch.Tensor]:
        n, m, d = self.g.shape
        g = self.g if self.g.dtype in (torch.float32, torch.float64) else self.g.float()
        if m == 1:  # the d elements of one source are distinct
            return {"weight": g.square().sum((1, 2))}
        units = torch.arange(n, device=g.device).reshape(n, 1, 1)
        key = (units * self.num_embeddings + self.rows) * d + self._coords()
        uniq, inverse = torch.unique(key.reshape(-1), return_inverse=True)
        elements = g.new_zeros(uniq.shape[0])
        elements.index_add_(0, inverse, g.reshape(-1))
        out = g.new_zeros(n)
        unit_of = torch.div(uniq, self.num_embeddings * d, rounding_mode="floor")
        out.index_add_(0, unit_of, elements.square())
        return {"weight": out}

    def zero_rows(self, rows: torch.Tensor) -> None:
        keep = (~rows).reshape(-1, 1, 1)
        self.g = torch.where(keep, self.g, torch.zeros((), dtype=self.g.dtype))

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        table = _table(self.g, self.num_embeddings, out, overwrite)
        w = weights["weight"].to(table.dtype).reshape(-1, 1, 1)
        values = self.g.to(table.dtype) * w
        table.index_put_(
            (self.rows.reshape(-1), self._coords().reshape(-1)), values.reshape(-1),
            accumulate=True,
        )
        return {"weight": table} if out is None else out

    def per_example(self, name: str) -> torch.Tensor:
        """Dense per-example gradients [U, V, d] (memory U V d: for tied weights and checks)."""
        n, _, d = self.g.shape
        dense = self.g.new_zeros(n, self.num_embeddings, d)
        units = torch.arange(n, device=self.g.device).reshape(n, 1, 1).expand_as(self.rows)
        dense.index_put_(
            (units.reshape(-1), self.rows.reshape(-1), self._coords().reshape(-1)),
            self.g.reshape(-1),
            accumulate=True,
        )
        return dense


def _sources(parts: list[torch.Tensor], units: int, group_size: int) -> torch.Tensor:
    """Per-call tensors [B, ...] as [U, calls * k, ...]: source ``c * k + i`` of unit ``u`` is
    bag ``u * k + i`` of call ``c``."""
    shaped = [p.reshape(units, group_size, *p.shape[1:]) for p in parts]
    stacked = torch.stack(shaped, 1)
    return stacked.reshape(units, len(parts) * group_size, *stacked.shape[3:])


@register_norm_rule(nn.EmbeddingBag, recompute=recompute_embedding_bag)
def embedding_bag_rule(
    module: nn.EmbeddingBag, captures: list[Capture], group_size: int
) -> BagGrads | BagMaxGrads:
    """Rule for ``nn.EmbeddingBag``: bags [B] of a 2-D input or of a 1-D input with offsets.

    Every call of the module in the chunk must have the same number of bags B (the batch),
    a multiple of ``group_size``; modes sum (with or without ``per_sample_weights``), mean
    and max; ``padding_idx`` entries get no gradient.
    """
    calls = [_bags(module, c.args, c.kwargs) for c in captures]
    batch = calls[0].batch
    if any(b.batch != batch for b in calls) or batch % group_size:
        raise ValueError(
            "every EmbeddingBag call of a chunk must have one bag per example (the batch size "
            f"{batch}, a multiple of the group size {group_size}); got "
            f"{[b.batch for b in calls]} bags"
        )
    units = batch // group_size
    d = module.embedding_dim
    grads = [c.grad_outputs[0].reshape(batch, d) for c in captures]
    g = _sources(grads, units, group_size)
    pad = module.padding_idx
    if module.mode == "max":
        sizes, argmax = [], []
        for bags, cap in zip(calls, captures, strict=True):
            real = bags.bag >= 0 if pad is None else (bags.bag >= 0) & (bags.indices != pad)
            sizes.append(torch.bincount(bags.bag[real], minlength=batch)[:batch])
            mi = cap.extra if cap.extra is not None else _max_indices(module, bags)
            argmax.append(mi.reshape(batch, d).long())
        idx = _sources(argmax, units, group_size)
        valid = (_sources(sizes, units, group_size) > 0).unsqueeze(-1) & (idx >= 0)
        if pad is not None:
            valid = valid & (idx != pad)
        g = torch.where(valid, g, torch.zeros((), dtype=g.dtype))
        idx = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype))
        return BagMaxGrads(g, idx, module.num_embeddings)
    units_e, src_e, rows_e, coef_e = [], [], [], []
    for c, bags in enumerate(calls):
        keep = bags.bag >= 0
        if pad is not None:
            keep = keep & (bags.indices != pad)
        bag, rows = bags.bag[keep], bags.indices[keep]
        if module.mode == "mean":
            counts = torch.bincount(bag, minlength=batch)
            coef = counts.to(g.dtype).reciprocal()[bag]
        elif bags.weights is not None:
            coef = bags.weights[keep].to(g.dtype)
        else:
            coef = torch.ones(bag.shape[0], dtype=g.dtype, device=bag.device)
        units_e.append(torch.div(bag, group_size, rounding_mode="floor"))
        src_e.append(c * group_size + bag % group_size)
        rows_e.append(rows)
        coef_e.append(coef)
    return BagGrads(
        g,
        torch.cat(units_e),
        torch.cat(src_e),
        torch.cat(rows_e),
        torch.cat(coef_e),
        module.num_embeddings,
    )


def _table(
    g: torch.Tensor, num_embeddings: int, out: dict[str, torch.Tensor] | None, overwrite: bool
) -> torch.Tensor:
    """Where a weighted sum goes: a new zero table, or ``out["weight"]`` (cleared to
    overwrite)."""
    if out is None:
        return g.new_zeros(num_embeddings, g.shape[-1])
    table = out["weight"]
    if overwrite:
        table.zero_()
    return table

"""Linear layers: ghost norms and book-keeping sums for ``y = x W^T + b``.

Every layer whose weight gradient is a sum of outer products -- Linear (with or without
sequence dimensions), convolutions after unfolding, several calls of one module -- is put in
the *linear form*: activations ``A`` [N, H, T, d] and output gradients ``G`` [N, H, T, o]
(N examples or microbatches, H independent weight blocks such as conv groups, T positions),
with per-example weight gradient ``G_n^T A_n`` (per block) and bias gradient ``sum_t G_n``.

Per-example squared weight-gradient norms (Li et al. 2022 "ghost clipping"; Bu et al. 2023
mixed ghost clipping, chosen per layer at run time by cost):

* T = 1: ``||a_n||^2 ||g_n||^2`` (outer product), O(N (d + o));
* ghost: ``<A_n A_n^T, G_n G_n^T>``, O(N T^2 (d + o));
* materialise: ``P_n = G_n^T A_n``, O(N T d o) time and N d o memory (then the clipped sum is
  the cheap ``sum_n w_n P_n``).

The clipped sum of the ghost modes is one contraction ``(w * G)^T A`` ("book-keeping", Bu et
al. 2023): no second backward pass.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from dpfy.training.norms.registry import (
    Capture,
    register_cross_term,
    register_norm_rule,
    register_norm_rule_by_name,
)

#: How a layer's per-example weight-gradient norms are computed (see the module docstring).
Mode = Literal["ghost", "materialize"]

# Materialising more than this many bytes of per-example weight gradients for one layer is
# avoided even if it would be cheaper in flops (ghost norms need only T x T Gram matrices).
MATERIALIZE_BYTES_LIMIT = 512 * 2**20


def fold_linear_form(
    a: torch.Tensor, g: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge groups of ``group_size`` consecutive examples into one (positions concatenated)."""
    if group_size == 1:
        return a, g

    def fold(x: torch.Tensor) -> torch.Tensor:
        n, h, t, d = x.shape
        x = x.reshape(n // group_size, group_size, h, t, d).transpose(1, 2)
        return x.reshape(n // group_size, h, group_size * t, d)

    return fold(a), fold(g)


class LinearForm:
    """LayerGrads of a weight (and optional bias) in linear form; see the module docstring.

    Args:
      a: activations [N, H, T, d].
      g: output gradients [N, H, T, o].
      weight_shape: shape of the weight parameter (its H*o*d entries in (h, o, d) order).
      weight_name, bias_name: local parameter names to report; ``None`` skips the parameter.
      mode: ``"auto"`` (cheapest by the cost model), ``"ghost"`` or ``"materialize"``.
      transposed: the weight is stored as [d, o] (``y = x W + b``, e.g. GPT-2's ``Conv1D``)
        instead of [o, d]; per-example gradients are then ``A_n^T G_n``.
    """

    def __init__(
        self,
        a: torch.Tensor,
        g: torch.Tensor,
        weight_shape: torch.Size | tuple[int, ...],
        *,
        weight_name: str | None = "weight",
        bias_name: str | None = None,
        mode: Mode | Literal["auto"] = "auto",
        transposed: bool = False,
    ) -> None:
        self.a, self.g = a, g
        self.transposed = transposed
        self.weight_shape = tuple(weight_shape)
        self.weight_name, self.bias_name = weight_name, bias_name
        n, h, t, d = a.shape
        o = g.shape[-1]
        self.mode: Mode = choose_mode(n, h, t, d, o, a.element_size()) if mode == "auto" else mode
        self._per_example: torch.Tensor | None = None

    def _materialize(self) -> torch.Tensor:
        if self._per_example is None:
            # [N, H, o, d] = G^T A per example and block ([N, H, d, o] = A^T G if transposed)
            if self.transposed:
                self._per_example = torch.matmul(self.a.transpose(-1, -2), self.g)
            else:
                self._per_example = torch.matmul(self.g.transpose(-1, -2), self.a)
        return self._per_example

    def per_example(self, name: str) -> torch.Tensor:
        """Per-example gradients of parameter ``name``: [N, *shape] (materialised)."""
        n = self.a.shape[0]
        if name == self.weight_name:
            return self._materialize().reshape(n, *self.weight_shape)
        if name == self.bias_name:
            return self.g.sum(2).reshape(n, -1)
        raise KeyError(name)

    def squared_norms(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        a, g = self.a, self.g
        n, h, t, _ = a.shape
        if t == 1:
            # outer products: ||a_n||^2 ||g_n||^2 per block; the bias norm reuses ||g_n||^2
            if h == 1:
                g_sq = _squared_rows(g.reshape(n, -1))
                if self.weight_name is not None:
                    out[self.weight_name] = _squared_rows(a.reshape(n, -1)).mul_(g_sq)
            else:
                g_sq = _squared_rows(g.reshape(n, h, -1))
                if self.weight_name is not None:
                    out[self.weight_name] = (_squared_rows(a.reshape(n, h, -1)) * g_sq).sum(1)
                g_sq = g_sq.sum(1)
            if self.bias_name is not None:
                out[self.bias_name] = g_sq
            return out
        if self.weight_name is not None:
            if self.mode == "ghost":
                gram_a = torch.matmul(a, a.transpose(-1, -2))
                gram_g = torch.matmul(g, g.transpose(-1, -2))
                # the exact value is >= 0; rounding must not turn a tiny norm into NaN
                sq = (gram_a * gram_g).sum((1, 2, 3)).clamp_(min=0.0)
            else:
                # one fused reduction: no squared copy of the N x d x o gradients
                sq = torch.linalg.vector_norm(self._materialize(), dim=(1, 2, 3)).square()
            out[self.weight_name] = sq
        if self.bias_name is not None:
            out[self.bias_name] = g.sum(2).square().sum((1, 2))
        return out

    def zero_rows(self, rows: torch.Tensor) -> None:
        keep = (~rows).reshape(-1, 1, 1, 1)
        zero = torch.zeros((), dtype=self.a.dtype)
        self.a = torch.where(keep, self.a, zero)
        self.g = torch.where(keep, self.g, zero)
        if self._per_example is not None:
            self._per_example = torch.where(keep, self._per_example, zero)

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        a, g = self.a, self.g
        n, h, t, d = a.shape
        o = g.shape[-1]
        res: dict[str, torch.Tensor] = {} if out is None else out
        beta = 0.0 if overwrite else 1.0  # beta = 0: the old contents (even NaN) are ignored
        if self.weight_name is not None:
            w = weights[self.weight_name].to(a.dtype)
            dst = None if out is None else out[self.weight_name]
            if self._per_example is not None:
                flat = self._per_example.reshape(n, -1)
                if dst is None:
                    res[self.weight_name] = torch.mv(flat.t(), w).reshape(self.weight_shape)
                else:
                    dst.view(-1).addmv_(flat.t(), w, beta=beta)
            elif h == 1:
                a2, g2 = a.reshape(n * t, d), g.reshape(n * t, o)
                wr = (w.repeat_interleave(t) if t > 1 else w).unsqueeze(1)
                if self.transposed:
                    left, right = (a2.t(), g2 * wr) if o <= d else ((a2 * wr).t(), g2)
                    shape2d = (d, o)
                else:
                    left, right = ((g2 * wr).t(), a2) if o <= d else (g2.t(), a2 * wr)
                    shape2d = (o, d)
                if dst is None:
                    res[self.weight_name] = torch.mm(left, right).reshape(self.weight_shape)
                else:
                    dst.view(shape2d).addmm_(left, right, beta=beta)
            else:
                spec = "nhto,nhtd->hdo" if self.transposed else "nhto,nhtd->hod"
                ws = torch.einsum(spec, g * w.reshape(n, 1, 1, 1), a)
                if dst is None:
                    res[self.weight_name] = ws.reshape(self.weight_shape)
                elif overwrite:
                    dst.copy_(ws.reshape(self.weight_shape))
                else:
                    dst.add_(ws.reshape(self.weight_shape))
        if self.bias_name is not None:
            w = weights[self.bias_name].to(g.dtype)
            gb = g.reshape(n, h * o) if t == 1 else g.sum(2).reshape(n, h * o)
            if out is None:
                res[self.bias_name] = torch.mv(gb.t(), w)
            else:
                out[self.bias_name].addmv_(gb.t(), w, beta=beta)
        return res


@register_cross_term(LinearForm, LinearForm)
def _linear_cross(a: LinearForm, name_a: str, b: LinearForm, name_b: str) -> torch.Tensor:
    """``<grad_a_n, grad_b_n>`` of one weight (or bias) used by two linear-form layers.

    Ghost form: ``<G1^T A1, G2^T A2> = <A1 A2^T, G1 G2^T>`` (T1 x T2 cross Gram matrices);
    when exactly one of them stores the weight transposed, ``<A1 G2^T, G1 A2^T>``.
    """
    if name_a == a.bias_name and name_b == b.bias_name:
        return (a.g.sum(2).flatten(1) * b.g.sum(2).flatten(1)).sum(1)
    if name_a != a.weight_name or name_b != b.weight_name or a.a.shape[1] != b.a.shape[1]:
        raise ValueError(f"cannot pair {name_a!r} and {name_b!r} of two linear layers")
    if a.transposed == b.transposed:
        left = torch.matmul(a.a, b.a.transpose(-1, -2))
        right = torch.matmul(a.g, b.g.transpose(-1, -2))
    else:
        left = torch.matmul(a.a, b.g.transpose(-1, -2))
        right = torch.matmul(a.g, b.a.transpose(-1, -2))
    return (left * right).sum((1, 2, 3))


def _squared_rows(x: torch.Tensor) -> torch.Tensor:
    """Squared L2 norms over the last dimension, in one reduction (no squared copy of x)."""
    norms: torch.Tensor = torch.linalg.vector_norm(x, dim=-1)  # untyped in torch's stubs
    return norms.square_()


#: Cost of one materialised per-example gradient element, in flops of the ghost Gram matrices
#: (write, square and read back N d o numbers; see :func:`choose_mode`).
MATERIALIZE_COST = 30


def choose_mode(n: int, h: int, t: int, d: int, o: int, itemsize: int) -> Mode:
    """Cheaper of ghost norms and materialisation for the shapes (Bu et al. 2023 criterion).

    Ghost needs two T x T Gram matrices per example and block (~T^2 (d + o) flops) and then
    the book-keeping GEMM; materialising costs the per-example GEMM (T d o) but makes the
    clipped sum cheap, and moves N*H*d*o numbers through memory. Memory decides first: when
    either mode's extra tensors (N H d o per-example gradients, or 2 N H T^2 Gram entries)
    exceed :data:`MATERIALIZE_BYTES_LIMIT`, the mode needing less memory is used (long
    sequences materialise, wide layers such as an LM head over a large vocabulary go ghost).
    Otherwise ghost wins when ``T^2 (d + o)`` is below ``MATERIALIZE_COST * d o`` (the
    book-keeping GEMM is common to both). Materialising is bound by memory traffic, not flops:
    the N d o per-example gradients are written, squared and read again, each element costing
    about as much as tens of flops on a CPU, hence the constant (measured on all-MiniLM-L6-v2
    at batch 32, seq 64, 2 threads: the full fine-tuning step went from 3.3x to 1.5x plain
    when its 384 x 384 and 384 x 1536 layers moved to ghost). For a transformer on [B, T, d],
    short sequences through wide layers go ghost; long sequences and narrow layers (LoRA
    factors, d x r) materialise.
    """
    if t == 1:
        return "ghost"
    mat_bytes = n * h * d * o * itemsize
    ghost_bytes = 2 * n * h * t * t * itemsize
    if max(mat_bytes, ghost_bytes) > MATERIALIZE_BYTES_LIMIT:
        return "ghost" if ghost_bytes < mat_bytes else "materialize"
    ghost = t * t * (d + o + 1)
    materialize = MATERIALIZE_COST * d * o
    return "ghost" if ghost <= materialize else "materialize"


def _linear_factors(captures: list[Capture]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack all calls of the module along the position axis: A [B, 1, T, d], G [B, 1, T, o]."""
    first = captures[0].args[0]
    if first.dim() < 2:
        raise ValueError(
            f"Linear input must be batched [B, ..., d]; got shape {tuple(first.shape)}"
        )
    n = first.shape[0]
    acts = [c.args[0].reshape(n, 1, -1, c.args[0].shape[-1]) for c in captures]
    grads = [c.grad_outputs[0].reshape(n, 1, -1, c.grad_outputs[0].shape[-1]) for c in captures]
    if len(captures) == 1:
        return acts[0], grads[0]
    return torch.cat(acts, dim=2), torch.cat(grads, dim=2)


@register_norm_rule(nn.Linear)
def linear_rule(module: nn.Linear, captures: list[Capture], group_size: int) -> LinearForm:
    """Rule for ``nn.Linear`` on inputs [B, ..., in_features] (any number of middle dims)."""
    a, g = _linear_factors(captures)
    a, g = fold_linear_form(a, g, group_size)
    return LinearForm(
        a,
        g,
        module.weight.shape,
        weight_name="weight" if module.weight.requires_grad else None,
        bias_name="bias" if module.bias is not None and module.bias.requires_grad else None,
    )


@register_norm_rule_by_name("transformers.pytorch_utils.Conv1D")
def conv1d_transposed_rule(
    module: nn.Module, captures: list[Capture], group_size: int
) -> LinearForm:
    """Rule for ``transformers``' ``Conv1D`` (GPT-2): ``y = x W + b`` with W stored [d, o].

    The same linear form as ``nn.Linear`` with the weight transposed (per-example gradient
    ``A_n^T G_n``); ghost or materialised by the same cost model. Registered by class name, so
    ``transformers`` is never imported by dpfy.
    """
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    bias: torch.Tensor | None = getattr(module, "bias", None)
    a, g = _linear_factors(captures)
    a, g = fold_linear_form(a, g, group_size)
    return LinearForm(
        a,
        g,
        weight.shape,
        weight_name="weight" if weight.requires_grad else None,
        bias_name="bias" if bias is not None and bias.requires_grad else None,
        transposed=True,
    )

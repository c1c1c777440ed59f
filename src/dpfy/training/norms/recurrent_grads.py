"""Per-example norms and clipped sums of one recurrent layer and direction's gate weights.

Per example n (``recurrent.py``): ``grad W_ih = G_n^T X_n``, ``grad W_hh = Gh_n^T H_n``,
``grad b_ih = sum_t G_n``, ``grad b_hh = sum_t Gh_n``, with ``G_n`` = ``dL/dgi`` [T, 4H] (LSTM;
3H GRU, H RNN), ``X_n`` the layer's input [T, d], ``H_n`` the previous hidden states [T, P]
and ``Gh_n`` = ``dL/dgh``, which is ``G_n`` itself for RNN and LSTM. Both weights are linear
forms sharing their output gradients, so their ghost norms (Li et al. 2022, "Large language
models can be strong differentially private learners") share one Gram matrix:

    ||G_n^T X_n||^2 = <X_n X_n^T, G_n G_n^T>,   ||G_n^T H_n||^2 = <H_n H_n^T, G_n G_n^T>,

``T^2 (4H + d + P)`` multiply-adds per example, against ``T 4H (d + P)`` for materialising both
per-example gradients (which then also have to be written, squared and read back); the clipped
sums are the book-keeping contractions ``(w G)^T X`` and ``(w G)^T H`` (Bu et al. 2023,
"Differentially private optimization on large model at small cost"), one GEMM each over all
examples and steps, as a plain backward pass computes the weight gradients. Long sequences
(``T`` above ``4H (d + P) / (4H + d + P)``, where ghost norms cost more) use
:class:`~dpfy.training.norms.linear.LinearForm`'s materialised mode instead (``recurrent.py``).
"""

from __future__ import annotations

import torch


def _fold(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[T, N, F] -> [k T, N / k, F]: the steps of each group of k examples as one sequence."""
    if group_size == 1:
        return t
    steps, n, f = t.shape
    t = t.reshape(steps, n // group_size, group_size, f).permute(2, 0, 1, 3)
    return t.reshape(group_size * steps, n // group_size, f)


def _gram(t: torch.Tensor) -> torch.Tensor:
    """Per-example Gram matrices [N, T, T] of time-major [T, N, F]."""
    b = t.transpose(0, 1)
    return torch.bmm(b, b.transpose(1, 2))


def ghost_cheaper(steps: int, gate: int, d: int, p: int) -> bool:
    """Whether the shared-Gram ghost norms cost fewer multiply-adds than materialising."""
    return steps * (gate + d + p) <= gate * (d + p)


class GateForm:
    """LayerGrads of ``weight_ih``/``weight_hh`` (and biases) of one layer and direction.

    Args (time-major, as ``recurrent_bptt.py`` computes them):
      x: layer input [T, N, d]; h_prev: previous hidden states [T, N, P]; g: ``dL/dgi``
        [T, N, G]; gh: ``dL/dgh`` [T, N, G], or ``None`` when it is ``g`` (RNN, LSTM).
      names: local names of ``(weight_ih, weight_hh, bias_ih, bias_hh)``; ``None`` skips a
        parameter (frozen or absent).
      group_size: examples summed into one unit before the norm (microbatches).
    """

    def __init__(
        self,
        x: torch.Tensor,
        h_prev: torch.Tensor,
        g: torch.Tensor,
        gh: torch.Tensor | None,
        names: tuple[str | None, str | None, str | None, str | None],
        group_size: int = 1,
    ) -> None:
        self.x, self.h = _fold(x, group_size), _fold(h_prev, group_size)
        self.g = _fold(g, group_size)
        self.gh = None if gh is None else _fold(gh, group_size)
        self.names = names

    def _pairs(self) -> list[tuple[str | None, torch.Tensor, torch.Tensor]]:
        """``(weight name, A, G)`` of the two weights."""
        gh = self.g if self.gh is None else self.gh
        return [(self.names[0], self.x, self.g), (self.names[1], self.h, gh)]

    def squared_norms(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        gram_g = None
        if self.names[0] is not None or (self.names[1] is not None and self.gh is None):
            gram_g = _gram(self.g)
        for name, a, g in self._pairs():
            if name is None:
                continue
            gram = gram_g if g is self.g else _gram(g)
            assert gram is not None
            gram_a = _gram(a)
            # the exact value is >= 0; rounding must not turn a tiny norm into NaN
            out[name] = gram_a.mul_(gram).sum((1, 2)).clamp_(min=0.0)
        for name, gb in ((self.names[2], self.g), (self.names[3], self.gh)):
            if name is not None:
                summed = (self.g if gb is None else gb).sum(0)
                out[name] = torch.linalg.vector_norm(summed, dim=1).square()
        return out

    def zero_rows(self, rows: torch.Tensor) -> None:
        keep = (~rows).reshape(1, -1, 1)
        zero = torch.zeros((), dtype=self.g.dtype, device=self.g.device)
        self.g = torch.where(keep, self.g, zero)
        if self.gh is not None:
            self.gh = torch.where(keep, self.gh, zero)

    def per_example(self, name: str) -> torch.Tensor:
        """Per-example gradients of parameter ``name``: [N, *shape] (materialised)."""
        for wname, a, g in self._pairs():
            if name == wname:
                return torch.bmm(g.permute(1, 2, 0), a.transpose(0, 1))
        if name == self.names[2]:
            return self.g.sum(0)
        if name == self.names[3]:
            return (self.g if self.gh is None else self.gh).sum(0)
        raise KeyError(name)

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        res: dict[str, torch.Tensor] = {} if out is None else out
        beta = 0.0 if overwrite else 1.0  # beta = 0: the old contents (even NaN) are ignored
        steps, n = self.g.shape[:2]
        # w G, shared by W_ih and W_hh when they have one G and one weight vector (flat
        # clipping gives every parameter the same one)
        scaled: dict[tuple[int, int], torch.Tensor] = {}
        for name, a, g in self._pairs():
            if name is None:
                continue
            w = weights[name]
            key = (id(g), id(w))
            if key not in scaled:
                scaled[key] = (g * w.to(g.dtype).view(1, n, 1)).reshape(n * steps, -1)
            left, right = scaled[key].t(), a.reshape(n * steps, -1)
            if out is None:
                res[name] = torch.mm(left, right)
            else:
                out[name].addmm_(left, right, beta=beta)
        for name, gb in ((self.names[2], self.g), (self.names[3], self.gh)):
            if name is None:
                continue
            summed = (self.g if gb is None else gb).sum(0)
            w = weights[name].to(summed.dtype)
            if out is None:
                res[name] = torch.mv(summed.t(), w)
            else:
                out[name].addmv_(summed.t(), w, beta=beta)
        return res


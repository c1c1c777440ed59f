"""The loss ``make_private``'s criterion returns: one physical batch's per-example losses.

Its ``backward()`` clips each example's gradient and adds it to the step's accumulator
(:mod:`dpfy.training.private`). It can be scaled by a constant (``loss / k`` in a gradient
accumulation script is the same per-example losses scaled); any other term would reach the
gradient outside the per-example losses, unclipped and unnoised, and is refused with the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from dpfy.training.norms.attribution import recomputable

if TYPE_CHECKING:
    from dpfy.training.private import _Engine


class PrivateLoss:
    """Per-example losses of one physical batch; ``backward()`` accumulates them privately."""

    def __init__(
        self, engine: _Engine, losses: torch.Tensor, weights: torch.Tensor,
        recompute: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
    ) -> None:
        self._engine = engine
        self.losses = losses
        self._weights = weights
        self._recompute = recompute  # (loss_fn, targets): for the attribution check

    def backward(self) -> None:
        """Clip the real rows' gradients and add them to the accumulator (no ``p.grad``)."""
        chunk = self._engine.chunk
        if self._recompute is not None and chunk is not None:
            chunk.set_loss(*self._recompute)  # the losses this backward differentiates
        self._engine.backward(self.losses)

    def detach(self) -> torch.Tensor:
        """Mean loss over the real rows (monitoring only: not private); nan without any."""
        w = self._weights.to(self.losses.device, self.losses.dtype)
        n = w.sum()
        total = (self.losses.detach() * w).sum()
        return total / n if float(n) > 0 else torch.full_like(total, math.nan)

    def item(self) -> float:
        return float(self.detach())

    def __float__(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"PrivateLoss({self.item():.4g})"

    # A constant factor is a per-example loss too (``loss / accumulation_steps``); any other
    # term would reach the gradient outside the per-example losses, unclipped and unnoised.
    def __mul__(self, factor: object) -> PrivateLoss:
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            _refuse_term(factor)
        k = float(factor)
        recompute = None
        if self._recompute is not None:
            loss_fn, targets = self._recompute
            scaled = (lambda outputs, t: loss_fn(outputs, t) * k) if recomputable(loss_fn) else (
                loss_fn)  # one that cannot be recomputed stays unchecked either way
            recompute = scaled, targets
        return PrivateLoss(self._engine, self.losses * k, self._weights, recompute)

    __rmul__ = __mul__

    def __truediv__(self, divisor: object) -> PrivateLoss:
        if isinstance(divisor, bool) or not isinstance(divisor, int | float) or divisor == 0:
            _refuse_term(divisor)
        return self * (1.0 / float(divisor))

    def __add__(self, other: object) -> PrivateLoss:
        _refuse_term(other)

    __radd__ = __sub__ = __rsub__ = __add__


def _refuse_term(other: object) -> NoReturn:
    raise TypeError(
        f"a private loss can only be scaled by a non-zero number, got {type(other).__name__}: "
        "a term added outside the per-example losses would reach the gradient unclipped. "
        "Compute every term of an example's loss in loss_fn(outputs, targets) (a regulariser "
        "on activations: return them from the model's forward); a penalty on the parameters "
        "is the optimizer's weight_decay"
    )

"""A physical chunk whose forward pass the caller runs (``PrivateGradient.open_chunk``).

For training loops that call the model themselves (:func:`dpfy.training.private.make_private`):
the layer hooks are registered when the chunk opens, the caller runs ``model(...)`` and its
per-example loss, and :meth:`OpenChunk.accumulate` runs the one backward pass and adds the
clipped sums exactly as :meth:`dpfy.training.step.PrivateGradient.accumulate` does.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from dpfy.training.norms.capture import LayerCapture, capture_layers
from dpfy.training.precision import check_loss_scale

if TYPE_CHECKING:
    from dpfy.training.step import ChunkStats, PrivateGradient


class OpenChunk:
    """One physical chunk whose forward pass the caller runs (see ``PrivateGradient.open_chunk``).

    The layer hooks are registered on construction and removed by :meth:`accumulate` or
    :meth:`close`, whichever comes first; the model is never wrapped.
    """

    def __init__(
        self, private_gradient: PrivateGradient, batch_size: int | None = None
    ) -> None:
        self._pg = private_gradient
        self._stack = contextlib.ExitStack()
        self._recorder: LayerCapture | None = self._stack.enter_context(
            capture_layers(private_gradient._hooked(), batch_size)
        )

    @property
    def open(self) -> bool:
        return self._recorder is not None

    def accumulate(
        self,
        losses: torch.Tensor,
        weights: torch.Tensor | None = None,
        *,
        loss_scale: float | None = None,
    ) -> ChunkStats:
        """Backward from the per-example ``losses`` [B]; add the clipped sums; close.

        ``loss_scale`` as in :meth:`PrivateGradient.accumulate` (fp16: the backward is seeded
        with S, the norms are taken of the unscaled gradients).
        """
        if self._recorder is None:
            raise RuntimeError("this chunk was already accumulated or closed")
        pg = self._pg
        loss_scale = check_loss_scale(pg.loss_scale if loss_scale is None else loss_scale)
        recorder, self._recorder = self._recorder, None
        try:
            self._pg._chunks += 1
            return self._pg._accumulate_losses(recorder, losses, weights, False, loss_scale)
        finally:
            self._stack.close()

    def close(self) -> None:
        """Remove the hooks without accumulating (the recorded calls are dropped)."""
        self._recorder = None
        self._stack.close()

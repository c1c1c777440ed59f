"""A physical chunk whose forward pass the caller runs (``PrivateGradient.open_chunk``).

For training loops that call the model themselves (:func:`dpfy.training.private.make_private`):
the layer hooks are registered when the chunk opens, the caller runs ``model(...)`` and its
per-example loss, and :meth:`OpenChunk.accumulate` runs the one backward pass and adds the
clipped sums exactly as :meth:`dpfy.training.step.PrivateGradient.accumulate` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpfy.training.norms.capture import LayerCapture, capture_layers
from dpfy.training.norms.layout import replays
from dpfy.training.precision import check_loss_scale
from dpfy.training.sharded import is_sharded

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
            capture_layers(private_gradient.recorded_plans(), batch_size)
        )
        if batch_size is not None and not is_sharded(private_gradient.model):
            # the caller's call of the model, kept so that a layout probe can run it again
            # with the examples reordered (dpfy.training.norms.layout); a loop that calls
            # submodules itself leaves the probe without a forward pass to rerun
            handle = private_gradient.model.register_forward_pre_hook(
                self._keep_call, with_kwargs=True
            )
            self._stack.callback(handle.remove)
        self._batch_size = batch_size
        #: the caller's model call (forward, its (args, kwargs)), kept for the replays
        self._kept: tuple[Callable[[Any], Any], Any] | None = None

    def _keep_call(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        recorder = self._recorder
        if recorder is None or not recorder.active or recorder.rerun is not None:
            return  # the first call of the chunk is the one to replay
        assert self._batch_size is not None
        forward: Callable[[Any], Any] = lambda call: module(*call[0], **call[1])  # noqa: E731
        self._kept = (forward, (args, kwargs))
        recorder.rerun, _ = replays(forward, self._pg.autocast, (args, kwargs), None, None,
                                    self._batch_size)

    def set_loss(self, loss_fn: Any, targets: Any) -> None:
        """The caller's per-example loss and this chunk's targets (after its forward pass), so
        that the attribution check can recompute one example's loss alone."""
        recorder, batch = self._recorder, self._batch_size
        if recorder is None or self._kept is None or batch is None:
            return
        forward, inputs = self._kept
        _, recorder.loss_of = replays(forward, self._pg.autocast, inputs, targets, loss_fn, batch)

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
            return pg.accumulate_recorded(recorder, losses, weights, loss_scale)
        finally:
            self._stack.close()

    def close(self) -> None:
        """Remove the hooks without accumulating (the recorded calls are dropped)."""
        self._recorder = None
        self._stack.close()

"""From a sampler's logical batches to fixed-shape physical batches, and accumulation over them.

A logical batch is what the sampler drew for one DP-SGD step (its size varies under Poisson and
Balls-and-Bins sampling). Memory and fixed shapes need physical batches of exactly
``max_physical_batch_size`` rows: the logical batch is cut into consecutive chunks and the last
chunk is padded with weight-0 rows (zero inputs, zero targets). Padding rows contribute nothing
to the clipped sum, so the private gradient of the padded chunks equals that of the logical
batch; the noise is added once per logical step, after all chunks
(:func:`accumulate_logical_batch`).

With ``max_batch_size`` (a truncating sampler) every logical step yields the same number of
chunks, ``ceil(max_batch_size / max_physical_batch_size)``, so the number of forward passes
does not reveal the batch size. An empty logical batch (possible under Poisson sampling) still
yields one all-padding chunk: the step releases pure noise, as the analysis assumes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from dpfy._validate import check_int


@dataclasses.dataclass(frozen=True)
class PhysicalBatch:
    """One fixed-shape chunk of a logical batch.

    Attributes:
      inputs: ``[P, ...]`` rows of the dataset inputs (padding rows are zeros); from a
        ``Dataset`` (:class:`dpfy.training.loader.DatasetBatcher`) whatever the collated batch
        holds (a tensor, a tuple, a dict of tensors), padding rows repeating a valid example.
      targets: ``[P, ...]`` rows of the dataset targets (padding rows are zeros), or None.
      weights: float ``[P]``; 1 for real examples, 0 for padding.
      count: number of real examples (the leading ``count`` rows).
    """

    inputs: Any
    targets: Any
    weights: torch.Tensor
    count: int


class Batcher(Protocol):
    """Anything that cuts a logical batch of indices into padded physical batches."""

    @property
    def dataset_size(self) -> int: ...

    def chunks(self, indices: np.ndarray) -> Iterator[PhysicalBatch]: ...


class PhysicalBatcher:
    """Cuts logical batches of dataset indices into padded physical batches.

    Args:
      inputs: dataset inputs, leading dimension = dataset size.
      targets: dataset targets, same leading dimension.
      max_physical_batch_size: rows per physical batch (memory bound).
      max_batch_size: if the sampler truncates logical batches to this size, every step yields
        ``ceil(max_batch_size / max_physical_batch_size)`` chunks (fixed work per step).
      device: where the chunks go (default: where ``inputs`` live).
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        max_physical_batch_size: int,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_int("max_physical_batch_size", max_physical_batch_size)
        if max_batch_size is not None:
            check_int("max_batch_size", max_batch_size)
        if len(inputs) != len(targets):
            raise ValueError(
                f"inputs and targets must have the same length, got {len(inputs)} and "
                f"{len(targets)}"
            )
        self.inputs = inputs
        self.targets = targets
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.device = torch.device(device) if device is not None else inputs.device

    @property
    def dataset_size(self) -> int:
        return len(self.inputs)

    def num_chunks(self, batch_size: int) -> int:
        """Physical batches for a logical batch of ``batch_size`` examples (at least 1)."""
        p = self.max_physical_batch_size
        if self.max_batch_size is not None:
            if batch_size > self.max_batch_size:
                raise ValueError(
                    f"batch_size must be in [0, {self.max_batch_size}] (the sampler's "
                    f"max_batch_size), got batch_size={batch_size!r}"
                )
            return math.ceil(self.max_batch_size / p)
        return max(1, math.ceil(batch_size / p))

    def chunks(self, indices: np.ndarray) -> Iterator[PhysicalBatch]:
        """The physical batches of one logical batch, in order (the last one padded)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(indices)
        if n and (indices.min() < 0 or indices.max() >= self.dataset_size):
            raise ValueError(
                f"indices must be in [0, {self.dataset_size - 1}], got min={indices.min()}, "
                f"max={indices.max()}"
            )
        p = self.max_physical_batch_size
        for c in range(self.num_chunks(n)):
            part = indices[c * p : (c + 1) * p]
            count = len(part)
            rows = torch.from_numpy(np.pad(part, (0, p - count)))
            x = self.inputs[rows]
            y = self.targets[rows]
            if count < p:
                x[count:] = 0
                y[count:] = 0
            w = torch.zeros(p, dtype=torch.float32)
            w[:count] = 1.0
            yield PhysicalBatch(
                x.to(self.device, non_blocking=True),
                y.to(self.device, non_blocking=True),
                w.to(self.device),
                count,
            )


def accumulate_logical_batch(
    private_gradient: Any,
    batcher: Batcher,
    indices: np.ndarray,
    loss_fn: Callable[..., torch.Tensor],
    *,
    on_chunk: Callable[[PhysicalBatch, Any], None] | None = None,
) -> list[Any]:
    """Feed every physical chunk of one logical batch to ``private_gradient.accumulate``.

    Gradient accumulation only: nothing is released. Call ``private_gradient.release(...)``
    once afterwards to add the noise for the whole logical step.

    Args:
      private_gradient: a :class:`dpfy.training.step.PrivateGradient`.
      batcher: cuts ``indices`` into padded physical batches.
      indices: the sampler's logical batch (dataset indices).
      loss_fn: per-example loss, ``loss_fn(outputs, targets) -> Tensor[P]``.
      on_chunk: optional observer called with each chunk and its stats (e.g. for metrics).

    Returns:
      The per-chunk statistics returned by ``accumulate``.
    """
    stats = []
    for chunk in batcher.chunks(indices):
        s = private_gradient.accumulate(chunk.inputs, chunk.targets, loss_fn, weights=chunk.weights)
        if on_chunk is not None:
            on_chunk(chunk, s)
        stats.append(s)
    return stats

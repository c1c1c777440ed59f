"""``BatchMemoryManager``: Opacus' bound on the rows per forward pass, on dpfy's loader.

``with BatchMemoryManager(data_loader=..., max_physical_batch_size=P, optimizer=...) as
loader:`` yields each logical batch as physical batches of at most P rows, real rows only as in
Opacus (the last one is smaller), so the losses and accuracies a ported script prints are
Opacus' on the same rows (an empty Poisson draw is one row of weight 0, where Opacus hands out
an empty batch). ``optimizer.step()`` after a physical batch that does not end its logical
batch only accumulates, so there is still one release per logical batch and privacy does not
change. As in Opacus the data loader passed in is unchanged: only the one the context returns
is cut. Fixed shapes (the last physical batch padded with weight-0 rows) stay available where
dpfy drives the loop itself (``dpfy.make_private``, ``PrivateTrainer``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from dpfy.opacus.data_loader import DPDataLoader
from dpfy.opacus.optimizer import DPOptimizer

__all__ = ["BatchMemoryManager"]


class BatchMemoryManager:
    """At most ``max_physical_batch_size`` rows per forward pass (module docstring).

    Args:
      data_loader: the data loader ``PrivacyEngine.make_private`` returned.
      max_physical_batch_size: rows per physical batch, >= 1.
      optimizer: the optimizer ``make_private`` returned (checked to belong to a private run).
    """

    def __init__(
        self, *, data_loader: DPDataLoader, max_physical_batch_size: int, optimizer: DPOptimizer
    ) -> None:
        if not isinstance(data_loader, DPDataLoader):
            raise TypeError(
                "data_loader must be the one PrivacyEngine.make_private returned, got "
                f"{type(data_loader).__name__}"
            )
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                "optimizer must be the one PrivacyEngine.make_private returned, got "
                f"{type(optimizer).__name__}"
            )
        if (
            isinstance(max_physical_batch_size, bool)
            or not isinstance(max_physical_batch_size, int)
            or max_physical_batch_size < 1
        ):
            raise ValueError(
                "max_physical_batch_size must be an integer in [1, inf), got "
                f"max_physical_batch_size={max_physical_batch_size!r}"
            )
        self.data_loader = data_loader
        self.optimizer = optimizer
        self.max_physical_batch_size = max_physical_batch_size

    def __enter__(self) -> PhysicalBatches:
        return PhysicalBatches(self.data_loader, self.max_physical_batch_size)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


class PhysicalBatches:
    """The loader a :class:`BatchMemoryManager` returns: ``data_loader`` cut into physical
    batches of at most ``size`` rows while it is iterated."""

    def __init__(self, data_loader: DPDataLoader, size: int) -> None:
        self.data_loader = data_loader
        self.size = int(size)

    @property
    def dataset(self) -> Any:
        return self.data_loader.dataset

    def __len__(self) -> int:
        """Physical batches per epoch of a logical batch of the expected size (for progress
        bars: a Poisson batch's size, and so its count of physical batches, varies)."""
        expected = float(self.data_loader.sampler.expected_batch_size)
        return len(self.data_loader) * max(1, math.ceil(expected / self.size))

    def __iter__(self) -> Iterator[Any]:
        private = self.data_loader.private_loader
        before = private.max_physical_batch_size
        private.max_physical_batch_size = self.size
        try:
            yield from self.data_loader
        finally:
            private.max_physical_batch_size = before

"""The data loader ``PrivacyEngine.make_private`` returns: dpfy's private loader, Opacus-shaped.

Iterating it iterates the :class:`dpfy.training.PrivateLoader` of the run (the dpfy sampler
draws every batch; the loader writes nothing until a batch is backpropagated) and, in
``grad_sample_mode="hooks"``, opens each physical batch for
:class:`~dpfy.opacus.outputs.OutputGradients`. ``len()`` is the number of logical batches per
epoch, as Opacus' ``DPDataLoader`` (``1 / sample_rate`` with Poisson sampling).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from dpfy.opacus.outputs import OutputGradients
from dpfy.training import PrivateLoader


class DPDataLoader:
    """Batches of a private run for a loop written against Opacus (module docstring).

    Args:
      private_loader: the run's loader (from :func:`dpfy.training.make_private`).
      outputs: the hooks-mode per-example losses, or None (``grad_sample_mode="ghost"``).
      original: the ``DataLoader`` the user passed (for ``dataset``, ``batch_size``, ...).
    """

    def __init__(
        self, private_loader: PrivateLoader, outputs: OutputGradients | None, original: Any
    ) -> None:
        self.private_loader = private_loader
        self._outputs = outputs
        self.original = original

    @classmethod
    def from_data_loader(cls, data_loader: Any, **_: Any) -> DPDataLoader:
        """Refused: a private loader belongs to a run (its sampler's event goes to the run's
        ledger), so it is made by ``PrivacyEngine.make_private``."""
        raise NotImplementedError(
            "DPDataLoader.from_data_loader is not part of dpfy.opacus: the private loader "
            "belongs to a run whose ledger records its sampler's event; "
            "PrivacyEngine.make_private(data_loader=...) returns it"
        )

    @property
    def dataset(self) -> Any:
        return self.private_loader.dataset

    @property
    def batch_size(self) -> int | None:
        """The batch size of the ``DataLoader`` passed in (batches drawn here vary in size)."""
        size = getattr(self.original, "batch_size", None)
        return None if size is None else int(size)

    @property
    def sampler(self) -> Any:
        """The dpfy sampler that draws the batches (it states the run's privacy event)."""
        return self.private_loader.sampler

    def __len__(self) -> int:
        return len(self.private_loader)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.private_loader)
        try:
            for batch in batches:
                if self._outputs is not None:
                    self._outputs.open(_rows(batch))
                yield batch
        finally:
            if self._outputs is not None:
                self._outputs.close()
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # ends the private loader's iteration now, not at garbage collection

    def __repr__(self) -> str:
        return f"DPDataLoader({self.private_loader.sampler!r})"


def _rows(batch: Any) -> int:
    """Rows of a collated batch: the first dimension of its first tensor."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("a batch must contain a tensor with the batch on dim 0")

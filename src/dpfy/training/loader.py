"""Any map-style ``Dataset`` as private physical batches: the sampler decides, dpfy loads.

The privacy event of a run is the event of the sampler that drew its batches
(``docs/architecture.md``, sections 1 and 5.8), so dpfy, not the data pipeline, decides which
indices form a batch:

* a map-style ``torch.utils.data.Dataset`` (``__len__`` and ``__getitem__``; items that are
  tensors, tuples or dicts, e.g. a tokenizer's padded ``input_ids``, ``attention_mask`` and
  ``labels``) is read by index, with the user's ``collate_fn`` (default:
  ``torch.utils.data.default_collate``);
* an ``IterableDataset``, or a ``DataLoader`` the user built (its sampler, not dpfy's,
  would decide the batches), is refused: pass the dataset and dpfy builds the loader.

A logical batch (one sampler draw, one release) is cut into physical batches of at most
``max_physical_batch_size`` rows; the last one is padded to the fixed shape with rows of a
valid index (0) and weight 0, so the padded rows contribute nothing to the clipped sum
(:mod:`dpfy.training.data`). :class:`PrivateBatchSampler` yields these padded index lists as a
``batch_sampler`` for a ``torch.utils.data.DataLoader`` (also with ``num_workers > 0``: the
sampler and its randomness stay in the main process; workers only read rows), and queues one
:class:`ChunkInfo` per list, in order, for the consumer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from dpfy._validate import check_range
from dpfy.training.data import PhysicalBatch

#: Why dpfy builds the loader itself (part of every refusal of a foreign data pipeline).
REFUSAL = "the sampler decides the accounting: pass the dataset, dpfy builds the loader"


def check_dataset(data: Any, name: str = "data") -> None:
    """Refuse anything but a map-style dataset (see the module docstring).

    Raises:
      TypeError: a ``DataLoader``, an ``IterableDataset``, or an object without ``__len__``
        and ``__getitem__``.
    """
    if isinstance(data, DataLoader):
        raise TypeError(
            f"{name} must be a map-style Dataset, got a torch DataLoader built outside dpfy: "
            f"{REFUSAL} (pass {name}=loader.dataset, and its collate_fn as collate_fn)"
        )
    if isinstance(data, IterableDataset):
        raise TypeError(
            f"{name} must be a map-style Dataset (__len__ and __getitem__), got the "
            f"IterableDataset {type(data).__name__}: it chooses its own batches, so no sampler "
            f"can state their privacy event; {REFUSAL}"
        )
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(
            f"{name} must be a map-style Dataset (__len__ and __getitem__), got "
            f"{type(data).__name__}; {REFUSAL}"
        )
    check_range(f"len({name})", len(data), 1, None, integer=True)


def check_sampler(sampler: Any, dataset_size: int, name: str = "sampler") -> None:
    """Refuse a sampler that is not a :mod:`dpfy.sampling` sampler over ``dataset_size``."""
    from dpfy.sampling import Sampler

    if isinstance(sampler, torch.utils.data.Sampler) or not isinstance(sampler, Sampler):
        raise TypeError(
            f"{name} must be a dpfy.sampling sampler or a kind name such as 'poisson', got "
            f"{type(sampler).__name__}: a sampler that does not state its privacy event "
            f"cannot be accounted; {REFUSAL}"
        )
    if int(sampler.dataset_size) != int(dataset_size):
        raise ValueError(
            f"{name} must draw from the {dataset_size} examples of the data, got "
            f"{name}.dataset_size={sampler.dataset_size!r}"
        )


def split_batch(batch: Any, target_key: str = "labels") -> tuple[Any, Any]:
    """(inputs, targets) of a collated batch.

    * a tensor: (the tensor, None);
    * a tuple or list: (first item, last item) for two items, else (all but the last as a
      tuple, last); one item: (it, None);
    * a mapping: (the mapping without ``target_key``, ``batch[target_key]`` or None); the
      model is then called as ``model(**inputs)``.
    """
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k != target_key}
        return inputs, batch.get(target_key)
    if isinstance(batch, tuple | list):
        if len(batch) == 1:
            return batch[0], None
        if len(batch) == 2:
            return batch[0], batch[1]
        return tuple(batch[:-1]), batch[-1]
    return batch, None


def chunk_rows(
    indices: np.ndarray, max_physical_batch_size: int | None, max_batch_size: int | None
) -> list[tuple[np.ndarray, int]]:
    """The padded physical batches of one logical batch: (rows, number of real rows) each.

    With ``max_physical_batch_size`` P: ceil(n / P) chunks of P rows (ceil(max_batch_size / P)
    when the sampler truncates, so the number of passes does not reveal n), at least one.
    Without: one chunk, padded to ``max_batch_size`` when the sampler truncates, else the
    logical batch as drawn (an empty batch becomes one padding row). Padding rows use index 0.
    """
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    n = len(indices)
    if max_batch_size is not None and n > max_batch_size:
        raise ValueError(
            f"batch_size must be in [0, {max_batch_size}] (the sampler's max_batch_size), got "
            f"batch_size={n!r}"
        )
    if max_physical_batch_size is None:
        p = max_batch_size if max_batch_size is not None else max(n, 1)
        count = 1
    else:
        p = int(max_physical_batch_size)
        bound = max_batch_size if max_batch_size is not None else n
        count = max(1, math.ceil(bound / p))
    out = []
    for c in range(count):
        part = indices[c * p : (c + 1) * p]
        out.append((np.pad(part, (0, p - len(part))), len(part)))
    return out


def _fetch(dataset: Any, rows: np.ndarray, collate_fn: Callable[[list[Any]], Any] | None) -> Any:
    """The collated rows of ``dataset`` (in-memory tensors: one indexing per tensor)."""
    if collate_fn is None and type(dataset) is TensorDataset:
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        return [t[index] for t in dataset.tensors]
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(rows.tolist()) if getitems else [dataset[int(i)] for i in rows]
    return (collate_fn or default_collate)(items)


def _to(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    return tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch
    )


class DatasetBatcher:
    """Cuts logical batches into padded physical batches read from a map-style dataset.

    The Dataset counterpart of :class:`dpfy.training.data.PhysicalBatcher` (which stays the
    fast path for in-memory tensors): each chunk's rows are read with ``dataset[i]`` (or
    ``__getitems__``), collated, split into (inputs, targets) by :func:`split_batch` and moved
    to ``device``. Padding rows repeat index 0 with weight 0.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        max_physical_batch_size: int | None,
        max_batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | str | None = None,
        target_key: str = "labels",
    ) -> None:
        check_dataset(dataset, "dataset")
        if max_physical_batch_size is not None:
            check_range("max_physical_batch_size", max_physical_batch_size, 1, None, integer=True)
        self.dataset = dataset
        self.max_physical_batch_size = max_physical_batch_size
        self.max_batch_size = max_batch_size
        self.collate_fn = collate_fn
        self.device = None if device is None else torch.device(device)
        self.target_key = target_key

    @property
    def dataset_size(self) -> int:
        return len(self.dataset)

    def chunks(self, indices: np.ndarray) -> Iterator[PhysicalBatch]:
        """The physical batches of one logical batch, in order (the last one padded)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.dataset_size):
            raise ValueError(
                f"indices must be in [0, {self.dataset_size - 1}], got min={indices.min()}, "
                f"max={indices.max()}"
            )
        for rows, count in chunk_rows(indices, self.max_physical_batch_size, self.max_batch_size):
            batch = _to(_fetch(self.dataset, rows, self.collate_fn), self.device)
            x, y = split_batch(batch, self.target_key)
            w = torch.zeros(len(rows), dtype=torch.float32)
            w[:count] = 1.0
            yield PhysicalBatch(x, y, w if self.device is None else w.to(self.device), count)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What the consumer of a physical batch needs to know about it.

    Attributes:
      epoch, step: the sampler's epoch and the step within it (0-based).
      chunk, num_chunks: position of this physical batch in its logical batch.
      count: real rows (the leading ones); the other rows are weight-0 padding.
      size: rows in the physical batch.
    """

    epoch: int
    step: int
    chunk: int
    num_chunks: int
    count: int
    size: int

    @property
    def last(self) -> bool:
        """Whether this physical batch ends its logical batch (the release follows it)."""
        return self.chunk + 1 == self.num_chunks

    def weights(self, device: torch.device | None = None) -> torch.Tensor:
        """Float ``[size]``: 1 for the real rows, 0 for padding."""
        w = torch.zeros(self.size, dtype=torch.float32)
        w[: self.count] = 1.0
        return w if device is None else w.to(device)


class PrivateBatchSampler:
    """A dpfy sampler as a ``batch_sampler``: padded physical index lists, epoch by epoch.

    Each ``iter()`` runs the next epoch of the sampler (or the epoch set by :meth:`begin`), at
    most ``limit`` logical batches of it, and appends one :class:`ChunkInfo` per yielded list to
    :attr:`infos`; a ``DataLoader`` keeps the order of its batch sampler, so the consumer pops
    them in step with the batches (prefetching only moves the queue ahead).

    ``pad`` (default True): physical batches have the fixed shape (the last one padded with
    weight-0 rows). False: each holds only its real rows (an empty draw: one weight-0 row),
    for a loop the user writes whose printed losses and accuracies must count real rows only
    (``dpfy.opacus``' ``BatchMemoryManager``); privacy is the same either way.

    ``shard`` (default None): ``(rank, world_size)`` of a data-parallel run whose ranks all
    iterate the same logical batches (:class:`dpfy.training.distributed.SharedSampler`): each
    physical batch is cut into ``world_size`` consecutive parts and this rank yields part
    ``rank`` (:func:`share_rows`), so the ranks' real rows together are the batch's, each once.
    """

    def __init__(
        self,
        sampler: Any,
        *,
        max_physical_batch_size: int | None = None,
    ) -> None:
        if max_physical_batch_size is not None:
            check_range("max_physical_batch_size", max_physical_batch_size, 1, None, integer=True)
        self.sampler = sampler
        self.max_physical_batch_size = max_physical_batch_size
        self.pad = True
        self.shard: tuple[int, int] | None = None
        self.infos: collections.deque[ChunkInfo] = collections.deque()
        self._epoch = 0
        self._limit: int | None = None

    def begin(self, epoch: int, limit: int | None = None) -> None:
        """The next ``iter()`` runs ``epoch``, stopping after ``limit`` logical batches."""
        self._epoch, self._limit = int(epoch), limit
        self.infos.clear()

    def __iter__(self) -> Iterator[list[int]]:
        epoch, limit = self._epoch, self._limit
        self._epoch, self._limit = epoch + 1, None
        if limit is not None and limit <= 0:
            return
        mb = getattr(self.sampler, "max_batch_size", None)
        for step, indices in enumerate(self.sampler.batches(epoch)):
            parts = chunk_rows(indices, self.max_physical_batch_size, mb)
            for c, (rows, count) in enumerate(parts):
                if self.shard is not None:
                    rows, count = share_rows(rows, count, *self.shard)
                rows = rows if self.pad else rows[: max(count, 1)]
                self.infos.append(ChunkInfo(epoch, step, c, len(parts), count, len(rows)))
                yield rows.tolist()
            if limit is not None and step + 1 >= limit:
                return

    def __len__(self) -> int:
        """Logical batches per epoch (physical batches per epoch vary with random batches)."""
        return int(self.sampler.steps_per_epoch)


def share_rows(rows: np.ndarray, count: int, rank: int, world_size: int) -> tuple[np.ndarray, int]:
    """Part ``rank`` of ``world_size`` consecutive parts of a physical batch whose first
    ``count`` rows are real: (its rows, its real rows). Part r holds rows
    ``[r S / W, (r+1) S / W)`` of the S rows (``P / W`` each when W divides the physical batch
    size P, as :class:`dpfy.training.distributed.ShardBatcher` cuts); an empty part is one
    weight-0 row (index of the batch's first row)."""
    size = len(rows)
    lo, hi = rank * size // world_size, (rank + 1) * size // world_size
    real = max(0, min(hi, count) - lo)
    return (rows[lo:hi] if hi > lo else rows[:1]), real


class RowsDataset(Dataset[Any]):
    """A dataset whose ``__getitems__`` returns collated rows (the DataLoader's fetch)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, rows: list[int]) -> Any:
        return _fetch(self.dataset, np.asarray(rows, dtype=np.int64), self.collate_fn)


def collated(batch: Any) -> Any:
    """The ``collate_fn`` of a :class:`RowsDataset` loader: its batches are collated already."""
    return batch

"""What every batch sampler provides, and the bookkeeping they share.

A sampler turns ``dataset_size`` example indices into batches of indices, epoch by epoch, and
states the ledger entry describing its batches (:meth:`Sampler.sample_spec`). Its privacy event
(:meth:`Sampler.privacy_event`) is derived from that entry by
:func:`dpfy.sampling.spec.spec_event`, the same map the ledger uses, so accounting follows the
sampler that actually ran and a sampler cannot claim another event than its ledger shows.

Maximum batch size (kinds whose row ``truncates``): a batch longer than ``max_batch_size`` is
cut to a uniformly random subset of that size (``truncated_steps`` counts how often); the event
then carries the truncation so its extra delta enters every epsilon
(:mod:`dpfy.accounting.truncation`). :func:`pad_batch` pads a batch to the fixed shape with
weight-0 rows.

Checkpointing: :meth:`BaseSampler.state_dict` after a yielded batch,
:meth:`BaseSampler.load_state_dict` into a freshly built sampler, then ``batches(epoch)``
continues with the next batch of that epoch. Epoch samplers save the epoch's layout, so resuming
keeps "every example once per epoch" even with secure randomness, whose generator state cannot
be saved.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.randomness import Randomness
from dpfy.sampling.kinds import kind
from dpfy.sampling.spec import SampleSpec, spec_event


@runtime_checkable
class Sampler(Protocol):
    """What every batch sampler provides (see the module docstring)."""

    kind: ClassVar[str]
    dataset_size: int
    steps_per_epoch: int
    expected_batch_size: float
    max_batch_size: int | None

    def batches(self, epoch: int) -> Iterator[np.ndarray]: ...

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event: ...

    def sample_spec(self) -> SampleSpec: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def pad_batch(indices: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch of indices to ``size`` rows: (indices, weights) with weight 0 on padding.

    Padding rows repeat index 0 (any valid row; their weight 0 removes them from every sum).

    Raises:
      ValueError: if the batch is longer than ``size`` (truncate first).
    """
    indices = np.asarray(indices, dtype=np.int64)
    check_range("size", size, len(indices), None, integer=True)
    out = np.zeros(int(size), dtype=np.int64)
    out[: len(indices)] = indices
    weights = np.zeros(int(size), dtype=np.float32)
    weights[: len(indices)] = 1.0
    return out, weights


def check_unit(unit: Any) -> str:
    """A unit of privacy: a non-empty lower-case word of letters, digits and ``_``/``-``."""
    if (
        not isinstance(unit, str)
        or not unit
        or len(unit) > 40
        or not all(c.isalnum() or c in "_-" for c in unit)
        or unit != unit.lower()
    ):
        raise ValueError(
            "unit must be a lower-case word of at most 40 letters, digits, '_' or '-' (e.g. "
            f"'example', 'user', 'movie'), got unit={unit!r}"
        )
    return unit


def epochs_and_steps(
    epochs: float | None, steps: int | None, steps_per_epoch: int
) -> tuple[int, int]:
    """(whole epochs touched, total steps) of a run given in epochs or in steps.

    Default: one epoch. A partial epoch counts as a whole one.

    Raises:
      ValueError: both ``epochs`` and ``steps`` given, or either out of range.
    """
    if epochs is not None and steps is not None:
        raise ValueError(f"give epochs or steps, not both, got epochs={epochs!r}, steps={steps!r}")
    if steps is not None:
        check_int("steps", steps)
        total = int(steps)
    else:
        e = 1.0 if epochs is None else epochs
        check_range("epochs", e, 0.0, None, low_open=True)
        total = max(1, math.ceil(float(e) * steps_per_epoch - 1e-9))
    return math.ceil(total / steps_per_epoch), total


class BaseSampler:
    """Shared bookkeeping: epoch/step position, truncation, checkpoint state, privacy event.

    A subclass sets ``kind`` (its row in :mod:`dpfy.sampling.kinds`), ``steps_per_epoch`` and
    ``expected_batch_size``, implements :meth:`sample_spec`, :meth:`from_batch_size` and either
    :meth:`_draw_step` (a step sampler) or :meth:`_draw_layout` (an epoch sampler, with
    ``_epoch_layout = True``).
    """

    kind: ClassVar[str] = ""
    #: epoch samplers draw one layout per epoch (and save it); step samplers draw per step.
    _epoch_layout: ClassVar[bool] = False
    #: What one index stands for, recorded in every ``SampleSpec`` (``"example"``; a
    #: user-level run samples user indices: ``"user"``, ``"movie"``; see ``with_unit``).
    unit: str = "example"

    def __init__(
        self,
        dataset_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        check_int("dataset_size", dataset_size)
        if max_batch_size is not None:
            check_int("max_batch_size", max_batch_size)
            max_batch_size = int(max_batch_size)
        self.dataset_size = int(dataset_size)
        self.max_batch_size = max_batch_size
        # default: the secure generator; a seeded one only when the caller passes it
        self.randomness = randomness if randomness is not None else Randomness.secure_mode()
        self.truncated_steps = 0
        self._epoch = 0
        self._step = 0
        self._layout: tuple[np.ndarray, np.ndarray] | None = None

    # -- subclasses provide -----------------------------------------------------------------
    steps_per_epoch: int
    expected_batch_size: float

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> BaseSampler:
        """The sampler whose (expected) batch size is ``batch_size`` (see ``make_sampler``)."""
        raise NotImplementedError

    def sample_spec(self) -> SampleSpec:
        """The ledger entry describing this sampler's batches."""
        raise NotImplementedError

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, sizes) of an epoch sampler."""
        raise NotImplementedError

    def _draw_step(self) -> np.ndarray:
        """One batch of a step sampler."""
        raise NotImplementedError

    # -- privacy ----------------------------------------------------------------------------
    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        """The event of a run of ``epochs`` or ``steps`` (default one epoch) with a Gaussian sum
        query of the given noise multiplier per step: ``spec_event`` of :meth:`sample_spec`.

        An epoch-structured kind is charged the epochs touched (a partial epoch counts as a whole
        one); a step kind the steps.
        """
        n_epochs, total = epochs_and_steps(epochs, steps, self.steps_per_epoch)
        spec = self.sample_spec()
        count = n_epochs if kind(spec.sampler).epoch_structured else total
        return spec_event(spec, noise_multiplier, count)

    # -- iteration --------------------------------------------------------------------------
    def batches(self, epoch: int) -> Iterator[np.ndarray]:
        """Yield the ``steps_per_epoch`` batches of ``epoch`` as int64 index arrays.

        If a loaded checkpoint stopped inside ``epoch``, iteration resumes after the last batch
        the checkpoint covered. Batches longer than ``max_batch_size`` are truncated.
        """
        check_int("epoch", epoch, 0)
        epoch = int(epoch)
        resume = epoch == self._epoch and 0 < self._step < self.steps_per_epoch
        if not resume:
            self._epoch, self._step = epoch, 0
            self._layout = self._draw_layout(epoch) if self._epoch_layout else None
        if self._epoch_layout:
            assert self._layout is not None
            order, sizes = self._layout
            bounds = np.concatenate(([0], np.cumsum(sizes)))
        for t in range(self._step, self.steps_per_epoch):
            if self._epoch_layout:
                batch = order[bounds[t] : bounds[t + 1]]
            else:
                batch = self._draw_step()
            batch = self._truncate(np.asarray(batch, dtype=np.int64))
            self._step = t + 1
            if self._step == self.steps_per_epoch:
                self._epoch, self._step, self._layout = epoch + 1, 0, None
            yield batch

    def _truncate(self, batch: np.ndarray) -> np.ndarray:
        if self.max_batch_size is None or len(batch) <= self.max_batch_size:
            return batch
        self.truncated_steps += 1
        keep = self.randomness.choice(len(batch), self.max_batch_size)
        return np.asarray(batch[np.sort(keep)], dtype=np.int64)

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position after the last yielded batch (+ generator state when seeded, + layout)."""
        state: dict[str, Any] = {
            "kind": self.kind,
            "epoch": self._epoch,
            "step": self._step,
            "truncated_steps": self.truncated_steps,
        }
        if not self.randomness.secure:
            state["randomness"] = self.randomness.state_dict()
        if self._layout is not None:
            state["layout"] = (self._layout[0].copy(), self._layout[1].copy())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (secure randomness continues with fresh bits)."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"state kind must be {self.kind!r}, got kind={state.get('kind')!r}"
            )
        self._epoch = int(state["epoch"])
        self._step = int(state["step"])
        self.truncated_steps = int(state.get("truncated_steps", 0))
        if "randomness" in state and not self.randomness.secure:
            self.randomness.load_state_dict(state["randomness"])
        layout = state.get("layout")
        self._layout = None if layout is None else (np.asarray(layout[0]), np.asarray(layout[1]))
        if self._epoch_layout and 0 < self._step and self._layout is None:
            raise ValueError("an epoch sampler's mid-epoch state must contain its layout")

    # -- ledger -----------------------------------------------------------------------------
    def _spec(self, **fields: Any) -> SampleSpec:
        return SampleSpec(self.kind, dataset_size=self.dataset_size, unit=self.unit, **fields)

    def with_unit(self, unit: str) -> BaseSampler:
        """Declare what an index stands for (the unit of privacy); returns ``self``.

        A sampler over the users of a dataset (``dataset_size`` = number of users) is the
        same sampler; only the unit its ledger entries state changes.
        """
        check_unit(unit)
        self.unit = str(unit)
        return self

    def __repr__(self) -> str:
        extra = "" if self.max_batch_size is None else f", max_batch_size={self.max_batch_size}"
        if self.unit != "example":
            extra += f", unit={self.unit!r}"
        return (
            f"{type(self).__name__}(dataset_size={self.dataset_size}, "
            f"steps_per_epoch={self.steps_per_epoch}, "
            f"expected_batch_size={self.expected_batch_size:g}{extra})"
        )


class FixedBatchEpochSampler(BaseSampler):
    """An epoch sampler with fixed-size consecutive batches of an epoch order (shuffle,
    deterministic); the subclass gives the order (:meth:`_order`)."""

    _epoch_layout: ClassVar[bool] = True

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        drop_last: bool = True,
        randomness: Randomness | None = None,
    ) -> None:
        super().__init__(dataset_size, max_batch_size=None, randomness=randomness)
        check_range("batch_size", batch_size, 1, dataset_size, integer=True)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        full, rest = divmod(self.dataset_size, self.batch_size)
        self.steps_per_epoch = full + (1 if rest and not drop_last else 0)
        self.expected_batch_size = float(self.batch_size)

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> BaseSampler:
        """Batches of exactly ``batch_size`` (the remainder is dropped); never truncated."""
        _no_truncation(cls.kind, max_batch_size)
        return cls(dataset_size, batch_size, randomness=randomness)

    def _order(self) -> np.ndarray:
        raise NotImplementedError

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = self._order()
        sizes = np.full(self.steps_per_epoch, self.batch_size, dtype=np.int64)
        if not self.drop_last and self.dataset_size % self.batch_size:
            sizes[-1] = self.dataset_size % self.batch_size
        return order, sizes

    def sample_spec(self) -> SampleSpec:
        return self._spec(batch_size=self.batch_size, steps_per_epoch=self.steps_per_epoch)


def _no_truncation(name: str, max_batch_size: int | None) -> None:
    if max_batch_size is not None:
        raise ValueError(
            f"max_batch_size applies to truncating samplers only, got "
            f"max_batch_size={max_batch_size!r} for kind={name!r} (its batches are fixed-size)"
        )

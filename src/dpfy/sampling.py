"""Batch samplers that know the privacy event they implement (DESIGN section 4).

A sampler turns ``dataset_size`` example indices into batches of indices, epoch by epoch, and
names the :mod:`dpfy.events` event its batches give a Gaussian sum query
(:meth:`privacy_event`) and the ledger entry describing it (:meth:`sample_spec`). Accounting
therefore follows the sampler that actually ran, never a hyperparameter that claims to.

* ``PoissonSampler``: each example joins each batch independently with probability q
  -> ``PoissonSampled`` (``TruncatedPoisson`` with a maximum batch size).
* ``BallsAndBinsSampler``: each example in one uniformly random batch per epoch
  -> ``BallsAndBins`` (``TruncatedBallsAndBins``).
* ``ShuffleSampler``: permute each epoch, cut into fixed-size batches -> ``Shuffled``.
* ``DeterministicSampler``: fixed order, fixed-size batches -> ``Deterministic``.
* ``FixedSizeSampler``: ``batch_size`` examples without replacement per step
  -> ``FixedSizeSampled`` (replace-one adjacency).

Maximum batch size (Poisson, Balls-and-Bins): a batch longer than ``max_batch_size`` is cut to a
uniformly random subset of that size (``truncated_steps`` counts how often); the event then
carries the truncation so its extra delta enters every epsilon (:mod:`dpfy.accounting.truncation`).
:func:`pad_batch` pads a batch to the fixed shape with weight-0 rows.

All randomness comes from an injected :class:`dpfy.randomness.Randomness` (seeded or secure).
Checkpointing: :meth:`state_dict` after a yielded batch, :meth:`load_state_dict` into a freshly
built sampler, then ``batches(epoch)`` continues with the next batch of that epoch. Epoch
samplers (Balls-and-Bins, shuffle) save the epoch's layout, so resuming keeps "every example
once per epoch" even with secure randomness, whose generator state cannot be saved.

Example:
    >>> from dpfy.randomness import Randomness
    >>> s = BallsAndBinsSampler(1000, steps_per_epoch=10, randomness=Randomness(0))
    >>> sum(len(b) for b in s.batches(0))
    1000
    >>> s.privacy_event(1.0, epochs=2)
    BallsAndBins(noise_multiplier=1.0, steps_per_epoch=10, epochs=2, adjacency='add_or_remove')
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.randomness import Randomness

if TYPE_CHECKING:  # pragma: no cover
    from dpfy.ledger import SampleSpec

__all__ = [
    "Sampler",
    "PoissonSampler",
    "BallsAndBinsSampler",
    "ShuffleSampler",
    "DeterministicSampler",
    "FixedSizeSampler",
    "SAMPLER_KINDS",
    "make_sampler",
    "pad_batch",
    "balls_and_bins_sizes",
]


@runtime_checkable
class Sampler(Protocol):
    """What every batch sampler provides (see the module docstring)."""

    kind: str
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


def balls_and_bins_sizes(dataset_size: int, steps: int, randomness: Randomness) -> np.ndarray:
    """Batch sizes of one Balls-and-Bins epoch: N balls thrown into T bins (DESIGN 4.1).

    ``b_t ~ Binomial(N - b_1 - ... - b_{t-1}, 1 / (T - t + 1))``: jointly Multinomial(N, 1/T),
    each marginally Binomial(N, 1/T), summing to N.
    """
    sizes = np.zeros(int(steps), dtype=np.int64)
    remaining = int(dataset_size)
    for t in range(int(steps) - 1):
        b = randomness.binomial(remaining, 1.0 / (steps - t)) if remaining else 0
        sizes[t] = b
        remaining -= b
    sizes[-1] = remaining
    return sizes


def _epochs_and_steps(
    epochs: float | None, steps: int | None, steps_per_epoch: int
) -> tuple[int, int]:
    """(whole epochs touched, total steps); a partial epoch counts as a whole one."""
    if epochs is not None and steps is not None:
        raise ValueError(f"give epochs or steps, not both, got epochs={epochs!r}, steps={steps!r}")
    if steps is not None:
        check_range("steps", steps, 1, None, integer=True)
        total = int(steps)
    else:
        e = 1.0 if epochs is None else epochs
        check_range("epochs", e, 0.0, None, low_open=True)
        total = max(1, math.ceil(float(e) * steps_per_epoch - 1e-9))
    return math.ceil(total / steps_per_epoch), total


class _BaseSampler:
    """Shared bookkeeping: epoch/step position, truncation, checkpoint state."""

    kind: ClassVar[str] = ""
    #: epoch samplers draw one layout per epoch (and save it); step samplers draw per step.
    _epoch_layout: ClassVar[bool] = False

    def __init__(
        self,
        dataset_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        check_range("dataset_size", dataset_size, 1, None, integer=True)
        if max_batch_size is not None:
            check_range("max_batch_size", max_batch_size, 1, None, integer=True)
            max_batch_size = int(max_batch_size)
        self.dataset_size = int(dataset_size)
        self.max_batch_size = max_batch_size
        self.randomness = randomness if randomness is not None else Randomness()
        self.truncated_steps = 0
        self._epoch = 0
        self._step = 0
        self._layout: tuple[np.ndarray, np.ndarray] | None = None

    # -- subclasses provide -----------------------------------------------------------------
    steps_per_epoch: int
    expected_batch_size: float

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, sizes) of an epoch sampler."""
        raise NotImplementedError

    def _draw_step(self) -> np.ndarray:
        """One batch of a step sampler."""
        raise NotImplementedError

    # -- iteration --------------------------------------------------------------------------
    def batches(self, epoch: int) -> Iterator[np.ndarray]:
        """Yield the ``steps_per_epoch`` batches of ``epoch`` as int64 index arrays.

        If a loaded checkpoint stopped inside ``epoch``, iteration resumes after the last batch
        the checkpoint covered. Batches longer than ``max_batch_size`` are truncated.
        """
        check_range("epoch", epoch, 0, None, integer=True)
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
        return batch[np.sort(keep)]

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
        from dpfy.ledger import SampleSpec

        return SampleSpec(self.kind, dataset_size=self.dataset_size, **fields)

    def __repr__(self) -> str:
        extra = "" if self.max_batch_size is None else f", max_batch_size={self.max_batch_size}"
        return (
            f"{type(self).__name__}(dataset_size={self.dataset_size}, "
            f"steps_per_epoch={self.steps_per_epoch}, "
            f"expected_batch_size={self.expected_batch_size:g}{extra})"
        )


class PoissonSampler(_BaseSampler):
    """Poisson sampling: each example joins each batch independently with ``sampling_rate``.

    Args:
      dataset_size: number of examples N.
      sampling_rate: q in (0, 1]; expected batch size q N.
      steps_per_epoch: steps counted as one epoch (default ``round(1 / q)``).
      max_batch_size: truncate larger batches (event becomes ``TruncatedPoisson``).
      randomness: source of randomness (default: a fresh seeded generator).

    Adjacency: add_or_remove; unit of privacy: one example (index).
    """

    kind: ClassVar[str] = "poisson"

    def __init__(
        self,
        dataset_size: int,
        sampling_rate: float,
        *,
        steps_per_epoch: int | None = None,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        super().__init__(dataset_size, max_batch_size=max_batch_size, randomness=randomness)
        check_range("sampling_rate", sampling_rate, 0.0, 1.0, low_open=True)
        self.sampling_rate = float(sampling_rate)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1.0 / self.sampling_rate))
        check_range("steps_per_epoch", steps_per_epoch, 1, None, integer=True)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = self.sampling_rate * self.dataset_size

    def _draw_step(self) -> np.ndarray:
        return np.flatnonzero(self.randomness.bernoulli(self.sampling_rate, self.dataset_size))

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        """Poisson-sampled Gaussian for the given steps (default: one epoch)."""
        _, total = _epochs_and_steps(epochs, steps, self.steps_per_epoch)
        if self.max_batch_size is not None:
            return ev.TruncatedPoisson(
                self.sampling_rate,
                noise_multiplier,
                total,
                self.dataset_size,
                self.max_batch_size,
            )
        return ev.SelfComposed(
            ev.PoissonSampled(self.sampling_rate, ev.Gaussian(noise_multiplier)), total
        )

    def sample_spec(self) -> SampleSpec:
        return self._spec(sampling_rate=self.sampling_rate, max_batch_size=self.max_batch_size)


class BallsAndBinsSampler(_BaseSampler):
    """Balls-and-Bins (Chua et al. 2025, Alg. 3): each example in one random batch per epoch.

    Implementation as in DESIGN 4.1: shuffle once per epoch, then cut consecutive batches of
    sizes b_t ~ Binomial(remaining, 1 / (T - t + 1)). Every example appears exactly once per
    epoch; each batch is marginally Binomial(N, 1/T), as Poisson sampling with q = 1/T.

    Args:
      dataset_size: number of examples N.
      steps_per_epoch: number of batches T per epoch (expected batch size N / T).
      max_batch_size: truncate larger batches (event becomes ``TruncatedBallsAndBins``).
      randomness: source of randomness.

    Adjacency: add_or_remove (the other examples' batches do not depend on the differing one).
    """

    kind: ClassVar[str] = "balls_and_bins"
    _epoch_layout: ClassVar[bool] = True

    def __init__(
        self,
        dataset_size: int,
        steps_per_epoch: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        super().__init__(dataset_size, max_batch_size=max_batch_size, randomness=randomness)
        check_range("steps_per_epoch", steps_per_epoch, 1, None, integer=True)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = self.dataset_size / self.steps_per_epoch

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.asarray(self.randomness.permutation(self.dataset_size), dtype=np.int64)
        sizes = balls_and_bins_sizes(self.dataset_size, self.steps_per_epoch, self.randomness)
        return order, sizes

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        """Balls-and-Bins Gaussian over the epochs touched (a partial epoch counts as whole)."""
        n_epochs, _ = _epochs_and_steps(epochs, steps, self.steps_per_epoch)
        if self.max_batch_size is not None:
            return ev.TruncatedBallsAndBins(
                noise_multiplier,
                self.steps_per_epoch,
                n_epochs,
                self.dataset_size,
                self.max_batch_size,
            )
        return ev.BallsAndBins(noise_multiplier, self.steps_per_epoch, n_epochs)

    def sample_spec(self) -> SampleSpec:
        return self._spec(steps_per_epoch=self.steps_per_epoch, max_batch_size=self.max_batch_size)


class _FixedBatchEpochSampler(_BaseSampler):
    """Shuffle / deterministic: fixed-size consecutive batches of an epoch order."""

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


class ShuffleSampler(_FixedBatchEpochSampler):
    """Shuffle each epoch, cut into batches of ``batch_size`` (remainder dropped by default).

    Event ``Shuffled``: no amplification bound is known; accountants report the no-amplification
    upper bound and the Chua et al. (2024a) lower bound, never a Poisson number.
    """

    kind: ClassVar[str] = "shuffle"

    def _order(self) -> np.ndarray:
        return np.asarray(self.randomness.permutation(self.dataset_size), dtype=np.int64)

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        n_epochs, _ = _epochs_and_steps(epochs, steps, self.steps_per_epoch)
        return ev.Shuffled(noise_multiplier, self.steps_per_epoch, n_epochs)


class DeterministicSampler(_FixedBatchEpochSampler):
    """Fixed order ``0..N-1`` cut into batches of B: no randomness, no amplification."""

    kind: ClassVar[str] = "deterministic"

    def _order(self) -> np.ndarray:
        return np.arange(self.dataset_size, dtype=np.int64)

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        n_epochs, _ = _epochs_and_steps(epochs, steps, self.steps_per_epoch)
        return ev.Deterministic(noise_multiplier, self.steps_per_epoch, n_epochs)


class FixedSizeSampler(_BaseSampler):
    """``batch_size`` distinct examples drawn uniformly without replacement, independently per step.

    Adjacency: replace_one (the dataset size is public); ``steps_per_epoch`` = ceil(N / B).
    """

    kind: ClassVar[str] = "fixed_size"

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        steps_per_epoch: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        super().__init__(dataset_size, max_batch_size=None, randomness=randomness)
        check_range("batch_size", batch_size, 1, dataset_size, integer=True)
        self.batch_size = int(batch_size)
        if steps_per_epoch is None:
            steps_per_epoch = math.ceil(self.dataset_size / self.batch_size)
        check_range("steps_per_epoch", steps_per_epoch, 1, None, integer=True)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = float(self.batch_size)

    def _draw_step(self) -> np.ndarray:
        return np.sort(self.randomness.choice(self.dataset_size, self.batch_size))

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        _, total = _epochs_and_steps(epochs, steps, self.steps_per_epoch)
        return ev.SelfComposed(
            ev.FixedSizeSampled(self.batch_size, self.dataset_size, ev.Gaussian(noise_multiplier)),
            total,
        )

    def sample_spec(self) -> SampleSpec:
        return self._spec(batch_size=self.batch_size, adjacency=ev.Adjacency.REPLACE_ONE.value)


SAMPLER_KINDS: dict[str, type[_BaseSampler]] = {
    "poisson": PoissonSampler,
    "balls_and_bins": BallsAndBinsSampler,
    "shuffle": ShuffleSampler,
    "deterministic": DeterministicSampler,
    "fixed_size": FixedSizeSampler,
}


def make_sampler(
    kind: str,
    dataset_size: int,
    batch_size: int,
    *,
    max_batch_size: int | None = None,
    randomness: Randomness | None = None,
) -> Sampler:
    """Build a sampler from the practitioner's (expected) batch size.

    Args:
      kind: one of ``SAMPLER_KINDS`` (``balls-and-bins`` with a dash is accepted).
      dataset_size: number of examples N.
      batch_size: expected batch size B: Poisson q = B / N; Balls-and-Bins T = round(N / B);
        shuffle / deterministic / fixed_size use batches of exactly B.
      max_batch_size: truncation threshold (Poisson and Balls-and-Bins only).
      randomness: source of randomness (default: a fresh seeded generator).

    Raises:
      ValueError: unknown kind, bad sizes, or a maximum batch size for a fixed-size sampler.
    """
    name = str(kind).replace("-", "_")
    if name not in SAMPLER_KINDS:
        allowed = ", ".join(SAMPLER_KINDS)
        raise ValueError(f"kind must be one of {{{allowed}}}, got kind={kind!r}")
    check_range("dataset_size", dataset_size, 1, None, integer=True)
    check_range("batch_size", batch_size, 1, dataset_size, integer=True)
    if max_batch_size is not None and name not in ("poisson", "balls_and_bins"):
        raise ValueError(
            f"max_batch_size applies to poisson and balls_and_bins batches only, got "
            f"max_batch_size={max_batch_size!r} for kind={kind!r} (its batches are fixed-size)"
        )
    if name == "poisson":
        return PoissonSampler(
            dataset_size,
            batch_size / dataset_size,
            max_batch_size=max_batch_size,
            randomness=randomness,
        )
    if name == "balls_and_bins":
        steps = max(1, round(dataset_size / batch_size))
        return BallsAndBinsSampler(
            dataset_size, steps, max_batch_size=max_batch_size, randomness=randomness
        )
    if name == "fixed_size":
        return FixedSizeSampler(dataset_size, batch_size, randomness=randomness)
    return SAMPLER_KINDS[name](dataset_size, batch_size, randomness=randomness)

"""Balls-and-Bins sampling (Chua et al. 2025): each example in one random batch per epoch.

Event: ``BallsAndBins(z, steps_per_epoch, epochs)``; with a maximum batch size
``TruncatedBallsAndBins`` (the truncation's extra delta is added by the accountants).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_int
from dpfy.randomness import Randomness
from dpfy.sampling.base import BaseSampler
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


def balls_and_bins_sizes(dataset_size: int, steps: int, randomness: Randomness) -> np.ndarray:
    """Batch sizes of one Balls-and-Bins epoch: N balls thrown into T bins (Chua et al. 2025).

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


class BallsAndBinsSampler(BaseSampler):
    """Balls-and-Bins (Chua et al. 2025, Alg. 3): each example in one random batch per epoch.

    Shuffle once per epoch, then cut consecutive batches of sizes
    b_t ~ Binomial(remaining, 1 / (T - t + 1)) (:func:`balls_and_bins_sizes`). Every example
    appears exactly once per epoch; each batch is marginally Binomial(N, 1/T), as Poisson
    sampling with q = 1/T.

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
        check_int("steps_per_epoch", steps_per_epoch)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = self.dataset_size / self.steps_per_epoch

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> BallsAndBinsSampler:
        """T = round(dataset_size / batch_size) batches per epoch (at least 1)."""
        steps = max(1, round(dataset_size / batch_size))
        return cls(dataset_size, steps, max_batch_size=max_batch_size, randomness=randomness)

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.asarray(self.randomness.permutation(self.dataset_size), dtype=np.int64)
        sizes = balls_and_bins_sizes(self.dataset_size, self.steps_per_epoch, self.randomness)
        return order, sizes

    def sample_spec(self) -> SampleSpec:
        return self._spec(steps_per_epoch=self.steps_per_epoch, max_batch_size=self.max_batch_size)


def balls_and_bins_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` Balls-and-Bins epochs (``TruncatedBallsAndBins`` with a maximum batch)."""
    steps = spec.required_int("steps_per_epoch")
    if spec.max_batch_size is not None:
        n = spec.required_int("dataset_size")
        return ev.TruncatedBallsAndBins(
            noise_multiplier, steps, count, n, spec.max_batch_size,
            adjacency=spec.adjacency_value,
        )
    return ev.BallsAndBins(noise_multiplier, steps, count, adjacency=spec.adjacency_value)


BALLS_AND_BINS = register_kind(
    SamplerKind(
        name="balls_and_bins",
        event=balls_and_bins_event,
        needs=("steps_per_epoch",),
        truncates=True,
        epoch_structured=True,
        once_per_epoch=True,
        assumptions="each example is placed in exactly one uniformly random batch per epoch "
        "(Balls-and-Bins, Chua et al. 2025); epsilon is the provable random-allocation PLD "
        "bound (Feldman & Shenfeld 2026) of the dominating pair",
        default_accountant="random_allocation",
        history_methods=("random_allocation",),
        sampler=BallsAndBinsSampler,
        cli=True,
        cli_train=True,
    )
)

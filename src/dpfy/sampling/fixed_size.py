"""Fixed-size sampling: ``batch_size`` distinct examples per step, drawn without replacement.

Event: ``SelfComposed(FixedSizeSampled(B, N, Gaussian(z)), steps)``, replace-one adjacency (the
dataset size is public).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.randomness import Randomness
from dpfy.sampling.base import BaseSampler, _no_truncation
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


class FixedSizeSampler(BaseSampler):
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
        check_int("steps_per_epoch", steps_per_epoch)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = float(self.batch_size)

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> FixedSizeSampler:
        """Batches of exactly ``batch_size``; never truncated."""
        _no_truncation(cls.kind, max_batch_size)
        return cls(dataset_size, batch_size, randomness=randomness)

    def _draw_step(self) -> np.ndarray:
        return np.sort(self.randomness.choice(self.dataset_size, self.batch_size))

    def sample_spec(self) -> SampleSpec:
        return self._spec(batch_size=self.batch_size, adjacency=ev.Adjacency.REPLACE_ONE.value)


def fixed_size_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` fixed-size-sampled Gaussian steps (replace-one, whatever the spec states)."""
    b, n = spec.required_int("batch_size"), spec.required_int("dataset_size")
    return ev.SelfComposed(ev.FixedSizeSampled(b, n, ev.Gaussian(noise_multiplier)), count)


def _batch_within_dataset(spec: SampleSpec) -> None:
    n = spec.required_int("dataset_size")
    check_range("batch_size", spec.required_int("batch_size"), 1, n, integer=True)


FIXED_SIZE = register_kind(
    SamplerKind(
        name="fixed_size",
        event=fixed_size_event,
        needs=("batch_size", "dataset_size"),
        assumptions="fixed-size batches drawn without replacement; replace-one adjacency",
        sampler=FixedSizeSampler,
        check=_batch_within_dataset,
        cli=True,
    )
)

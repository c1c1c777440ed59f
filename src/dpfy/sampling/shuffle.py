"""Shuffle sampling: permute each epoch, cut into fixed-size batches.

Event: ``Shuffled(z, steps_per_epoch, epochs)``. No amplification bound is known; accountants
report the no-amplification upper bound and the lower bound of Chua et al. 2024a, never a
Poisson number.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from dpfy import events as ev
from dpfy.sampling.base import FixedBatchEpochSampler
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


class ShuffleSampler(FixedBatchEpochSampler):
    """Shuffle each epoch, cut into batches of ``batch_size`` (remainder dropped by default).

    Event ``Shuffled``: no amplification bound is known; accountants report the no-amplification
    upper bound and the Chua et al. (2024a) lower bound, never a Poisson number.
    """

    kind: ClassVar[str] = "shuffle"

    def _order(self) -> np.ndarray:
        return np.asarray(self.randomness.permutation(self.dataset_size), dtype=np.int64)


def shuffle_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` shuffled epochs."""
    steps = spec.required_int("steps_per_epoch")
    return ev.Shuffled(noise_multiplier, steps, count, adjacency=spec.adjacency_value)


SHUFFLE = register_kind(
    SamplerKind(
        name="shuffle",
        event=shuffle_event,
        needs=("steps_per_epoch",),
        adjacency=ev.Adjacency.ZERO_OUT.value,
        epoch_structured=True,
        once_per_epoch=True,
        assumptions="data shuffled once per epoch and cut into fixed-size batches. No tight "
        "amplification bound is known for shuffling: the reported epsilon assumes NO "
        "amplification (a valid upper bound); the lower bound of Chua et al. 2024a shows how far "
        "a Poisson number would be from the truth. A Poisson-sampling epsilon is NOT valid for "
        "this run.",
        history_methods=("shuffle",),
        sampler=ShuffleSampler,
        cli=True,
    )
)

"""Deterministic batches: fixed order ``0..N-1`` cut into batches of B, no amplification.

Event: ``Deterministic(z, steps_per_epoch, epochs)`` (each example used once per epoch).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from dpfy import events as ev
from dpfy.sampling.base import FixedBatchEpochSampler
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


class DeterministicSampler(FixedBatchEpochSampler):
    """Fixed order ``0..N-1`` cut into batches of B: no randomness, no amplification."""

    kind: ClassVar[str] = "deterministic"

    def _order(self) -> np.ndarray:
        return np.arange(self.dataset_size, dtype=np.int64)


def deterministic_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` epochs of fixed batches."""
    steps = spec.required_int("steps_per_epoch")
    return ev.Deterministic(noise_multiplier, steps, count, adjacency=spec.adjacency_value)


DETERMINISTIC = register_kind(
    SamplerKind(
        name="deterministic",
        event=deterministic_event,
        needs=("steps_per_epoch",),
        adjacency=ev.Adjacency.ZERO_OUT.value,
        epoch_structured=True,
        once_per_epoch=True,
        cyclic=True,
        assumptions="fixed order and batch size: no amplification by sampling; each example "
        "is used once per epoch",
        history_methods=("shuffle",),
        sampler=DeterministicSampler,
        cli=True,
    )
)

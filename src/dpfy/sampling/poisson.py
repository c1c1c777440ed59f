"""Poisson sampling: each example joins each batch independently with probability q.

Event: ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)``; with a maximum batch size
``TruncatedPoisson`` (the truncation's extra delta is added by the accountants).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.randomness import Randomness
from dpfy.sampling.base import BaseSampler
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


class PoissonSampler(BaseSampler):
    """Poisson sampling: each example joins each batch independently with ``sampling_rate``.

    Args:
      dataset_size: number of examples N.
      sampling_rate: q in (0, 1]; expected batch size q N.
      steps_per_epoch: steps counted as one epoch (default ``round(1 / q)``).
      max_batch_size: truncate larger batches (event becomes ``TruncatedPoisson``).
      randomness: source of randomness (default: the secure generator,
        ``Randomness.secure_mode()``; pass ``Randomness(seed)`` for a reproducible experiment).

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
        check_int("steps_per_epoch", steps_per_epoch)
        self.steps_per_epoch = int(steps_per_epoch)
        self.expected_batch_size = self.sampling_rate * self.dataset_size

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> PoissonSampler:
        """q = batch_size / dataset_size."""
        return cls(
            dataset_size,
            batch_size / dataset_size,
            max_batch_size=max_batch_size,
            randomness=randomness,
        )

    def _draw_step(self) -> np.ndarray:
        return np.flatnonzero(self.randomness.bernoulli(self.sampling_rate, self.dataset_size))

    def sample_spec(self) -> SampleSpec:
        return self._spec(sampling_rate=self.sampling_rate, max_batch_size=self.max_batch_size)


def poisson_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` Poisson-sampled Gaussian steps (``TruncatedPoisson`` with a maximum batch)."""
    q = spec.required_rate()
    if spec.max_batch_size is not None:
        n = spec.required_int("dataset_size")
        return ev.TruncatedPoisson(q, noise_multiplier, count, n, spec.max_batch_size)
    return ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(noise_multiplier)), count)


POISSON = register_kind(
    SamplerKind(
        name="poisson",
        event=poisson_event,
        needs=("sampling_rate",),
        allowed_adjacency=(ev.Adjacency.ADD_OR_REMOVE.value,),
        truncates=True,
        assumptions="each example is included in each step independently with probability q "
        "(Poisson sampling, as the sampler actually ran); the denominator is the expected "
        "batch size",
        default_accountant="pld",
        sampler=PoissonSampler,
        cli=True,
        cli_train=True,
    )
)

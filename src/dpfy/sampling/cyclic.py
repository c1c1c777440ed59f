"""Cyclic batches: one secret permutation, drawn once, cut into fixed-size batches and
repeated every epoch.

Example ``i`` of the permuted order is in batch ``i // B`` of *every* epoch, so with ``p``
batches per epoch it joins steps ``s, s + p, s + 2p, ...``: the participation schema
:class:`dpfy.correlated.schemas.Cyclic` (period ``p``) that a matrix-mechanism run's
sensitivity is computed for (Choquette-Choo et al. 2023; McMahan et al. 2024). With plain
Gaussian noise per step the accounting is that of a fixed order: ``Deterministic(z, p,
epochs)``, no amplification (the permutation is not used to claim any).

The permutation is part of the sampler's state (saved in checkpoints, so a resumed run keeps
the schema even with secure randomness, whose generator state cannot be saved).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from dpfy import events as ev
from dpfy.sampling.base import FixedBatchEpochSampler
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


class CyclicSampler(FixedBatchEpochSampler):
    """One permutation for the whole run, cut into batches of ``batch_size`` every epoch."""

    kind: ClassVar[str] = "cyclic"
    _permutation: np.ndarray | None = None

    def _order(self) -> np.ndarray:
        if self._permutation is None:
            self._permutation = np.asarray(
                self.randomness.permutation(self.dataset_size), dtype=np.int64
            )
        return self._permutation

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._permutation is not None:
            state["permutation"] = self._permutation.copy()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        perm = state.get("permutation")
        self._permutation = None if perm is None else np.asarray(perm, dtype=np.int64)


def cyclic_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` epochs of one repeated order with a Gaussian per step: no amplification."""
    steps = spec.required_int("steps_per_epoch")
    return ev.Deterministic(noise_multiplier, steps, count, adjacency=spec.adjacency_value)


CYCLIC = register_kind(
    SamplerKind(
        name="cyclic",
        event=cyclic_event,
        needs=("steps_per_epoch",),
        adjacency=ev.Adjacency.ZERO_OUT.value,
        epoch_structured=True,
        once_per_epoch=True,
        cyclic=True,
        assumptions="data shuffled once (a secret permutation) and cut into fixed-size "
        "batches, the same batches every epoch: each example is used once per epoch at the "
        "same position (the cyclic participation schema of matrix-factorization DP-FTRL); no "
        "amplification is claimed",
        history_methods=("shuffle",),
        sampler=CyclicSampler,
        cli=True,
        cli_train=True,
    )
)

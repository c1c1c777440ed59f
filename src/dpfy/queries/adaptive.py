"""Adaptive clipping: clip norms that follow a target quantile of the per-example norms.

Andrew, Thakkar, McMahan, Ramaswamy (2021), "Differentially private learning with adaptive
clipping", Alg. 1 with the geometric update. Each release also counts the examples with
``norm <= C`` as the centred sum ``sum_i (1[norm_i <= C] - 1/2)`` (add/remove sensitivity 1/2),
adds N(0, count_noise_std^2), estimates the unclipped fraction
``b = noisy_count / expected_batch_size + 1/2`` and updates
``C <- C exp(-learning_rate (b - target_quantile))``.

The count is a second Gaussian part of the same release, recorded in the ledger with the sum.
The gradient noise is raised so that the parts together have exactly the requested effective
noise multiplier (Andrew et al., Thm. 1; McMahan et al. 2018, Eq. 1).

Both queries are stateful: ``clip_weights`` accumulates the (non-private) count of unclipped
real examples of the current logical step over physical chunks; the release draws the count
noise after the sum's noise, updates the clip norms and resets the accumulator. Weights always
use the clip norms current at the start of the step. ``state_dict``/``load_state_dict``
checkpoint the clip norms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpfy._validate import check_range
from dpfy.queries._tree import (
    Norms,
    check_mask,
    check_partition,
    clip_weights_from_norms,
    flat_norm,
    group_norms,
)
from dpfy.queries.base import LedgerEntry, QueryBase
from dpfy.queries.nested import check_clip_norms
from dpfy.randomness import Randomness

#: Add/remove sensitivity of a centred count ``sum_i (1[norm_i <= C] - 1/2)``.
_COUNT_BOUND = 0.5


def _check_schedule(
    noise_multiplier: float, expected_batch_size: float, target_quantile: float,
    learning_rate: float,
) -> None:
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True)
    check_range(
        "expected_batch_size", expected_batch_size, 0.0, math.inf, low_open=True, high_open=True
    )
    check_range("target_quantile", target_quantile, 0.0, 1.0)
    check_range("learning_rate", learning_rate, 0.0, math.inf, high_open=True)


def _geometric_update(
    clip_norm: float, centred_count: float, expected_batch_size: float, learning_rate: float,
    target_quantile: float,
) -> tuple[float, float]:
    """(new clip norm, unclipped fraction) from one noisy centred count (Andrew et al. 2021)."""
    fraction = centred_count / expected_batch_size + 0.5
    return clip_norm * math.exp(-learning_rate * (fraction - target_quantile)), fraction


class AdaptiveClipQuery(QueryBase):
    """Flat clipping whose clip norm tracks a quantile of the per-example norms.

    One release records (C, z_g C) for the gradient sum and (1/2, count_noise_std) for the
    count, with ``z_g = (z^-2 - (2 count_noise_std)^-2)^(-1/2)``.

    Args:
      initial_clip_norm: C at the first step, > 0.
      noise_multiplier: requested effective z of one release (gradient sum + count).
      expected_batch_size: fixed denominator of the fraction (q N for Poisson), > 0.
      target_quantile: fraction of examples that should be unclipped, in [0, 1].
      learning_rate: eta of the geometric update, >= 0 (0 keeps C fixed).
      count_noise_std: std of the count noise; default ``expected_batch_size / 20`` (the
        paper's recommendation); must exceed ``noise_multiplier / 2``.
      name: ledger label prefix (``f"{name}/sum"``, ``f"{name}/unclipped_count"``).
    """

    groups = None

    def __init__(
        self,
        initial_clip_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        *,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
        count_noise_std: float | None = None,
        name: str = "adaptive",
    ) -> None:
        check_range(
            "initial_clip_norm", initial_clip_norm, 0.0, math.inf, low_open=True, high_open=True
        )
        _check_schedule(noise_multiplier, expected_batch_size, target_quantile, learning_rate)
        if count_noise_std is None:
            count_noise_std = expected_batch_size / 20.0
        check_range(
            "count_noise_std", count_noise_std, noise_multiplier / 2.0, math.inf,
            low_open=True, high_open=True,
        )
        self.clip_norm = float(initial_clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.count_noise_std = float(count_noise_std)
        self.name = name
        self._unclipped = 0.0
        self._count = 0.0
        self.last_unclipped_fraction: float | None = None

    @property
    def gradient_noise_multiplier(self) -> float:
        """z_g: noise std of the gradient sum divided by the current clip norm."""
        inv = self.noise_multiplier**-2 - (2.0 * self.count_noise_std) ** -2
        return float(inv**-0.5)

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """(C, z_g C) for the gradient sum, then (1/2, count_noise_std) for the count."""
        return (
            LedgerEntry(f"{self.name}/sum", self.clip_norm, self.noise_stds()),
            LedgerEntry(f"{self.name}/unclipped_count", _COUNT_BOUND, self.count_noise_std),
        )

    def noise_stds(self) -> float:
        """Noise std of the gradient sum: ``z_g C``."""
        return self.gradient_noise_multiplier * self.clip_norm

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weights ``min(1, C / norm)``; also accumulates this step's unclipped count."""
        flat = flat_norm(norms)
        w = clip_weights_from_norms(flat, self.clip_norm, mask)
        real = torch.ones_like(flat) if mask is None else check_mask(mask, flat)
        real = real * torch.isfinite(flat)
        self._unclipped += float((real * (flat <= self.clip_norm)).sum())
        self._count += float(real.sum())
        return w

    def pending_centred_count(self) -> float:
        """The exact centred count ``sum_i (1[norm_i <= C] - 1/2)`` accumulated this step.

        Diagnostics and tests only: it is not private; the release adds noise to it.
        """
        return self._unclipped - 0.5 * self._count

    def _after_release(self, randomness: Randomness) -> None:
        """Noise the count, update C and reset the accumulator."""
        noisy = self.pending_centred_count() + float(randomness.normal(1, self.count_noise_std)[0])
        self.clip_norm, self.last_unclipped_fraction = _geometric_update(
            self.clip_norm, noisy, self.expected_batch_size, self.learning_rate,
            self.target_quantile,
        )
        self._unclipped = 0.0
        self._count = 0.0

    def state_dict(self) -> dict[str, float]:
        """Checkpoint state (the current clip norm)."""
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        check_range("clip_norm", state["clip_norm"], 0.0, math.inf, low_open=True, high_open=True)
        self.clip_norm = float(state["clip_norm"])
        self._unclipped = 0.0
        self._count = 0.0

    def __repr__(self) -> str:
        return (
            f"AdaptiveClipQuery(clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier}, target_quantile={self.target_quantile})"
        )


class AdaptiveNestedQuery(QueryBase):
    """Per-group clipping where each group's clip norm tracks a quantile of its own norms.

    The per-group version of :class:`AdaptiveClipQuery` (applied to each group of a
    :class:`~dpfy.queries.NestedQuery`). Each release records, on the same sample, one gradient
    sum per group with (C_g, s_g) and one centred unclipped count per group with
    (1/2, count_noise_std). Noise is proportional to the clip norms, ``s_g = z_g sqrt(k) C_g``
    for k groups, with ``z_g = (z^-2 - k (2 count_noise_std)^-2)^(-1/2)``, so that the
    effective noise multiplier of the whole release (McMahan et al. 2018, Eq. 1) is exactly the
    requested ``noise_multiplier`` z.

    Args:
      groups: ``{group: param names}`` (disjoint).
      initial_clip_norms: one C for every group, or ``{group: C_g}``.
      noise_multiplier: requested effective z of one release (all sums and counts).
      expected_batch_size: fixed denominator of the unclipped fractions.
      target_quantile, learning_rate: as in :class:`AdaptiveClipQuery`.
      count_noise_std: std of each count's noise; default ``expected_batch_size / 20``; must
        exceed ``noise_multiplier x sqrt(k) / 2``.
      name: ledger label prefix.
    """

    groups: dict[str, tuple[str, ...]]

    def __init__(
        self,
        groups: Mapping[str, Sequence[str]],
        initial_clip_norms: float | Mapping[str, float],
        noise_multiplier: float,
        expected_batch_size: float,
        *,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
        count_noise_std: float | None = None,
        name: str = "adaptive_nested",
    ) -> None:
        if not groups:
            raise ValueError("groups must not be empty")
        self.groups = {g: (ns,) if isinstance(ns, str) else tuple(ns) for g, ns in groups.items()}
        check_partition(self.groups, [])
        if not isinstance(initial_clip_norms, Mapping):
            initial_clip_norms = dict.fromkeys(self.groups, initial_clip_norms)
        if set(initial_clip_norms) != set(self.groups):
            raise ValueError(
                f"initial_clip_norms must have the keys {sorted(self.groups)}, "
                f"got {sorted(initial_clip_norms)}"
            )
        self.clip_norms = check_clip_norms({g: initial_clip_norms[g] for g in self.groups})
        _check_schedule(noise_multiplier, expected_batch_size, target_quantile, learning_rate)
        k = len(self.groups)
        if count_noise_std is None:
            count_noise_std = expected_batch_size / 20.0
        check_range(
            "count_noise_std", count_noise_std, noise_multiplier * math.sqrt(k) / 2.0, math.inf,
            low_open=True, high_open=True,
        )
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.count_noise_std = float(count_noise_std)
        self.name = name
        self._unclipped = dict.fromkeys(self.groups, 0.0)
        self._count = 0.0
        self.last_unclipped_fractions: dict[str, float] | None = None

    @property
    def gradient_noise_multiplier(self) -> float:
        """z_g: effective noise multiplier of the k gradient sums together."""
        k = len(self.groups)
        return float((self.noise_multiplier**-2 - k * (2.0 * self.count_noise_std) ** -2) ** -0.5)

    def noise_stds(self) -> dict[str, float]:
        """Current noise std per group: ``z_g sqrt(k) C_g``."""
        scale = self.gradient_noise_multiplier * math.sqrt(len(self.groups))
        return {g: scale * c for g, c in self.clip_norms.items()}

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """(C_g, s_g) per group, then (1/2, count_noise_std) per group."""
        stds = self.noise_stds()
        sums = tuple(
            LedgerEntry(f"{self.name}/{g}/sum", self.clip_norms[g], stds[g]) for g in self.groups
        )
        counts = tuple(
            LedgerEntry(f"{self.name}/{g}/unclipped_count", _COUNT_BOUND, self.count_noise_std)
            for g in self.groups
        )
        return sums + counts

    def clip_weights(
        self, norms: Norms, *, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``{group: min(1, C_g / norm_g)}``; also accumulates this step's unclipped counts."""
        gn = group_norms(norms, self.groups)
        first = next(iter(gn.values()))
        real = torch.ones_like(first) if mask is None else check_mask(mask, first)
        for v in gn.values():
            real = real * torch.isfinite(v)
        out = {}
        for g, v in gn.items():
            out[g] = clip_weights_from_norms(v, self.clip_norms[g], mask)
            self._unclipped[g] += float((real * (v <= self.clip_norms[g])).sum())
        self._count += float(real.sum())
        return out

    def pending_centred_counts(self) -> dict[str, float]:
        """Exact centred counts of this step (diagnostics and tests only; not private)."""
        return {g: u - 0.5 * self._count for g, u in self._unclipped.items()}

    def _after_release(self, randomness: Randomness) -> None:
        """Noise the k counts, update every C_g and reset the accumulators."""
        centred = self.pending_centred_counts()
        noise = randomness.normal(len(self.groups), self.count_noise_std)
        fractions = {}
        for (g, c), e in zip(centred.items(), noise, strict=True):
            self.clip_norms[g], fractions[g] = _geometric_update(
                self.clip_norms[g], c + float(e), self.expected_batch_size, self.learning_rate,
                self.target_quantile,
            )
        self.last_unclipped_fractions = fractions
        self._unclipped = dict.fromkeys(self.groups, 0.0)
        self._count = 0.0

    def state_dict(self) -> dict[str, dict[str, float]]:
        """Checkpoint state (the current clip norms)."""
        return {"clip_norms": dict(self.clip_norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        norms = state["clip_norms"]
        if set(norms) != set(self.groups):
            raise ValueError(f"clip_norms must have the keys {sorted(self.groups)}")
        self.clip_norms = check_clip_norms({g: norms[g] for g in self.groups})
        self._unclipped = dict.fromkeys(self.groups, 0.0)
        self._count = 0.0

    def __repr__(self) -> str:
        return (
            f"AdaptiveNestedQuery(clip_norms={self.clip_norms}, "
            f"noise_multiplier={self.noise_multiplier}, target_quantile={self.target_quantile})"
        )

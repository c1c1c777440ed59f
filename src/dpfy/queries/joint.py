"""Joint clipping with per-group scale parameters (McMahan et al. 2018, Sec. 2).

Each example's groups are rescaled ``x_g / gamma_g``, clipped *jointly* to C, summed, noised
with N(0, (z C)^2) per coordinate and scaled back by ``gamma_g``. Equivalently the raw
contribution gets one weight ``min(1, C / sqrt(sum_g |x_g|^2 / gamma_g^2))`` and group g gets
noise std ``gamma_g z C``. The release is a post-processed Gaussian sum with privacy tuple
(C, z C): one ledger entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from dpfy._validate import check_range
from dpfy.queries._tree import Norms, check_partition, clip_weights_from_norms, group_norms
from dpfy.queries.base import LedgerEntry, QueryBase


class JointClipQuery(QueryBase):
    """Joint clipping of all groups to one ``clip_norm`` in units of per-group scales.

    Args:
      groups: ``{group: param names}`` (disjoint; together all released parameters).
      scales: ``{group: gamma_g > 0}``, e.g. a typical norm bound of the group.
      clip_norm: C > 0, the joint bound in scaled units (sqrt(#groups) if every group obeys
        ``|x_g| <= gamma_g``).
      noise_multiplier: z > 0.
      name: label written to the ledger.
    """

    groups: dict[str, tuple[str, ...]]

    def __init__(
        self,
        groups: Mapping[str, Sequence[str]],
        scales: Mapping[str, float],
        clip_norm: float,
        noise_multiplier: float,
        *,
        name: str = "joint",
    ) -> None:
        if not groups:
            raise ValueError("groups must not be empty")
        if set(scales) != set(groups):
            raise ValueError(f"scales must have the keys {sorted(groups)}, got {sorted(scales)}")
        for g, gamma in scales.items():
            check_range(f"scales[{g!r}]", gamma, 0.0, math.inf, low_open=True, high_open=True)
        check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        self.groups = {g: (ns,) if isinstance(ns, str) else tuple(ns) for g, ns in groups.items()}
        check_partition(self.groups, [])
        self.scales = {g: float(scales[g]) for g in self.groups}
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.name = name

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """One part: (C, z C) in scaled units."""
        return (LedgerEntry(self.name, self.clip_norm, self.noise_multiplier * self.clip_norm),)

    def noise_stds(self) -> dict[str, float]:
        """Noise std per group in the raw (unscaled) units: ``gamma_g z C``."""
        std = self.noise_multiplier * self.clip_norm
        return {g: gamma * std for g, gamma in self.scales.items()}

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One weight per example from per-group raw norms: ``min(1, C / joint_norm)``."""
        gn = group_norms(norms, self.groups)
        joint = torch.stack([gn[g] / self.scales[g] for g in self.groups]).pow(2).sum(0).sqrt()
        return clip_weights_from_norms(joint, self.clip_norm, mask)

    def __repr__(self) -> str:
        return (
            f"JointClipQuery(scales={self.scales}, clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier})"
        )

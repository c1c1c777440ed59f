"""Separate clipping per parameter group, and how to allocate clip norms and noise to groups.

McMahan, Ramage, Talwar, Zhang (2018), "Learning differentially private recurrent language
models": :class:`NestedQuery` clips each group j (e.g. each layer) to its own C_j and adds its
own noise std s_j (Sec. 2, "separate clipping"); one release is k Gaussian parts on the same
sample with effective noise multiplier ``(sum_j C_j^2 / s_j^2)^(-1/2)`` (Sec. 3, Eq. 1). The
allocation helpers (Sec. 4) pick the s_j for a target effective multiplier
(:func:`proportional_noise`, :func:`dimension_adjusted_noise`) and split one clip norm over the
groups (:func:`split_clip_norm`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from dpfy._validate import check_int, check_range
from dpfy.queries._tree import Norms, check_partition, clip_weights_from_norms, group_norms
from dpfy.queries.base import LedgerEntry, QueryBase


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """One parameter group of a :class:`NestedQuery` (McMahan Sec. 2, separate clipping).

    Attributes:
      params: names of the parameters in the group (flattened with '.').
      clip_norm: C_j > 0, bound on the group's per-example L2 norm (= its sensitivity).
      noise_std: s_j > 0, std of the noise on each coordinate of the group's sum.
    """

    params: tuple[str, ...]
    clip_norm: float
    noise_std: float

    def __post_init__(self) -> None:
        params = (self.params,) if isinstance(self.params, str) else tuple(self.params)
        if not params:
            raise ValueError("params must name at least one parameter, got params=()")
        check_range("clip_norm", self.clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_range("noise_std", self.noise_std, 0.0, math.inf, low_open=True, high_open=True)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "clip_norm", float(self.clip_norm))
        object.__setattr__(self, "noise_std", float(self.noise_std))


class NestedQuery(QueryBase):
    """One Gaussian sum query per parameter group, each with its own (C_j, s_j).

    Each group is clipped separately to C_j and gets noise std s_j; one release records one
    sum-query entry per group on the same sample, which the ledger folds into one Gaussian with
    ``z = (sum_j C_j^2 / s_j^2)^(-1/2)`` (McMahan et al. 2018, Sec. 3, Eq. 1). Per-layer
    clipping is one group per layer.

    Args:
      groups: ``{group name: Group(params, clip_norm, noise_std)}``; groups must be disjoint.
      name: ledger label prefix (entries are named ``f"{name}/{group}"``).

    Example:
      >>> q = NestedQuery.from_noise_multiplier(
      ...     {"fc1": ["fc1.weight", "fc1.bias"], "fc2": ["fc2.weight"]},
      ...     clip_norms={"fc1": 1.0, "fc2": 0.5}, noise_multiplier=1.0)
      >>> round(q.noise_multiplier, 12)
      1.0
    """

    groups: dict[str, tuple[str, ...]]

    def __init__(self, groups: Mapping[str, Group], *, name: str = "nested") -> None:
        if not groups:
            raise ValueError("groups must not be empty")
        for g, spec in groups.items():
            if not isinstance(spec, Group):
                raise ValueError(f"groups[{g!r}] must be a dpfy.queries.Group, got {spec!r}")
        self.specs = dict(groups)
        self.groups = {g: s.params for g, s in self.specs.items()}
        check_partition(self.groups, [])
        self.name = name

    @classmethod
    def from_noise_multiplier(
        cls,
        groups: Mapping[str, Sequence[str]],
        clip_norms: Mapping[str, float],
        noise_multiplier: float,
        *,
        allocation: Literal["proportional", "dimension"] = "proportional",
        dims: Mapping[str, int] | None = None,
        name: str = "nested",
    ) -> NestedQuery:
        """Build groups whose noise stds meet an effective ``noise_multiplier`` exactly.

        Args:
          groups: ``{group: param names}``.
          clip_norms: ``{group: C_j}``.
          noise_multiplier: target effective z of one release.
          allocation: ``"proportional"`` (:func:`proportional_noise`) or ``"dimension"``
            (:func:`dimension_adjusted_noise`, needs ``dims``).
          dims: ``{group: number of coordinates}``.
        """
        if allocation == "proportional":
            stds = proportional_noise(clip_norms, noise_multiplier)
        elif allocation == "dimension":
            if dims is None:
                raise ValueError("allocation='dimension' needs dims")
            stds = dimension_adjusted_noise(clip_norms, dims, noise_multiplier)
        else:
            raise ValueError(
                "allocation must be one of {proportional, dimension}, "
                f"got allocation={allocation!r}"
            )
        if set(groups) != set(clip_norms):
            raise ValueError(
                f"clip_norms must have the groups' keys {sorted(groups)}, got {sorted(clip_norms)}"
            )
        return cls(
            {g: Group(tuple(ns), clip_norms[g], stds[g]) for g, ns in groups.items()}, name=name
        )

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """One part per group: ``f"{name}/{group}"`` with (C_j, s_j)."""
        return tuple(
            LedgerEntry(f"{self.name}/{g}", s.clip_norm, s.noise_std)
            for g, s in self.specs.items()
        )

    def noise_stds(self) -> dict[str, float]:
        """``{group: s_j}``."""
        return {g: s.noise_std for g, s in self.specs.items()}

    def clip_weights(
        self, norms: Norms, *, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``{group: min(1, C_j / norm_j)}`` from per-group norms keyed like ``groups``."""
        gn = group_norms(norms, self.groups)
        return {
            g: clip_weights_from_norms(gn[g], self.specs[g].clip_norm, mask) for g in self.groups
        }

    def __repr__(self) -> str:
        return f"NestedQuery({self.specs!r})"


# --------------------------------------------------------------------------------------------
# Noise and clip allocation (McMahan et al. 2018, Sec. 2 and 4)
# --------------------------------------------------------------------------------------------


def proportional_noise(
    clip_norms: Mapping[str, float], noise_multiplier: float
) -> dict[str, float]:
    """Noise stds proportional to the clip norms with effective multiplier ``noise_multiplier``.

    ``s_j = z sqrt(k) C_j`` for k groups, so that s_j / C_j is the same for every group and
    ``(sum_j C_j^2 / s_j^2)^(-1/2) = z`` (McMahan et al. 2018, Sec. 4, "proportional noise").
    """
    clips = check_clip_norms(clip_norms)
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True)
    k = len(clips)
    return {g: noise_multiplier * math.sqrt(k) * c for g, c in clips.items()}


def dimension_adjusted_noise(
    clip_norms: Mapping[str, float], dims: Mapping[str, int], noise_multiplier: float
) -> dict[str, float]:
    """Noise stds proportional to each group's maximal per-coordinate RMS ``C_j / sqrt(d_j)``.

    ``s_j = z C_j sqrt(d / d_j)`` with ``d = sum_j d_j``, so that
    ``(sum_j C_j^2 / s_j^2)^(-1/2) = z`` (McMahan et al. 2018, Sec. 4, "dimensionality adjusted").
    """
    clips = check_clip_norms(clip_norms)
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True)
    if set(dims) != set(clips):
        raise ValueError(f"dims must have the keys {sorted(clips)}, got {sorted(dims)}")
    for g, d in dims.items():
        check_int(f"dims[{g!r}]", d)
    total = float(sum(dims.values()))
    return {g: noise_multiplier * c * math.sqrt(total / dims[g]) for g, c in clips.items()}


def split_clip_norm(
    clip_norm: float, dims: Mapping[str, int], *, how: Literal["equal", "dimension"] = "equal"
) -> dict[str, float]:
    """Split a total clip norm C over groups so that ``sum_j C_j^2 = C^2``.

    ``how="equal"``: ``C_j = C / sqrt(k)`` (per-layer clipping of McMahan et al. 2018);
    ``how="dimension"``: ``C_j = C sqrt(d_j / d)`` (McMahan Sec. 2).
    """
    check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
    if not dims:
        raise ValueError("dims must not be empty")
    for g, d in dims.items():
        check_int(f"dims[{g!r}]", d)
    if how == "equal":
        return {g: clip_norm / math.sqrt(len(dims)) for g in dims}
    if how == "dimension":
        total = float(sum(dims.values()))
        return {g: clip_norm * math.sqrt(d / total) for g, d in dims.items()}
    raise ValueError(f"how must be one of {{equal, dimension}}, got how={how!r}")


def prefix_groups(
    names: Sequence[str], prefixes: Sequence[str], *, rest: str = "rest"
) -> dict[str, tuple[str, ...]]:
    """Parameter names grouped by the first of ``prefixes`` they start with.

    Group ``p.rstrip(".")`` holds the names starting with prefix ``p``; the names matching no
    prefix form the group ``rest`` (left out when empty).

    Raises:
      ValueError: no prefixes, a repeated prefix, or a prefix that matches no name (a typo
        would otherwise silently clip everything jointly).
    """
    if not prefixes:
        raise ValueError("clip_groups must name at least one parameter-name prefix, got ()")
    keys = {p: p.rstrip(".") or p for p in prefixes}  # prefix -> group name
    if len(set(keys.values())) != len(prefixes):
        raise ValueError(f"clip_groups must not repeat a prefix, got {list(prefixes)}")
    groups: dict[str, list[str]] = {g: [] for g in keys.values()}
    if rest in groups:
        raise ValueError(f"clip_groups must not use the group name {rest!r}, got {list(prefixes)}")
    others: list[str] = []
    for n in names:
        match = next((p for p in prefixes if n.startswith(p)), None)
        (others if match is None else groups[keys[match]]).append(n)
    empty = [p for p in prefixes if not groups[keys[p]]]
    if empty:
        raise ValueError(
            f"clip_groups must be prefixes of trainable parameter names, got {empty} matching "
            f"none of {len(names)} (e.g. {list(names)[:3]})"
        )
    out = {g: tuple(v) for g, v in groups.items()}
    if others:
        out[rest] = tuple(others)
    return out


def separate_clipping(
    names: Sequence[str],
    prefixes: Sequence[str],
    clip_norm: float,
    noise_multiplier: float,
    *,
    name: str = "gradient",
) -> NestedQuery:
    """Separate clipping of the :func:`prefix_groups` at the privacy cost of one clip norm.

    The k groups get ``C_j = C / sqrt(k)`` (:func:`split_clip_norm`) and proportional noise
    ``s_j = z sqrt(k) C_j = z C``: every coordinate gets the noise of joint clipping to C, the
    per-example sensitivity stays ``sqrt(sum_j C_j^2) = C``, and the effective noise multiplier
    of a release is exactly ``z`` (McMahan et al. 2018, Sec. 2 and 4), so the privacy event is
    that of joint clipping. What changes is the geometry: a group with small gradients (a
    classification head beside a whole encoder) is no longer scaled down by the others' norm.
    """
    groups = prefix_groups(names, prefixes)
    clips = split_clip_norm(clip_norm, {g: 1 for g in groups})
    return NestedQuery.from_noise_multiplier(groups, clips, noise_multiplier, name=name)


def check_clip_norms(clip_norms: Mapping[str, float]) -> dict[str, float]:
    """``{group: float(C_j)}``, refusing an empty mapping or a C_j outside (0, inf)."""
    if not clip_norms:
        raise ValueError("clip_norms must not be empty")
    for g, c in clip_norms.items():
        check_range(f"clip_norms[{g!r}]", c, 0.0, math.inf, low_open=True, high_open=True)
    return {g: float(c) for g, c in clip_norms.items()}

"""Tensor trees and per-example norms: the pure helpers every query shares.

A *tree* maps names to tensors, possibly through nested dicts (``{"layer": {"w": t}}``); its
flat form joins the keys with ``"."`` (``{"layer.w": t}``). Per-example tensors carry the batch
on dimension 0. Norms and clip weights are float64 (``Tensor[B]``). Clipping is
``w = min(1, C / norm)``; a non-finite norm gets weight 0 (McMahan et al. 2018, Sec. 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import torch

Tensors: TypeAlias = Mapping[str, Any]  # name -> torch.Tensor, possibly nested dicts of them
Norms: TypeAlias = torch.Tensor | Mapping[str, torch.Tensor]
Weights: TypeAlias = torch.Tensor | dict[str, torch.Tensor]


def flatten(tree: Tensors, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` of a tree (keys joined with ``"."``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):  # before the (slower) abstract Mapping check
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            raise ValueError(f"{name} must be a torch.Tensor or a dict of them, got {value!r}")
    return out


def unflatten_like(
    flat: Mapping[str, torch.Tensor], tree: Tensors, prefix: str = ""
) -> dict[str, Any]:
    """The tensors of ``flat`` arranged in the (nested) structure of ``tree``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        nested = not isinstance(value, torch.Tensor) and isinstance(value, Mapping)
        out[key] = unflatten_like(flat, value, name + ".") if nested else flat[name]
    return out


def per_example_norms(
    per_example: Tensors, groups: Mapping[str, Sequence[str]] | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """L2 norm of each example's contribution (float64), flat or per group.

    Args:
      per_example: name -> tensor with leading batch dim B.
      groups: ``None`` for one norm over all tensors, else ``{group: names}``.

    Returns:
      ``Tensor[B]`` (flat) or ``{group: Tensor[B]}``.
    """
    flat = flatten(per_example)
    sq = {n: t.detach().flatten(1).to(torch.float64).pow(2).sum(1) for n, t in flat.items()}
    if groups is None:
        return torch.stack(list(sq.values())).sum(0).sqrt()
    check_partition(groups, flat.keys())
    return {g: torch.stack([sq[n] for n in names]).sum(0).sqrt() for g, names in groups.items()}


def clip_weights_from_norms(
    norms: torch.Tensor, clip_norm: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``min(1, clip_norm / norm)`` per example (float64); 0 for padding or non-finite norms.

    A negative norm is refused on the CPU; on another device that check would need a host
    synchronisation, so the example's weight is 0 instead (docs/devices.md).
    """
    norms = torch.as_tensor(norms).to(torch.float64)
    if norms.device.type == "cpu" and bool((norms < 0).any()):
        raise ValueError(f"norms must be in [0, inf], got a norm of {float(norms.min())!r}")
    # C / norm, capped at 1: norm 0 gives inf -> 1, norm inf gives 0, NaN stays NaN -> 0
    # (a negative norm, off the CPU, gives a negative weight: clamped to 0)
    w = torch.nan_to_num_((clip_norm / norms).clamp_(0.0, 1.0), nan=0.0)
    return w if mask is None else w * check_mask(mask, w)


def expand_weights(
    weights: Weights, groups: Mapping[str, Sequence[str]] | None, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Map ``clip_weights`` output to one ``Tensor[B]`` per parameter name."""
    if isinstance(weights, torch.Tensor):
        return dict.fromkeys(names, weights)
    if groups is None:
        raise ValueError("per-group weights need the query's groups")
    owner = {n: g for g, ns in groups.items() for n in ns}
    missing = [n for n in names if n not in owner]
    if missing:
        raise ValueError(f"parameters {missing} belong to no group of the query")
    return {n: weights[owner[n]] for n in names}


def check_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as float64 on ``like``'s device, checked to be in [0, 1] with ``like``'s shape.

    Off the CPU the range check would need a host synchronisation: values are clamped into
    [0, 1] there instead (NaN to 0), which can only lower an example's weight (docs/devices.md).
    """
    m = torch.as_tensor(mask, device=like.device).to(torch.float64)
    if m.shape != like.shape:
        raise ValueError(f"mask must have shape {tuple(like.shape)}, got {tuple(m.shape)}")
    if m.device.type != "cpu":
        return torch.nan_to_num(m, nan=0.0).clamp_(0.0, 1.0)
    if not bool(((m >= 0) & (m <= 1)).all()):
        # A weight above 1 would scale an example past the clip norm (more sensitivity).
        bad = m[~((m >= 0) & (m <= 1))][0].item()
        raise ValueError(f"mask must be in [0, 1], got mask value {bad!r}")
    return m


def check_partition(groups: Mapping[str, Sequence[str]], names: Iterable[str]) -> None:
    """Refuse overlapping groups, and any of ``names`` that belongs to no group."""
    seen: dict[str, str] = {}
    for g, ns in groups.items():
        for n in ns:
            if n in seen:
                raise ValueError(f"parameter {n!r} is in groups {seen[n]!r} and {g!r}")
            seen[n] = g
    missing = [n for n in names if n not in seen]
    if missing:
        raise ValueError(f"parameters {missing} belong to no group; every parameter needs one")


def flat_norm(norms: Norms) -> torch.Tensor:
    """One float64 norm per example from a flat norm or from partial norms (root sum square)."""
    if isinstance(norms, torch.Tensor):
        return norms.to(torch.float64)
    parts = [torch.as_tensor(v).to(torch.float64) for v in norms.values()]
    if not parts:
        raise ValueError("norms must not be empty")
    return torch.stack(parts).pow(2).sum(0).sqrt()


def group_norms(norms: Norms, groups: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """``{group: float64 norms}``, refusing norms not keyed exactly by the groups."""
    if not isinstance(norms, Mapping) or set(norms) != set(groups):
        got = sorted(norms) if isinstance(norms, Mapping) else type(norms).__name__
        raise ValueError(f"norms must be a dict keyed by the groups {sorted(groups)}, got {got}")
    return {g: torch.as_tensor(norms[g]).to(torch.float64) for g in groups}


def weighted_sum(
    per_example: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``sum_b weights[n][b] x per_example[n][b]`` per name; weight-0 rows add exactly 0."""
    out = {}
    for n, x in per_example.items():
        w = weights[n]
        if w.shape != x.shape[:1]:
            raise ValueError(
                f"{n} has batch size {x.shape[0]} but the weights have shape {tuple(w.shape)}"
            )
        wx = w.to(device=x.device, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1))) * x
        # Zero-weight rows (padding, non-finite norms) contribute exactly 0, even if NaN.
        keep = (w > 0).to(x.device).reshape(-1, *([1] * (x.dim() - 1)))
        out[n] = torch.where(keep, wx, torch.zeros_like(wx)).sum(0)
    return out

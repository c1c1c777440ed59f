"""DP queries: clip per-example contributions, sum them, add Gaussian noise, record the release.

A query turns per-example contributions (gradients, or any vectors) into one noisy aggregate and
appends the facts of that release to a :class:`dpfy.ledger.Ledger` *before* returning it
(write-ahead). The family (McMahan et al. 2018; Andrew et al. 2021):

* :class:`GaussianSumQuery` - flat clipping of all tensors as one vector to ``clip_norm`` and
  N(0, (noise_multiplier x clip_norm)^2) noise per coordinate.
* :class:`AverageQuery` / :func:`gaussian_average_query` - a sum query divided by a *fixed*
  denominator (the expected batch size; never the realised size of a Poisson batch).
* :class:`NestedQuery` - one query per parameter group (per-layer or any grouping), each with
  its own clip norm C_j and noise std s_j (McMahan Sec. 2, "separate clipping"); the sample's
  effective noise multiplier is ``(sum_j C_j^2 / s_j^2)^(-1/2)`` (Sec. 3, Eq. 1).
* :class:`JointClipQuery` - joint clipping with per-group scale parameters gamma_g (McMahan
  Sec. 2): clip ``(x_g / gamma_g)_g`` jointly to C, noise std ``gamma_g x z x C`` on group g.
* :class:`AdaptiveClipQuery` - flat clipping whose clip norm follows a target quantile of the
  per-example norms (Andrew et al. 2021); the noisy count of unclipped examples is a second
  Gaussian release on the same sample, recorded in the ledger, and the gradient noise is raised
  so that the two together have exactly the requested effective noise multiplier.
* :class:`AdaptiveNestedQuery` - per-group (e.g. per-layer) clipping, each group's clip norm
  following the target quantile of that group's norms, with its own noisy count.
* :class:`NoPrivacyQuery` - clip (optionally) and sum without noise, for debugging; it records a
  non-private entry, so the ledger reports epsilon = infinity.
* Noise allocation (McMahan Sec. 4): :func:`proportional_noise`, :func:`dimension_adjusted_noise`
  and clip splitting :func:`split_clip_norm`.

Adjacency: add_or_remove of one unit of privacy (one row of the per-example batch); the recorded
sensitivity is the L2 change of the released sum when one row is added or removed.

Every query offers two paths with identical privacy:

(a) materialised per-example tensors::

      noisy = query.release(per_example, ledger=ledger, sample_id=sid, randomness=rng)

    where ``per_example`` maps parameter names to tensors with a leading batch dimension
    (nested dicts allowed; the output has the input's structure). ``release`` is
    ``add_noise(clip_and_sum(per_example))``.

(b) the fast path of the trainer (norms -> clip weights -> weighted sum -> noise -> ledger)::

      w = query.clip_weights(norms, mask=valid)       # per physical chunk
      clipped_sum = sum_b w[b] * grad_b               # the trainer's weighted contraction
      noisy = query.add_noise(clipped_sum, ledger=ledger, sample_id=sid, randomness=rng)

    ``query.groups`` says which per-example norms ``clip_weights`` needs: ``None`` means one
    flat norm (a ``Tensor[B]``, or a dict of partial norms over any partition of the
    parameters, combined as sqrt(sum of squares)); a dict ``{group: (param names...)}`` means
    one norm per group, keyed by group. ``clip_weights`` returns a ``Tensor[B]`` applying to
    every parameter, or (``NestedQuery``) a dict ``{group: Tensor[B]}``; see
    :func:`expand_weights`. ``mask`` (1 = real example, 0 = padding row) zeroes padding rows.
    ``add_noise`` must receive *every* parameter that is released (noise goes on parameters
    with zero gradient too), exactly once per logical step. With ``out=`` (a tree of tensors
    shaped like the sum) the noisy values are written there instead of into new tensors, so
    a training loop can reuse its gradient buffers step after step. With ``scale=s`` the
    caller passes ``s x`` the clipped sum (e.g. 1 / expected batch size folded into the clip
    weights) and gets ``s x (sum + noise)``: the same release, post-processed, without a
    separate pass over the result. The ledger records the unscaled sensitivity and noise.

Clipping is ``w = min(1, C / norm)`` computed in float64; a non-finite norm gets weight 0. The
sensitivity holds up to floating-point rounding of the caller's norms.

Example:
    >>> import torch
    >>> from dpfy.ledger import Ledger, SampleSpec
    >>> from dpfy.queries import GaussianSumQuery
    >>> from dpfy.randomness import Randomness
    >>> ledger, rng = Ledger(), Randomness(seed=0)
    >>> sid = ledger.record_sample(SampleSpec("poisson", sampling_rate=0.01))
    >>> query = GaussianSumQuery(clip_norm=1.0, noise_multiplier=1.1)
    >>> grads = {"w": torch.randn(8, 3, 2), "b": torch.randn(8, 2)}
    >>> noisy = query.release(grads, ledger=ledger, sample_id=sid, randomness=rng)
    >>> sorted(noisy), tuple(noisy["w"].shape)
    (['b', 'w'], (3, 2))
    >>> ledger.noise_multipliers()
    {0: 1.1}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from dpfy._validate import check_range
from dpfy.ledger import Ledger, effective_noise_multiplier
from dpfy.randomness import Randomness

__all__ = [
    "Query",
    "GaussianSumQuery",
    "AverageQuery",
    "gaussian_average_query",
    "Group",
    "NestedQuery",
    "JointClipQuery",
    "AdaptiveClipQuery",
    "AdaptiveNestedQuery",
    "NoPrivacyQuery",
    "proportional_noise",
    "dimension_adjusted_noise",
    "split_clip_norm",
    "clip_weights_from_norms",
    "per_example_norms",
    "expand_weights",
    "effective_noise_multiplier",
]

Tensors = Mapping[str, Any]  # name -> torch.Tensor, possibly nested dicts of them
Norms = torch.Tensor | Mapping[str, torch.Tensor]
Weights = torch.Tensor | dict[str, torch.Tensor]


class Query(Protocol):
    """What every query provides (see the module docstring for the two paths).

    Attributes:
      groups: ``None`` (one flat norm) or ``{group: (param names...)}`` (one norm per group).
    """

    groups: dict[str, tuple[str, ...]] | None

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> Weights: ...

    def clip_and_sum(
        self, per_example: Tensors, *, mask: torch.Tensor | None = None
    ) -> dict[str, Any]: ...

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict[str, Any]: ...

    def release(
        self,
        per_example: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        mask: torch.Tensor | None = None,
    ) -> dict[str, Any]: ...

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]: ...


# --------------------------------------------------------------------------------------------
# Tensor-tree helpers
# --------------------------------------------------------------------------------------------


def _flatten(tree: Tensors, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):  # before the (slower) abstract Mapping check
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            raise ValueError(f"{name} must be a torch.Tensor or a dict of them, got {value!r}")
    return out


def _unflatten_like(flat: Mapping[str, torch.Tensor], tree: Tensors, prefix: str = "") -> dict:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        nested = not isinstance(value, torch.Tensor) and isinstance(value, Mapping)
        out[key] = _unflatten_like(flat, value, name + ".") if nested else flat[name]
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
    flat = _flatten(per_example)
    sq = {n: t.detach().flatten(1).to(torch.float64).pow(2).sum(1) for n, t in flat.items()}
    if groups is None:
        return torch.stack(list(sq.values())).sum(0).sqrt()
    _check_partition(groups, flat.keys())
    return {g: torch.stack([sq[n] for n in names]).sum(0).sqrt() for g, names in groups.items()}


def clip_weights_from_norms(
    norms: torch.Tensor, clip_norm: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``min(1, clip_norm / norm)`` per example (float64); 0 for padding or non-finite norms."""
    norms = torch.as_tensor(norms).to(torch.float64)
    if bool((norms < 0).any()):
        raise ValueError(f"norms must be in [0, inf], got a norm of {float(norms.min())!r}")
    # C / norm, capped at 1: norm 0 gives inf -> 1, norm inf gives 0, NaN stays NaN -> 0
    w = torch.nan_to_num_((clip_norm / norms).clamp_(max=1.0), nan=0.0)
    return w if mask is None else w * _mask(mask, w)


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


def _mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    m = torch.as_tensor(mask, device=like.device).to(torch.float64)
    if m.shape != like.shape:
        raise ValueError(f"mask must have shape {tuple(like.shape)}, got {tuple(m.shape)}")
    if not bool(((m >= 0) & (m <= 1)).all()):
        # A weight above 1 would scale an example past the clip norm (more sensitivity).
        bad = m[~((m >= 0) & (m <= 1))][0].item()
        raise ValueError(f"mask must be in [0, 1], got mask value {bad!r}")
    return m


def _check_partition(groups: Mapping[str, Sequence[str]], names: Any) -> None:
    names = list(names)
    seen: dict[str, str] = {}
    for g, ns in groups.items():
        for n in ns:
            if n in seen:
                raise ValueError(f"parameter {n!r} is in groups {seen[n]!r} and {g!r}")
            seen[n] = g
    missing = [n for n in names if n not in seen]
    if missing:
        raise ValueError(f"parameters {missing} belong to no group; every parameter needs one")


def _flat_norm(norms: Norms) -> torch.Tensor:
    if isinstance(norms, torch.Tensor):
        return norms.to(torch.float64)
    parts = [torch.as_tensor(v).to(torch.float64) for v in norms.values()]
    if not parts:
        raise ValueError("norms must not be empty")
    return torch.stack(parts).pow(2).sum(0).sqrt()


def _group_norms(norms: Norms, groups: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    if not isinstance(norms, Mapping) or set(norms) != set(groups):
        got = sorted(norms) if isinstance(norms, Mapping) else type(norms).__name__
        raise ValueError(f"norms must be a dict keyed by the groups {sorted(groups)}, got {got}")
    return {g: torch.as_tensor(norms[g]).to(torch.float64) for g in groups}


def _weighted_sum(per_example: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict:
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


def _noisy(
    clipped_sum: Tensors,
    stds: Mapping[str, float],
    randomness: Randomness,
    out: Tensors | None = None,
    scale: float = 1.0,
) -> dict[str, Any]:
    """``clipped_sum + N(0, (scale std)^2)`` per tensor, written to ``out`` or new tensors.

    ``clipped_sum`` is the clipped sum already multiplied by ``scale`` (see the module
    docstring). All noise of one release is drawn in a single call (see
    :meth:`Randomness.normal_`).
    """
    if scale != 1.0:
        stds = {n: scale * sd for n, sd in stds.items()}
    flat = _flatten(clipped_sum)
    if out is None:
        fmt = torch.contiguous_format
        dst = {n: torch.empty_like(t, memory_format=fmt) for n, t in flat.items()}
    else:
        dst = _flatten(out)
        for n, t in flat.items():
            o = dst.get(n)
            if o is None or o.shape != t.shape or o.dtype != t.dtype:
                got = None if o is None else (tuple(o.shape), o.dtype)
                raise ValueError(
                    f"out[{n!r}] must match the clipped sum ({tuple(t.shape)}, {t.dtype}), "
                    f"got {got}"
                )
    noisy = [n for n in flat if stds[n] != 0.0]
    randomness.normal_(
        [dst[n] for n in noisy], [stds[n] for n in noisy], add=[flat[n] for n in noisy]
    )
    for n, t in flat.items():
        if stds[n] == 0.0:
            dst[n].copy_(t)
    return _unflatten_like(dst, clipped_sum)


def _check_release_args(ledger: Any, randomness: Any, scale: float = 1.0) -> None:
    """Checked before the ledger entry is written: a refused release records nothing."""
    if scale != 1.0 and not 0.0 < scale < math.inf:
        check_range("scale", scale, 0.0, math.inf, low_open=True, high_open=True)  # raises
    if not isinstance(ledger, Ledger):
        raise ValueError(f"ledger must be a dpfy.ledger.Ledger, got ledger={ledger!r}")
    if not isinstance(randomness, Randomness):
        raise ValueError(
            f"randomness must be a dpfy.randomness.Randomness, got randomness={randomness!r}"
        )


# --------------------------------------------------------------------------------------------
# Flat Gaussian sum and average
# --------------------------------------------------------------------------------------------


class _Releases:
    """What every query shares: clip and sum by ``clip_weights``, and the one-call release."""

    groups: dict[str, tuple[str, ...]] | None

    def clip_and_sum(self, per_example: Tensors, *, mask: torch.Tensor | None = None) -> dict:
        """Clip each example (leading batch dim) by ``clip_weights`` and sum; no noise.

        Flat queries clip one norm per example, grouped queries one norm per group.
        """
        flat = _flatten(per_example)
        w = self.clip_weights(per_example_norms(flat, self.groups), mask=mask)
        summed = _weighted_sum(flat, expand_weights(w, self.groups, list(flat)))
        return _unflatten_like(summed, per_example)

    def release(
        self,
        per_example: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        mask: torch.Tensor | None = None,
    ) -> dict:
        """``add_noise(clip_and_sum(per_example))`` (the ledger entry is written first)."""
        clipped = self.clip_and_sum(per_example, mask=mask)
        return self.add_noise(clipped, ledger=ledger, sample_id=sample_id, randomness=randomness)


class GaussianSumQuery(_Releases):
    """Flat clipping to ``clip_norm`` and Gaussian noise on the sum.

    Records one sum query per release: sensitivity ``S`` (= ``clip_norm`` unless given) and
    noise std ``noise_multiplier x S``.

    Args:
      clip_norm: L2 bound C > 0 on each example's whole contribution (all tensors together).
      noise_multiplier: z > 0 (noise std / sensitivity); 0 is refused - use NoPrivacyQuery.
      sensitivity: add/remove L2 sensitivity of the sum when it is not C (e.g. 2C/b for
        microbatch averages, computed by the caller); the noise scales with it.
      name: label written to the ledger.
    """

    groups = None

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        *,
        sensitivity: float | None = None,
        name: str = "sum",
    ) -> None:
        check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        if sensitivity is not None:
            check_range("sensitivity", sensitivity, 0.0, math.inf, low_open=True, high_open=True)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.sensitivity = float(sensitivity if sensitivity is not None else clip_norm)
        self.name = name

    @property
    def noise_std(self) -> float:
        """Std of the noise added to each coordinate of the sum."""
        return self.noise_multiplier * self.sensitivity

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        """The (sensitivity, noise_std) entries one release records."""
        return ((self.sensitivity, self.noise_std),)

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example weights ``min(1, C / norm)`` from flat norms (or partial norms)."""
        return clip_weights_from_norms(_flat_norm(norms), self.clip_norm, mask)

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record the release in ``ledger`` (write-ahead), then return ``sum + noise``."""
        _check_release_args(ledger, randomness, scale)
        ledger.record_sum_query(
            sample_id, sensitivity=self.sensitivity, noise_std=self.noise_std, name=self.name
        )
        return _noisy(clipped_sum, _const(clipped_sum, self.noise_std), randomness, out, scale)

    def __repr__(self) -> str:
        return (
            f"GaussianSumQuery(clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier}, sensitivity={self.sensitivity})"
        )


def _const(tree: Tensors, value: float) -> dict[str, float]:
    return dict.fromkeys(_flatten(tree), value)


class AverageQuery(_Releases):
    """A sum query divided by a fixed ``denominator`` (post-processing; same privacy).

    Use the *expected* batch size (q x N for Poisson sampling), never the realised one: the
    realised size of a Poisson batch is private.

    Args:
      query: any query (sum, nested, joint, adaptive, no-privacy).
      denominator: fixed positive divisor.
    """

    def __init__(self, query: Query, denominator: float) -> None:
        check_range("denominator", denominator, 0.0, math.inf, low_open=True, high_open=True)
        self.query = query
        self.denominator = float(denominator)

    @property
    def groups(self) -> dict[str, tuple[str, ...]] | None:
        return self.query.groups

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        return self.query.privacy_tuples()

    @property
    def noise_multiplier(self) -> float:
        """Effective noise multiplier of one release."""
        return _effective(self.query.privacy_tuples())

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> Weights:
        return self.query.clip_weights(norms, mask=mask)

    def clip_and_sum(self, per_example: Tensors, *, mask: torch.Tensor | None = None) -> dict:
        return self.query.clip_and_sum(per_example, mask=mask)

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """The inner query's noisy sum (recorded write-ahead) divided by the denominator."""
        noisy = self.query.add_noise(
            clipped_sum,
            ledger=ledger,
            sample_id=sample_id,
            randomness=randomness,
            out=out,
            scale=scale,
        )
        scaled = {n: t.div_(self.denominator) for n, t in _flatten(noisy).items()}
        return _unflatten_like(scaled, noisy)

    def __repr__(self) -> str:
        return f"AverageQuery({self.query!r}, denominator={self.denominator})"


def gaussian_average_query(
    clip_norm: float, noise_multiplier: float, denominator: float, *, name: str = "average"
) -> AverageQuery:
    """``AverageQuery(GaussianSumQuery(clip_norm, noise_multiplier), denominator)``."""
    return AverageQuery(GaussianSumQuery(clip_norm, noise_multiplier, name=name), denominator)


def _effective(tuples: Sequence[tuple[float, float]]) -> float:
    return effective_noise_multiplier([s for s, _ in tuples], [sd for _, sd in tuples])


# --------------------------------------------------------------------------------------------
# Groups: separate clipping per group (nested) and joint clipping
# --------------------------------------------------------------------------------------------


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


class NestedQuery(_Releases):
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

    def __init__(self, groups: Mapping[str, Group], *, name: str = "nested") -> None:
        if not groups:
            raise ValueError("groups must not be empty")
        for g, spec in groups.items():
            if not isinstance(spec, Group):
                raise ValueError(f"groups[{g!r}] must be a dpfy.queries.Group, got {spec!r}")
        self.specs = dict(groups)
        self.groups = {g: s.params for g, s in self.specs.items()}
        _check_partition(self.groups, [])
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

    @property
    def noise_multiplier(self) -> float:
        """Effective noise multiplier of one release (McMahan Eq. 1)."""
        return _effective(self.privacy_tuples())

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        return tuple((s.clip_norm, s.noise_std) for s in self.specs.values())

    def clip_weights(
        self, norms: Mapping[str, torch.Tensor], *, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``{group: min(1, C_j / norm_j)}`` from per-group norms keyed like ``groups``."""
        gn = _group_norms(norms, self.groups)
        return {
            g: clip_weights_from_norms(gn[g], self.specs[g].clip_norm, mask) for g in self.groups
        }

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record one entry per group (write-ahead), then add each group's noise."""
        _check_release_args(ledger, randomness, scale)
        names = list(_flatten(clipped_sum))
        _check_partition(self.groups, names)
        ledger.record_sum_queries(
            sample_id,
            [(s.clip_norm, s.noise_std, f"{self.name}/{g}") for g, s in self.specs.items()],
        )
        stds = {n: self.specs[g].noise_std for g, ns in self.groups.items() for n in ns}
        return _noisy(clipped_sum, stds, randomness, out, scale)

    def __repr__(self) -> str:
        return f"NestedQuery({self.specs!r})"


class JointClipQuery(_Releases):
    """Joint clipping with per-group scale parameters (McMahan et al. 2018, Sec. 2).

    Each example's groups are rescaled ``x_g / gamma_g``, clipped *jointly* to ``clip_norm``
    C, summed, noised with N(0, (z C)^2) per coordinate and scaled back by ``gamma_g``.
    Equivalently the raw contribution gets one weight ``min(1, C / sqrt(sum_g |x_g|^2 /
    gamma_g^2))`` and group g gets noise std ``gamma_g z C``. The release is a post-processed
    Gaussian sum with privacy tuple (C, z C), recorded as one ledger entry.

    Args:
      groups: ``{group: param names}`` (disjoint; together all released parameters).
      scales: ``{group: gamma_g > 0}``, e.g. a typical norm bound of the group.
      clip_norm: C > 0, the joint bound in scaled units (sqrt(#groups) if every group obeys
        ``|x_g| <= gamma_g``).
      noise_multiplier: z > 0.
    """

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
        self.groups = {g: (ns,) if isinstance(ns, str) else tuple(ns) for g, ns in groups.items()}
        _check_partition(self.groups, [])
        self.scales = {g: float(scales[g]) for g in self.groups}
        self.inner = GaussianSumQuery(clip_norm, noise_multiplier, name=name)

    @property
    def clip_norm(self) -> float:
        return self.inner.clip_norm

    @property
    def noise_multiplier(self) -> float:
        return self.inner.noise_multiplier

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        return self.inner.privacy_tuples()

    def noise_stds(self) -> dict[str, float]:
        """Noise std per group in the raw (unscaled) units: ``gamma_g z C``."""
        return {g: gamma * self.inner.noise_std for g, gamma in self.scales.items()}

    def clip_weights(
        self, norms: Mapping[str, torch.Tensor], *, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One weight per example from per-group raw norms: ``min(1, C / joint_norm)``."""
        gn = _group_norms(norms, self.groups)
        joint = torch.stack([gn[g] / self.scales[g] for g in self.groups]).pow(2).sum(0).sqrt()
        return clip_weights_from_norms(joint, self.clip_norm, mask)

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record (C, z C) write-ahead, then add noise ``gamma_g z C`` to group g."""
        _check_release_args(ledger, randomness, scale)
        _check_partition(self.groups, _flatten(clipped_sum))
        s, sd = self.inner.privacy_tuples()[0]
        ledger.record_sum_query(sample_id, sensitivity=s, noise_std=sd, name=self.inner.name)
        per_group = self.noise_stds()
        stds = {n: per_group[g] for g, ns in self.groups.items() for n in ns}
        return _noisy(clipped_sum, stds, randomness, out, scale)

    def __repr__(self) -> str:
        return (
            f"JointClipQuery(scales={self.scales}, clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier})"
        )


# --------------------------------------------------------------------------------------------
# Adaptive clipping (Andrew et al. 2021)
# --------------------------------------------------------------------------------------------


class AdaptiveClipQuery(_Releases):
    """Flat clipping whose clip norm tracks a quantile of the per-example norms.

    Andrew, Thakkar, McMahan, Ramaswamy (2021), "Differentially private learning with adaptive
    clipping", Alg. 1 with the geometric update: each release also counts the examples with
    ``norm <= C`` as the centred sum ``sum_i (1[norm_i <= C] - 1/2)`` (add/remove sensitivity
    1/2), adds N(0, count_noise_std^2), estimates the unclipped fraction
    ``b = noisy_count / expected_batch_size + 1/2`` and updates
    ``C <- C exp(-learning_rate (b - target_quantile))``.

    The count is a second Gaussian release on the same sample, recorded in the ledger. The
    gradient noise multiplier is raised to ``z_g = (z^-2 - (2 count_noise_std)^-2)^(-1/2)`` so
    the pair has exactly the requested effective ``noise_multiplier`` z (Andrew et al., Thm. 1).

    Stateful: ``clip_weights`` accumulates the (non-private) count of unclipped real examples
    of the current logical step over physical chunks; ``add_noise`` releases it once, updates
    ``clip_norm`` and resets the accumulator. Weights always use the clip norm current at the
    start of the step. ``state_dict``/``load_state_dict`` checkpoint the clip norm.

    Args:
      initial_clip_norm: C at the first step, > 0.
      noise_multiplier: requested effective z of one release (gradient sum + count).
      expected_batch_size: fixed denominator of the fraction (q N for Poisson), > 0.
      target_quantile: fraction of examples that should be unclipped, in [0, 1].
      learning_rate: eta of the geometric update, >= 0 (0 keeps C fixed).
      count_noise_std: std of the count noise; default ``expected_batch_size / 20`` (the
        paper's recommendation); must exceed ``noise_multiplier / 2``.
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
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        check_range(
            "expected_batch_size",
            expected_batch_size,
            0.0,
            math.inf,
            low_open=True,
            high_open=True,
        )
        check_range("target_quantile", target_quantile, 0.0, 1.0)
        check_range("learning_rate", learning_rate, 0.0, math.inf, high_open=True)
        if count_noise_std is None:
            count_noise_std = expected_batch_size / 20.0
        check_range(
            "count_noise_std",
            count_noise_std,
            noise_multiplier / 2.0,
            math.inf,
            low_open=True,
            high_open=True,
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
        return inv**-0.5

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        """(C, z_g C) for the gradient sum and (1/2, count_noise_std) for the count."""
        return (
            (self.clip_norm, self.gradient_noise_multiplier * self.clip_norm),
            (0.5, self.count_noise_std),
        )

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weights ``min(1, C / norm)``; also accumulates this step's unclipped count."""
        flat = _flat_norm(norms)
        w = clip_weights_from_norms(flat, self.clip_norm, mask)
        real = torch.ones_like(flat) if mask is None else _mask(mask, flat)
        real = real * torch.isfinite(flat)
        self._unclipped += float((real * (flat <= self.clip_norm)).sum())
        self._count += float(real.sum())
        return w

    def pending_centred_count(self) -> float:
        """The exact centred count ``sum_i (1[norm_i <= C] - 1/2)`` accumulated this step.

        Diagnostics and tests only: it is not private; ``add_noise`` releases it with noise.
        """
        return self._unclipped - 0.5 * self._count

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record both releases (write-ahead), noise the sum and the count, update C."""
        _check_release_args(ledger, randomness, scale)
        (s, sd), (cs, csd) = self.privacy_tuples()
        ledger.record_sum_queries(
            sample_id,
            [(s, sd, f"{self.name}/sum"), (cs, csd, f"{self.name}/unclipped_count")],
        )
        noisy = _noisy(clipped_sum, _const(clipped_sum, sd), randomness, out, scale)
        noisy_centred = self.pending_centred_count() + float(randomness.normal(1, csd)[0])
        fraction = noisy_centred / self.expected_batch_size + 0.5
        self.last_unclipped_fraction = fraction
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        self._unclipped = 0.0
        self._count = 0.0
        return noisy

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


class AdaptiveNestedQuery(_Releases):
    """Per-group clipping where each group's clip norm tracks a quantile of its own norms.

    The per-group version of :class:`AdaptiveClipQuery` (Andrew et al. 2021, geometric update,
    applied to each group of a :class:`NestedQuery`). Each release records, on the same sample,
    one gradient sum per group with (C_g, s_g) and one centred unclipped count per group with
    (1/2, count_noise_std). Noise is proportional to the clip norms,
    ``s_g = z_g sqrt(k) C_g`` for k groups, with
    ``z_g = (z^-2 - k (2 count_noise_std)^-2)^(-1/2)``, so that McMahan's effective noise
    multiplier of the whole release is exactly the requested ``noise_multiplier`` z.

    Stateful like :class:`AdaptiveClipQuery`: ``clip_weights`` accumulates each group's
    unclipped count over the chunks of a logical step; ``add_noise`` releases and resets them
    and updates every ``clip_norms[g]``.

    Args:
      groups: ``{group: param names}`` (disjoint).
      initial_clip_norms: one C for every group, or ``{group: C_g}``.
      noise_multiplier: requested effective z of one release (all sums and counts).
      expected_batch_size: fixed denominator of the unclipped fractions.
      target_quantile, learning_rate: as in :class:`AdaptiveClipQuery`.
      count_noise_std: std of each count's noise; default ``expected_batch_size / 20``; must
        exceed ``noise_multiplier x sqrt(k) / 2``.
    """

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
        _check_partition(self.groups, [])
        if not isinstance(initial_clip_norms, Mapping):
            initial_clip_norms = dict.fromkeys(self.groups, initial_clip_norms)
        if set(initial_clip_norms) != set(self.groups):
            raise ValueError(
                f"initial_clip_norms must have the keys {sorted(self.groups)}, "
                f"got {sorted(initial_clip_norms)}"
            )
        self.clip_norms = dict(_check_clips({g: initial_clip_norms[g] for g in self.groups}))
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        check_range(
            "expected_batch_size",
            expected_batch_size,
            0.0,
            math.inf,
            low_open=True,
            high_open=True,
        )
        check_range("target_quantile", target_quantile, 0.0, 1.0)
        check_range("learning_rate", learning_rate, 0.0, math.inf, high_open=True)
        k = len(self.groups)
        if count_noise_std is None:
            count_noise_std = expected_batch_size / 20.0
        check_range(
            "count_noise_std",
            count_noise_std,
            noise_multiplier * math.sqrt(k) / 2.0,
            math.inf,
            low_open=True,
            high_open=True,
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
        return (self.noise_multiplier**-2 - k * (2.0 * self.count_noise_std) ** -2) ** -0.5

    def noise_stds(self) -> dict[str, float]:
        """Current noise std per group: ``z_g sqrt(k) C_g``."""
        scale = self.gradient_noise_multiplier * math.sqrt(len(self.groups))
        return {g: scale * c for g, c in self.clip_norms.items()}

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        """(C_g, s_g) per group, then (1/2, count_noise_std) per group."""
        stds = self.noise_stds()
        sums = tuple((self.clip_norms[g], stds[g]) for g in self.groups)
        return sums + ((0.5, self.count_noise_std),) * len(self.groups)

    def clip_weights(
        self, norms: Mapping[str, torch.Tensor], *, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """``{group: min(1, C_g / norm_g)}``; also accumulates this step's unclipped counts."""
        gn = _group_norms(norms, self.groups)
        first = next(iter(gn.values()))
        real = torch.ones_like(first) if mask is None else _mask(mask, first)
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

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record all 2k releases (write-ahead), noise sums and counts, update every C_g."""
        _check_release_args(ledger, randomness, scale)
        _check_partition(self.groups, _flatten(clipped_sum))
        stds = self.noise_stds()
        entries = [(self.clip_norms[g], stds[g], f"{self.name}/{g}/sum") for g in self.groups]
        entries += [
            (0.5, self.count_noise_std, f"{self.name}/{g}/unclipped_count") for g in self.groups
        ]
        ledger.record_sum_queries(sample_id, entries)
        per_param = {n: stds[g] for g, ns in self.groups.items() for n in ns}
        noisy = _noisy(clipped_sum, per_param, randomness, out, scale)
        centred = self.pending_centred_counts()
        noise = randomness.normal(len(self.groups), self.count_noise_std)
        fractions = {}
        for (g, c), e in zip(centred.items(), noise, strict=True):
            fractions[g] = (c + float(e)) / self.expected_batch_size + 0.5
            self.clip_norms[g] *= math.exp(
                -self.learning_rate * (fractions[g] - self.target_quantile)
            )
        self.last_unclipped_fractions = fractions
        self._unclipped = dict.fromkeys(self.groups, 0.0)
        self._count = 0.0
        return noisy

    def state_dict(self) -> dict[str, dict[str, float]]:
        """Checkpoint state (the current clip norms)."""
        return {"clip_norms": dict(self.clip_norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        norms = state["clip_norms"]
        if set(norms) != set(self.groups):
            raise ValueError(f"clip_norms must have the keys {sorted(self.groups)}")
        self.clip_norms = _check_clips({g: norms[g] for g in self.groups})
        self._unclipped = dict.fromkeys(self.groups, 0.0)
        self._count = 0.0

    def __repr__(self) -> str:
        return (
            f"AdaptiveNestedQuery(clip_norms={self.clip_norms}, "
            f"noise_multiplier={self.noise_multiplier}, target_quantile={self.target_quantile})"
        )


# --------------------------------------------------------------------------------------------
# No privacy (debugging)
# --------------------------------------------------------------------------------------------


class NoPrivacyQuery(_Releases):
    """Clip (if ``clip_norm`` is given) and sum without noise; records a non-private entry.

    For debugging only: the ledger then reports epsilon = infinity, so a report can never
    mistake the run for a private one.
    """

    groups = None
    noise_multiplier = 0.0

    def __init__(self, clip_norm: float | None = None, *, name: str = "no_privacy") -> None:
        if clip_norm is not None:
            check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
            clip_norm = float(clip_norm)
        self.clip_norm = clip_norm
        self.name = name

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        return ((math.inf if self.clip_norm is None else self.clip_norm, 0.0),)

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = _flat_norm(norms)
        if self.clip_norm is None:
            w = torch.ones_like(flat)
            return w if mask is None else w * _mask(mask, w)
        return clip_weights_from_norms(flat, self.clip_norm, mask)

    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict:
        """Record a non-private entry (write-ahead) and return the sum unchanged (a copy)."""
        _check_release_args(ledger, randomness, scale)
        ledger.record_non_private(
            sample_id, name=self.name, reason="NoPrivacyQuery: released without noise (debugging)"
        )
        return _noisy(clipped_sum, _const(clipped_sum, 0.0), randomness, out, scale)


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
    clips = _check_clips(clip_norms)
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
    clips = _check_clips(clip_norms)
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True)
    if set(dims) != set(clips):
        raise ValueError(f"dims must have the keys {sorted(clips)}, got {sorted(dims)}")
    for g, d in dims.items():
        check_range(f"dims[{g!r}]", d, 1, None, integer=True)
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
        check_range(f"dims[{g!r}]", d, 1, None, integer=True)
    if how == "equal":
        return {g: clip_norm / math.sqrt(len(dims)) for g in dims}
    if how == "dimension":
        total = float(sum(dims.values()))
        return {g: clip_norm * math.sqrt(d / total) for g, d in dims.items()}
    raise ValueError(f"how must be one of {{equal, dimension}}, got how={how!r}")


def _check_clips(clip_norms: Mapping[str, float]) -> dict[str, float]:
    if not clip_norms:
        raise ValueError("clip_norms must not be empty")
    for g, c in clip_norms.items():
        check_range(f"clip_norms[{g!r}]", c, 0.0, math.inf, low_open=True, high_open=True)
    return {g: float(c) for g, c in clip_norms.items()}

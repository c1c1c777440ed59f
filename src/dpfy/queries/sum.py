"""Flat clipping: the Gaussian sum query, its fixed-denominator average, and no-privacy.

* :class:`GaussianSumQuery` clips all tensors of an example as one vector to ``clip_norm`` C and
  adds N(0, (z S)^2) per coordinate, S the sensitivity that follows from what is clipped
  (McMahan et al. 2018, Sec. 2; Abadi et al. 2016). The clip function is flat
  (``min(1, C / norm)``) or automatic (``C / (norm + gamma)``, Bu et al. 2023;
  :mod:`dpfy.queries.clipping`); both bound every clipped norm by C, so S is the same.
* :class:`AverageQuery` divides another query's release by a *fixed* denominator (the expected
  batch size; never the realised size of a Poisson batch) -- post-processing, same privacy.
* :class:`NoPrivacyQuery` clips (optionally) and sums without noise, for debugging; the ledger
  then reports epsilon = infinity.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from dpfy._validate import check_range
from dpfy.ledger import Ledger
from dpfy.ledger.ledger import effective_noise_multiplier
from dpfy.queries._tree import (
    Norms,
    Tensors,
    Weights,
    check_mask,
    flat_norm,
    flatten,
    unflatten_like,
)
from dpfy.queries.base import LedgerEntry, Query, QueryBase, ReleasesClippedSums
from dpfy.queries.clipping import (
    DEFAULT_STABILITY,
    ClippingMode,
    check_clipping,
    clip_weights_for,
)
from dpfy.randomness import Randomness

#: What one clipped contribution is: one ``"example"`` (one unit of privacy adds or removes
#: it: sensitivity C), or a ``"microbatch_average"`` of several rows (adding or removing one
#: example moves one clipped average anywhere in the C-ball: sensitivity 2C).
ClippedUnit = Literal["example", "microbatch_average"]
_SENSITIVITY_FACTOR: dict[str, float] = {"example": 1.0, "microbatch_average": 2.0}


class GaussianSumQuery(QueryBase):
    """Flat clipping to ``clip_norm`` and Gaussian noise on the sum.

    Records one sum query per release: sensitivity S = C for clipped examples, 2C for clipped
    microbatch averages, and noise std ``noise_multiplier x S``.

    Args:
      clip_norm: L2 bound C > 0 on each clipped unit's contribution (all tensors together).
      noise_multiplier: z > 0 (noise std / sensitivity); 0 is refused - use NoPrivacyQuery.
      clipped_unit: ``"example"`` (default) or ``"microbatch_average"`` (see
        :data:`ClippedUnit`).
      name: label written to the ledger.
      clipping: ``"flat"`` (default, ``min(1, C / norm)``) or ``"automatic"``
        (``C / (norm + stability)``, Bu et al. 2023); :mod:`dpfy.queries.clipping`.
      stability: gamma > 0 of automatic clipping, in gradient-norm units (default 0.01).
    """

    groups = None

    def __init__(
        self,
        clip_norm: float,
        noise_multiplier: float,
        *,
        clipped_unit: ClippedUnit = "example",
        name: str = "sum",
        clipping: ClippingMode = "flat",
        stability: float = DEFAULT_STABILITY,
    ) -> None:
        check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        if clipped_unit not in _SENSITIVITY_FACTOR:
            raise ValueError(
                f"clipped_unit must be one of {set(_SENSITIVITY_FACTOR)}, "
                f"got clipped_unit={clipped_unit!r}"
            )
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.clipped_unit: ClippedUnit = clipped_unit
        self.name = name
        self.clipping: ClippingMode = check_clipping(clipping, stability, "stability")
        self.stability = float(stability)

    @property
    def sensitivity(self) -> float:
        """Add/remove L2 sensitivity of the sum: C (examples) or 2C (microbatch averages)."""
        return _SENSITIVITY_FACTOR[self.clipped_unit] * self.clip_norm

    @property
    def noise_std(self) -> float:
        """Std of the noise added to each coordinate of the sum."""
        return self.noise_multiplier * self.sensitivity

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        factor = _SENSITIVITY_FACTOR[self.clipped_unit]
        return (LedgerEntry(self.name, self.clip_norm, self.noise_std, factor),)

    def noise_stds(self) -> float:
        return self.noise_std

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-example weights (``min(1, C / norm)``, or ``C / (norm + gamma)`` when
        automatic) from flat norms (or partial norms)."""
        return clip_weights_for(
            self.clipping, flat_norm(norms), self.clip_norm, self.stability, mask
        )

    def __repr__(self) -> str:
        unit = "" if self.clipped_unit == "example" else f", clipped_unit={self.clipped_unit!r}"
        if self.clipping != "flat":
            unit += f", clipping={self.clipping!r}, stability={self.stability}"
        return (
            f"GaussianSumQuery(clip_norm={self.clip_norm}, "
            f"noise_multiplier={self.noise_multiplier}, sensitivity={self.sensitivity}{unit})"
        )


class NoPrivacyQuery(QueryBase):
    """Clip (if ``clip_norm`` is given) and sum without noise; records a non-private entry.

    For debugging only: the ledger then reports epsilon = infinity, so a report can never
    mistake the run for a private one.
    """

    groups = None
    noise_multiplier = 0.0

    def __init__(
        self,
        clip_norm: float | None = None,
        *,
        name: str = "no_privacy",
        clipping: ClippingMode = "flat",
        stability: float = DEFAULT_STABILITY,
    ) -> None:
        if clip_norm is not None:
            check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
            clip_norm = float(clip_norm)
        self.clipping: ClippingMode = check_clipping(clipping, stability, "stability")
        if clip_norm is None and clipping != "flat":
            raise ValueError(f"clip_norm must be given with clipping={clipping!r}, got None")
        self.clip_norm = clip_norm
        self.stability = float(stability)
        self.name = name

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        bound = math.inf if self.clip_norm is None else self.clip_norm
        return (LedgerEntry(self.name, bound, 0.0),)

    def noise_stds(self) -> float:
        return 0.0

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = flat_norm(norms)
        if self.clip_norm is None:
            w = torch.ones_like(flat)
            return w if mask is None else w * check_mask(mask, w)
        return clip_weights_for(self.clipping, flat, self.clip_norm, self.stability, mask)

    def __repr__(self) -> str:
        mode = "" if self.clipping == "flat" else f", clipping={self.clipping!r}"
        return f"NoPrivacyQuery(clip_norm={self.clip_norm}{mode})"


class AverageQuery(ReleasesClippedSums):
    """Another query's release divided by a fixed ``denominator`` (post-processing).

    Use the *expected* batch size (q x N for Poisson sampling), never the realised one: the
    realised size of a Poisson batch is private. The inner query runs the release template
    (validation, write-ahead ledger entries, noise); this wrapper records nothing itself.

    Args:
      query: any query (sum, nested, joint, adaptive, no-privacy).
      denominator: fixed positive divisor.
    """

    fused_release = True

    def __init__(self, query: Query, denominator: float) -> None:
        check_range("denominator", denominator, 0.0, math.inf, low_open=True, high_open=True)
        self.query = query
        self.denominator = float(denominator)

    @property
    def groups(self) -> dict[str, tuple[str, ...]] | None:
        return self.query.groups

    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        return self.query.ledger_entries()

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        return self.query.privacy_tuples()

    @property
    def noise_multiplier(self) -> float:
        """Effective noise multiplier of one release."""
        tuples = self.query.privacy_tuples()
        return effective_noise_multiplier([s for s, _ in tuples], [sd for _, sd in tuples])

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> Weights:
        return self.query.clip_weights(norms, mask=mask)

    def clip_and_sum(
        self, per_example: Tensors, *, mask: torch.Tensor | None = None
    ) -> dict[str, Any]:
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
    ) -> dict[str, Any]:
        """The inner query's noisy sum (recorded write-ahead) divided by the denominator."""
        noisy = self.query.add_noise(
            clipped_sum,
            ledger=ledger,
            sample_id=sample_id,
            randomness=randomness,
            out=out,
            scale=scale,
        )
        scaled = {n: t.div_(self.denominator) for n, t in flatten(noisy).items()}
        return unflatten_like(scaled, noisy)

    def __repr__(self) -> str:
        return f"AverageQuery({self.query!r}, denominator={self.denominator})"


def check_average_sensitivity(query: Query) -> None:
    """``ValueError`` unless ``query`` can release sums of clipped microbatch *averages*
    (``PrivateGradient(microbatch_mode="average")``): one flat part recorded with sensitivity
    2C, or no noise at all."""
    if query.noise_multiplier == 0.0:
        return  # NoPrivacyQuery: nothing to protect
    entries = query.ledger_entries()
    if len(entries) != 1 or query.groups is not None:
        raise ValueError(
            "microbatch_mode='average' needs a flat sum query with sensitivity 2 x clip_norm, "
            "e.g. GaussianSumQuery(clip_norm, noise_multiplier, "
            "clipped_unit='microbatch_average')"
        )
    clip, sensitivity = entries[0].clip_norm, entries[0].sensitivity
    if sensitivity < 2.0 * clip * (1 - 1e-12):
        raise ValueError(
            "microbatch_mode='average' clips microbatch averages: one example changes one of "
            f"them by up to 2 x clip_norm = {2 * clip!r} under add-or-remove adjacency "
            f"(Ponomareva et al. 2023, Alg. 3), but the query records sensitivity "
            f"{sensitivity!r}; use "
            "GaussianSumQuery(clip_norm, noise_multiplier, clipped_unit='microbatch_average')"
        )


def gaussian_average_query(
    clip_norm: float, noise_multiplier: float, denominator: float, *, name: str = "average"
) -> AverageQuery:
    """``AverageQuery(GaussianSumQuery(clip_norm, noise_multiplier), denominator)``."""
    return AverageQuery(GaussianSumQuery(clip_norm, noise_multiplier, name=name), denominator)

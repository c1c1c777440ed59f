"""The query contract and the one release template every query of dpfy runs.

A *query* turns clipped per-example contributions into one noisy aggregate. Its release is always
the same three steps, owned by :meth:`QueryBase.add_noise`:

1. validate the arguments (ledger, randomness, ``scale``, the output buffers, the partition of
   the released tensors into the query's groups) -- a refused release records nothing;
2. write the query's ledger entries, one per released Gaussian part, *before* any noise exists
   (write-ahead: a crash can only over-count the privacy spent);
3. draw all the noise of the release in one call of :meth:`Randomness.normal_`, fused with the
   addition of the clipped sum (and with ``scale``) into the output buffers.

A concrete query declares only *what* it releases: :meth:`QueryBase.ledger_entries` (name, clip
norm, noise std and the sensitivity that follows from its structure, per part),
:meth:`QueryBase.noise_stds` (one std for every tensor, or one per group) and
:meth:`QueryBase.clip_weights`. Stateful queries (adaptive clipping, Andrew et al. 2021) also
override :meth:`QueryBase._after_release`, which runs after the noise is drawn.

Sensitivity is never taken from the caller: a :class:`LedgerEntry` derives it from the part's
clip norm and the structure of the release (``sensitivity_factor``: 1 when one unit of privacy
adds or removes one clipped contribution, 2 when it moves one clipped contribution anywhere in
the clip ball, as with microbatch averages), and refuses a factor below 1 -- a recorded
sensitivity below the clip norm would understate the privacy loss (McMahan et al. 2018, Sec. 2).

Adjacency: add_or_remove of one unit of privacy (one row of the per-example batch).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol, overload, runtime_checkable

import torch

from dpfy._validate import check_range
from dpfy.ledger import Ledger
from dpfy.ledger.ledger import effective_noise_multiplier
from dpfy.queries._tree import (
    Norms,
    Tensors,
    Weights,
    check_partition,
    expand_weights,
    flatten,
    per_example_norms,
    unflatten_like,
    weighted_sum,
)
from dpfy.randomness import Randomness


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One Gaussian part of a release, as the ledger records it.

    Attributes:
      name: ledger label of the part (e.g. ``"nested/fc1"``).
      clip_norm: bound C on one unit's clipped contribution to this part, L2, in the part's
        own units; in (0, inf) -- inf only for a part released without noise.
      noise_std: std of the Gaussian noise on each coordinate of the part, in [0, inf); 0 means
        released without noise, which the ledger records as non-private.
      sensitivity_factor: add/remove L2 sensitivity in units of ``clip_norm``, >= 1: 1 when one
        unit adds or removes one clipped contribution (the default), 2 when it can move one
        clipped contribution anywhere in the clip ball (microbatch averages).
    """

    name: str
    clip_norm: float
    noise_std: float
    sensitivity_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.clip_norm > 0.0:  # also refuses NaN
            raise ValueError(
                f"ledger entry {self.name!r}: clip_norm must be in (0, inf], "
                f"got clip_norm={self.clip_norm!r}"
            )
        check_range("noise_std", self.noise_std, 0.0, math.inf, high_open=True)
        if self.noise_std > 0.0 and not self.sensitivity / self.noise_std <= 1e150:
            raise ValueError(
                f"ledger entry {self.name!r}: noise_std={self.noise_std!r} is too small for "
                f"clip_norm={self.clip_norm!r} (sensitivity / noise_std must be <= 1e150)"
            )
        if self.clip_norm == math.inf and self.noise_std != 0.0:
            raise ValueError(
                f"ledger entry {self.name!r}: an unbounded (unclipped) part cannot be private; "
                f"got noise_std={self.noise_std!r} with clip_norm=inf"
            )
        if not 1.0 <= self.sensitivity_factor < math.inf:
            raise ValueError(
                f"ledger entry {self.name!r} would record sensitivity "
                f"{self.sensitivity_factor * self.clip_norm!r}, below its clip norm "
                f"{self.clip_norm!r}: one unit can move its clipped contribution by the whole "
                f"clip norm (sensitivity_factor must be in [1, inf), "
                f"got {self.sensitivity_factor!r})"
            )

    @property
    def sensitivity(self) -> float:
        """Recorded add/remove L2 sensitivity: ``sensitivity_factor x clip_norm``."""
        return self.sensitivity_factor * self.clip_norm


@runtime_checkable
class Query(Protocol):
    """What every query provides (materialised path and the trainer's fast path).

    Every query class of dpfy satisfies it (``tests/test_queries.py`` checks each one), and
    :class:`~dpfy.training.PrivateGradient` reads a query only through it: a query of one's own
    provides all of it (:func:`check_query` names what is missing), most simply by
    subclassing :class:`QueryBase`.

    (a) materialised per-example tensors: ``release(per_example, ...)`` is
    ``add_noise(clip_and_sum(per_example), ...)``; ``per_example`` maps names to tensors with a
    leading batch dimension (nested dicts allowed; the output has the input's structure).

    (b) the fast path: ``w = clip_weights(norms, mask=valid)`` per physical chunk, the caller's
    weighted sum ``sum_b w[b] grad_b``, then ``add_noise`` once per logical step with *every*
    released parameter (noise goes on parameters with zero gradient too). ``groups`` says which
    norms ``clip_weights`` needs: ``None`` -- one flat norm (a ``Tensor[B]``, or a dict of
    partial norms over any partition of the parameters, combined as sqrt(sum of squares)); a
    dict ``{group: (param names...)}`` -- one norm per group, keyed by group. ``clip_weights``
    returns a ``Tensor[B]`` for every parameter or a dict ``{group: Tensor[B]}``
    (:func:`expand_weights`); ``mask`` (1 = real example, 0 = padding row) zeroes padding rows.

    ``add_noise(..., out=tree)`` writes the noisy values into ``out`` (reusable gradient
    buffers); ``add_noise(s x sum, ..., scale=s)`` returns ``s x (sum + noise)``: the same
    release, post-processed (e.g. 1 / expected batch size folded into the clip weights). The
    ledger records the unscaled sensitivity and noise. ``ledger_entries()`` says what the next
    release will record, one :class:`LedgerEntry` per Gaussian part (``privacy_tuples()``: their
    ``(sensitivity, noise_std)`` pairs).

    Attributes:
      groups: ``None`` (one flat norm) or ``{group: (param names...)}`` (one norm per group).
      noise_multiplier: effective noise multiplier of one release (noise std / sensitivity,
        McMahan et al. 2018, Eq. 1, over all parts).
      fused_release: ``True`` when ``add_noise`` honours ``out=`` and ``scale=`` (every
        :class:`QueryBase` does); the trainer then reuses its gradient buffers and folds the
        division by the batch size into the clip weights.
    """

    @property
    def groups(self) -> dict[str, tuple[str, ...]] | None: ...

    @property
    def noise_multiplier(self) -> float: ...

    @property
    def fused_release(self) -> bool: ...

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

    def ledger_entries(self) -> tuple[LedgerEntry, ...]: ...

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]: ...


#: The members of :class:`Query`, for messages that name the missing ones.
QUERY_MEMBERS: tuple[str, ...] = tuple(sorted(n for n in vars(Query) if not n.startswith("_")))


def check_query(query: object) -> None:
    """``ValueError`` unless ``query`` satisfies :class:`Query`, naming the members it lacks."""
    if not isinstance(query, Query):
        missing = [n for n in QUERY_MEMBERS if not hasattr(query, n)]
        raise ValueError(
            f"query must implement dpfy.queries.Query (missing {', '.join(missing)}), "
            f"got query={query!r}"
        )


class ReleasesClippedSums:
    """``release = add_noise(clip_and_sum(...))``, shared by every query and query wrapper."""

    def release(
        self: Query,
        per_example: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        mask: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """``add_noise(clip_and_sum(per_example))`` (the ledger entries are written first)."""
        clipped = self.clip_and_sum(per_example, mask=mask)
        return self.add_noise(clipped, ledger=ledger, sample_id=sample_id, randomness=randomness)


class _EffectiveNoiseMultiplier:
    """``QueryBase.noise_multiplier`` of a query that states none: the effective noise multiplier
    of its next release, from its ledger entries (McMahan et al. 2018, Sec. 3, Eq. 1). Only a
    ``__get__`` (a non-data descriptor), so a query that sets ``self.noise_multiplier`` or
    defines the property overrides it."""

    @overload
    def __get__(self, query: None, owner: type | None = None) -> _EffectiveNoiseMultiplier: ...

    @overload
    def __get__(self, query: QueryBase, owner: type | None = None) -> float: ...

    def __get__(
        self, query: QueryBase | None, owner: type | None = None
    ) -> float | _EffectiveNoiseMultiplier:
        if query is None:
            return self
        pairs = query.privacy_tuples()
        return effective_noise_multiplier([s for s, _ in pairs], [sd for _, sd in pairs])


class QueryBase(ReleasesClippedSums, abc.ABC):
    """Base of the Gaussian queries: owns clip-and-sum and the release template.

    A subclass sets ``name`` (ledger label) and ``groups`` (``None`` or ``{group: params}``)
    and implements :meth:`clip_weights`, :meth:`ledger_entries` and :meth:`noise_stds`; it
    then satisfies :class:`Query` (``noise_multiplier`` follows from its ledger entries unless
    it sets its own).
    """

    groups: dict[str, tuple[str, ...]] | None = None
    fused_release: bool = True
    name: str
    noise_multiplier = _EffectiveNoiseMultiplier()

    # -- what a query declares -----------------------------------------------------------------

    @abc.abstractmethod
    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> Weights:
        """Per-example clip weights (float64) from per-example norms (see :class:`Query`)."""

    @abc.abstractmethod
    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """The Gaussian parts the next release records, in order (write-ahead)."""

    @abc.abstractmethod
    def noise_stds(self) -> float | Mapping[str, float]:
        """Noise std per coordinate of the next release: one for every tensor, or per group."""

    def _after_release(self, randomness: Randomness) -> None:  # noqa: B027 - optional hook
        """Runs once the noisy sum exists (state updates of adaptive queries); default none."""

    # -- derived ---------------------------------------------------------------------------------

    def privacy_tuples(self) -> tuple[tuple[float, float], ...]:
        """The (sensitivity, noise_std) pairs one release records, in order."""
        return tuple((e.sensitivity, e.noise_std) for e in self.ledger_entries())

    def clip_and_sum(
        self, per_example: Tensors, *, mask: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """Clip each example (leading batch dim) by :meth:`clip_weights` and sum; no noise.

        Flat queries clip one norm per example, grouped queries one norm per group. The
        query's ledger entries are built first, so their checks (e.g. a noise std too small
        for its sensitivity) refuse a release before any work.
        """
        self.ledger_entries()
        check_per_example(per_example)
        flat = flatten(per_example)
        w = self.clip_weights(per_example_norms(flat, self.groups), mask=mask)
        summed = weighted_sum(flat, expand_weights(w, self.groups, list(flat)))
        return unflatten_like(summed, per_example)

    # -- the template ----------------------------------------------------------------------------

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
        """Validate, record every part in ``ledger`` (write-ahead), then return ``sum + noise``.

        Args:
          clipped_sum: the clipped sum (a tree), already multiplied by ``scale``.
          ledger: where the release is recorded before the noise is drawn.
          sample_id: id from ``ledger.record_sample`` of the batch the sum came from.
          randomness: the noise source (all noise of the release in one draw).
          out: optional tree of tensors shaped like the sum to write the result into.
          scale: ``s`` in (0, inf): the result is ``s x (sum + noise)``.
        """
        check_release_args(ledger, randomness, scale)
        flat = flatten(clipped_sum)
        check_clipped_sum(flat)
        stds = self._tensor_stds(flat)
        dst = _output_buffers(flat, out)
        self._write_ahead(ledger, sample_id, self.ledger_entries())
        _draw(flat, stds, randomness, dst, scale)
        self._after_release(randomness)
        return unflatten_like(dst, clipped_sum)

    def _tensor_stds(self, flat: Mapping[str, torch.Tensor]) -> dict[str, float]:
        stds = self.noise_stds()
        if isinstance(stds, float | int):
            return dict.fromkeys(flat, float(stds))
        groups = self.groups
        if groups is None:
            raise TypeError(f"{type(self).__name__}.noise_stds() is per group but groups is None")
        check_partition(groups, flat)
        return {n: stds[g] for g, ns in groups.items() for n in ns}

    def _write_ahead(
        self, ledger: Ledger, sample_id: int, entries: tuple[LedgerEntry, ...]
    ) -> None:
        noisy = [(e.sensitivity, e.noise_std, e.name) for e in entries if e.noise_std > 0.0]
        if noisy:
            ledger.record_sum_queries(sample_id, noisy)
        for e in entries:
            if e.noise_std == 0.0:
                reason = f"{type(self).__name__}: released without noise (debugging)"
                ledger.record_non_private(sample_id, name=e.name, reason=reason)


def check_per_example(per_example: object) -> None:
    """Per-example tensors: a non-empty tree of floating-point tensors that share one leading
    (batch) dimension. ``ValueError`` naming ``per_example`` otherwise (nothing is recorded)."""
    if not isinstance(per_example, Mapping):
        raise ValueError(
            f"per_example must be a dict of tensors, got {type(per_example).__name__}"
        )
    flat = flatten(per_example)
    if not flat:
        raise ValueError("per_example must hold at least one tensor, got an empty dict")
    sizes = {}
    for name, t in flat.items():
        if t.ndim == 0:
            raise ValueError(
                f"per_example[{name!r}] must have a leading batch dimension, got a 0-dim tensor"
            )
        if not t.is_floating_point():
            raise ValueError(
                f"per_example[{name!r}] must be a floating-point tensor, got dtype {t.dtype}"
            )
        sizes[name] = int(t.shape[0])
    if len(set(sizes.values())) > 1:
        raise ValueError(f"per_example tensors must share one batch size, got {sizes}")


def check_clipped_sum(flat: Mapping[str, torch.Tensor]) -> None:
    """A clipped sum to noise: floating-point tensors only (``ValueError`` naming the tensor)."""
    for name, t in flat.items():
        if not t.is_floating_point():
            raise ValueError(
                f"clipped_sum[{name!r}] must be a floating-point tensor (noise is real), "
                f"got dtype {t.dtype}"
            )


def check_release_args(ledger: object, randomness: object, scale: float = 1.0) -> None:
    """Checked before the ledger entry is written: a refused release records nothing."""
    if scale != 1.0 and not 0.0 < scale < math.inf:
        check_range("scale", scale, 0.0, math.inf, low_open=True, high_open=True)  # raises
    if not isinstance(ledger, Ledger):
        raise ValueError(f"ledger must be a dpfy.ledger.Ledger, got ledger={ledger!r}")
    if not isinstance(randomness, Randomness):
        raise ValueError(
            f"randomness must be a dpfy.randomness.Randomness, got randomness={randomness!r}"
        )


def _output_buffers(
    flat: Mapping[str, torch.Tensor], out: Tensors | None
) -> dict[str, torch.Tensor]:
    """Where the noisy values go: ``out`` (checked against the sum) or fresh tensors."""
    if out is None:
        fmt = torch.contiguous_format
        return {n: torch.empty_like(t, memory_format=fmt) for n, t in flat.items()}
    dst = flatten(out)
    for n, t in flat.items():
        o = dst.get(n)
        if o is None or o.shape != t.shape or o.dtype != t.dtype:
            got = None if o is None else (tuple(o.shape), o.dtype)
            raise ValueError(
                f"out[{n!r}] must match the clipped sum ({tuple(t.shape)}, {t.dtype}), got {got}"
            )
    return dst


def _draw(
    flat: Mapping[str, torch.Tensor],
    stds: Mapping[str, float],
    randomness: Randomness,
    dst: Mapping[str, torch.Tensor],
    scale: float,
) -> None:
    """``dst[n] = flat[n] + N(0, (scale std_n)^2)``: all noise in one :meth:`normal_` call.

    Views of one flat buffer with one std take the fused path of :meth:`Randomness.normal_`
    (the addend and the std folded into the transform's last pass).
    """
    noisy = [n for n in flat if stds[n] != 0.0]
    randomness.normal_(
        [dst[n] for n in noisy],
        [scale * stds[n] for n in noisy],
        add=[flat[n] for n in noisy],
    )
    for n, t in flat.items():
        if stds[n] == 0.0:
            dst[n].copy_(t)

"""What a ledger records about a batch (:class:`SampleSpec`) and the one map to events.

:func:`spec_event` is the only place where a recorded sampler becomes a :mod:`dpfy.events`
event: the ledger (:meth:`dpfy.ledger.Ledger.to_event`) and every sampler's
``privacy_event`` go through it, so the two cannot disagree. What each kind needs and maps to
is its row in :mod:`dpfy.sampling.kinds`.

This module imports neither torch nor :mod:`dpfy.accounting`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dpfy import events as ev
from dpfy._validate import check_int, check_range, check_real
from dpfy.sampling.kinds import kind, kind_names, registered_kinds

_POSITIVE_INTS = ("dataset_size", "batch_size", "steps_per_epoch", "max_batch_size")


def _quoted(names: Sequence[str]) -> str:
    """``'a'``, ``'a' and 'b'``, ``'a', 'b' and 'c'``."""
    q = [repr(n) for n in names]
    return q[0] if len(q) == 1 else f"{', '.join(q[:-1])} and {q[-1]}"


@dataclasses.dataclass(frozen=True, slots=True)
class SampleSpec:
    """How one batch was drawn: the facts an accountant needs about the sampler.

    Attributes:
      sampler: a registered kind (:func:`dpfy.sampling.kinds`), e.g. ``"poisson"``.
      dataset_size: number of units of privacy in the dataset (needed by ``fixed_size`` and by a
        truncated ``poisson`` sampler).
      sampling_rate: per-step inclusion probability q (``poisson``; expected batch q x N).
      batch_size: batch size (``fixed_size``; informative for ``shuffle``/``deterministic``).
      steps_per_epoch: batches per epoch (``balls_and_bins``, ``shuffle``, ``deterministic``).
      max_batch_size: batches longer than this were truncated to a random subset (kinds whose
        row ``truncates``: ``poisson`` and ``balls_and_bins``; needs ``dataset_size``).
      adjacency: neighbouring relation, one of :class:`dpfy.events.Adjacency`; default (None):
        the kind's own (``zero_out`` for ``shuffle``/``deterministic``, whose bounds assume
        no other example changes batch; ``add_or_remove`` otherwise). ``fixed_size`` is
        ``replace_one`` whatever is stated; ``poisson`` and ``full_batch`` need
        ``add_or_remove``.
      unit: the unit of privacy ("example", "user", ...); one ledger uses one unit.
    """

    sampler: str
    dataset_size: int | None = None
    sampling_rate: float | None = None
    batch_size: int | None = None
    steps_per_epoch: int | None = None
    max_batch_size: int | None = None
    adjacency: str | None = None
    unit: str = "example"

    def __post_init__(self) -> None:
        names = kind_names()
        if self.sampler not in names:
            raise ValueError(
                f"sampler must be one of {{{', '.join(names)}}}, got sampler={self.sampler!r}"
            )
        row = kind(self.sampler)
        adjacency = row.adjacency if self.adjacency is None else self.adjacency
        object.__setattr__(self, "adjacency", ev._as_adjacency(adjacency))
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if value is not None:
                check_int(name, value)
                object.__setattr__(self, name, int(value))
        if self.sampling_rate is not None:
            check_range("sampling_rate", self.sampling_rate, 0.0, 1.0, low_open=True)
            object.__setattr__(self, "sampling_rate", float(self.sampling_rate))
        if not isinstance(self.unit, str) or not self.unit:
            raise ValueError(f"unit must be a non-empty string, got unit={self.unit!r}")
        needs = row.needs
        if self.max_batch_size is not None:
            if not row.truncates:
                allowed = _quoted([r.name for r in registered_kinds() if r.truncates])
                raise ValueError(
                    f"max_batch_size applies to the {allowed} samplers only, "
                    f"got sampler={self.sampler!r} with max_batch_size={self.max_batch_size!r}"
                )
            needs = (*needs, "dataset_size")
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"sampler={self.sampler!r} needs {', '.join(missing)}, got {self!r}")
        if row.check is not None:
            row.check(self)
        if self.adjacency not in row.allowed_adjacency:
            options = row.allowed_adjacency
            must = repr(options[0]) if len(options) == 1 else f"one of {{{', '.join(options)}}}"
            raise ValueError(
                f"adjacency must be {must} for sampler={self.sampler!r}, "
                f"got adjacency={self.adjacency!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict, omitting fields left at None."""
        out: dict[str, Any] = {"sampler": self.sampler}
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleSpec:
        """Inverse of :meth:`to_dict` (validates again; a number given as a string or of
        another JSON type is refused with ``TypeError`` naming the field)."""
        if data.get("sampling_rate") is not None:
            check_real("sampling_rate", data["sampling_rate"])
        return cls(**data)

    # Typed accessors for fields a kind's row guarantees (``needs``): event maps use these.
    def required_int(self, name: str) -> int:
        """Integer field ``name``, which this spec's kind requires (ValueError if absent)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"sampler={self.sampler!r} needs {name}, got {self!r}")
        return int(value)

    def required_rate(self) -> float:
        """``sampling_rate``, which this spec's kind requires (ValueError if absent)."""
        if self.sampling_rate is None:
            raise ValueError(f"sampler={self.sampler!r} needs sampling_rate, got {self!r}")
        return self.sampling_rate

    @property
    def adjacency_value(self) -> str:
        """The adjacency, always set after validation."""
        assert self.adjacency is not None
        return self.adjacency


def spec_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """The event of ``count`` steps (epochs, for an epoch-structured kind) drawn as ``spec``
    with a Gaussian sum query of noise multiplier ``noise_multiplier`` each.

    A step kind gives ``SelfComposed(step, count)`` even for ``count == 1``, as its sampler
    states it; the ledger composes through :class:`dpfy.events.EventBuilder`, which writes one
    repetition as the bare step. The mapping per kind is its row's ``event``
    (:mod:`dpfy.sampling.kinds`).
    """
    if not isinstance(spec, SampleSpec):
        raise ValueError(f"spec must be a dpfy.sampling.SampleSpec, got spec={spec!r}")
    check_int("count", count)
    return kind(spec.sampler).event(spec, noise_multiplier, int(count))

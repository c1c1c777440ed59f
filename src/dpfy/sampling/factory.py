"""Build a sampler by kind name from the practitioner's (expected) batch size.

Driven by the table (:mod:`dpfy.sampling.kinds`): a kind's row names its sampler class, whose
``from_batch_size`` does the kind-specific part.
"""

from __future__ import annotations

from collections.abc import Mapping

from dpfy._validate import check_int, check_range
from dpfy.randomness import Randomness
from dpfy.sampling.base import BaseSampler, Sampler, check_unit
from dpfy.sampling.kinds import SamplerClass, column, registered_kinds

#: Kind name -> sampler class, for every registered kind with a sampler (a live view).
SAMPLER_KINDS: Mapping[str, SamplerClass] = column("sampler")


def make_sampler(
    kind: str,
    dataset_size: int,
    batch_size: int,
    *,
    max_batch_size: int | None = None,
    randomness: Randomness | None = None,
    unit: str = "example",
) -> Sampler:
    """Build a sampler from the practitioner's (expected) batch size.

    Args:
      kind: one of ``SAMPLER_KINDS`` (``balls-and-bins`` with a dash is accepted).
      dataset_size: number of examples N.
      batch_size: expected batch size B: Poisson q = B / N; Balls-and-Bins T = round(N / B);
        shuffle / deterministic / fixed_size use batches of exactly B (each class's
        ``from_batch_size``).
      max_batch_size: truncation threshold (kinds whose row ``truncates`` only).
      randomness: source of randomness (default: the secure generator,
        ``Randomness.secure_mode()``; pass ``Randomness(seed)`` for a reproducible experiment).
      unit: what one index stands for, recorded in every ``SampleSpec`` (default
        ``"example"``; a sampler over users: ``"user"``, ``"movie"``, with ``dataset_size``
        the number of users).

    Raises:
      ValueError: unknown kind, bad sizes, or a maximum batch size for a fixed-size sampler.
    """
    name = str(kind).replace("-", "_")
    rows = {r.name: r for r in registered_kinds() if r.sampler is not None}
    if name not in rows:
        allowed = ", ".join(rows)
        raise ValueError(f"kind must be one of {{{allowed}}}, got kind={kind!r}")
    check_unit(unit)
    check_int("dataset_size", dataset_size)
    check_batch_size(batch_size, dataset_size, unit)
    row = rows[name]
    if max_batch_size is not None and not row.truncates:
        truncating = " and ".join(r.name for r in rows.values() if r.truncates)
        raise ValueError(
            f"max_batch_size applies to {truncating} batches only, got "
            f"max_batch_size={max_batch_size!r} for kind={kind!r} (its batches are fixed-size)"
        )
    assert row.sampler is not None
    sampler = row.sampler.from_batch_size(
        dataset_size, batch_size, max_batch_size=max_batch_size, randomness=randomness
    )
    if unit != "example":
        if not isinstance(sampler, BaseSampler):
            raise ValueError(f"unit={unit!r} needs a sampler derived from BaseSampler, got "
                             f"{type(sampler).__name__}")
        sampler.with_unit(unit)
    return sampler


def check_batch_size(batch_size: object, units: int, unit: str = "example") -> None:
    """``batch_size`` (expected units per step) must be an integer in ``[1, units]``.

    Over users the message names the unit, e.g. ``batch_size must be an integer in [1, 11]
    movies (the expected number of movies a step draws; the data holds 11 movies), got
    batch_size=256``: the number counts units of privacy, not examples.
    """
    if unit == "example":
        check_range("batch_size", batch_size, 1, units, integer=True)
        return
    try:
        check_range("batch_size", batch_size, 1, units, integer=True)
    except ValueError:
        raise ValueError(
            f"batch_size must be an integer in [1, {units}] {unit}s (the expected number of "
            f"{unit}s a step draws; the data holds {units} {unit}s), got "
            f"batch_size={batch_size!r}"
        ) from None

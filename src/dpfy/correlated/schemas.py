"""Participation schemas and the sensitivity of a strategy under them.

A schema says which sets of steps one example may contribute to (its participation pattern
``u``, a 0/1 vector over the ``T`` steps; gradients are clipped to norm 1 here, so multiply by
the clip norm for the L2 sensitivity of the raw sums). The sensitivity of a strategy ``C`` is
``max_u max_{x: ||x_t|| <= 1 on u} ||C x||``; for ``C^T C`` with non-negative entries the inner
maximum is attained with all contributions equal, so it is ``max_u ||C u||``
(Choquette-Choo et al. 2023, "(Amplified) banded matrix factorization", Thm. 2).

Schemas (guide Table 3):

* :class:`SingleEpoch` — each example at most once, in any order: the largest column norm
  (exact for every ``C``).
* :class:`Cyclic` — the data order of one shuffle repeated every ``period`` steps: example ``i``
  is used at steps ``i, i + period, ...``; ``period`` patterns, each evaluated exactly.
* :class:`MinSeparation` — at most ``k`` participations at least ``separation`` steps apart
  (b-min-sep). Exact when ``C^T C >= 0`` and ``C`` is banded with band ``<= separation``
  (the pattern's columns are then orthogonal, and a dynamic programme over column norms gives
  the maximum); otherwise by exhaustive search when ``T <= MAX_BRUTE_FORCE_STEPS``; refused
  beyond that rather than under-estimated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from dpfy._validate import check_int

#: Largest number of steps for which sensitivity falls back to searching every pattern.
MAX_BRUTE_FORCE_STEPS = 20


@dataclass(frozen=True, slots=True)
class SingleEpoch:
    """Each example participates in at most one step, in any order."""

    def to_dict(self) -> dict[str, object]:
        return {"schema": "single_epoch"}


@dataclass(frozen=True, slots=True)
class Cyclic:
    """One fixed order repeated: example ``i`` is used at steps ``i, i + period, ...``.

    Args:
        period: steps per epoch (``>= 1``).
    """

    period: int

    def __post_init__(self) -> None:
        check_int("period", self.period)

    def to_dict(self) -> dict[str, object]:
        return {"schema": "cyclic", "period": self.period}


@dataclass(frozen=True, slots=True)
class MinSeparation:
    """At most ``max_participations`` steps per example, any two at least ``separation`` apart.

    Args:
        separation: minimum distance between two participations, in steps (``>= 1``).
        max_participations: most participations of one example (``>= 1``).
    """

    separation: int
    max_participations: int

    def __post_init__(self) -> None:
        check_int("separation", self.separation)
        check_int("max_participations", self.max_participations)

    def to_dict(self) -> dict[str, object]:
        return {
            "schema": "min_separation",
            "separation": self.separation,
            "max_participations": self.max_participations,
        }


Schema = SingleEpoch | Cyclic | MinSeparation


def _check_strategy(strategy: np.ndarray) -> np.ndarray:
    c = np.asarray(strategy, dtype=float)
    if c.ndim != 2 or c.shape[1] == 0 or not np.all(np.isfinite(c)):
        raise ValueError(
            f"strategy must be a finite 2-D matrix with >= 1 column, got shape {c.shape}"
        )
    return c


def _band(gram: np.ndarray) -> int:
    """Smallest ``b`` with ``gram[i, j] == 0`` whenever ``|i - j| >= b``."""
    n = gram.shape[0]
    for b in range(n, 0, -1):
        if np.any(np.diagonal(gram, offset=b - 1) != 0) or np.any(
            np.diagonal(gram, offset=-(b - 1)) != 0
        ):
            return b
    return 1


def _patterns(steps: int, separation: int, most: int) -> list[tuple[int, ...]]:
    """Every non-empty pattern of at most ``most`` steps, pairwise ``>= separation`` apart."""

    @cache
    def from_(start: int, left: int) -> tuple[tuple[int, ...], ...]:
        out: list[tuple[int, ...]] = []
        if left == 0:
            return ()
        for t in range(start, steps):
            out.append((t,))
            out.extend((t, *rest) for rest in from_(t + separation, left - 1))
        return tuple(out)

    return list(from_(0, most))


def _max_separated_sum(weights: np.ndarray, separation: int, most: int) -> float:
    """``max sum_{t in u} weights[t]``, ``u`` of ``<= most`` steps ``>= separation`` apart."""
    n = weights.size
    # best[j][t]: best sum using at most j picks among steps t..n-1
    best = np.zeros((most + 1, n + separation + 1))
    for j in range(1, most + 1):
        for t in range(n - 1, -1, -1):
            best[j, t] = max(best[j, t + 1], weights[t] + best[j - 1, t + separation])
    return float(best[most, 0])


def sensitivity(strategy: np.ndarray, schema: Schema) -> float:
    """L2 sensitivity of ``C x`` for per-step contributions of norm ``<= 1`` under ``schema``.

    Args:
        strategy: the strategy matrix ``C`` (``m x T``; ``T`` steps as columns).
        schema: the participation schema.

    Returns:
        ``max_u ||C u||`` over the schema's patterns (exact; multiply by the clip norm).

    Raises:
        ValueError: for a malformed ``strategy``, or a :class:`MinSeparation` schema whose
            exact sensitivity is not known for this ``C`` and ``T > MAX_BRUTE_FORCE_STEPS``;
            also when ``C^T C`` has a negative entry under a multi-participation schema (the
            all-equal contributions bound would not be exact).
    """
    c = _check_strategy(strategy)
    steps = c.shape[1]
    col_sq = np.einsum("ij,ij->j", c, c)
    if isinstance(schema, SingleEpoch):
        return float(np.sqrt(col_sq.max()))
    gram = c.T @ c
    if np.any(gram < -1e-12 * max(1.0, float(np.abs(gram).max()))):
        raise ValueError(
            "strategy must have C^T C >= 0 entrywise for a multi-participation schema "
            "(Choquette-Choo et al. 2023, Thm. 2); got a negative entry"
        )
    if isinstance(schema, Cyclic):
        best = 0.0
        for i in range(min(schema.period, steps)):
            idx = np.arange(i, steps, schema.period)
            best = max(best, float(gram[np.ix_(idx, idx)].sum()))
        return float(np.sqrt(best))
    if isinstance(schema, MinSeparation):
        k, sep = schema.max_participations, schema.separation
        if _band(np.where(np.abs(gram) > 1e-12 * float(np.abs(gram).max()), gram, 0.0)) <= sep:
            return float(np.sqrt(_max_separated_sum(col_sq, sep, min(k, steps))))
        if steps > MAX_BRUTE_FORCE_STEPS:
            raise ValueError(
                f"steps must be in [1, {MAX_BRUTE_FORCE_STEPS}] for the exact sensitivity of a "
                f"non-banded strategy under min-separation participation, got steps={steps}"
            )
        best = 0.0
        for pattern in _patterns(steps, sep, min(k, steps)):
            idx = np.asarray(pattern)
            best = max(best, float(gram[np.ix_(idx, idx)].sum()))
        return float(np.sqrt(best))
    raise TypeError(
        f"schema must be one of SingleEpoch, Cyclic, MinSeparation, got {type(schema).__name__}"
    )

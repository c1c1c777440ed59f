"""A correlated-noise training run, described by numbers: strategy, steps, schema, sensitivity.

A :class:`CorrelatedPlan` is what the ledger records once per run (the run-level matrix
record) and what the training query streams from: the strategy's own parameters (BandMF band
coefficients ``c``, BLT buffer weights and decays ``omega, theta``, or none for tree
aggregation), the number of steps ``T`` and the participation schema. Everything privacy
needs follows from these numbers and is recomputed here, never taken from a caller:

* the lower-triangular ``T x T`` strategy ``C`` acts on a pattern ``u`` in ``O(T log T)``
  (Toeplitz strategies, an FFT convolution) or ``O(T)`` (tree, prefix sums), so the exact
  sensitivity ``max_u ||C u||`` under the schema (:mod:`.schemas`) is cheap even for a few
  thousand steps: one column for :class:`~dpfy.correlated.schemas.SingleEpoch`, ``period``
  patterns for :class:`~dpfy.correlated.schemas.Cyclic` (exact when ``C^T C >= 0``
  entrywise, Choquette-Choo et al. 2023, Thm. 2; here every entry of ``C`` is ``>= 0``);
* the event is :class:`dpfy.events.MatrixMechanism` with ``mu = sensitivity / z``.

The strategy's own math (its ``C``, noise map, ``C u``, single-epoch sensitivity and noise
stream) belongs to the object registered under its name (:mod:`.strategy`), reached as
:attr:`CorrelatedPlan.rule`; this module holds what every strategy shares: the record, the
schema and the sensitivity under it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from dpfy import events as ev
from dpfy._validate import check_int
from dpfy.correlated.schemas import Cyclic, MinSeparation, Schema, SingleEpoch
from dpfy.correlated.strategy import Strategy, ToeplitzStrategy, find_strategy


def schema_from_dict(data: Any) -> Schema:
    """The schema a ledger records (``Schema.to_dict()``), checked."""
    if not isinstance(data, dict):
        raise ValueError(f"schema must be an object, got schema={data!r}")
    name = data.get("schema")
    if name == "single_epoch" and set(data) == {"schema"}:
        return SingleEpoch()
    if name == "cyclic" and set(data) == {"schema", "period"}:
        return Cyclic(data["period"])
    if name == "min_separation" and set(data) == {"schema", "separation", "max_participations"}:
        return MinSeparation(data["separation"], data["max_participations"])
    raise ValueError(
        "schema must be {'schema': 'single_epoch'}, {'schema': 'cyclic', 'period': p} or "
        f"{{'schema': 'min_separation', ...}}, got schema={data!r}"
    )


def schema_name(schema: Schema) -> str:
    """Short description of a schema for events and reports (``"cyclic(period=235)"``)."""
    if isinstance(schema, SingleEpoch):
        return "single_epoch"
    if isinstance(schema, Cyclic):
        return f"cyclic(period={schema.period})"
    return f"min_separation(separation={schema.separation}, k={schema.max_participations})"


def _floats(name: str, values: Any) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers, got {name}={values!r}") from None
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite, got {name}={values!r}")
    return out


@dataclasses.dataclass(frozen=True)
class CorrelatedPlan:
    """One correlated-noise run: strategy parameters, ``steps`` and participation ``schema``.

    Attributes:
      strategy: a registered strategy's name: built in ``"bandmf"``, ``"blt"``, ``"tree"``
        and ``"tree-efficient"`` (:func:`~dpfy.correlated.register_strategy` adds more).
      params: the strategy's numbers (its class's ``keys``): ``{"coeffs": c}`` (BandMF,
        ``c_0 = 1``, ``c_k >= 0``), ``{"omega": w, "theta": t}`` (BLT) or ``{}`` (the
        trees), as tuples of floats.
      steps: ``T``, the most steps the run may take (a shorter run is covered: releasing a
        prefix of ``C x + z`` is post-processing).
      schema: :class:`SingleEpoch` or :class:`Cyclic` (the samplers that exist implement
        these; :class:`MinSeparation` is refused).

    Raises:
      ValueError: unknown strategy, malformed parameters, or an unsupported schema.
    """

    strategy: str
    params: dict[str, tuple[float, ...]]
    steps: int
    schema: Schema

    def __post_init__(self) -> None:
        cls = find_strategy(self.strategy)
        check_int("steps", self.steps)
        if not isinstance(self.schema, SingleEpoch | Cyclic):
            raise ValueError(
                "schema must be SingleEpoch or Cyclic (a training sampler implements these), "
                f"got schema={self.schema!r}"
            )
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a dict, got params={self.params!r}")
        if set(self.params) != set(cls.keys):
            raise ValueError(
                f"params of {self.strategy!r} must have the keys {sorted(cls.keys)}, "
                f"got {sorted(self.params)}"
            )
        params = {k: _floats(k, v) for k, v in self.params.items()}
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "steps", int(self.steps))
        self.__dict__["rule"] = cls.from_params(params, self.steps)  # validates the numbers

    # -- the strategy ---------------------------------------------------------------------------
    @functools.cached_property
    def rule(self) -> Strategy:
        """The registered strategy object for these numbers (its ``C``, noise map, stream)."""
        return find_strategy(self.strategy).from_params(self.params, self.steps)

    @property
    def band(self) -> int:
        """Band width (BandMF), buffer count (BLT) or 0 (trees), as the event records it."""
        return self.rule.band

    def coeffs(self) -> np.ndarray:
        """First column of a Toeplitz ``C`` (BandMF, BLT); ``T`` entries."""
        if not isinstance(self.rule, ToeplitzStrategy):
            raise ValueError(f"the {self.strategy} strategy is not Toeplitz; use strategy_matrix()")
        return self.rule.first_column(self.steps)

    def strategy_matrix(self) -> np.ndarray:
        """``C`` for tests and small ``T``: square lower-triangular ``T x T``, except the
        full tree of ``"tree-efficient"`` (``nodes x T``, node order of TreeAggregation)."""
        return self.rule.strategy_matrix(self.steps)

    def noise_map(self) -> np.ndarray:
        """``C^{-1}`` (``T x T``): the per-step noise is ``C^{-1} z``, ``z ~ N(0, sigma^2 I)``;
        for ``"tree-efficient"`` the left inverse ``G = A^{-1} B`` (``T x nodes``, ``G C = I``)
        of the online least-squares decoder ``B``."""
        return self.rule.noise_map(self.steps)

    def apply(self, u: np.ndarray) -> np.ndarray:
        """``C u`` for a vector ``u`` of ``T`` entries, without forming ``C`` (``nodes``
        entries for ``"tree-efficient"``)."""
        u = np.asarray(u, dtype=float)
        if u.shape != (self.steps,):
            raise ValueError(f"u must have shape ({self.steps},), got shape {u.shape}")
        return self.rule.apply(u)

    # -- privacy --------------------------------------------------------------------------------
    @functools.cached_property
    def sensitivity(self) -> float:
        """``max_u ||C u||`` over the schema's patterns, per unit clip norm (exact)."""
        t = self.steps
        if isinstance(self.schema, SingleEpoch):
            return self.rule.sensitivity(t)
        assert isinstance(self.schema, Cyclic)
        best = 0.0
        for i in range(min(self.schema.period, t)):
            u = np.zeros(t)
            u[i :: self.schema.period] = 1.0
            best = max(best, float(np.dot(v := self.rule.apply(u), v)))
        return float(np.sqrt(best))

    def event(self, noise_multiplier: float, adjacency: str = "zero_out") -> ev.MatrixMechanism:
        """The whole run as one Gaussian: ``MatrixMechanism`` with ``mu = sensitivity / z``."""
        return ev.MatrixMechanism(
            noise_multiplier,
            self.sensitivity,
            self.steps,
            self.strategy,
            schema_name(self.schema),
            band=self.band,
            adjacency=adjacency,
        )

    # -- records --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "params": {k: list(v) for k, v in self.params.items()},
            "steps": self.steps,
            "schema": self.schema.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> CorrelatedPlan:
        if not isinstance(data, dict):
            raise ValueError(f"a correlated plan must be an object, got {data!r}")
        params = data.get("params")
        if not isinstance(params, dict):
            raise ValueError(f"params must be an object, got params={params!r}")
        return cls(str(data.get("strategy")), dict(params), data.get("steps"),  # type: ignore[arg-type]
                   schema_from_dict(data.get("schema")))


def make_plan(
    strategy: str,
    steps: int,
    schema: Schema,
    *,
    band: int = 8,
    buffers: int = 4,
    maxiter: int = 200,
) -> CorrelatedPlan:
    """An optimised plan: BandMF of ``band`` diagonals, BLT of ``buffers`` buffers, or a tree.

    ``strategy`` is a registered name (:mod:`dpfy.correlated.strategy`); its class's
    ``optimised`` chooses the numbers. BandMF is optimised for ``k`` participations
    ``>= band`` apart (``k`` the epochs of a cyclic schema, whose period must then be
    ``>= band``; Choquette-Choo et al. 2023); BLT for one epoch (McMahan et al. 2024). The
    sensitivity is recomputed exactly for the schema whatever the optimiser assumed.
    """
    check_int("steps", steps)
    cls = find_strategy(strategy)
    chosen = cls.optimised(steps, schema, band=band, buffers=buffers, maxiter=maxiter)
    return CorrelatedPlan(cls.name, chosen.params(), steps, schema)

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

Tree aggregation is used in its square form: at step ``t`` (``n = t + 1``) exactly one node
of the binary decomposition of a prefix is completed, the node ``[n - lowbit(n), n)``; the
nodes no prefix uses are never drawn. Row ``t`` of ``C`` is the indicator of that interval,
its column norms are those of the full tree (``sqrt(floor(log2 T) + 1)`` for the first
step), and the per-step noise ``C^{-1} z`` is the difference of consecutive prefix noises
(Kairouz et al. 2021).

``"tree-efficient"`` releases the FULL tree (every node with ``(j + 1) 2^l <= T``, the
``nodes x T`` matrix of :class:`~dpfy.correlated.tree.TreeAggregation`, the same column norms
and sensitivity) and decodes it with the streaming least-squares estimator of Honaker 2015
(:mod:`.tree_efficient`): ``C`` is not square, the per-step noise is ``G z`` with
``G = A^{-1} B`` (``B`` the online decoder, :meth:`CorrelatedPlan.noise_map`), ``G C = I``.
Its prefix noise has variance ``sum_{bits l of t + 1} v_l`` (``v_l`` from 1 down to 1/2)
instead of the plain tree's ``popcount(t + 1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import numpy as np
from scipy.signal import fftconvolve

from dpfy import events as ev
from dpfy._validate import check_int
from dpfy.correlated.bandmf import optimize_bandmf
from dpfy.correlated.blt import BLT, optimize_blt
from dpfy.correlated.schemas import Cyclic, MinSeparation, Schema, SingleEpoch
from dpfy.correlated.tree import TreeAggregation
from dpfy.correlated.tree_efficient import efficient_noise_map
from dpfy.correlated.workload import toeplitz_inverse_coeffs, toeplitz_lower

StrategyName = Literal["bandmf", "blt", "tree", "tree-efficient"]
#: The strategies a training run can stream.
STRATEGIES: tuple[str, ...] = ("bandmf", "blt", "tree", "tree-efficient")
#: The tree strategies (no parameters; ``C`` made of dyadic intervals).
TREES: tuple[str, ...] = ("tree", "tree-efficient")


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
      strategy: ``"bandmf"``, ``"blt"``, ``"tree"`` or ``"tree-efficient"``.
      params: the strategy's numbers: ``{"coeffs": c}`` (BandMF, ``c_0 = 1``, ``c_k >= 0``),
        ``{"omega": w, "theta": t}`` (BLT) or ``{}`` (the trees), as tuples of floats.
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
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {{{', '.join(STRATEGIES)}}}, "
                f"got strategy={self.strategy!r}"
            )
        check_int("steps", self.steps)
        if not isinstance(self.schema, SingleEpoch | Cyclic):
            raise ValueError(
                "schema must be SingleEpoch or Cyclic (a training sampler implements these), "
                f"got schema={self.schema!r}"
            )
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a dict, got params={self.params!r}")
        keys = {"bandmf": {"coeffs"}, "blt": {"omega", "theta"}}.get(self.strategy, set())
        if set(self.params) != keys:
            raise ValueError(
                f"params of {self.strategy!r} must have the keys {sorted(keys)}, "
                f"got {sorted(self.params)}"
            )
        params = {k: _floats(k, v) for k, v in self.params.items()}
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "steps", int(self.steps))
        if self.strategy == "bandmf":
            c = np.asarray(params["coeffs"])
            if c.size == 0 or c[0] != 1.0 or np.any(c < 0):
                raise ValueError(
                    f"coeffs must start with 1 and be >= 0 (BandMF), got coeffs={c.tolist()!r}"
                )
        if self.strategy == "blt":
            BLT(np.asarray(params["omega"]), np.asarray(params["theta"]))  # validates
            if np.any(self.coeffs() < -1e-12):
                raise ValueError(
                    "the BLT strategy C must have entries >= 0 (so that C^T C >= 0 and the "
                    "sensitivity is exact); got a negative coefficient"
                )

    # -- the strategy ---------------------------------------------------------------------------
    @property
    def band(self) -> int:
        """Band width (BandMF), buffer count (BLT) or 0 (trees), as the event records it."""
        if self.strategy == "bandmf":
            return len(self.params["coeffs"])
        if self.strategy == "blt":
            return len(self.params["omega"])
        return 0

    def coeffs(self) -> np.ndarray:
        """First column of the Toeplitz ``C`` (BandMF, BLT); ``T`` entries."""
        if self.strategy == "bandmf":
            c = np.zeros(self.steps)
            k = min(self.steps, self.band)
            c[:k] = self.params["coeffs"][:k]
            return c
        if self.strategy == "blt":
            return BLT(np.asarray(self.params["omega"]), np.asarray(self.params["theta"])).coeffs(
                self.steps
            )
        raise ValueError("tree aggregation is not Toeplitz; use strategy_matrix()")

    def strategy_matrix(self) -> np.ndarray:
        """``C`` for tests and small ``T``: square lower-triangular ``T x T``, except the
        full tree of ``"tree-efficient"`` (``nodes x T``, node order of TreeAggregation)."""
        t = self.steps
        if self.strategy == "tree-efficient":
            return TreeAggregation(t).strategy_matrix()
        if self.strategy != "tree":
            return toeplitz_lower(self.coeffs(), t)
        c = np.zeros((t, t))
        for n in range(1, t + 1):
            c[n - 1, n - (n & -n) : n] = 1.0
        return c

    def noise_map(self) -> np.ndarray:
        """``C^{-1}`` (``T x T``): the per-step noise is ``C^{-1} z``, ``z ~ N(0, sigma^2 I)``;
        for ``"tree-efficient"`` the left inverse ``G = A^{-1} B`` (``T x nodes``, ``G C = I``)
        of the online least-squares decoder ``B``."""
        if self.strategy == "tree-efficient":
            return efficient_noise_map(self.steps)
        if self.strategy == "bandmf":
            inv = toeplitz_inverse_coeffs(np.asarray(self.params["coeffs"]), self.steps)
            return toeplitz_lower(inv, self.steps)
        if self.strategy == "blt":
            strat = BLT(np.asarray(self.params["omega"]), np.asarray(self.params["theta"]))
            return toeplitz_lower(strat.inverse_coeffs(self.steps), self.steps)
        return np.asarray(np.linalg.inv(self.strategy_matrix()))

    def apply(self, u: np.ndarray) -> np.ndarray:
        """``C u`` for a vector ``u`` of ``T`` entries, without forming ``C`` (``nodes``
        entries for ``"tree-efficient"``)."""
        u = np.asarray(u, dtype=float)
        if self.strategy == "tree-efficient":  # each level's complete blocks, prefix sums
            prefix = np.concatenate(([0.0], np.cumsum(u)))
            return np.concatenate([
                prefix[np.arange(1, (self.steps >> lv) + 1) << lv]
                - prefix[np.arange(0, self.steps >> lv) << lv]
                for lv in range(self.steps.bit_length())
            ])
        if self.strategy == "tree":
            n = np.arange(1, self.steps + 1)
            prefix = np.concatenate(([0.0], np.cumsum(u)))
            return np.asarray(prefix[n] - prefix[n - (n & -n)])
        return np.asarray(fftconvolve(self.coeffs(), u)[: self.steps])

    # -- privacy --------------------------------------------------------------------------------
    @functools.cached_property
    def sensitivity(self) -> float:
        """``max_u ||C u||`` over the schema's patterns, per unit clip norm (exact)."""
        t = self.steps
        if isinstance(self.schema, SingleEpoch):
            if self.strategy == "tree-efficient":  # step 0 is in one complete node per level
                return float(np.sqrt(t.bit_length()))
            if self.strategy != "tree":  # Toeplitz column j is the first one cut short
                return float(np.linalg.norm(self.coeffs()))
            n = np.arange(1, t + 1)  # the tree: how many drawn nodes hold each step
            cover = np.zeros(t + 1)
            np.add.at(cover, n - (n & -n), 1.0)
            np.add.at(cover, n, -1.0)
            return float(np.sqrt(np.cumsum(cover)[:t].max()))
        assert isinstance(self.schema, Cyclic)
        best = 0.0
        for i in range(min(self.schema.period, t)):
            u = np.zeros(t)
            u[i :: self.schema.period] = 1.0
            best = max(best, float(np.dot(v := self.apply(u), v)))
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

    BandMF is optimised for ``k`` participations ``>= band`` apart (``k`` the epochs of a
    cyclic schema, whose period must then be ``>= band``; Choquette-Choo et al. 2023); BLT for
    one epoch (McMahan et al. 2024). The sensitivity is recomputed exactly for the schema
    whatever the optimiser assumed.
    """
    check_int("steps", steps)
    if strategy == "bandmf":
        check_int("band", band, high=steps)
        k = 1
        if isinstance(schema, Cyclic):
            if schema.period < band:
                raise ValueError(
                    f"band must be in [1, {schema.period}] (the cyclic period: participations "
                    f"are a period apart), got band={band}"
                )
            k = -(-steps // schema.period)
        coeffs = optimize_bandmf(steps, band, participations=k, maxiter=maxiter).coeffs
        return CorrelatedPlan("bandmf", {"coeffs": tuple(coeffs / coeffs[0])}, steps, schema)
    if strategy == "blt":
        strat = optimize_blt(steps, buffers, maxiter=maxiter)
        return CorrelatedPlan(
            "blt", {"omega": tuple(strat.omega), "theta": tuple(strat.theta)}, steps, schema
        )
    if strategy in TREES:
        return CorrelatedPlan(strategy, {}, steps, schema)
    raise ValueError(
        f"strategy must be one of {{{', '.join(STRATEGIES)}}}, got strategy={strategy!r}"
    )

"""The seams of the Monte Carlo accountant: directions, sampling jobs, their results, and the
:class:`LossEstimator` protocol that every estimator implements.

A run has two stages. Jobs (:class:`Job`, pure functions of a seed) draw privacy-loss samples
or sufficient statistics of them (:data:`JobResult`); an estimator merges all jobs' results and
turns them into delta estimates and upper confidence bounds at any epsilon. Deltas are
probabilities (dimensionless); epsilons are in nats.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from dpfy.accounting.monte_carlo.epochs import Epoch

FloatArray = npt.NDArray[np.float64]
AnyFloatArray = npt.NDArray[np.floating[Any]]  # float32 or float64 draws
IntArray = npt.NDArray[np.int64]

Direction = Literal["remove", "add"]
DIRECTIONS: tuple[Direction, Direction] = ("remove", "add")
"""remove: E_P[(1 - e^(eps - L))_+]; add: E_Q[(1 - e^(eps + L))_+] (Chua et al. 2025)."""

DirectionPair = tuple[float, float]
"""A value per direction, in the order of :data:`DIRECTIONS` (remove, add)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One chunk of sampling work (top-level and picklable, so a process pool can run it).

    Attributes:
      epochs: the composed epochs.
      n: samples per direction in this job.
      seed: the job's ``numpy.random.SeedSequence`` (a child of the run's seed).
      mode: the sampler (a key of :data:`dpfy.accounting.monte_carlo.runner.SAMPLERS`).
      threshold: losses <= threshold are dropped (the integrand is 0 there for eps >=
        threshold).
      chunk: Gaussian draws held in memory at once.
      orders: order statistics: the indices k_1 = 1 < ... < k_m per epoch.
      m_star: conditional: split level of the other coordinates' maximum (inf: no split).
      big_fraction: conditional: share of samples from the stratum "maximum > m_star".
      tilt_order: tilted: the integer order a of the tilted mixture.
    """

    epochs: tuple[Epoch, ...]
    n: int
    seed: np.random.SeedSequence
    mode: str
    threshold: float
    chunk: int
    orders: tuple[IntArray, ...] | None = None
    m_star: float = math.inf
    big_fraction: float = 0.0
    tilt_order: int = 0


@dataclasses.dataclass(frozen=True)
class LossSamples:
    """Kept privacy-loss samples of ``n`` draws per direction (sorted, all > the threshold).

    ``weights`` are the (remove, add) probabilities of the importance-sampling events (1 if
    none): each direction's delta is weight x mean over the n draws. Samplers that only draw
    one direction leave the other empty.
    """

    n: int
    remove: FloatArray
    add: FloatArray
    weights: DirectionPair = (1.0, 1.0)

    def values(self, direction: Direction) -> FloatArray:
        return self.remove if direction == "remove" else self.add

    def weight(self, direction: Direction) -> float:
        return self.weights[DIRECTIONS.index(direction)]


@dataclasses.dataclass(frozen=True)
class SumHistograms:
    """Histograms of log S (sum over the other coordinates) for the two strata of a job.

    ``hist`` counts the ``n`` samples of the stratum without big terms, ``hist_big`` the
    ``n_big`` samples whose maximum exceeds m* (see :mod:`.conditional`).
    """

    n: int
    n_big: int
    hist: IntArray
    hist_big: IntArray


JobResult = LossSamples | SumHistograms

Sampler = Callable[[Job, np.random.Generator], JobResult]
"""A job's sampler: a pure function of the job and its generator."""


@runtime_checkable
class LossEstimator(Protocol):
    """Delta(epsilon) statements from merged job results, for both directions.

    Every estimate is a mean of bounded samples (times a known scale); every upper bound holds
    with probability >= 1 - ``error_probability`` and is non-increasing in epsilon.
    """

    @property
    def error_probability(self) -> float:
        """The probability that :meth:`upper` is below the true delta."""
        ...

    def estimate(self, epsilon: float) -> float:
        """Point estimate of delta(epsilon): the maximum over the directions."""
        ...

    def upper(self, epsilon: float) -> float:
        """Upper confidence bound on delta(epsilon) (maximum over directions)."""
        ...

    def delta(self, epsilon: float, error_probability: float) -> tuple[float, float, Direction]:
        """(estimate, upper bound, direction attaining the upper bound) at epsilon."""
        ...

    def by_direction(self, epsilon: float) -> tuple[DirectionPair, DirectionPair]:
        """((remove, add) estimates, (remove, add) importance scales) at epsilon."""
        ...

    def top(self) -> float:
        """An epsilon above every kept loss (delta vanishes beyond it); inf if unknown."""
        ...

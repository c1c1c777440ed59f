"""The ``monte_carlo`` accountant: Balls-and-Bins epochs and Gaussians, by Monte Carlo
(Chua et al. 2025).

One epoch of T steps of Balls-and-Bins DP-SGD with noise multiplier z is tightly dominated by
    P = (1/T) sum_t N(e_t, z^2 I_T),   Q = N(0, z^2 I_T)        (Chua et al. 2025, Thm. 3.1)
with privacy loss L(x) = log P(x)/Q(x) = logsumexp_t((2 x_t - 1) / (2 z^2)) - log T. Several
epochs (or any composition of Balls-and-Bins epochs and plain Gaussians, a Gaussian being the
T = 1 case) compose as products, so L adds over epochs. For add/remove (and zero-out) adjacency
    delta(eps) = max( E_P[(1 - e^(eps - L))_+],  E_Q[(1 - e^(eps + L))_+] ),
the "remove" and "add" directions. Both are means of [0, 1]-valued variables, estimated by
Monte Carlo with an upper confidence bound from the Chernoff-Hoeffding (Bernoulli-KL) inequality
(Chua et al. 2025, Alg. 4, Thm. 4.1; :mod:`.confidence`): with probability
>= 1 - error_probability the true delta is at most the reported bound. The reported epsilon at
a target delta is the smallest epsilon whose delta bound is <= delta; it is >= the true epsilon
with the same probability (the bound is monotone in epsilon). The direction taking the maximum
is fixed (if unknown), so each direction uses the full error probability.

Samplers (``method``, chosen in :mod:`.methods`): :mod:`.plain`, :mod:`.importance`,
:mod:`.order_statistics`, :mod:`.conditional`, :mod:`.tilted` (with :mod:`.hybrid` for one
epoch). The certain lower bound is :mod:`.lower_bound`. Jobs run as in :mod:`.runner`.

Registered accountant: ``monte_carlo``, in ``auto`` because it is the only accountant for
``BallsAndBins``. Its default sample count (:func:`default_samples`, about 1e8 Gaussian draws)
keeps ``epsilon(BallsAndBins(...), 1e-5)`` to a few seconds on an idle core, at the price of a
looser upper bound; pass a :class:`MonteCarloAccountant` with more ``samples`` (and an
``executor``) for a tighter one. Results have ``provable=False`` and state
``error_probability``. When the Monte Carlo bound is looser than the provable no-amplification
bound (exact Gaussian composition, valid since Balls-and-Bins is at least as private as
deterministic batching, Chua et al. 2025, Prop. 3.3), that provable bound is reported instead.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting._api import PrivacyResult, register_accountant
from dpfy.accounting.monte_carlo.epochs import Epoch, epochs_of_event, unsupported
from dpfy.accounting.monte_carlo.lower_bound import lower_bound_delta, lower_bound_epsilon
from dpfy.accounting.monte_carlo.methods import (
    METHODS,
    Method,
    build_estimator,
    default_samples,
    smallest_epsilon,
)


@dataclasses.dataclass(frozen=True, slots=True)
class MonteCarloEstimate:
    """A Monte Carlo (epsilon, delta) statement.

    Attributes:
      epsilon, delta: for ``monte_carlo_delta`` epsilon is the input and ``delta_*`` the output;
        for ``monte_carlo_epsilon`` delta is the input and ``epsilon_*`` the output.
      epsilon_upper / delta_upper: the bound holding with prob. >= 1 - error_probability.
      epsilon_estimate / delta_estimate: the point estimate (Monte Carlo mean).
      epsilon_lower / delta_lower: the certain (analytic) lower bound.
      direction: the adjacency direction attaining the maximum ("remove" or "add").
      samples, method, error_probability, seconds: how it was computed.
      direction_estimates: delta estimates (remove, add) at the reported epsilon.
      direction_scales: (remove, add) probability of the importance-sampling event (1 if none);
        each direction's estimate is that scale times a mean of [0, 1]-valued samples.
    """

    epsilon_upper: float
    epsilon_estimate: float
    epsilon_lower: float
    delta_upper: float
    delta_estimate: float
    delta_lower: float
    direction: str
    samples: int
    method: str
    error_probability: float
    seconds: float
    direction_estimates: tuple[float, float] = (math.nan, math.nan)
    direction_scales: tuple[float, float] = (1.0, 1.0)


def _check_common(samples: int, error_probability: float, method: str) -> None:
    check_int("samples", samples)
    check_range(
        "error_probability", error_probability, 0.0, 1.0, low_open=True, high_open=True
    )
    if method not in METHODS:
        allowed = ", ".join(METHODS)
        raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")


def monte_carlo_delta(
    epochs: Sequence[Epoch],
    epsilon: float,
    *,
    samples: int | None = None,
    error_probability: float = 1e-3,
    method: Method = "auto",
    seed: int | None = None,
    executor: Executor | None = None,
    chunk_elements: int = 1 << 22,
    progress: bool = True,
) -> MonteCarloEstimate:
    """Monte Carlo delta(epsilon) of a composition of Balls-and-Bins epochs (both directions).

    Args:
      epochs: the epochs (see :func:`epochs_of_event`); a Gaussian is ``Epoch(z, 1)``.
      epsilon: epsilon >= 0.
      samples: Monte Carlo samples per direction (default :func:`default_samples`).
      error_probability: probability that ``delta_upper`` is below the true delta.
      method: ``auto``, ``plain``, ``importance``, ``order_statistics``, ``conditional`` or
        ``tilted`` (:mod:`dpfy.accounting.monte_carlo.methods`).
      seed: seed of the sampler (None: fresh OS entropy).
      executor: run chunks on this ``concurrent.futures.Executor`` (None: in this process).
      chunk_elements: Gaussian draws held in memory at once per job.
      progress: show a progress bar if the run exceeds ~2 s.
    """
    t0 = time.perf_counter()
    epochs = list(epochs)
    check_range("epsilon", epsilon, 0.0, None)
    samples = default_samples(epochs) if samples is None else samples
    _check_common(samples, error_probability, method)
    losses, mode = build_estimator(
        epochs,
        samples=samples,
        threshold=float(epsilon),
        method=method,
        seed=seed,
        executor=executor,
        chunk_elements=chunk_elements,
        progress=progress,
        error_probability=error_probability,
        delta=None,
    )
    est, ub, direction = losses.delta(float(epsilon), error_probability)
    by_dir, scales = losses.by_direction(float(epsilon))
    low = lower_bound_delta(epochs, float(epsilon))
    return MonteCarloEstimate(
        epsilon_upper=float(epsilon),
        epsilon_estimate=float(epsilon),
        epsilon_lower=float(epsilon),
        delta_upper=min(1.0, ub),
        delta_estimate=est,
        delta_lower=low,
        direction=direction,
        samples=samples,
        method=mode,
        error_probability=error_probability,
        seconds=time.perf_counter() - t0,
        direction_estimates=by_dir,
        direction_scales=scales,
    )


def monte_carlo_epsilon(
    epochs: Sequence[Epoch],
    delta: float,
    *,
    samples: int | None = None,
    error_probability: float = 1e-3,
    method: Method = "auto",
    seed: int | None = None,
    executor: Executor | None = None,
    chunk_elements: int = 1 << 22,
    progress: bool = True,
) -> MonteCarloEstimate:
    """Monte Carlo epsilon(delta): upper confidence bound, estimate and certain lower bound.

    ``epsilon_upper`` is the smallest epsilon whose delta upper bound is <= ``delta``; it is at
    least the true epsilon with probability >= 1 - ``error_probability``. ``inf`` means the
    samples cannot certify ``delta`` at any epsilon (use more samples). Arguments as in
    :func:`monte_carlo_delta`.
    """
    t0 = time.perf_counter()
    epochs = list(epochs)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    samples = default_samples(epochs) if samples is None else samples
    _check_common(samples, error_probability, method)
    eps_low = lower_bound_epsilon(epochs, delta)
    # Losses below the threshold cannot contribute at any epsilon >= threshold. The estimate and
    # the bound lie above the lower bound unless the sample is wildly off; half of it is margin.
    threshold = 0.5 * eps_low if math.isfinite(eps_low) else 0.0
    losses, mode = build_estimator(
        epochs,
        samples=samples,
        threshold=threshold,
        method=method,
        seed=seed,
        executor=executor,
        chunk_elements=chunk_elements,
        progress=progress,
        error_probability=error_probability,
        delta=float(delta),
    )
    top = losses.top()
    if not math.isfinite(top):  # conditional: grow the bracket until the bound certifies delta
        top = max(threshold, 0.5)
        while losses.upper(top) > delta and top < 1e3:
            top *= 2.0
    eps_up = smallest_epsilon(losses.upper, delta, threshold, top)
    eps_est = smallest_epsilon(losses.estimate, delta, threshold, top)
    at = eps_up if math.isfinite(eps_up) else top
    _, _, direction = losses.delta(at, error_probability)
    by_dir, scales = losses.by_direction(at)
    return MonteCarloEstimate(
        epsilon_upper=eps_up,
        epsilon_estimate=eps_est,
        epsilon_lower=eps_low,
        delta_upper=float(delta),
        delta_estimate=float(delta),
        delta_lower=float(delta),
        direction=direction,
        samples=samples,
        method=mode,
        error_probability=error_probability,
        seconds=time.perf_counter() - t0,
        direction_estimates=by_dir,
        direction_scales=scales,
    )


def balls_and_bins_epsilon(
    noise_multiplier: float, steps_per_epoch: int, delta: float, *, epochs: int = 1,
    **options: Any,
) -> MonteCarloEstimate:
    """:func:`monte_carlo_epsilon` for ``epochs`` identical Balls-and-Bins epochs.

    Example:
      >>> r = balls_and_bins_epsilon(1.0, 1, 1e-5, samples=200_000, seed=0, progress=False)
      >>> r.epsilon_lower <= r.epsilon_estimate <= r.epsilon_upper
      True
    """
    return monte_carlo_epsilon(
        [Epoch(noise_multiplier, steps_per_epoch)] * int(epochs), delta, **options
    )


def balls_and_bins_delta(
    noise_multiplier: float, steps_per_epoch: int, epsilon: float, *, epochs: int = 1,
    **options: Any,
) -> MonteCarloEstimate:
    """:func:`monte_carlo_delta` for ``epochs`` identical Balls-and-Bins epochs."""
    return monte_carlo_delta(
        [Epoch(noise_multiplier, steps_per_epoch)] * int(epochs), epsilon, **options
    )


@dataclasses.dataclass(frozen=True)
class MonteCarloAccountant:
    """The ``monte_carlo`` accountant: Balls-and-Bins epochs and Gaussians, by Monte Carlo.

    Configure and pass as ``method=`` to :func:`dpfy.accounting.epsilon` for more samples, a
    seed or an executor. Results: ``epsilon`` = upper confidence bound (``provable=False``),
    ``epsilon_estimate``, ``epsilon_lower`` (certain), ``error_probability``.

    Truncation (``TruncatedBallsAndBins``) is accounted as the untruncated mechanism here; the
    extra delta of :mod:`dpfy.accounting.truncation` is added by the public ``epsilon()``.
    """

    samples: int | None = None
    error_probability: float = 1e-3
    seed: int | None = 0
    method: Method = "auto"
    executor: Executor | None = None
    progress: bool = True
    name: str = "monte_carlo"

    def unsupported(self, event: ev.Event) -> str | None:
        return unsupported(event)

    def _options(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "error_probability": self.error_probability,
            "method": self.method,
            "seed": self.seed,
            "executor": self.executor,
            "progress": self.progress,
        }

    def _notes(self, r: MonteCarloEstimate) -> tuple[str, ...]:
        notes = [
            f"Monte Carlo estimate ({r.method} sampling, {r.samples} samples per direction): "
            f"epsilon is an upper confidence bound holding with probability "
            f">= 1 - {r.error_probability:g}; not a provable guarantee",
            f"dominating direction: {r.direction}",
        ]
        if r.method == "order_statistics":
            notes.append("order-statistics sampling: pessimistic bound on the privacy loss")
        if r.method == "tilted":
            notes.append(
                "tilted sampling: remove direction by importance sampling; add direction by "
                + ("the conditional sampler or " if r.direction_scales[1] == 1.0 else "")
                + "its Renyi-moment bound (numerical quadrature); the estimate is "
                + ("the larger direction's" if r.direction_scales[1] == 1.0 else
                   "the remove direction's")
            )
        if math.isinf(r.epsilon_upper):
            notes.append("too few samples to certify this delta; increase samples")
        return tuple(notes)

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        epochs = epochs_of_event(event)
        r = monte_carlo_epsilon(epochs, delta, **self._options())
        eps, provable, notes = r.epsilon_upper, False, self._notes(r)
        fallback = _no_amplification_epsilon(epochs, delta)
        if fallback <= eps:
            eps, provable = fallback, True
            notes = (*notes, NO_AMPLIFICATION_NOTE)
        return PrivacyResult(
            epsilon=eps,
            delta=float(delta),
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=provable,
            epsilon_estimate=r.epsilon_estimate,
            epsilon_lower=r.epsilon_lower,
            error_probability=None if provable else r.error_probability,
            notes=notes,
        )

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        epochs = epochs_of_event(event)
        r = monte_carlo_delta(epochs, epsilon, **self._options())
        d, provable, notes = r.delta_upper, False, self._notes(r)
        from dpfy.accounting.gaussian import gaussian_delta

        fallback = float(gaussian_delta(_no_amplification_mu(epochs), epsilon))
        if fallback <= d:
            d, provable = fallback, True
            notes = (*notes, NO_AMPLIFICATION_NOTE)
        return PrivacyResult(
            epsilon=float(epsilon),
            delta=d,
            method=self.name,
            adjacency=event.adjacency_relation.value,
            provable=provable,
            error_probability=None if provable else r.error_probability,
            notes=(
                *notes,
                f"delta estimate {r.delta_estimate:.6g}; certain lower bound {r.delta_lower:.6g}",
            ),
        )


NO_AMPLIFICATION_NOTE = (
    "the Monte Carlo bound was looser than the provable no-amplification bound (each example in "
    "one batch per epoch: exact Gaussian composition; Balls-and-Bins is at least as private as "
    "deterministic batching, Chua et al. 2025, Prop. 3.3), which is reported instead"
)


def _no_amplification_mu(epochs: Sequence[Epoch]) -> float:
    return math.sqrt(sum(1.0 / e.noise_multiplier**2 for e in epochs))


def _no_amplification_epsilon(epochs: Sequence[Epoch], delta: float) -> float:
    from dpfy.accounting.gaussian import gaussian_epsilon

    return float(gaussian_epsilon(_no_amplification_mu(epochs), delta))


# Not an auto method: Balls-and-Bins events get the provable random-allocation PLD by default
# (dpfy.accounting.random_allocation); Monte Carlo stays selectable as an estimate.
register_accountant(MonteCarloAccountant(), auto=False)

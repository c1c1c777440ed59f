"""Choosing and building the loss estimator of a run (``method``), and the epsilon search.

``auto`` picks: importance sampling for one epoch when both importance events have probability
< 1/4; else ``tilted`` (with the conditional add direction, :mod:`.hybrid`) for one epoch with
T >= 16; for several epochs order statistics when T > 20,000, ``tilted`` otherwise; ``plain``
in the remaining single-epoch cases. Every tuning choice (tilt order, stratification level m*,
the conditional cap tau) is made from analytic quantities or an independent pilot stream,
never from the samples that enter the bound, so the bound keeps its error probability.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Literal

from dpfy.accounting import roots
from dpfy.accounting.monte_carlo.base import JobResult, LossEstimator, LossSamples, SumHistograms
from dpfy.accounting.monte_carlo.conditional import BIG_FRACTION, ConditionalLosses, split_level
from dpfy.accounting.monte_carlo.empirical import EmpiricalLosses
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.hybrid import HybridLosses
from dpfy.accounting.monte_carlo.importance import event_probabilities
from dpfy.accounting.monte_carlo.lower_bound import lower_bound_delta
from dpfy.accounting.monte_carlo.runner import sample_losses
from dpfy.accounting.monte_carlo.tilted import TiltedLosses, choose_tilt_order

Method = Literal["auto", "plain", "importance", "order_statistics", "conditional", "tilted"]
METHODS: tuple[Method, ...] = (
    "auto", "plain", "importance", "order_statistics", "conditional", "tilted"
)
_ORDER_STATISTICS_ABOVE = 20_000  # steps per epoch from which auto uses order statistics


def default_samples(epochs: Sequence[Epoch], budget: float = 5e7) -> int:
    """Default sample count: about ``budget`` Gaussian draws, between 2^12 and 2^22 samples.

    About 2 s per idle core with NumPy; use more samples for a tighter upper bound.
    """
    cost = sum(e.steps for e in epochs)
    return int(min(2**22, max(2**12, budget // max(cost, 1))))


def choose_mode(epochs: Sequence[Epoch], method: str, threshold: float) -> str:
    """The sampler for ``method`` (``auto``: see the module docstring); checks applicability."""
    if method != "auto":
        if method in ("importance", "conditional") and len(epochs) != 1:
            raise ValueError(
                f"method={method!r} applies to a single epoch (Chua et al., App. B.4), "
                f"got {len(epochs)} epochs"
            )
        if method == "conditional" and epochs[0].steps < 2:
            raise ValueError("method='conditional' needs steps >= 2 (T = 1 is a Gaussian)")
        return method
    if len(epochs) == 1:
        ep = epochs[0]
        p_rem, p_add = event_probabilities(ep.noise_multiplier, ep.steps, threshold)
        if max(p_rem, p_add) < 0.25:
            return "importance"
        if ep.steps >= 16:
            return "tilted"  # remove: tilted sampler; add: conditional sampler
    if max(e.steps for e in epochs) > _ORDER_STATISTICS_ABOVE:
        return "order_statistics"
    if len(epochs) > 1:
        return "tilted"
    return "plain"


def smallest_epsilon(fn: Callable[[float], float], delta: float, lo: float, hi: float) -> float:
    """Smallest eps in [lo, hi] with fn(eps) <= delta for non-increasing fn; inf if none."""
    if fn(lo) <= delta:
        return lo
    if fn(hi) > delta:
        return math.inf
    return roots.safe_root(lambda e: fn(e) - delta, lo, hi, side="high", xtol=1e-6, rtol=1e-6)


def _loss_samples(results: Sequence[JobResult]) -> list[LossSamples]:
    out = [r for r in results if isinstance(r, LossSamples)]
    if len(out) != len(results):
        raise TypeError("expected loss samples from every job")
    return out


def _histograms(results: Sequence[JobResult]) -> list[SumHistograms]:
    out = [r for r in results if isinstance(r, SumHistograms)]
    if len(out) != len(results):
        raise TypeError("expected histograms from every job")
    return out


def build_estimator(
    epochs: Sequence[Epoch],
    *,
    samples: int,
    threshold: float,
    method: str,
    seed: int | None,
    executor: Executor | None,
    chunk_elements: int,
    progress: bool,
    error_probability: float,
    delta: float | None,
) -> tuple[LossEstimator, str]:
    """(estimator, mode) for the chosen sampler; ``delta`` given: epsilon search, tau from a
    pilot. Losses <= ``threshold`` are dropped (valid for epsilon >= threshold)."""
    mode = choose_mode(epochs, method, threshold)

    def run(n: int, *, pilot: bool = False, m_star: float = math.inf,
            big_fraction: float = 0.0, tilt_order: int = 0) -> list[JobResult]:
        return sample_losses(
            epochs, samples=n, threshold=threshold, mode=mode, seed=seed, executor=executor,
            chunk_elements=chunk_elements, progress=progress, pilot=pilot, m_star=m_star,
            big_fraction=big_fraction, tilt_order=tilt_order,
        )

    if mode == "tilted":
        # the order is chosen from the analytic moments only (delta, or the lower bound's delta
        # at the threshold when epsilon is given), never from the samples
        delta_ref = delta if delta is not None else lower_bound_delta(epochs, threshold)
        order = choose_tilt_order(epochs, min(max(delta_ref, 1e-300), 0.5))
        tilted = TiltedLosses(
            _loss_samples(run(samples, tilt_order=order)), epochs, order, threshold,
            error_probability,
        )
        if len(epochs) == 1 and epochs[0].steps >= 16:
            # one epoch: the add direction by the conditional sampler instead of the looser
            # Renyi bound (independent stream: seed + 1)
            cond, _ = build_estimator(
                epochs, samples=samples, threshold=threshold, method="conditional",
                seed=None if seed is None else seed + 1, executor=executor,
                chunk_elements=chunk_elements, progress=progress,
                error_probability=error_probability, delta=delta,
            )
            if not isinstance(cond, ConditionalLosses):
                raise TypeError("the conditional method built another estimator")
            return HybridLosses(tilted, cond), mode
        return tilted, mode
    if mode != "conditional":
        return EmpiricalLosses(_loss_samples(run(samples)), threshold, error_probability), mode
    # Split the other coordinates at m* so that the rare "some other batch has a huge value"
    # stratum is sampled directly (1/16 of the samples) and the rest has light tails.
    delta_ref = delta if delta is not None else lower_bound_delta(epochs, threshold)
    big_fraction = BIG_FRACTION
    m_star = split_level(epochs[0].steps, int(samples * big_fraction), delta_ref,
                         error_probability)
    if not math.isfinite(m_star):
        big_fraction = 0.0
    results = _histograms(run(samples, m_star=m_star, big_fraction=big_fraction))
    reference = threshold
    if delta is not None:
        # tau is tuned at a pilot estimate from an independent stream (never from the samples
        # that enter the bound), so the bound keeps its error probability
        pilot = _histograms(
            run(max(8, samples // 16), pilot=True, m_star=m_star, big_fraction=big_fraction)
        )
        p = ConditionalLosses(pilot, epochs[0], error_probability, threshold, m_star)
        est = smallest_epsilon(p.estimate, delta, threshold, max(threshold, 1.0) * 64)
        if math.isfinite(est):
            reference = max(threshold, 0.97 * est)
    return ConditionalLosses(results, epochs[0], error_probability, reference, m_star), mode

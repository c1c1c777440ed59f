"""Statistics of privacy audits: confidence intervals and empirical epsilon lower bounds.

Pure NumPy/SciPy functions, no torch. An audit runs a membership test many times: scores of
releases *with* a canary (``scores_in``) and *without* it (``scores_out``). If the mechanism is
(epsilon, delta)-DP, every test S obeys ``P_in[S] <= e^epsilon P_out[S] + delta`` and the same
with in and out swapped (Kairouz, Oh, Viswanath 2015), so a threshold test "score > t" with
true-positive rate TPR and false-positive rate FPR gives (Jagielski et al. 2020; Nasr et al.
2023, arXiv 2302.07956)

    epsilon >= log((TPR - delta) / FPR)        and, the other orientation,
    epsilon >= log((TNR - delta) / FNR).

Rates are estimated with one-sided Clopper-Pearson bounds, TPR from below and FPR from above,
each at error ``beta / 2`` (a union bound), so the bound holds with probability at least
``1 - beta`` when the trials are independent.

Choosing the threshold on the same trials that evaluate it would invalidate the confidence.
Two honest ways are offered: ``selection="split"`` picks the threshold and orientation on the
first half of the trials and evaluates them once on the second half; ``selection="grid"`` takes
a fixed grid of thresholds chosen before the trials and spends ``beta`` over all
``2 x len(grid)`` tests (a union bound).

The one-run bound of Steinke, Nasr and Jagielski 2023 (arXiv 2305.08846, Theorem 5.2 and
Appendix D) needs no independence between canaries: ``m`` canaries, each included with
probability 1/2, ``r`` guesses (the rest abstain) of which ``v`` are correct.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy import stats

from dpfy._validate import check_int, check_range

Selection = Literal["split", "grid"]
Orientation = Literal["above", "below"]


def _check_confidence(confidence: float) -> None:
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)


def clopper_pearson(
    successes: int | np.ndarray, trials: int | np.ndarray, confidence: float
) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds of a binomial rate, each at confidence ``confidence``.

    Returns ``(lower, upper)``: ``P[p < lower] <= 1 - confidence`` and
    ``P[p > upper] <= 1 - confidence`` for ``successes ~ Binomial(trials, p)`` (each side
    alone; a two-sided interval at level c uses ``confidence = (1 + c) / 2``).
    Vectorised over arrays of counts.
    """
    _check_confidence(confidence)
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise ValueError(
            f"successes must be in [0, trials] and trials >= 1, got successes={successes!r}, "
            f"trials={trials!r}"
        )
    return _cp_lower(k, n, confidence), _cp_upper(k, n, confidence)


def _cp_lower(k: np.ndarray, n: np.ndarray, confidence: float) -> np.ndarray:
    """The lower side of :func:`clopper_pearson` alone (float counts, already checked)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out: np.ndarray = np.where(k > 0, stats.beta.ppf(1.0 - confidence, k, n - k + 1), 0.0)
    return out


def _cp_upper(k: np.ndarray, n: np.ndarray, confidence: float) -> np.ndarray:
    """The upper side of :func:`clopper_pearson` alone (float counts, already checked)."""
    a = 1.0 - confidence
    with np.errstate(invalid="ignore", divide="ignore"):
        out: np.ndarray = np.where(k < n, stats.beta.ppf(1.0 - a, k + 1, n - k), 1.0)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ThresholdBound:
    """An empirical epsilon lower bound from one threshold test.

    Attributes:
      epsilon: the lower bound (0 when no test gives a positive one); holds with probability
        at least ``confidence`` if the trials are independent.
      confidence: 1 - beta.
      threshold: the score threshold of the evaluated test.
      orientation: ``"above"`` (guess "in" when score > threshold) or ``"below"``.
      tpr_lower, fpr_upper: the Clopper-Pearson bounds used (of the oriented test).
      n_in, n_out: trials with and without the canary that evaluated the test.
      selection: ``"split"`` or ``"grid"``.
      mu_lower: the Gaussian-DP mu implied by the same (TPR, FPR) bounds,
        ``Phi^-1(TPR_lo) - Phi^-1(FPR_hi)`` (an estimate that assumes a Gaussian trade-off
        curve; not a bound for other mechanisms). 0 when not positive.
    """

    epsilon: float
    confidence: float
    threshold: float
    orientation: Orientation
    tpr_lower: float
    fpr_upper: float
    n_in: int
    n_out: int
    selection: Selection
    mu_lower: float


def _as_scores(name: str, scores: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(scores, dtype=np.float64).ravel()
    if arr.size < 2:
        raise ValueError(f"{name} must hold at least 2 scores, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite scores")
    return arr


def _rates(
    s_in: np.ndarray, s_out: np.ndarray, thresholds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Counts of scores > t (in, out) and <= t, for each threshold t."""
    a_in, a_out = np.sort(s_in), np.sort(s_out)
    above_in = a_in.size - np.searchsorted(a_in, thresholds, side="right")
    above_out = a_out.size - np.searchsorted(a_out, thresholds, side="right")
    return above_in, above_out, a_in.size - above_in, a_out.size - above_out


def _bounds(
    s_in: np.ndarray, s_out: np.ndarray, thresholds: np.ndarray, delta: float, conf_each: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per threshold, both orientations stacked: (eps, tpr_lo, fpr_hi, orient_index, t)."""
    above_in, above_out, below_in, below_out = _rates(s_in, s_out, thresholds)
    # "above": positives are in-trials with score > t; "below": positives are out-trials
    # with score <= t (the swapped pair), negatives in-trials with score <= t.
    pos = np.concatenate([above_in, below_out])
    n_pos = np.concatenate(
        [np.full(thresholds.size, s_in.size), np.full(thresholds.size, s_out.size)]
    )
    neg = np.concatenate([above_out, below_in])
    n_neg = np.concatenate(
        [np.full(thresholds.size, s_out.size), np.full(thresholds.size, s_in.size)]
    )
    # only the side each rate needs (the beta quantiles dominate the cost of a bound)
    tpr_lo = _cp_lower(pos.astype(np.float64), n_pos.astype(np.float64), conf_each)
    fpr_hi = _cp_upper(neg.astype(np.float64), n_neg.astype(np.float64), conf_each)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log(np.maximum(tpr_lo - delta, 0.0) / fpr_hi)
    eps = np.where(np.isfinite(eps), eps, 0.0)
    orient = np.concatenate([np.zeros(thresholds.size), np.ones(thresholds.size)])
    return np.maximum(eps, 0.0), tpr_lo, fpr_hi, orient, np.concatenate([thresholds, thresholds])


def _mu(tpr_lo: float, fpr_hi: float) -> float:
    if tpr_lo <= 0.0 or fpr_hi >= 1.0:
        return 0.0
    return max(0.0, float(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)))


def gdp_mu_lower(tpr_lower: float, fpr_upper: float) -> float:
    """The Gaussian-DP mu of a test point: ``Phi^-1(TPR) - Phi^-1(FPR)`` (Dong, Roth, Su 2022).

    For a mu-GDP mechanism every test has ``TPR <= Phi(Phi^-1(FPR) + mu)``; given rate bounds
    ``tpr_lower`` and ``fpr_upper`` this is the smallest mu consistent with them (0 if none).
    It estimates mu *assuming* the mechanism's trade-off curve is Gaussian (Nasr et al. 2023).
    """
    check_range("tpr_lower", tpr_lower, 0.0, 1.0)
    check_range("fpr_upper", fpr_upper, 0.0, 1.0)
    return _mu(tpr_lower, fpr_upper)


def threshold_epsilon_bound(
    scores_in: Sequence[float] | np.ndarray,
    scores_out: Sequence[float] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    selection: Selection = "split",
    thresholds: Sequence[float] | np.ndarray | None = None,
    max_candidates: int = 4096,
) -> ThresholdBound:
    """Empirical epsilon lower bound from threshold tests on scores with and without a canary.

    Args:
      scores_in: scores of trials that included the canary (higher = "looks in").
      scores_out: scores of trials without it.
      delta: the delta of the claim being audited, in [0, 1).
      confidence: 1 - beta, in (0, 1).
      selection: ``"split"``: the first half of each score array (in the given order, which
        must not depend on the scores) chooses the threshold and orientation among at most
        ``max_candidates`` quantiles, the second half evaluates that one test. ``"grid"``: the
        fixed ``thresholds`` (chosen before the trials), all trials, confidence split over
        ``2 x len(thresholds)`` tests.
      thresholds: the fixed grid for ``selection="grid"``.
      max_candidates: number of candidate thresholds on the selection half.

    Returns:
      :class:`ThresholdBound`.

    Raises:
      ValueError: bad arguments (named).
    """
    check_range("delta", delta, 0.0, 1.0, high_open=True)
    _check_confidence(confidence)
    check_int("max_candidates", max_candidates)
    s_in = _as_scores("scores_in", scores_in)
    s_out = _as_scores("scores_out", scores_out)
    beta = 1.0 - confidence
    if selection == "grid":
        if thresholds is None:
            raise ValueError("thresholds must be given (a fixed grid) when selection='grid'")
        grid = np.asarray(thresholds, dtype=np.float64).ravel()
        if grid.size == 0 or not np.all(np.isfinite(grid)):
            raise ValueError("thresholds must be a non-empty grid of finite numbers")
        conf_each = 1.0 - beta / (2.0 * 2.0 * grid.size)
        eps, tpr, fpr, orient, ts = _bounds(s_in, s_out, grid, delta, conf_each)
        i = int(np.argmax(eps))
        n_in, n_out = s_in.size, s_out.size
    elif selection == "split":
        if thresholds is not None:
            raise ValueError("thresholds are only used with selection='grid'")
        if s_in.size < 4 or s_out.size < 4:
            raise ValueError("selection='split' needs at least 4 scores on each side")
        h_in, h_out = s_in.size // 2, s_out.size // 2
        sel_in, ev_in = s_in[:h_in], s_in[h_in:]
        sel_out, ev_out = s_out[:h_out], s_out[h_out:]
        pooled = np.concatenate([sel_in, sel_out])
        qs = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, min(max_candidates, pooled.size))))
        # choose on the selection half with the confidence the evaluation will use
        conf_each = 1.0 - beta / 2.0
        eps_sel, *_rest, orient_sel, ts_sel = _bounds(sel_in, sel_out, qs, delta, conf_each)
        j = int(np.argmax(eps_sel))
        t, o = float(ts_sel[j]), int(orient_sel[j])
        eps, tpr, fpr, orient, ts = _bounds(ev_in, ev_out, np.array([t]), delta, conf_each)
        i = o  # index of the chosen orientation among the two stacked entries
        n_in, n_out = ev_in.size, ev_out.size
    else:
        raise ValueError(
            f"selection must be one of {{'split', 'grid'}}, got selection={selection!r}"
        )
    orientation: Orientation = "above" if orient[i] == 0 else "below"
    if orientation == "below":
        n_in, n_out = n_out, n_in  # positives of the swapped test are the out-trials
    return ThresholdBound(
        epsilon=float(eps[i]),
        confidence=confidence,
        threshold=float(ts[i]),
        orientation=orientation,
        tpr_lower=float(tpr[i]),
        fpr_upper=float(fpr[i]),
        n_in=int(n_in),
        n_out=int(n_out),
        selection=selection,
        mu_lower=_mu(float(tpr[i]), float(fpr[i])),
    )


# ----------------------------------------------------------------------------------------
# One-run auditing: Steinke, Nasr, Jagielski 2023 (arXiv 2305.08846), Theorem 5.2, App. D.


def _check_counts(m: int, r: int, v: int) -> None:
    check_int("m", m)
    check_int("r", r, 0, m)
    check_int("v", v, 0, r)


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least v of r guesses correct] if the run is (epsilon, delta)-DP for each canary.

    ``m`` canaries, each included independently with probability 1/2; ``r`` guesses; ``v``
    correct. With q = e^eps / (1 + e^eps) (the accuracy of eps-randomised response) the value
    is ``P[Binomial(r, q) >= v] + 2 m delta max_{1<=i<=v} P[v > Binomial(r, q) >= v - i] / i``
    (Steinke et al. 2023, Theorem 5.2 and Appendix D), capped at 1.
    """
    _check_counts(m, r, v)
    check_range("epsilon", epsilon, 0.0, math.inf, high_open=True)
    check_range("delta", delta, 0.0, 1.0)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))
    if delta == 0.0 or v == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # pmf(v-1), pmf(v-2), ..., pmf(0)
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + alpha * delta * 2.0 * m, 1.0)


def one_run_epsilon(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95) -> float:
    """Largest epsilon rejected at ``confidence``: the run is not (epsilon, delta)-DP.

    The p-value grows with epsilon; bisection (60 steps) finds where it crosses
    ``1 - confidence`` and returns the lower end (the safe side). 0 if even epsilon = 0 is
    not rejected.
    """
    _check_counts(m, r, v)
    check_range("delta", delta, 0.0, 1.0)
    _check_confidence(confidence)
    p = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) >= p:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < p:
        lo, hi = hi, 2.0 * hi
        if hi > 1e3:
            return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if one_run_p_value(m, r, v, mid, delta) < p:
            lo = mid
        else:
            hi = mid
    return lo


def one_run_ceiling(m: int, r: int, *, delta: float, confidence: float = 0.95) -> float:
    """The most the one-run method can show: the bound when all ``r`` guesses are correct."""
    return one_run_epsilon(m, r, r, delta=delta, confidence=confidence)

"""The f-DP one-run bound: a Gaussian-DP lower bound from the counts of a one-run audit.

Mahloujifar, Melis, Chaudhuri 2024 (arXiv 2410.22235), the analysis with abstention. The
setting is the one of Steinke, Nasr, Jagielski 2023 (:func:`dpfy.audit.stats.one_run_epsilon`):
``m`` canaries, each included with probability 1/2 by a secret coin; after one run the auditor
guesses the coin of ``r`` of them (abstaining on the rest) and ``v`` guesses are right.
Instead of asking whether the run is (epsilon, delta)-DP, it asks whether it is mu-GDP (its
trade-off curve between two neighbours is at least ``G_mu(a) = Phi(Phi^-1(1 - a) - mu)``, Dong,
Roth, Su 2022), which uses the whole curve instead of one (epsilon, delta) point of it, and so
rejects larger privacy parameters from the same counts.

The test, in our words. Fix the level ``tau = 1 - confidence`` and suppose a mu-GDP run made
``>= v`` correct guesses with probability at least ``tau``. Per canary (everything divided by
``m``), write ``a`` for the probability mass of "guessed and right" and ``b`` for "guessed and
wrong". On the event of at least ``v`` correct guesses, the run contributes at least
``a_v = tau v / m`` and ``b_v = tau (r - v) / m``. Flipping a canary's coin turns a right guess
into a wrong one; by the GDP curve a test that is right with mass ``a`` is wrong with mass at
least ``F(a) = Phi(Phi^-1(a) - mu)``. Walking down one correct guess at a time,
``i = v - 1, ..., 0``::

    b_i = max(b_{i+1}, F(a_{i+1}))
    a_i = a_{i+1} + i / (r - i) x (b_i - b_{i+1})

(an outcome with ``i`` right guesses among ``r`` carries ``i`` right per ``r - i`` wrong ones,
so wrong mass forced in by the curve brings right mass with it). Every run guesses at most
``r`` of the ``m`` canaries, so ``a_0 + b_0 <= r / m``; if the recursion ends above that, the
supposition was false: a mu-GDP run makes ``>= v`` correct guesses with probability below
``tau``, and mu is rejected at ``confidence``. :func:`one_run_gdp_bound` returns the largest
rejected mu (bisection, the lower end: the safe side) and the epsilon it implies at the run's
delta (the exact Gaussian conversion, :func:`dpfy.accounting.gaussian.gaussian_epsilon`).

The bound is a bound on mu-GDP; its epsilon is "this run is not (eps, delta)-DP *with a
Gaussian trade-off curve*". For DP-SGD (Gaussian noise, Poisson subsampling, composition),
whose curve is close to Gaussian, that is the natural question; validity on a simulated mu-GDP
guesser is checked by Monte Carlo in ``tests/audit/test_fdp.py``.
"""

from __future__ import annotations

import dataclasses
import math

from scipy import special

from dpfy._validate import check_int, check_range

_MU_MAX = 64.0  # above this every realistic count is consistent with mu (F is ~0)


def _check(m: int, r: int, v: int, confidence: float) -> None:
    check_int("m", m)
    check_int("r", r, 1, m)
    check_int("v", v, 0, r)
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)


def gdp_rejects(m: int, r: int, v: int, mu: float, *, confidence: float = 0.95) -> bool:
    """True when ``v`` correct of ``r`` guesses on ``m`` canaries rejects mu-GDP at
    ``confidence``: a mu-GDP run reaches ``>= v`` correct with probability below
    ``1 - confidence`` (the recursion of the module docstring)."""
    _check(m, r, v, confidence)
    check_range("mu", mu, 0.0, math.inf, high_open=True)
    return _rejects(m, r, v, float(mu), 1.0 - confidence)


def _rejects(m: int, r: int, v: int, mu: float, tau: float) -> bool:
    cap = r / m
    a, b = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        forced = float(special.ndtr(special.ndtri(a) - mu)) if a < 1.0 else 1.0
        b_new = max(b, forced)
        a += i / (r - i) * (b_new - b)
        b = b_new
        if a + b > cap:  # both only grow from here on
            return True
    return a + b > cap


@dataclasses.dataclass(frozen=True, slots=True)
class OneRunGdpBound:
    """An f-DP (Gaussian) one-run lower bound.

    Attributes:
      mu: the largest mu-GDP rejected at ``confidence`` (0 when none is).
      epsilon: the epsilon of mu-GDP at ``delta`` (0 when mu is 0).
      delta: the delta of the conversion (the run's delta).
      confidence: 1 - beta.
      canaries, guesses, correct: m, r, v.
    """

    mu: float
    epsilon: float
    delta: float
    confidence: float
    canaries: int
    guesses: int
    correct: int


def _largest_rejected_mu(m: int, r: int, v: int, tau: float) -> float:
    if not _rejects(m, r, v, 0.0, tau):
        return 0.0
    lo, hi = 0.0, 1.0
    while _rejects(m, r, v, hi, tau):
        lo, hi = hi, 2.0 * hi
        if hi > _MU_MAX:
            return lo
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _rejects(m, r, v, mid, tau):
            lo = mid
        else:
            hi = mid
    return lo


def one_run_gdp_bound(
    m: int, r: int, v: int, *, delta: float, confidence: float = 0.95
) -> OneRunGdpBound:
    """The largest mu-GDP (and its epsilon at ``delta``) that ``v`` correct of ``r`` guesses
    on ``m`` canaries rejects at ``confidence`` (Mahloujifar, Melis, Chaudhuri 2024).

    Args:
      m: canaries, each included with probability 1/2, in [1, 2**53].
      r: guesses (the rest abstain), in [1, m].
      v: correct guesses, in [0, r].
      delta: delta of the epsilon conversion, in (0, 1).
      confidence: in (0, 1).
    """
    _check(m, r, v, confidence)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    from dpfy.accounting.gaussian import gaussian_epsilon

    mu = _largest_rejected_mu(m, r, v, 1.0 - confidence)
    eps = float(gaussian_epsilon(mu, delta)) if mu > 0 else 0.0
    return OneRunGdpBound(mu, eps, float(delta), float(confidence), int(m), int(r), int(v))


def one_run_gdp_ceiling(
    m: int, r: int, *, delta: float, confidence: float = 0.95
) -> OneRunGdpBound:
    """The most this analysis can show with ``r`` guesses: all of them correct."""
    return one_run_gdp_bound(m, r, r, delta=delta, confidence=confidence)

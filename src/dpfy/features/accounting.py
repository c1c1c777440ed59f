"""Noise calibration and the GDP/zCDP figures of the feature algorithms (Mehta et al. 2023).

DP-LS, DP-Newton, DP-FC and full-batch DP-SGD/DP-Adam release sums over the *whole* dataset with
Gaussian noise and no sampling. A composition of Gaussian mechanisms with sensitivity-to-noise
ratios ``r_i = S_i / s_i`` is exactly ``mu``-GDP with ``mu^2 = sum_i r_i^2`` (Dong, Roth, Su 2019,
Cor. 3.3), and ``mu``-GDP is (epsilon, delta)-DP for exactly

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - exp(epsilon) Phi(-epsilon/mu - mu/2)

(Balle & Wang 2018, Thm. 8). The same run is ``rho``-zCDP with ``rho = mu^2 / 2``, the figure the
paper (Mehta et al. 2023, Theorems 2.1-2.3) reports; converting zCDP to (epsilon, delta) with the
generic bound ``epsilon = rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 2016, Prop. 1.3) is
looser, so calibrating with the exact curve needs less noise for the same target.

The (epsilon, delta) statement of a fitted model is its ledger accounted like every other one,
``dpfy.accounting.epsilon(ledger, delta, method="gaussian")`` (ledger -> ``to_event()`` -> the
exact Gaussian accountant -> ``PrivacyResult``; :func:`ledger_statement`). This module is the
one door of :mod:`dpfy.features` to :mod:`dpfy.accounting` (docs/architecture.md, section 2):
it calibrates the noise before training (:func:`mu_for_target`, :func:`noise_multipliers`),
states a fitted ledger's epsilon (:func:`ledger_statement`) and the figures the paper reports
beside it (:func:`gdp_figures`, :func:`paper_zcdp_rho`).

Adjacency is add-or-remove one example; the unit of privacy is one example (one feature vector
with its labels). The released sums never divide by the dataset size; the ledger records it and
the report states that it is treated as public.

This module imports NumPy/SciPy and the ledger only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dpfy import events as ev
from dpfy._validate import check_int, check_range

# PrivacyResult is re-exported on purpose: the estimators reach dpfy.accounting through this module.
from dpfy.accounting import PrivacyResult as PrivacyResult
from dpfy.accounting import epsilon as _account
from dpfy.accounting import gaussian, roots
from dpfy.accounting._api import first_unsupported
from dpfy.ledger import Ledger
from dpfy.ledger.records import NonPrivateRecord, SumQueryRecord


def gdp_delta(mu: float, epsilon: float) -> float:
    """Smallest delta for which a ``mu``-GDP mechanism is (epsilon, delta)-DP (exact)."""
    return float(gaussian.gaussian_delta(mu, epsilon))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon for which a ``mu``-GDP mechanism is (epsilon, delta)-DP (safe side)."""
    return float(gaussian.gaussian_epsilon(mu, delta))


def mu_for_target(epsilon: float, delta: float) -> float:
    """Largest ``mu`` (up to 1e-10 relative) such that ``mu``-GDP is (epsilon, delta)-DP.

    The safe side: ``gdp_delta(result, epsilon) <= delta``.
    """
    check_range("epsilon", epsilon, 0.0, math.inf, low_open=True, high_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    lo, hi = 1e-8, 1.0
    while gdp_delta(hi, epsilon) < delta:
        lo, hi = hi, hi * 2.0
    # gdp_delta(mu) - delta is increasing in mu: the largest mu with it <= 0, never above.
    return float(
        roots.safe_root(
            lambda m: gdp_delta(m, epsilon) - delta, lo, hi, side="low", xtol=1e-14, rtol=1e-12
        )
    )


def noise_multipliers(mu: float, shares: Sequence[float]) -> npt.NDArray[np.float64]:
    """Split a GDP budget ``mu`` across releases: ``z_i = 1 / (mu sqrt(share_i))``.

    Release ``i`` gets the share ``share_i`` of ``mu^2`` (the shares are normalised to sum to 1),
    so that ``sum_i 1 / z_i^2 = mu^2`` exactly. A noise multiplier is the noise std divided by the
    L2 sensitivity of the release.
    """
    check_range("mu", mu, 0.0, math.inf, low_open=True, high_open=True)
    w = np.asarray(shares, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"shares must be a non-empty list of positive numbers, got {shares!r}")
    w = w / float(w.sum())
    return 1.0 / (mu * np.sqrt(w))


def zcdp_epsilon(rho: float, delta: float) -> float:
    """The paper's generic conversion ``rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 1.3)."""
    check_range("rho", rho, 0.0, math.inf)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return float(rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta)))


def paper_zcdp_rho(algorithm: str, noise_multiplier: float, steps: int = 1) -> float:
    """The zCDP figure of Mehta et al. 2023 for a run with one noise multiplier on every release.

    Theorem 2.1 (DP-Newton): ``T / sigma^2``; Theorem 2.2 (DP-LS): ``3 / (2 sigma^2)``;
    Theorem 2.3 (DP-FC): ``(T + 1) / (2 sigma^2)``; DP-SGD/Adam (full batch): ``T / (2 sigma^2)``.
    """
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True)
    check_int("steps", steps)
    s2 = float(noise_multiplier) ** 2
    table = {
        "dp_newton": steps / s2,
        "dp_ls": 1.5 / s2,
        "dp_fc": (steps + 1) / (2.0 * s2),
        "dp_adam": steps / (2.0 * s2),
    }
    if algorithm not in table:
        raise ValueError(f"algorithm must be one of {tuple(table)}, got algorithm={algorithm!r}")
    return float(table[algorithm])


@dataclass(frozen=True, slots=True)
class GDPFigures:
    """The GDP and zCDP view of a full-batch run, beside its (epsilon, delta) statement.

    The statement itself is ``dpfy.accounting.epsilon(ledger, delta, method="gaussian")``, the
    exact epsilon of this ``mu``-GDP composition (Dong, Roth, Su 2019; Balle & Wang 2018).

    Attributes:
      mu: GDP parameter, ``sqrt(sum_i (S_i / s_i)^2)`` over every release in the ledger
        (``inf`` if some release was non-private).
      zcdp_rho: ``mu^2 / 2``, the quantity of the paper's Theorems 2.1-2.3 (Mehta et al. 2023).
      releases: number of releases recorded (noisy sums and non-private releases).
    """

    mu: float
    zcdp_rho: float
    releases: int

    def zcdp_epsilon(self, delta: float) -> float:
        """Epsilon by the paper's generic zCDP conversion (looser than the exact GDP curve)."""
        return zcdp_epsilon(self.zcdp_rho, delta) if math.isfinite(self.zcdp_rho) else math.inf

    def to_dict(self) -> dict[str, float | int]:
        return {"mu": self.mu, "zcdp_rho": self.zcdp_rho, "releases": self.releases}


def ledger_statement(ledger: Ledger, delta: float) -> PrivacyResult:
    """The (epsilon, delta) statement of a fitted model: its ledger accounted by the exact
    Gaussian accountant (GDP composition, Dong, Roth, Su 2019), as any ledger is.

    The estimators import ``PrivacyResult``, the type of this result, from this module: the
    features reach :mod:`dpfy.accounting` through this one module.
    """
    return _account(ledger, delta, method="gaussian")


def gdp_figures(ledger: Ledger) -> GDPFigures:
    """``mu``, the paper's ``rho`` and the release count of a ledger of unsampled Gaussians.

    ``mu`` is read from ``ledger.to_event()`` (:func:`dpfy.accounting.gaussian.mu_of_event`),
    the event every accountant sees, so it is the ``mu`` behind the reported epsilon.

    Raises:
      ValueError: the ledger holds a sampled (not full-batch) step; account sampled runs with
        :func:`dpfy.accounting.epsilon`.
    """
    event = ledger.to_event()
    reason = _not_full_batch(event)
    if reason is not None:
        raise ValueError(f"gdp_figures accounts full-batch runs only, got {reason}")
    mu = float(gaussian.mu_of_event(event))
    releases = sum(isinstance(r, SumQueryRecord | NonPrivateRecord) for r in ledger.entries)
    return GDPFigures(mu=mu, zcdp_rho=mu * mu / 2.0, releases=releases)


def _not_full_batch(event: ev.Event) -> str | None:
    """None if ``event`` composes only unsampled Gaussians (and non-private releases)."""

    def leaf(e: ev.Event) -> str | None:
        return None if isinstance(e, ev.Gaussian | ev.NonPrivate) else f"a {type(e).__name__} event"

    return first_unsupported(event, leaf)

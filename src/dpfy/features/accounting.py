"""Exact accounting and noise calibration for the feature algorithms (DESIGN 3.3 and 6).

DP-LS, DP-Newton, DP-FC and full-batch DP-SGD/DP-Adam release sums over the *whole* dataset with
Gaussian noise and no sampling. A composition of Gaussian mechanisms with sensitivity-to-noise
ratios ``r_i = S_i / s_i`` is exactly ``mu``-GDP with ``mu^2 = sum_i r_i^2`` (Dong, Roth, Su 2019,
Cor. 3.3), and ``mu``-GDP is (epsilon, delta)-DP for exactly

    delta(epsilon) = Phi(-epsilon/mu + mu/2) - exp(epsilon) Phi(-epsilon/mu - mu/2)

(Balle & Wang 2018, Thm. 8). The same run is ``rho``-zCDP with ``rho = mu^2 / 2``, the figure the
paper (Mehta et al., Theorems 2.1-2.3) reports; converting zCDP to (epsilon, delta) with the
generic bound ``epsilon = rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 2016, Prop. 1.3) is
looser, so calibrating with the exact curve needs less noise for the same target.

Adjacency is add-or-remove one example; the unit of privacy is one example (one feature vector
with its labels). The released sums never divide by the (private) dataset size.

This module imports NumPy/SciPy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_range
from dpfy.accounting import gaussian, roots

__all__ = [
    "FeaturePrivacy",
    "ledger_mu",
    "privacy_of_ledger",
    "gdp_delta",
    "gdp_epsilon",
    "mu_for_target",
    "noise_multipliers",
    "paper_zcdp_rho",
    "zcdp_epsilon",
]


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


def noise_multipliers(mu: float, shares: Sequence[float]) -> np.ndarray:
    """Split a GDP budget ``mu`` across releases: ``z_i = 1 / (mu sqrt(share_i))``.

    Release ``i`` gets the share ``share_i`` of ``mu^2`` (the shares are normalised to sum to 1),
    so that ``sum_i 1 / z_i^2 = mu^2`` exactly. A noise multiplier is the noise std divided by the
    L2 sensitivity of the release.
    """
    check_range("mu", mu, 0.0, math.inf, low_open=True, high_open=True)
    w = np.asarray(shares, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"shares must be a non-empty list of positive numbers, got {shares!r}")
    w = w / w.sum()
    return 1.0 / (mu * np.sqrt(w))


def zcdp_epsilon(rho: float, delta: float) -> float:
    """The paper's generic conversion ``rho + 2 sqrt(rho log(1/delta))`` (Bun & Steinke 1.3)."""
    check_range("rho", rho, 0.0, math.inf)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return float(rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta)))


def paper_zcdp_rho(algorithm: str, noise_multiplier: float, steps: int = 1) -> float:
    """The zCDP figure of Mehta et al. for a run with one noise multiplier on every release.

    Theorem 2.1 (DP-Newton): ``T / sigma^2``; Theorem 2.2 (DP-LS): ``3 / (2 sigma^2)``;
    Theorem 2.3 (DP-FC): ``(T + 1) / (2 sigma^2)``; DP-SGD/Adam (full batch): ``T / (2 sigma^2)``.
    """
    check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True)
    check_range("steps", steps, 1, None, integer=True)
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
class FeaturePrivacy:
    """The privacy statement of one fitted model (a composition of unsampled Gaussians).

    Attributes:
      epsilon: exact epsilon of the ``mu``-GDP composition at ``delta``.
      delta: the target delta.
      mu: GDP parameter, ``sqrt(sum_i (S_i / s_i)^2)`` over every release in the ledger.
      zcdp_rho: ``mu^2 / 2``, the quantity of the paper's Theorems 2.1-2.3.
      zcdp_epsilon: epsilon from the generic zCDP conversion (looser; for comparison).
      releases: number of noisy releases (Gaussian sum queries).
      method: ``"gaussian (exact GDP composition)"``.
      adjacency: ``"add_or_remove"``. unit: ``"example"``.
    """

    epsilon: float
    delta: float
    mu: float
    zcdp_rho: float
    zcdp_epsilon: float
    releases: int
    method: str = "gaussian (exact GDP composition)"
    adjacency: str = "add_or_remove"
    unit: str = "example"

    @classmethod
    def from_mu(cls, mu: float, delta: float, releases: int) -> FeaturePrivacy:
        rho = mu * mu / 2.0
        return cls(
            epsilon=gdp_epsilon(mu, delta),
            delta=float(delta),
            mu=float(mu),
            zcdp_rho=float(rho),
            zcdp_epsilon=zcdp_epsilon(rho, delta) if math.isfinite(rho) else math.inf,
            releases=int(releases),
        )

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def ledger_mu(ledger) -> tuple[float, int]:
    """``(mu, releases)`` of a ledger holding only full-batch Gaussian sum queries.

    ``mu^2 = sum_i (S_i / s_i)^2`` over every sum query; a non-private release (or a noise std of
    0 with a positive sensitivity) gives ``mu = inf``.

    Raises:
      ValueError: the ledger holds a sample that is not ``full_batch`` (use
        :meth:`dpfy.ledger.Ledger.epsilon` for sampled runs).
    """
    from dpfy.ledger import NonPrivateRecord, SampleRecord, SumQueryRecord

    mu2, releases = 0.0, 0
    for rec in ledger.entries:
        if isinstance(rec, SampleRecord) and rec.spec.sampler != "full_batch":
            raise ValueError(
                "ledger_mu accounts full-batch runs only, got a sample with "
                f"sampler={rec.spec.sampler!r}"
            )
        if isinstance(rec, NonPrivateRecord):
            return math.inf, releases + 1
        if isinstance(rec, SumQueryRecord):
            releases += 1
            if rec.sensitivity == 0.0:
                continue
            if rec.noise_std == 0.0:
                return math.inf, releases
            mu2 += (rec.sensitivity / rec.noise_std) ** 2
    return math.sqrt(mu2), releases


def privacy_of_ledger(ledger, delta: float) -> FeaturePrivacy:
    """The exact privacy statement of a full-batch ledger at ``delta`` (see :func:`ledger_mu`)."""
    mu, releases = ledger_mu(ledger)
    return FeaturePrivacy.from_mu(mu, delta, releases)

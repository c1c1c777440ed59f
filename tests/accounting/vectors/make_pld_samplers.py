"""Reference epsilons for the fixed-size and truncated-Poisson PLDs, from dp_accounting 0.6.0.

Writes ``pld_samplers.json`` beside this script. Run once (a few minutes on a shared machine):

  PYTHONPATH=src nice python tests/accounting/vectors/make_pld_samplers.py

Fixed-size batches (B of N without replacement, replace_one, noise multiplier z relative to the
clip norm, so the replace-one sensitivity is 2C), per row:

* ``lower``: dp_accounting's *optimistic* PLD (pessimistic_estimate=False, interval 1e-4) of the
  Poisson-subsampled Gaussian at rate B/N and noise z/2, maximised over the add and remove
  directions. A real pair of neighbouring datasets reaches each direction (every other
  example's gradient equal to the replaced one's), so the true epsilon is at least this.
* ``rdp``: dp_accounting's RdpAccountant (default orders, REPLACE_ONE) for
  SampledWithoutReplacementDpEvent(N, B, Gaussian(z/2)): dp_accounting 0.6.0 has no PLD for
  sampling without replacement, so this is its tightest number for the event.

Truncated Poisson (rate q, N examples, batches cut to B_max), per row:

* ``dp_accounting``: its default PLDAccountant on TruncatedSubsampledGaussianDpEvent (interval
  1e-4), the number dpfy must never exceed.
* ``lower``: a valid lower bound on the true epsilon. Coupling the truncated run A with the
  untruncated M (they differ only when some batch is over-full, probability <= p), for any
  epsilon delta_A(eps) >= delta_M(eps) - (1 + e^eps) p; so eps_A >= eps_M(delta + (1 + e^E) p)
  for any E >= eps_A, and dp_accounting's figure is such an E. eps_M is dp_accounting's
  optimistic Poisson PLD (interval 1e-4); p = steps * P(Binomial(N + 1, q) > B_max).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import pathlib

import numpy as np
from dp_accounting import dp_event as de
from dp_accounting.pld import pld_privacy_accountant as pld_acc
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc
from scipy import stats

NR = pld_acc.NeighborRel
FINE = 1e-4  # optimistic: a lower bound of its pair at any interval
CONVERGED = 1e-5  # pessimistic, ten times finer than dp_accounting's default

# (B, N, z, steps, delta)
FIXED = [
    (10, 10_000, 0.8, 1_000, 1e-5),
    (100, 10_000, 0.8, 100, 1e-5),
    (100, 10_000, 2.0, 1_000, 1e-6),
    (256, 60_000, 1.0, 705, 1e-5),
    (1_000, 10_000, 1.5, 50, 1e-5),
    (50, 100, 3.0, 20, 1e-8),
    (10, 100, 2.0, 10, 1e-5),
    (100, 1_000, 5.0, 2_000, 1e-5),
]
# (q, N, B_max, z, steps, delta)
TRUNCATED = [
    (256 / 60_000, 60_000, 320, 1.0, 705, 1e-5),
    (256 / 60_000, 60_000, 300, 1.0, 705, 1e-5),
    (256 / 60_000, 60_000, 280, 1.0, 705, 1e-5),
    (0.01, 10_000, 120, 1.0, 300, 1e-5),
    (0.01, 10_000, 150, 2.0, 1_000, 1e-6),
    (0.1, 1_000, 110, 0.8, 50, 1e-5),
    (256 / 60_000, 60_000, 345, 1.0, 705, 1e-5),
    (0.01, 10_000, 170, 1.0, 300, 1e-5),
]


def _optimistic_poisson(q: float, z: float, steps: int) -> pld_lib.PrivacyLossDistribution:
    one = pld_lib.from_gaussian_mechanism(
        standard_deviation=z,
        sampling_prob=q,
        pessimistic_estimate=False,
        value_discretization_interval=FINE,
    )
    return one.self_compose(steps)


def fixed_rows() -> list[dict]:
    rows = []
    for b, n, z, steps, delta in FIXED:
        q = b / n
        lower = _optimistic_poisson(q, z / 2.0, steps).get_epsilon_for_delta(delta)
        rdp = rdp_acc.RdpAccountant(neighboring_relation=NR.REPLACE_ONE)
        inner = de.SampledWithoutReplacementDpEvent(n, b, de.GaussianDpEvent(z / 2.0))
        rdp.compose(de.SelfComposedDpEvent(inner, steps))
        rows.append(
            {"B": b, "N": n, "z": z, "steps": steps, "delta": delta,
             "lower": float(lower), "rdp": float(rdp.get_epsilon(delta))}
        )
        print(rows[-1], flush=True)
    return rows


def _weights(q: float, n_all: int, b_max: int) -> tuple[float, float, float]:
    """(t(N-1), t(N), q_bar) by direct sums over the binomial pmf."""
    ts, qbars = [], []
    for n in (n_all - 1, n_all):
        k = np.arange(b_max, n + 1)
        pk = stats.binom.pmf(k, n, q)
        t = float(pk.sum())
        ts.append(t)
        if t > 0.0:
            qbars.append(q * float(np.sum(pk * b_max / (k + 1.0))) / t)
    return ts[0], ts[1], max(qbars, default=0.0)


def _pessimistic(q: float, sigma: float) -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=q, value_discretization_interval=CONVERGED
    )


def converged_mixture(q: float, n: int, b_max: int, z: float, steps: int, delta: float) -> float:
    """Epsilon of dpfy's truncated step pair, composed, on dp_accounting's fine grid."""
    t1, t2, q_bar = _weights(q, n, b_max)
    step = _pessimistic(q, z)
    if t2 > t1:  # (q, z/2) with weight t2 - t1
        step = _pessimistic(q, z / 2.0).compute_mixture(step, (t2 - t1) / (1.0 - t1))
    if t1 > 0.0:
        step = _pessimistic(q_bar, z / 2.0).compute_mixture(step, t1)
    return float(step.self_compose(steps).get_epsilon_for_delta(delta))


def truncated_rows() -> list[dict]:
    rows = []
    for q, n, b_max, z, steps, delta in TRUNCATED:
        acc = pld_acc.PLDAccountant()
        acc.compose(
            de.SelfComposedDpEvent(de.TruncatedSubsampledGaussianDpEvent(n, q, b_max, z), steps)
        )
        upper = float(acc.get_epsilon(delta))
        p = min(1.0, steps * float(stats.binom.sf(b_max, n + 1, q)))
        budget = delta + (1.0 + math.exp(upper)) * p
        lower = 0.0
        if budget < 1.0:
            lower = float(_optimistic_poisson(q, z, steps).get_epsilon_for_delta(budget))
        rows.append(
            {"q": q, "N": n, "B_max": b_max, "z": z, "steps": steps, "delta": delta,
             "dp_accounting": upper, "lower": max(0.0, lower), "p": p,
             "converged": converged_mixture(q, n, b_max, z, steps, delta)}
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    version = importlib.metadata.version("dp-accounting")
    out = {
        "source": f"dp_accounting {version}",
        "fixed_size": fixed_rows(),
        "truncated": truncated_rows(),
    }
    path = pathlib.Path(__file__).with_name("pld_samplers.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Planning figure: noise in the released prefix sums of gradients at one (epsilon, delta).

For an MNIST-sized run (N=60000, batch 250, 5 epochs, 1200 steps; epsilon=3, delta=1e-5) this
calibrates the noise multiplier of DP-SGD under the honest shuffle bound (no amplification,
``gaussian`` accountant), DP-SGD with Poisson sampling (``rdp``), and BandMF with the cyclic
order of a once-shuffled dataset (``MatrixMechanism``, exact GDP), and prints the total
variance of the released prefix sums per clip norm^2 (``z^2 ||A C^{-1}||_F^2``; the identity
strategy for DP-SGD). NumPy/SciPy only, seconds on one core. Run:

    PYTHONPATH=src python benchmarks/dpftrl_plan.py
"""

from __future__ import annotations

import numpy as np

from dpfy import events as ev
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.correlated.bandmf import optimize_bandmf
from dpfy.correlated.workload import prefix_error_total, toeplitz_inverse_coeffs


def main() -> None:
    n, batch, epochs, eps, delta = 60_000, 250, 5, 3.0, 1e-5
    per_epoch = n // batch
    steps = per_epoch * epochs
    workload = float(np.sum(np.arange(steps, 0, -1)))  # ||A||_F^2
    rows = []
    z = calibrate_noise_multiplier(
        lambda z: ev.Shuffled(z, per_epoch, epochs), eps, delta, method="gaussian"
    )
    rows.append(("DP-SGD shuffle (honest bound)", z, z * z * workload))
    z = calibrate_noise_multiplier(
        lambda z: ev.SelfComposed(ev.PoissonSampled(batch / n, ev.Gaussian(z)), steps),
        eps,
        delta,
        method="rdp",
    )
    rows.append(("DP-SGD Poisson (rdp)", z, z * z * workload))
    for band in (8, 32):
        strat = optimize_bandmf(steps, band, participations=epochs)
        sens = strat.separated_sensitivity(steps, epochs)
        z = calibrate_noise_multiplier(
            lambda z, s=sens, b=band: ev.MatrixMechanism(
                z, s, steps, "bandmf", f"cyclic(period={per_epoch})", band=b
            ),
            eps,
            delta,
            method="gaussian",
        )
        err = prefix_error_total(toeplitz_inverse_coeffs(strat.coeffs, steps))
        rows.append((f"BandMF band {band} cyclic (sens {sens:.3f})", z, z * z * err))
    print(f"steps={steps} epsilon={eps} delta={delta}")
    print(f"{'mechanism':40s} {'z':>8s} {'total prefix variance / C^2':>28s}")
    for name, z, var in rows:
        print(f"{name:40s} {z:8.4f} {var:28.4g}")


if __name__ == "__main__":
    main()

"""Plain sampling: exact privacy-loss draws of Balls-and-Bins epochs (Chua et al. 2025).

One epoch of T steps with noise multiplier z: under Q = N(0, z^2 I_T) draw x = z g; under P the
differing example's coordinate is shifted by 1. Both directions share the Gaussian draws. The
loss is L(x) = logsumexp_t((2 x_t - 1) / (2 z^2)) - log T (remove direction, x ~ P) and
-L(x) with x ~ Q (add direction).
"""

from __future__ import annotations

import math

import numpy as np

from dpfy.accounting.monte_carlo.base import FloatArray, Job, LossSamples
from dpfy.accounting.monte_carlo.empirical import summed_losses
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.normals import log_sum_exp_rows


def plain_losses(
    z: float, steps: int, n: int, rng: np.random.Generator, chunk: int
) -> tuple[FloatArray, FloatArray]:
    """Exact (remove, add) loss samples of one epoch sharing Gaussian draws.

    ``chunk`` bounds the Gaussians held in memory at once; z >= 0.15 uses float32 draws
    (exp(g / z) cannot overflow float32 for |g| < 13) with float64 sums.
    """
    rem = np.empty(n)
    add = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    fast = z >= 0.15  # exp(g / z) cannot overflow float32 for |g| < 13
    for start in range(0, n, rows):
        m = min(rows, n - start)
        g = rng.standard_normal((m, steps), dtype=np.float32 if fast else np.float64)
        g1 = g[:, 0].astype(np.float64) * inv_z
        if steps == 1:
            rest_log = np.full(m, -np.inf)
        elif fast:
            g_rest = g[:, 1:]
            g_rest *= np.float32(inv_z)
            np.exp(g_rest, out=g_rest)
            rest_log = np.log(g_rest.sum(axis=1, dtype=np.float64))
        else:
            rest_log = log_sum_exp_rows(g[:, 1:] * inv_z)
        # remove: x ~ P (coordinate 1 shifted by 1): log sum = logaddexp(g1/z + 1/z^2, rest)
        rem[start : start + m] = np.logaddexp(g1 + 2 * c, rest_log) - c - log_t
        # add: x ~ Q: L_QP(x) = -(logsumexp(x / z^2 - 1/(2 z^2)) - log T)
        add[start : start + m] = -(np.logaddexp(g1, rest_log) - c - log_t)
    return rem, add


def sample_plain(job: Job, rng: np.random.Generator) -> LossSamples:
    """The job's total losses over its epochs, every epoch sampled exactly."""

    def one(_: int, ep: Epoch) -> tuple[FloatArray, FloatArray]:
        return plain_losses(ep.noise_multiplier, ep.steps, job.n, rng, job.chunk)

    return summed_losses(job, one)

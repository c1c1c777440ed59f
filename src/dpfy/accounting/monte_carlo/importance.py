"""Importance sampling of one Balls-and-Bins epoch (Chua et al. 2025, Alg. 5, App. B.1).

Sample only the event E outside which the integrand is 0 and multiply by its exact
probability. Remove direction: E = {max_t y_t >= z eps0 - 1/(2z)} with y = (x - e_1)/z, drawn by
placing the conditional maximum first (Alg. 10). Add direction:
E = {max_t x_t / z <= (1/2 + z^2 (log T - eps0)) / z}, i.i.d. truncated normals. Gains a
factor 1 / P(E): large for small T or large epsilon. eps0 is the job's threshold; the
estimate is valid for every epsilon >= eps0.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from dpfy.accounting.monte_carlo.base import FloatArray, Job, LossSamples
from dpfy.accounting.monte_carlo.normals import (
    log_cdf,
    log_sum_exp_rows,
    truncated_normals_below,
)


def event_probabilities(z: float, steps: int, eps0: float) -> tuple[float, float]:
    """(P(E_remove), P(E_add)) of one epoch at threshold eps0 (exact)."""
    p_rem = -math.expm1(steps * float(log_cdf(z * eps0 - 0.5 / z)))
    p_add = math.exp(steps * float(log_cdf((0.5 + z * z * (math.log(steps) - eps0)) / z)))
    return p_rem, p_add


def importance_remove(
    z: float, steps: int, n: int, eps0: float, rng: np.random.Generator, chunk: int
) -> tuple[FloatArray, float]:
    """Remove-direction losses on E = {max y >= b}, and P(E) (Chua et al. 2025, Alg. 10)."""
    b = z * eps0 - 0.5 / z
    log_cdf_b = float(log_cdf(b))
    p_e = -math.expm1(steps * log_cdf_b)  # P(max of T std normals >= b)
    out = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        # Conditional maximum: P(M >= x) = 1 - Phi(x)^T; draw its survival u * P(M >= b).
        u = rng.random(m)
        log_cdf_m = np.log1p(-u * p_e) / steps  # log Phi(M)
        mx = -special.ndtri(-np.expm1(log_cdf_m))  # M = Phi^-1(exp(.)) via the upper tail
        others = truncated_normals_below(mx, (m, steps - 1), rng)
        pos = rng.integers(0, steps, m)  # position of the maximum among the T coordinates
        y = np.empty((m, steps))
        y[:, 1:] = others
        y[:, 0] = mx
        swap = pos > 0
        rows_idx = np.flatnonzero(swap)
        y[rows_idx, 0] = others[rows_idx, pos[rows_idx] - 1]
        y[rows_idx, pos[rows_idx]] = mx[rows_idx]
        a = y * inv_z
        a[:, 0] += 2 * c  # x_1 = z y_1 + 1
        out[start : start + m] = log_sum_exp_rows(a) - c - log_t
    return out, p_e


def importance_add(
    z: float, steps: int, n: int, eps0: float, rng: np.random.Generator, chunk: int
) -> tuple[FloatArray, float]:
    """Add-direction losses on E = {all x_t / z <= b}, and P(E) (Chua et al. 2025, App. B.1)."""
    b = (0.5 + z * z * (math.log(steps) - eps0)) / z
    p_e = math.exp(steps * float(log_cdf(b)))
    out = np.empty(n)
    rows = max(1, chunk // steps)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        g = truncated_normals_below(np.full(m, b), (m, steps), rng)
        out[start : start + m] = -(log_sum_exp_rows(g * inv_z) - c - log_t)
    return out, p_e


def sample_importance(job: Job, rng: np.random.Generator) -> LossSamples:
    """Both directions of the job's single epoch on their events E, with weights P(E)."""
    (ep,) = job.epochs
    rem, p_rem = importance_remove(
        ep.noise_multiplier, ep.steps, job.n, job.threshold, rng, job.chunk
    )
    add, p_add = importance_add(ep.noise_multiplier, ep.steps, job.n, job.threshold, rng, job.chunk)
    return LossSamples(
        job.n,
        np.sort(rem[rem > job.threshold]),
        np.sort(add[add > job.threshold]),
        (p_rem, p_add),
    )

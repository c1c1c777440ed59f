"""Order-statistics sampling (Chua et al. 2025, Alg. 6, Eqs. 4-5), any number of epochs.

Draw only the order statistics k_1 = 1 < k_2 < ... < k_m of the T - 1 unshifted coordinates
(as exponential spacings pushed through the inverse normal CDF) and bound the sum of
exp(x_t / z^2) above (remove) or below (add) blockwise. Every loss sample is >= the exact one
in its direction, so the estimate and bound are pessimistic by construction; cost O(m)
instead of O(T). Epochs with T <= 2 are sampled exactly (:mod:`.plain`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from dpfy._validate import check_int
from dpfy.accounting.monte_carlo.base import FloatArray, IntArray, Job, LossSamples
from dpfy.accounting.monte_carlo.empirical import summed_losses
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.normals import log_sum_exp_rows
from dpfy.accounting.monte_carlo.plain import plain_losses


def default_orders(n: int, *, dense: int = 256, ratio: float = 1.005) -> IntArray:
    """Order-statistic indices 1 = k_1 < ... < k_m = n: dense at the top, then geometric."""
    check_int("n", n)
    if n <= dense:
        return np.arange(1, n + 1)
    ks = list(range(1, dense + 1))
    k = float(dense)
    while True:
        k = max(k * ratio, k + 1)
        if k >= n:
            break
        ks.append(int(k))
    ks.append(n)
    return np.unique(np.asarray(ks, dtype=np.int64))


def block_log_sums(
    scaled: FloatArray, orders: IntArray, n: int
) -> tuple[FloatArray, FloatArray]:
    """Pathwise bounds on ``log sum_t exp(v_t)`` from the order statistics of n values v_t.

    ``scaled[:, i]`` is the ``orders[i]``-th largest value (orders k_1 = 1 < ... < k_m = n).
    Upper: each block [k_i, k_{i+1}) is at most its first value (Chua et al. 2025, Eq. 4);
    lower: each block (k_{i-1}, k_i] is at least its last value (Eq. 5). Returns (upper, lower).
    """
    k = np.asarray(orders, dtype=np.int64)
    if k[0] != 1 or k[-1] != n or np.any(np.diff(k) <= 0):
        raise ValueError(f"orders must increase from 1 to n={n}, got orders={k!r}")
    upper_w = np.log(np.diff(np.concatenate((k, [n + 1]))).astype(float))
    lower_w = np.log(np.diff(np.concatenate(([0], k))).astype(float))
    return log_sum_exp_rows(scaled + upper_w), log_sum_exp_rows(scaled + lower_w)


def order_statistic_losses(
    z: float, steps: int, n: int, rng: np.random.Generator, chunk: int, orders: IntArray
) -> tuple[FloatArray, FloatArray]:
    """Pessimistic (remove, add) losses from order statistics of the T - 1 unshifted coordinates.

    The k-th largest of T - 1 standard normals is -Phi^-1(U_(k)) with U_(k) the k-th smallest of
    T - 1 uniforms, drawn jointly as exponential spacings U_(k) = G_k / G_T (Gamma partial
    sums; equivalent to the Beta recursion of Chua et al. 2025, Alg. 6). :func:`block_log_sums`
    bounds the sum above (remove direction) and below (add direction).
    """
    rem = np.empty(n)
    add = np.empty(n)
    inv_z = 1.0 / z
    c = 0.5 * inv_z * inv_z
    log_t = math.log(steps)
    n_rest = steps - 1
    k = np.asarray(orders, dtype=np.int64)
    gaps = np.diff(np.concatenate(([0], k))).astype(float)  # k_i - k_{i-1}
    tail = float(n_rest + 1 - k[-1])
    rows = max(1, chunk // (len(k) + 1))
    for start in range(0, n, rows):
        m = min(rows, n - start)
        inc = rng.standard_gamma(np.broadcast_to(gaps, (m, len(k))))
        cum = np.cumsum(inc, axis=1)
        total = cum[:, -1] + rng.standard_gamma(tail, m)
        a = -special.ndtri(cum / total[:, None]) * inv_z  # k-th largest normal, over z
        g1 = rng.standard_normal(m) * inv_z
        up, low = block_log_sums(a, k, n_rest)
        rem[start : start + m] = np.logaddexp(g1 + 2 * c, up) - c - log_t
        add[start : start + m] = -(np.logaddexp(g1, low) - c - log_t)
    return rem, add


def sample_order_statistics(job: Job, rng: np.random.Generator) -> LossSamples:
    """The job's total pessimistic losses over its epochs (``job.orders`` per epoch)."""
    orders = job.orders
    if orders is None:
        raise ValueError("order-statistics jobs need orders per epoch")

    def one(i: int, ep: Epoch) -> tuple[FloatArray, FloatArray]:
        if ep.steps > 2:
            return order_statistic_losses(
                ep.noise_multiplier, ep.steps, job.n, rng, job.chunk, orders[i]
            )
        return plain_losses(ep.noise_multiplier, ep.steps, job.n, rng, job.chunk)

    return summed_losses(job, one)

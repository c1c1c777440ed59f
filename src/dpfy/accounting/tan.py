"""TAN: the Total Amount of Noise view of DP-SGD (Sander, Stock, Sablayrolles, ICML 2023).

DP-SGD with Poisson sampling rate ``q``, noise multiplier ``z`` and ``S`` steps has an individual
signal-to-noise ratio ``eta`` (Sander et al. 2023, Definition 3.1; docs/architecture.md, 5.7)::

    eta_step = q / (sqrt(2) z)          eta^2 = S eta_step^2 = q^2 S / (2 z^2)

The total amount of noise is ``1 / eta``. When the noise multiplier is large (``z >= 2``) the RDP
of one step is close to ``order * eta_step^2``, and minimising the RDP-to-DP conversion over the
order gives the closed form (TAN Eq. 4)::

    eps_TAN = eta^2 + 2 eta sqrt(log(1/delta))

``eps_TAN`` is a *heuristic*, never a guarantee: report the accountant's epsilon beside it. Below
``z = 0.5`` the true epsilon at constant ``eta`` explodes ("privacy wall", TAN Fig. 2); between 0.5
and 2 it rises steadily ("transition").

Measured (``pytest -s tests/accounting/test_tan.py`` prints the table; delta = 1e-5, eps_TAN in
{1, 2, 4, 8}, S in {1e2, 1e3, 1e4}): for ``z >= 2`` the RDP epsilon of dpfy's ``rdp`` accountant
is 0.81-1.04 x eps_TAN. So eps_TAN mostly *over*-estimates the accountant (by up to 23 % of the
RDP epsilon at eps_TAN = 1, z = 10: the gap is the improved RDP-to-DP conversion of Balle et al.
2020, which Eq. 4 does not use) and under-estimates only near ``z = 2`` with large epsilon and few
steps (by at most 4 %). Against the basic conversion ``min_a RDP(a) + log(1/delta)/(a-1)`` that
Eq. 4 is derived from, eps_TAN is a lower bound that is tight as ``z`` grows (ratio 1.00-1.22
for ``z >= 2``). At ``z <= 0.5`` the RDP epsilon is 3.5-37 x eps_TAN.

Scaling helpers (TAN Sec. 3.4 and 4.3):
  * :func:`simulate_small_batch` — a reference run ``(B_ref, z_ref, S)`` simulated at ``B_ref/k``
    with ``z_ref/k``: same ``S`` and ``eta_step``, hence (TAN's claim) similar accuracy at ``1/k``
    of the compute — but the small run's own epsilon is much larger (it is below the wall).
  * :func:`constant_tan_family` — ``(B, S)`` pairs at constant ``eta`` and fixed ``z`` (privacy
    parameter search at almost constant epsilon when ``z >= 2``).
  * :func:`fit_batch_scaling` — the log-linear batch scaling law of TAN Fig. 4,
    ``accuracy ~ intercept + slope * log(B)`` at constant ``eta_step`` and ``S``, fitted to small-
    batch measurements and extrapolated to ``B_ref``.

Units: ``batch_size`` is the *expected* Poisson batch size ``q N``; adjacency add-or-remove,
unit of privacy one example.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting import rdp as _rdp

#: ``z >= 2``: epsilon depends (almost) only on ``eta`` (TAN Sec. 3.2, Fig. 2-3).
CONSTANT_PRIVACY_NOISE_MULTIPLIER = 2.0
#: ``z < 0.5``: at constant ``eta`` the true epsilon explodes (TAN Fig. 2, "privacy wall").
PRIVACY_WALL_NOISE_MULTIPLIER = 0.5


class Regime(enum.StrEnum):
    """Where a noise multiplier sits relative to the TAN approximation (TAN Fig. 2)."""

    CONSTANT_PRIVACY = "constant_privacy"
    TRANSITION = "transition"
    PRIVACY_WALL = "privacy_wall"


def _scalar_or_array(x: np.ndarray) -> float | np.ndarray:
    return float(x) if np.ndim(x) == 0 else x


def _positive(name: str, value: ArrayLike, *, high: float | None = None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    bad = ~(arr > 0) | (arr > high if high is not None else np.zeros(arr.shape, bool))
    if np.any(bad):
        first = arr[bad].flat[0] if arr.ndim else arr
        check_range(name, float(first), 0.0, high, low_open=True)
    return arr


def eta_step(sampling_rate: ArrayLike, noise_multiplier: ArrayLike) -> float | np.ndarray:
    """Per-step signal-to-noise ratio ``q / (sqrt(2) z)`` (TAN Sec. 3.1). Broadcasts."""
    q = _positive("sampling_rate", sampling_rate, high=1.0)
    z = _positive("noise_multiplier", noise_multiplier)
    return _scalar_or_array(q / (math.sqrt(2.0) * z))


def eta(
    sampling_rate: ArrayLike, noise_multiplier: ArrayLike, steps: ArrayLike
) -> float | np.ndarray:
    """Individual signal-to-noise ratio ``q sqrt(S) / (sqrt(2) z)`` (TAN Definition 3.1)."""
    s = np.asarray(steps, dtype=np.float64)
    if np.any(~(s >= 0)):
        check_range("steps", float(s[~(s >= 0)].flat[0]) if s.ndim else float(s), 0, None)
    return _scalar_or_array(np.asarray(eta_step(sampling_rate, noise_multiplier)) * np.sqrt(s))


def total_amount_of_noise(
    sampling_rate: ArrayLike, noise_multiplier: ArrayLike, steps: ArrayLike
) -> float | np.ndarray:
    """TAN ``Sigma = 1 / eta`` (TAN Definition 3.1)."""
    with np.errstate(divide="ignore"):
        return _scalar_or_array(1.0 / np.asarray(eta(sampling_rate, noise_multiplier, steps)))


def _log_inv_delta(delta: float) -> float:
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    return -math.log(delta)


def epsilon_tan_from_eta(eta_value: ArrayLike, delta: float) -> float | np.ndarray:
    """``eps_TAN = eta^2 + 2 eta sqrt(log(1/delta))`` (TAN Eq. 4). A heuristic, not a bound."""
    e = np.asarray(eta_value, dtype=np.float64)
    if np.any(~(e >= 0)):
        check_range("eta", float(e[~(e >= 0)].flat[0]) if e.ndim else float(e), 0.0, None)
    return _scalar_or_array(e * e + 2.0 * e * math.sqrt(_log_inv_delta(delta)))


def epsilon_tan(
    sampling_rate: ArrayLike, noise_multiplier: ArrayLike, steps: ArrayLike, delta: float
) -> float | np.ndarray:
    """eps_TAN of DP-SGD with Poisson rate ``q``, noise multiplier ``z``, ``steps`` steps.

    Valid as an approximation of the RDP epsilon only for ``z >= 2`` (see :func:`regime`); it
    ignores the privacy wall, so for small ``z`` it can be far below the true epsilon.

    Example:
      >>> round(epsilon_tan(0.01, 4.0, 10_000, 1e-5), 3)
      1.231
    """
    return epsilon_tan_from_eta(eta(sampling_rate, noise_multiplier, steps), delta)


def eta_for_epsilon(target_epsilon: ArrayLike, delta: float) -> float | np.ndarray:
    """The ``eta`` with ``eps_TAN(eta) = target_epsilon``: ``sqrt(L + eps) - sqrt(L)``.

    Here ``L = log(1/delta)``.
    """
    eps = _positive("target_epsilon", target_epsilon)
    root = math.sqrt(_log_inv_delta(delta))
    # sqrt(L + eps) - sqrt(L), written without cancellation.
    return _scalar_or_array(eps / (np.sqrt(root * root + eps) + root))


def noise_multiplier_for_eta(
    sampling_rate: ArrayLike, steps: ArrayLike, eta_value: ArrayLike
) -> float | np.ndarray:
    """The ``z`` giving signal-to-noise ``eta`` at rate ``q`` and ``steps``.

    ``z = q sqrt(S) / (sqrt(2) eta)``.
    """
    q = _positive("sampling_rate", sampling_rate, high=1.0)
    s = _positive("steps", steps)
    e = _positive("eta", eta_value)
    return _scalar_or_array(q * np.sqrt(s) / (math.sqrt(2.0) * e))


def regime(noise_multiplier: float) -> Regime:
    """TAN regime: ``z >= 2`` constant privacy, ``z < 0.5`` privacy wall, else transition."""
    check_range("noise_multiplier", noise_multiplier, 0.0, None, low_open=True)
    if noise_multiplier >= CONSTANT_PRIVACY_NOISE_MULTIPLIER:
        return Regime.CONSTANT_PRIVACY
    if noise_multiplier < PRIVACY_WALL_NOISE_MULTIPLIER:
        return Regime.PRIVACY_WALL
    return Regime.TRANSITION


# --------------------------------------------------------------------------------------------
# Configurations and scaling at constant TAN
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TanConfig:
    """One DP-SGD privacy configuration (Poisson sampling, add-or-remove, example level).

    Attributes:
      batch_size: expected batch size ``B = q N`` (may be fractional after scaling).
      noise_multiplier: ``z``, noise std / clip norm.
      steps: number of DP-SGD steps ``S``.
      dataset_size: ``N``.
    """

    batch_size: float
    noise_multiplier: float
    steps: int
    dataset_size: int

    def __post_init__(self) -> None:
        check_int("dataset_size", self.dataset_size)
        check_range("batch_size", self.batch_size, 0.0, self.dataset_size, low_open=True)
        check_range("noise_multiplier", self.noise_multiplier, 0.0, None, low_open=True)
        check_int("steps", self.steps)
        object.__setattr__(self, "batch_size", float(self.batch_size))
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "steps", int(self.steps))
        object.__setattr__(self, "dataset_size", int(self.dataset_size))

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size

    @property
    def eta_step(self) -> float:
        return float(eta_step(self.sampling_rate, self.noise_multiplier))

    @property
    def eta(self) -> float:
        return float(eta(self.sampling_rate, self.noise_multiplier, self.steps))

    @property
    def regime(self) -> Regime:
        return regime(self.noise_multiplier)

    @property
    def examples_processed(self) -> float:
        """Expected compute in examples through the model: ``B S``."""
        return self.batch_size * self.steps

    @property
    def epochs(self) -> float:
        return self.examples_processed / self.dataset_size

    def epsilon_tan(self, delta: float) -> float:
        return float(epsilon_tan_from_eta(self.eta, delta))

    def privacy_event(self) -> ev.Event:
        """The accountable event: ``steps`` Poisson-sampled Gaussian steps."""
        step = ev.PoissonSampled(self.sampling_rate, ev.Gaussian(self.noise_multiplier))
        return ev.SelfComposed(step, self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "noise_multiplier": self.noise_multiplier,
            "steps": self.steps,
            "dataset_size": self.dataset_size,
            "sampling_rate": self.sampling_rate,
            "eta_step": self.eta_step,
            "eta": self.eta,
            "regime": self.regime.value,
            "examples_processed": self.examples_processed,
            "epochs": self.epochs,
        }


def simulate_small_batch(reference: TanConfig, k: float) -> TanConfig:
    """Simulate ``reference`` at ``1/k`` of its compute: ``B = B_ref/k``, ``z = z_ref/k``, same S.

    The batch is rounded to an integer (at least 1) and the noise multiplier is set to
    ``z_ref * B / B_ref`` so that ``eta_step`` (and ``S``) are *exactly* those of the reference
    (TAN Sec. 3.4: "Efficient TAN training"). The simulation is a tool for choosing non-privacy
    hyper-parameters: its own epsilon is typically far larger than the reference's.
    """
    check_range("k", k, 1.0, None)
    batch = max(1, round(reference.batch_size / k))
    z = reference.noise_multiplier * batch / reference.batch_size
    return TanConfig(batch, z, reference.steps, reference.dataset_size)


def constant_tan_family(
    reference: TanConfig,
    *,
    steps: Sequence[int] | None = None,
    batch_sizes: Sequence[float] | None = None,
) -> list[TanConfig]:
    """Configurations with the reference's ``eta`` and noise multiplier (TAN Sec. 4.3).

    With ``z`` fixed, ``eta^2 = q^2 S / (2 z^2)`` is constant along ``B^2 S = B_ref^2 S_ref``.
    Give either the step counts (the batch follows, ``B = B_ref sqrt(S_ref / S)``) or the batch
    sizes (the steps follow, rounded to the nearest integer). Pairs whose batch would exceed the
    dataset are left out. Rounding moves ``eta`` slightly; each config reports its own ``eta``.
    When ``z >= 2`` the accountant's epsilon is nearly constant along the family (check it with
    :func:`dpfy.accounting.epsilon`); the TAN paper scales the learning rate like ``1/S``.
    """
    if (steps is None) == (batch_sizes is None):
        raise ValueError("give exactly one of steps or batch_sizes")
    b_ref, s_ref = reference.batch_size, reference.steps
    out: list[TanConfig] = []
    if steps is not None:
        for s in steps:
            check_int("steps", s)
            b = b_ref * math.sqrt(s_ref / int(s))
            if b <= reference.dataset_size:
                out.append(TanConfig(b, reference.noise_multiplier, int(s), reference.dataset_size))
    else:
        for b in batch_sizes or ():
            check_range("batch_size", b, 0.0, reference.dataset_size, low_open=True)
            s = max(1, round(s_ref * (b_ref / float(b)) ** 2))
            out.append(TanConfig(float(b), reference.noise_multiplier, s, reference.dataset_size))
    return out


# --------------------------------------------------------------------------------------------
# Batch scaling law (TAN Fig. 4)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class BatchScalingFit:
    """Least-squares fit of ``metric = intercept + slope * log(batch_size)`` (TAN Fig. 4).

    Attributes:
      intercept, slope: the fitted line in natural-log batch size.
      residual_std: residual standard deviation (``nan`` with fewer than 3 points).
      batch_sizes, values: the measurements the line was fitted to.
    """

    intercept: float
    slope: float
    residual_std: float
    batch_sizes: tuple[float, ...]
    values: tuple[float, ...]

    def predict(self, batch_size: ArrayLike) -> float | np.ndarray:
        """The fitted metric at ``batch_size`` (extrapolation beyond the data is the point)."""
        b = _positive("batch_size", batch_size)
        return _scalar_or_array(self.intercept + self.slope * np.log(b))

    def prediction_std(self, batch_size: ArrayLike) -> float | np.ndarray:
        """Standard error of a new measurement at ``batch_size`` under the linear model."""
        b = np.log(_positive("batch_size", batch_size))
        x = np.log(np.asarray(self.batch_sizes))
        n = x.size
        sxx = float(np.sum((x - x.mean()) ** 2))
        if n < 3 or sxx == 0.0:
            return _scalar_or_array(np.full(np.shape(b), np.nan))
        var = self.residual_std**2 * (1.0 + 1.0 / n + (b - x.mean()) ** 2 / sxx)
        return _scalar_or_array(np.sqrt(var))

    def to_dict(self) -> dict[str, Any]:
        return {
            "intercept": self.intercept,
            "slope": self.slope,
            "residual_std": self.residual_std,
            "batch_sizes": list(self.batch_sizes),
            "values": list(self.values),
        }


def fit_batch_scaling(batch_sizes: Sequence[float], values: Sequence[float]) -> BatchScalingFit:
    """Fit TAN's log-linear batch scaling law to metrics measured at constant eta_step and S.

    Args:
      batch_sizes: batch sizes of the (cheap) simulations, at least two distinct values.
      values: the metric measured at each (e.g. test accuracy in %); repeats are allowed.

    Returns:
      A :class:`BatchScalingFit`; ``fit.predict(B_ref)`` extrapolates to the reference batch.
    """
    b = _positive("batch_sizes", batch_sizes)
    y = np.asarray(values, dtype=np.float64)
    if b.ndim != 1 or b.shape != y.shape:
        raise ValueError(
            f"batch_sizes and values must be 1-d of equal length, got {b.shape} and {y.shape}"
        )
    if np.unique(b).size < 2:
        raise ValueError("batch_sizes must contain at least two distinct values")
    if not np.all(np.isfinite(y)):
        raise ValueError("values must be finite")
    x = np.log(b)
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = y.size - 2
    std = float(np.sqrt(resid @ resid / dof)) if dof > 0 else math.nan
    return BatchScalingFit(
        float(coef[0]), float(coef[1]), std, tuple(b.tolist()), tuple(y.tolist())
    )


# --------------------------------------------------------------------------------------------
# The privacy wall (TAN Fig. 2)
# --------------------------------------------------------------------------------------------


def privacy_wall_curve(
    eta_value: float,
    steps: int,
    noise_multipliers: ArrayLike,
    delta: float,
    method: str = "rdp",
) -> np.ndarray:
    """True epsilon at constant ``eta`` and ``steps`` as a function of ``z`` (TAN Fig. 2).

    Each point uses the sampling rate ``q = sqrt(2) z eta / sqrt(S)`` that keeps ``eta`` fixed;
    points needing ``q > 1`` are ``nan``. The flat part is close to eps_TAN; the rise at small
    ``z`` is the privacy wall. ``method`` is any accountant name (``rdp`` is vectorised).
    """
    check_range("eta", eta_value, 0.0, None, low_open=True)
    check_int("steps", steps)
    zs = np.atleast_1d(_positive("noise_multipliers", noise_multipliers))
    qs = math.sqrt(2.0) * zs * eta_value / math.sqrt(steps)
    out = np.full(zs.shape, np.nan)
    ok = qs <= 1.0
    if method == "rdp":
        if np.any(ok):
            out[ok] = _rdp.epsilon_poisson_gaussian(qs[ok], zs[ok], int(steps), delta)[0]
        return out
    from dpfy import accounting

    for i in np.flatnonzero(ok):
        event = ev.SelfComposed(ev.PoissonSampled(float(qs[i]), ev.Gaussian(float(zs[i]))), steps)
        out[i] = accounting.epsilon(event, delta, method=method).epsilon
    return out


def ratio_table(
    target_epsilons: Sequence[float],
    steps: Sequence[int],
    noise_multipliers: Sequence[float],
    delta: float,
    *,
    conversion: str = "balle",
) -> np.ndarray:
    """``eps_RDP / eps_TAN`` at constant ``eta`` on a grid, shape (targets, steps, z).

    For each target ``eps_TAN`` the ``eta`` is fixed by :func:`eta_for_epsilon`; each (S, z)
    then uses ``q = sqrt(2) z eta / sqrt(S)`` (``nan`` where ``q > 1``). ``conversion="balle"``
    uses the RDP-to-DP conversion of dpfy's ``rdp`` accountant (Balle et al. 2020, the one the
    TAN paper reports); ``"basic"`` uses ``min_a RDP(a) + log(1/delta)/(a-1)`` (Mironov 2017),
    the conversion TAN's Eq. 3-4 start from.
    """
    if conversion not in ("balle", "basic"):
        raise ValueError(f"conversion must be one of {{balle, basic}}, got {conversion=!r}")
    orders = _rdp.DEFAULT_ORDERS
    zs = _positive("noise_multipliers", noise_multipliers)
    out = np.full((len(target_epsilons), len(steps), zs.size), np.nan)
    for i, target in enumerate(target_epsilons):
        eta_value = float(eta_for_epsilon(target, delta))
        for j, s in enumerate(steps):
            check_int("steps", s)
            qs = math.sqrt(2.0) * zs * eta_value / math.sqrt(s)
            ok = qs <= 1.0
            if not np.any(ok):
                continue
            curves = int(s) * _rdp.rdp_poisson_gaussian(qs[ok], zs[ok], orders)
            if conversion == "balle":
                eps = _rdp.epsilon_from_rdp(curves, orders, delta)[0]
            else:
                eps = np.min(curves - math.log(delta) / (orders - 1.0), axis=-1)
            out[i, j, ok] = np.asarray(eps) / target
    return out

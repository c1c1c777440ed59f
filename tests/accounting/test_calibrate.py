"""Tests for dpfy.accounting.calibrate: round trips, the safe side, closed forms, errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize, special

from dpfy import events as ev
from dpfy.accounting import UnsupportedEventError, epsilon
from dpfy.accounting.calibrate import (
    CalibrationError,
    calibrate_noise_multiplier,
    calibrate_sampling_rate,
    calibrate_steps,
)


def _poisson(q: float, z: float, steps: int) -> ev.Event:
    return ev.SelfComposed(ev.PoissonSampled(q, ev.Gaussian(z)), steps)


def _eps(event: ev.Event, delta: float, method: str) -> float:
    return epsilon(event, delta, method=method).epsilon


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_noise_round_trip_is_safe_and_tight(method: str) -> None:
    make = lambda z: _poisson(0.01, z, 1000)  # noqa: E731
    z = calibrate_noise_multiplier(make, 2.0, 1e-5, method=method)
    assert _eps(make(z), 1e-5, method) <= 2.0
    assert _eps(make(z * (1 - 2e-3)), 1e-5, method) > 2.0


def test_noise_against_gaussian_closed_form() -> None:
    # 100 unsampled Gaussian steps are mu-GDP with mu = 10 / z (Balle & Wang 2018).
    target, delta = 1.5, 1e-6

    def gdp_delta(mu: float) -> float:
        e = target
        return special.ndtr(-e / mu + mu / 2) - math.exp(e) * special.ndtr(-e / mu - mu / 2)

    mu = optimize.brentq(lambda m: gdp_delta(m) - delta, 1e-3, 20.0, xtol=1e-14)
    z_exact = 10.0 / mu
    for method in ("gaussian", "pld"):
        z = calibrate_noise_multiplier(
            lambda z: ev.SelfComposed(ev.Gaussian(z), 100), target, delta, method=method
        )
        assert z >= z_exact * (1 - 1e-9)
        assert z <= z_exact * (1 + 3e-3)


def test_auto_takes_the_best_method_and_stays_safe() -> None:
    make = lambda z: _poisson(0.02, z, 500)  # noqa: E731
    z_auto = calibrate_noise_multiplier(make, 3.0, 1e-6)
    z_rdp = calibrate_noise_multiplier(make, 3.0, 1e-6, method="rdp")
    assert z_auto <= z_rdp
    assert _eps(make(z_auto), 1e-6, "auto") <= 3.0


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_steps_round_trip(method: str) -> None:
    make = lambda t: _poisson(0.01, 1.0, t)  # noqa: E731
    steps = calibrate_steps(make, 1.0, 1e-5, method=method)
    assert isinstance(steps, int)
    assert _eps(make(steps), 1e-5, method) <= 1.0
    assert _eps(make(steps + 1), 1e-5, method) > 1.0


def test_sampling_rate_round_trip() -> None:
    make = lambda q: _poisson(q, 1.2, 2000)  # noqa: E731
    q = calibrate_sampling_rate(make, 2.0, 1e-5, method="pld")
    assert _eps(make(q), 1e-5, "pld") <= 2.0
    assert _eps(make(q * 1.003), 1e-5, "pld") > 2.0


def test_sampling_rate_one_when_full_batches_are_affordable() -> None:
    make = lambda q: _poisson(q, 50.0, 10)  # noqa: E731
    assert calibrate_sampling_rate(make, 1.0, 1e-5, method="rdp") == 1.0


def test_truncated_sampler_calibrates_through_the_api() -> None:
    make = lambda z: ev.TruncatedPoisson(0.01, z, 500, 10_000, 180)  # noqa: E731
    z = calibrate_noise_multiplier(make, 2.0, 1e-5, method="pld")
    assert _eps(make(z), 1e-5, "pld") <= 2.0
    plain = calibrate_noise_multiplier(lambda z: _poisson(0.01, z, 500), 2.0, 1e-5, method="pld")
    assert z >= plain * (1 - 2e-4)  # truncation only adds delta (both to rtol=1e-4)


@settings(max_examples=6, deadline=None)
@given(
    q=st.floats(1e-3, 0.2),
    steps=st.integers(1, 2000),
    target=st.floats(0.3, 10.0),
    log_delta=st.floats(-10.0, -4.0),
    method=st.sampled_from(["rdp", "pld"]),
)
def test_never_exceeds_the_target(
    q: float, steps: int, target: float, log_delta: float, method: str
) -> None:
    delta = 10.0**log_delta
    make = lambda z: _poisson(q, z, steps)  # noqa: E731
    z = calibrate_noise_multiplier(make, target, delta, method=method)
    assert _eps(make(z), delta, method) <= target


# ------------------------------------------------------------------------------------------
# Ends of the range and bad input
# ------------------------------------------------------------------------------------------


def test_unreachable_noise_target_is_a_clear_error() -> None:
    make = lambda z: _poisson(0.5, z, 1000)  # noqa: E731
    with pytest.raises(CalibrationError, match="target_epsilon=0.01 cannot be met"):
        calibrate_noise_multiplier(make, 0.01, 1e-5, method="rdp", bracket=(0.5, 2.0))


def test_lower_bracket_end_when_even_little_noise_meets_the_target() -> None:
    make = lambda z: _poisson(1e-3, z, 10)  # noqa: E731
    z = calibrate_noise_multiplier(make, 50.0, 1e-5, method="rdp", bracket=(0.5, 100.0))
    assert z == 0.5


def test_unreachable_steps_and_rate() -> None:
    with pytest.raises(CalibrationError, match="steps=1"):
        calibrate_steps(lambda t: _poisson(0.5, 0.5, t), 0.1, 1e-5, method="pld")
    with pytest.raises(CalibrationError, match="sampling_rate"):
        calibrate_sampling_rate(
            lambda q: _poisson(q, 0.5, 1000), 0.1, 1e-5, method="rdp", min_sampling_rate=0.1
        )


def test_max_steps_returned_when_affordable() -> None:
    make = lambda t: _poisson(1e-4, 5.0, t)  # noqa: E731
    assert calibrate_steps(make, 5.0, 1e-5, method="rdp", max_steps=1000) == 1000


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"target_epsilon": 0.0, "delta": 1e-5}, ValueError, "target_epsilon must be in"),
        ({"target_epsilon": 1.0, "delta": 1.0}, ValueError, "delta must be in"),
        ({"target_epsilon": 1.0, "delta": 1e-5, "method": "nope"}, ValueError, "method must"),
        (
            {"target_epsilon": 1.0, "delta": 1e-5, "bracket": (2.0, 1.0)},
            ValueError,
            r"bracket\[1\] must be in",
        ),
    ],
)
def test_bad_input(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        calibrate_noise_multiplier(lambda z: _poisson(0.01, z, 10), **kwargs)


def test_unsupported_method_for_the_event() -> None:
    with pytest.raises(UnsupportedEventError, match="Shuffled"):
        calibrate_noise_multiplier(lambda z: ev.Shuffled(z, 100, 2), 1.0, 1e-5, method="pld")


def test_configured_accountant_instance() -> None:
    from dpfy.accounting.pld import PLDAccountant

    acc = PLDAccountant(tolerance=1e-2)
    make = lambda z: _poisson(0.05, z, 200)  # noqa: E731
    z = calibrate_noise_multiplier(make, 3.0, 1e-6, method=acc, rtol=1e-3)
    assert acc.epsilon(make(z), 1e-6).epsilon <= 3.0
    assert acc.epsilon(make(z * 0.99), 1e-6).epsilon > 3.0

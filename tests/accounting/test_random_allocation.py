"""Random-allocation (Balls-and-Bins) PLD accountant: provable bounds against stored references.

The reference values (PLD_accounting 2.0, Feldman & Shenfeld 2026) are slow to compute; they
were made once by ``vectors/make_random_allocation.py`` and are read from
``vectors/random_allocation.json``.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting import gaussian as gauss
from dpfy.accounting import random_allocation as ra
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.accounting.monte_carlo.accountant import MonteCarloAccountant

VECTORS = json.loads(
    (pathlib.Path(__file__).parent / "vectors" / "random_allocation.json").read_text()
)


FAST = [r for r in VECTORS if r["T"] * r["epochs"] <= 50]
SLOW = [r for r in VECTORS if r not in FAST]


def _check(row: dict) -> None:
    b = ra.allocation_epsilon(row["z"], row["T"], row["epochs"], row["delta"])
    # Never below the reference's lower bound (it would be invalid), never looser than 1.01 x
    # its upper bound, and the optimistic twin never above the upper bound.
    assert b.upper >= row["lower"], (row, b)
    assert b.upper <= 1.01 * row["upper"], (row, b)
    assert b.lower <= b.upper, (row, b)
    assert b.lower <= row["upper"], (row, b)  # a lower bound above a valid upper bound is wrong


@pytest.mark.parametrize("row", FAST, ids=lambda r: f"T{r['T']}-z{r['z']}-k{r['epochs']}")
def test_within_reference_bounds(row):
    _check(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", SLOW, ids=lambda r: f"T{r['T']}-z{r['z']}-k{r['epochs']}")
def test_within_reference_bounds_large(row):
    _check(row)


def test_vectors_cover_the_issue_grid():
    assert {r["T"] for r in VECTORS} >= {8, 1000}
    assert min(r["z"] for r in VECTORS) == 0.5 and max(r["z"] for r in VECTORS) == 5.0
    assert {1, 50} <= {r["epochs"] for r in VECTORS}
    assert {1e-10, 1e-5} <= {r["delta"] for r in VECTORS}


@pytest.mark.parametrize(
    ("z", "epochs", "delta"), [(0.5, 1, 1e-10), (1.0, 3, 1e-5), (4.0, 20, 1e-8)]
)
def test_one_step_equals_the_gaussian_exactly(z, epochs, delta):
    exact = float(gauss.gaussian_epsilon(math.sqrt(epochs) / z, delta))
    b = ra.allocation_epsilon(z, 1, epochs, delta)
    assert b.upper == exact and b.lower == exact


@pytest.mark.parametrize(("z", "epochs"), [(0.7, 1), (2.0, 4)])
def test_grid_path_brackets_the_gaussian(z, epochs):
    # T = 1 through the discretised path (not the exact shortcut) must bracket the exact value.
    exact = float(gauss.gaussian_epsilon(math.sqrt(epochs) / z, 1e-6))
    b = ra._bounds({(z, 1): epochs}, "epsilon", 1e-6, ra.DEFAULT_TOLERANCE)
    assert b.lower <= exact <= b.upper
    assert b.upper <= exact * 1.005


def test_monotone_in_noise_steps_epochs_and_delta():
    base = ra.allocation_epsilon(1.0, 16, 2, 1e-6).upper
    assert ra.allocation_epsilon(1.5, 16, 2, 1e-6).upper < base
    assert ra.allocation_epsilon(1.0, 64, 2, 1e-6).upper < base
    assert ra.allocation_epsilon(1.0, 16, 4, 1e-6).upper > base
    assert ra.allocation_epsilon(1.0, 16, 2, 1e-4).upper < base


def test_delta_is_consistent_with_epsilon():
    b = ra.allocation_epsilon(1.0, 16, 2, 1e-6)
    d = ra.allocation_delta(1.0, 16, 2, b.upper)
    assert d.lower <= d.upper
    assert d.upper == pytest.approx(1e-6, rel=0.05)


def test_tighter_than_poisson_pld_and_no_amplification():
    # The issue's example: N=8000, B=1000 (T=8), z=1, one epoch, delta=1e-8: no amplification
    # gives 5.78, Poisson PLD at q=1/8 gives 5.11; the reference upper bound is 3.733.
    res = accounting.epsilon(ev.BallsAndBins(1.0, 8), 1e-8)
    assert res.method == "random_allocation" and res.provable
    assert 3.70 <= res.epsilon <= 3.733
    assert res.epsilon_lower is not None and res.epsilon_lower <= res.epsilon


def test_registry_default_and_monte_carlo_still_selectable():
    event = ev.BallsAndBins(2.0, 10, 2)
    assert accounting.epsilon(event, 1e-5).method == "random_allocation"
    acc = MonteCarloAccountant(samples=2_000, seed=0, progress=False, method="plain")
    mc = accounting.epsilon(event, 1e-5, method=acc)
    assert mc.method == "monte_carlo" and mc.epsilon >= accounting.epsilon(event, 1e-5).epsilon
    assert "random_allocation" in accounting.accountants()
    # Poisson events are not this accountant's
    assert accounting.epsilon(ev.PoissonSampled(0.1, ev.Gaussian(1.0)), 1e-5).method != (
        "random_allocation"
    )


def test_truncated_balls_and_bins_adds_truncation():
    plain = accounting.epsilon(ev.BallsAndBins(2.0, 10), 1e-3).epsilon
    cut = accounting.epsilon(ev.TruncatedBallsAndBins(2.0, 10, 1, 1000, 125), 1e-3)
    assert cut.method == "random_allocation" and cut.epsilon >= plain


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_multiplier": 0.01}, "noise_multiplier"),
        ({"steps": 0}, "steps"),
        ({"epochs": 0}, "epochs"),
        ({"delta": 1.0}, "delta"),
    ],
)
def test_bad_inputs_name_the_parameter(kwargs, name):
    args = {"noise_multiplier": 1.0, "steps": 8, "epochs": 1, "delta": 1e-5, **kwargs}
    with pytest.raises(ValueError, match=name):
        ra.allocation_epsilon(**args)


def test_calibration_takes_seconds_and_round_trips():
    start = time.perf_counter()
    z = calibrate_noise_multiplier(
        lambda x: ev.BallsAndBins(x, 100, 3), 2.0, 1e-6, method="random_allocation"
    )
    elapsed = time.perf_counter() - start
    assert accounting.epsilon(ev.BallsAndBins(z, 100, 3), 1e-6).epsilon <= 2.0
    assert accounting.epsilon(ev.BallsAndBins(z * 0.98, 100, 3), 1e-6).epsilon > 2.0
    assert elapsed < 30.0


@pytest.mark.parametrize(("z", "steps", "epochs"), [(0.2, 100, 1), (0.6, 16, 3), (3.0, 50, 2)])
def test_between_lower_bound_and_no_amplification(z, steps, epochs):
    # Balls-and-Bins is at least as private as deterministic batching (Chua et al. 2025,
    # Prop. 3.3): the exact Gaussian of one step per epoch is a valid upper bound, so our
    # optimistic twin must lie below it, and a tight upper bound should too.
    no_amp = float(gauss.gaussian_epsilon(math.sqrt(epochs) / z, 1e-5))
    b = ra.allocation_epsilon(z, steps, epochs, 1e-5)
    assert math.isfinite(b.upper)
    assert b.lower <= b.upper <= no_amp


def test_the_refinement_states_the_tolerance_it_reached_met_or_not():
    from dpfy.accounting.random_allocation import RandomAllocationAccountant, _bounds

    met = _bounds({(1.0, 10): 1}, "epsilon", 1e-5, 2e-3)
    assert met.converged and met.gap <= 2e-3
    short = _bounds({(1.0, 10): 1}, "epsilon", 1e-5, 1e-9, levels=2)  # cannot meet 1e-9
    assert not short.converged and short.gap > 1e-9 and short.upper >= met.upper * (1 - 1e-3)
    event = ev.BallsAndBins(1.0, 10)
    notes = RandomAllocationAccountant(tolerance=1e-9, lower=False).epsilon(event, 1e-5).notes
    assert any("NOT met" in n and "valid upper bound" in n for n in notes), notes
    notes = RandomAllocationAccountant(lower=False).epsilon(event, 1e-5).notes
    assert any("tolerance=0.002 met" in n for n in notes), notes

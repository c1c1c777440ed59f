"""The ledger's steps and releases against the sampler's plan and the run's own count
(dpfy.audit.counts): what a correct ledger may hold, and what it may not."""

from __future__ import annotations

from typing import Any

from dpfy.audit.counts import ledger_count_check, planned_steps
from dpfy.ledger import Ledger
from dpfy.sampling import SampleSpec

SPEC = SampleSpec("poisson", dataset_size=64, sampling_rate=0.25)


def _ledger(steps: list[int | None], *, released: bool = True, **facts: Any) -> Ledger:
    ledger = Ledger()
    ledger.record_metadata(epochs=2, steps_per_epoch=4, **facts)
    for step in steps:
        sid = ledger.record_sample(SPEC, step=step)
        if released:
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    return ledger


def test_a_completed_run_matches_its_plan() -> None:
    ledger = _ledger(list(range(8)), stopped="completed")
    assert planned_steps(ledger.metadata) == 8
    assert ledger_count_check(ledger, {"steps": 8}) == ()


def test_releases_outside_the_step_loop_are_not_steps() -> None:
    """A tuning trial's ledger: 8 numbered steps, then its validation score (no step)."""
    ledger = _ledger([*range(8), None], stopped="completed")
    assert ledger_count_check(ledger, {"steps": 8}) == ()


def test_a_run_stopped_early_is_held_to_its_own_count_only() -> None:
    ledger = _ledger(list(range(5)), stopped="budget")
    assert planned_steps(ledger.metadata) is None
    assert ledger_count_check(ledger, {"steps": 5}) == ()
    assert ledger_count_check(ledger, {"steps": 6}) == (
        "ledger: 5 steps recorded, but the run's summary.json counts 6 steps",
    )


def test_a_step_recorded_twice_is_charged_twice_and_allowed() -> None:
    ledger = _ledger([0, 1, 2, 2, 3, 4, 5, 6, 7], stopped="completed")
    assert ledger_count_check(ledger, {"steps": 8}) == ()


def test_a_gap_and_a_step_without_release_are_found() -> None:
    ledger = _ledger([0, 1, 3])  # no "stopped": no plan to compare with
    assert ledger_count_check(ledger) == (
        "ledger: step(s) [2] of 0..3 have no sample record (1 missing): their releases are "
        "not accounted",
    )
    bare = _ledger([0, 1], released=False)
    assert ledger_count_check(bare) == (
        "ledger: step(s) [0, 1] have a sample record and no release record",
    )


def test_a_step_cut_short_and_taken_again_is_allowed() -> None:
    """A crash between a step's sample and its release; the resumed run takes the step again."""
    ledger = _ledger([0, 1], stopped="completed")
    ledger.record_sample(SPEC, step=2)  # no release: the process died here
    for step in range(2, 8):
        sid = ledger.record_sample(SPEC, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    assert ledger_count_check(ledger, {"steps": 8}) == ()

"""EventBuilder folds repetitions exactly and flattens compositions; untruncated lives in events."""

from __future__ import annotations

import pytest

from dpfy import events as ev

STEP = ev.PoissonSampled(0.1, ev.Gaussian(1.0))
OTHER = ev.PoissonSampled(0.2, ev.Gaussian(1.0))


def test_consecutive_equal_events_fold_into_one_count():
    b = ev.EventBuilder().add(STEP).add(STEP, 2).add(ev.SelfComposed(STEP, 3))
    assert b.build() == ev.SelfComposed(STEP, 6)
    assert ev.compose(STEP, OTHER, STEP) == ev.Composed((STEP, OTHER, STEP))


def test_counted_events_add_up_their_own_field():
    assert ev.compose(ev.BallsAndBins(1.0, 10, 1), ev.BallsAndBins(1.0, 10, 2)) == (
        ev.BallsAndBins(1.0, 10, 3)
    )
    tp = ev.TruncatedPoisson(0.1, 1.0, 4, 100, 20)
    assert ev.compose(tp, tp) == ev.TruncatedPoisson(0.1, 1.0, 8, 100, 20)
    assert ev.repeat(ev.Shuffled(1.0, 10, 2), 3) == ev.Shuffled(1.0, 10, 6)
    assert ev.repeat(ev.Gaussian(1.0), 3) == ev.SelfComposed(ev.Gaussian(1.0), 3)
    assert ev.repeat(STEP, 1) is STEP


def test_nested_compositions_are_flattened_and_one_repetition_is_bare():
    nested = ev.Composed((STEP, ev.Composed((OTHER, ev.SelfComposed(OTHER, 1)))))
    assert ev.compose(nested) == ev.Composed((STEP, ev.SelfComposed(OTHER, 2)))
    assert ev.compose(ev.SelfComposed(STEP, 1)) == STEP
    assert ev.EventBuilder().build() == ev.Composed(())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="count"):
        ev.EventBuilder().add(STEP, 0)
    with pytest.raises(ValueError, match="event must be"):
        ev.EventBuilder().add("gaussian")  # type: ignore[arg-type]


def test_untruncated_removes_truncation_only():
    tp = ev.TruncatedPoisson(0.1, 1.0, 4, 100, 20)
    tbb = ev.TruncatedBallsAndBins(1.0, 10, 2, 100, 20)
    assert ev.untruncated(ev.Composed((tp, tbb))) == ev.Composed(
        (ev.SelfComposed(STEP, 4), ev.BallsAndBins(1.0, 10, 2))
    )
    assert tbb.untruncated() == ev.BallsAndBins(1.0, 10, 2)

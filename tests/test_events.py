"""Events: JSON round trip (hypothesis) and validation messages naming parameter and range."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfy import events as ev
from dpfy._validate import MAX_COUNT as M

positive = st.floats(1e-6, 1e6, allow_nan=False)
rates = st.floats(1e-9, 1.0)
small_int = st.integers(1, 10_000)
adjacency = st.sampled_from([a.value for a in ev.Adjacency])


@st.composite
def _fixed_size(draw: st.DrawFn, inner: st.SearchStrategy) -> ev.FixedSizeSampled:
    n = draw(small_int)
    return ev.FixedSizeSampled(draw(st.integers(1, n)), n, draw(inner), draw(adjacency))


leaves = st.one_of(
    positive.map(ev.Gaussian),
    positive.map(ev.Laplace),
    st.floats(0.0, 1e3).map(ev.ZCDP),
    st.text(max_size=8).map(ev.NonPrivate),
    st.builds(ev.BallsAndBins, positive, small_int, small_int, adjacency),
    st.builds(ev.Shuffled, positive, small_int, small_int, adjacency),
    st.builds(ev.Deterministic, positive, small_int, small_int, adjacency),
    st.builds(ev.TruncatedPoisson, rates, positive, st.integers(0, 10**7), small_int, small_int),
)


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.builds(ev.PoissonSampled, rates, children),
        _fixed_size(children),
        st.builds(ev.SelfComposed, children, st.integers(0, 10**7)),
        st.lists(children, max_size=4).map(lambda xs: ev.Composed(tuple(xs))),
        st.builds(
            ev.RepeatAndSelect, children, positive, st.one_of(st.just(math.inf), positive)
        ),
    )


event_trees = st.recursive(leaves, _extend, max_leaves=8)


@settings(max_examples=30, deadline=None)
@given(event_trees)
def test_json_round_trip(event: ev.Event) -> None:
    text = json.dumps(event.to_dict(), allow_nan=False)
    again = ev.event_from_dict(json.loads(text))
    assert again == event
    assert type(again) is type(event)
    assert again.adjacency_relation is event.adjacency_relation


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ev.Gaussian(0), "noise_multiplier must be in (0.0, inf), got noise_multiplier=0"),
        (lambda: ev.Laplace(-1.0), "noise_multiplier must be in (0.0, inf)"),
        (lambda: ev.Gaussian(math.nan), "noise_multiplier must be in (0.0, inf)"),
        (
            lambda: ev.PoissonSampled(1.5, ev.Gaussian(1)),
            "sampling_rate must be in (0.0, 1.0], got sampling_rate=1.5",
        ),
        (lambda: ev.PoissonSampled(0.0, ev.Gaussian(1)), "sampling_rate must be in (0.0, 1.0]"),
        (
            lambda: ev.FixedSizeSampled(11, 10, ev.Gaussian(1)),
            "sample_size must be an integer in [1, 10], got sample_size=11",
        ),
        (lambda: ev.SelfComposed(ev.Gaussian(1), -1), f"count must be an integer in [0, {M}]"),
        (lambda: ev.SelfComposed(ev.Gaussian(1), 2.5), f"count must be an integer in [0, {M}]"),
        (lambda: ev.ZCDP(-1), "rho must be in [0.0, inf), got rho=-1"),
        (lambda: ev.Shuffled(1, 10, 0), f"epochs must be an integer in [1, {M}], got epochs=0"),
        (lambda: ev.Deterministic(1, 0), f"steps_per_epoch must be an integer in [1, {M}]"),
        (lambda: ev.BallsAndBins(1, 10, adjacency="x"), "adjacency must be one of {add_or_remove"),
        (lambda: ev.Composed((1,)), "events[0] must be a dpfy.events.Event, got events[0]=1"),
        (lambda: ev.PoissonSampled(0.5, "g"), "event must be a dpfy.events.Event"),
        (lambda: ev.RepeatAndSelect(ev.Gaussian(1), 0), "mean must be in (0.0, inf)"),
        (
            lambda: ev.TruncatedPoisson(0.1, 1, 10, 100, 0),
            f"max_batch_size must be an integer in [1, {M}]",
        ),
        (lambda: ev.event_from_dict({"type": "nope"}), "event type must be one of {"),
        (lambda: ev.event_from_dict({"noise_multiplier": 1}), "an event dict needs a 'type' key"),
        (
            lambda: ev.event_from_dict({"type": "gaussian", "noise_multiplier": 1, "z": 2}),
            "unknown field 'z'",
        ),
        (
            lambda: ev.event_from_dict({"type": "gaussian", "noise_multiplier": -2}),
            "noise_multiplier must be in (0.0, inf)",
        ),
    ],
)
def test_validation_names_parameter_and_range(make, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_adjacency_of_a_tree() -> None:
    tree = ev.Composed(
        (ev.Gaussian(1.0), ev.SelfComposed(ev.FixedSizeSampled(2, 10, ev.Gaussian(1.0)), 3))
    )
    assert tree.adjacency_relation is ev.Adjacency.REPLACE_ONE
    assert ev.Gaussian(1.0).adjacency_relation is ev.Adjacency.ADD_OR_REMOVE

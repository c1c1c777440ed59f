"""A search calibrated to a total budget (:func:`dpfy.accounting.tuning.calibrate_search`): the
whole search's epsilon, recomputed here from the events, is at most the budget and within a
small gap of it, at the largest such per-run target; a budget the scores alone exceed is refused
at once."""

from __future__ import annotations

import math

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting.tuning import calibrate_search, search_event

DELTA = 1e-5


def _events(per_run: float) -> tuple[ev.Event, ev.Event]:
    """A trial (Poisson DP-SGD and its score) and a final run whose noise falls as the
    per-run target grows (z = 1.5 / per_run: monotone, no calibration, so this stays fast)."""
    def run(rate: float) -> ev.Event:
        return ev.SelfComposed(ev.PoissonSampled(rate, ev.Gaussian(1.5 / per_run)), 60)

    return ev.Composed((run(0.025), ev.Gaussian(10.0))), run(0.02)


def _full_batch_events(per_run: float) -> tuple[ev.Event, ev.Event]:
    """Full-batch runs (exact Gaussian accounting: a fixed K composes in microseconds)."""
    run = ev.SelfComposed(ev.Gaussian(8.0 / per_run), 20)
    return ev.Composed((run, ev.Gaussian(10.0))), run


@pytest.mark.parametrize(("total", "mean", "shape", "events"), [
    (1.0, 4.0, 1.0, _events), (8.0, 4.0, 1.0, _events), (3.0, 3.0, 0.0, _events),
    (3.0, 4.0, math.inf, _events),  # Poisson K: Theorem 6 with the PLD's delta_hat
    (3.0, 2.0, None, _full_batch_events), (8.0, 4.0, None, _full_batch_events)])
def test_the_calibrated_search_spends_at_most_its_total_and_nearly_all_of_it(
    total, mean, shape, events
):
    budget = calibrate_search(events, total, DELTA, mean=mean, shape=shape, rtol=1e-3)
    event, method = search_event(*events(budget.per_run_epsilon), mean, shape)
    spent = accounting.epsilon(event, DELTA, method).epsilon
    assert spent == budget.epsilon <= total
    assert spent >= total * (1 - 5e-3)  # the per-run target is within 0.1 % of the root
    assert budget.per_run_epsilon < total  # the trials cost something
    more = search_event(*events(budget.per_run_epsilon * 1.01), mean, shape)[0]
    assert accounting.epsilon(more, DELTA, method).epsilon > total  # the largest such target


def test_a_total_the_scores_alone_exceed_is_refused():
    with pytest.raises(ValueError, match=r"total_epsilon=0\.05 cannot be met .* scores alone"):
        calibrate_search(_events, 0.05, DELTA, mean=4.0, shape=1.0, floor=ev.Gaussian(0.5))
    with pytest.raises(ValueError, match="total_epsilon must be in"):
        calibrate_search(_events, 0.0, DELTA, mean=4.0, shape=1.0)


def test_a_margin_calibrates_below_the_total_and_reports_the_total():
    budget = calibrate_search(_events, 3.0, DELTA, mean=4.0, shape=1.0, margin=0.01)
    assert budget.total_epsilon == 3.0 and 2.96 < budget.epsilon <= 2.97

"""The report of a feature learner says that the data set size N its ledger records is public."""

from __future__ import annotations

import numpy as np

from dpfy.features import DPNewtonClassifier
from dpfy.ledger import Ledger
from dpfy.ledger.records import SampleRecord
from dpfy.report import build_report
from dpfy.sampling import SampleSpec


def test_report_states_that_the_recorded_size_is_treated_as_public():
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(500, 4)), rng.integers(0, 3, 500)
    model = DPNewtonClassifier(epsilon=1.0, classes=[0, 1, 2], random_state=0).fit(X, y)
    sizes = {r.spec.dataset_size for r in model.ledger_.entries if isinstance(r, SampleRecord)}
    assert sizes == {500}  # every full-batch entry records N
    rep = build_report(model.ledger_, delta=1e-5)
    assert "with the data set size (N = 500) treated as public" in rep.formal_statement
    assert rep.formal_statement.startswith("Not a DP release (seeded experiment)")
    assert any(a.startswith("The data set size N = 500 is treated as public") and
               "N itself is not protected" in a for a in rep.assumptions)
    md = rep.to_markdown()
    assert "delta x N = 0.005 (N = 500)" in md and "treated as public" in md


def test_no_size_assumption_where_neighbours_have_the_same_size_or_none_is_recorded():
    for spec in (SampleSpec("fixed_size", dataset_size=100, batch_size=10),
                 SampleSpec("poisson", sampling_rate=0.1)):
        ledger = Ledger()
        for step in range(3):
            sid = ledger.record_sample(spec, step=step)
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0)
        rep = build_report(ledger, delta=1e-5)
        assert "treated as public" not in rep.formal_statement
        assert not any("treated as public" in a for a in rep.assumptions)

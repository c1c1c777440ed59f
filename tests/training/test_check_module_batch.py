"""``check_module(model, example_batch)``: the first step's verdict, before the first step.

With a sample batch, the run-time checks (layout probe, coverage, attribution, the capture's
refusals) run on a copy of the model with nothing released; the verdict must equal that of a
real first step on the same batch: the same refusal message, or none. Without a batch, the
report names the checks that are left to run time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.queries import GaussianSumQuery
from dpfy.training import PrivateGradient, check_module
from dpfy.training.dry_run import RUN_TIME_CHECKS
from dpfy.training.validate import Severity
from tests.training.test_layout import BatchFirst, TimeMajorLinear

LOSS = nn.CrossEntropyLoss(reduction="none")


class PerExampleLoop(nn.Module):
    """A rule layer called on single-example slices inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.lin(x[i : i + 1])[0] for i in range(x.shape[0])])


def _batch(b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 10 + t)
    return torch.randn(b, t, 3, generator=g), torch.randint(0, 2, (b,), generator=g)


def _first_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=4.0)
    try:
        pg.accumulate(*batch, LOSS)
    except (ValueError, TypeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.parametrize(
    ("make", "batch"),
    [
        (TimeMajorLinear, _batch(4, 4)),  # T == B: refused
        (TimeMajorLinear, _batch(4, 5)),  # T != B: exact
        (BatchFirst, _batch(4, 4)),
        (PerExampleLoop, (torch.randn(4, 3), torch.randint(0, 2, (4,)))),
    ],
    ids=["time-major-T=B", "time-major-T!=B", "batch-first", "per-example-loop"],
)
def test_the_verdict_with_a_sample_batch_equals_the_first_steps(make, batch):
    torch.manual_seed(0)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = check_module(model, batch, loss_fn=LOSS)
    assert report.deferred == ()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # the check ran on a copy
    errors = [i.reason for i in report if i.severity is Severity.ERROR]
    real = _first_step(make(), batch)
    assert errors == ([] if real is None else [real])


def test_the_refusals_are_found_at_all():
    assert any(i.severity is Severity.ERROR for i in check_module(TimeMajorLinear(), _batch(4, 4)))
    assert any(i.severity is Severity.ERROR
               for i in check_module(PerExampleLoop(), (torch.randn(4, 3), torch.zeros(4).long())))


def test_without_a_batch_the_report_names_the_checks_left_to_run_time():
    report = check_module(TimeMajorLinear())
    assert report == [] and report.deferred == RUN_TIME_CHECKS


def test_a_malformed_sample_batch_is_refused_naming_the_parameter():
    with pytest.raises(ValueError, match="example_batch must be"):
        check_module(BatchFirst(), torch.randn(4, 4, 3))

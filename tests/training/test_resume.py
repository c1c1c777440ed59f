"""A resumed run keeps the hyperparameters its privacy depends on; its budget changes only when
the caller says so, and then the ledger and the report show the raised budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.report import build_report
from dpfy.sampling import PoissonSampler
from dpfy.training.resume import ResumeMismatchError
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

N = 64


def _trainer(ledger: Ledger, ckpt, **kw) -> PrivateTrainer:
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    options = {"clip_norm": 1.0, "epochs": 2, "delta": 1e-5, "target_epsilon": 3.0,
               "max_physical_batch_size": 16, "ledger": ledger, "randomness": Randomness(1),
               "checkpoint_path": ckpt, **kw}
    return PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.CrossEntropyLoss(reduction="none"), x, (x[:, 0] > 0).long(),
                          PoissonSampler(N, 0.25, randomness=Randomness(2)),
                          TrainerOptions(**options))


@pytest.fixture
def interrupted(tmp_path):
    path, ckpt = tmp_path / "ledger.jsonl", tmp_path / "ckpt.pt"
    first = _trainer(Ledger(path), ckpt).fit(max_steps=3)
    first.ledger.close()
    return path, ckpt


@pytest.mark.parametrize(("change", "name"), [
    ({"target_epsilon": 8.0}, "target_epsilon"),
    ({"clip_norm": 2.0}, "clip_norm"),
    ({"epochs": 5}, "epochs"),
    ({"delta": 1e-6}, "delta"),
])
def test_resume_refuses_another_budget_or_hyperparameter(interrupted, change, name):
    path, ckpt = interrupted
    ledger = Ledger(path)  # reopening the file marks the resume in it
    lines = path.read_bytes()
    with pytest.raises(ResumeMismatchError) as info:
        _trainer(ledger, ckpt, **change).resume(ckpt)
    text = str(info.value)
    assert text.startswith(f"{name} must be ") and f"got {name}=" in text and "\n" not in text
    assert path.read_bytes() == lines  # nothing written


def test_a_budget_raised_explicitly_is_recorded_and_reported(interrupted):
    path, ckpt = interrupted
    result = _trainer(Ledger(path), ckpt, target_epsilon=8.0).resume(
        ckpt, raise_budget=True).fit()
    assert result.stopped == "completed"
    raised = Ledger.load(path).metadata["budget_raised_on_resume"]
    assert raised == {"from": 3.0, "to": 8.0, "at_step": 3}
    report = build_report(Ledger.load(path), delta=1e-5)
    assert report.hyperparameters["target_epsilon"] == 8.0
    assert report.hyperparameters["budget_raised_on_resume"]["from"] == 3.0
    assert "budget_raised_on_resume" in report.to_markdown()


def test_the_same_hyperparameters_resume_silently(interrupted):
    path, ckpt = interrupted
    result = _trainer(Ledger(path), ckpt).resume(ckpt).fit()
    assert result.stopped == "completed"
    assert "budget_raised_on_resume" not in Ledger.load(path).metadata

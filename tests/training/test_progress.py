"""Progress without a terminal: plain lines about every INTERVAL_S seconds, never silence."""

from __future__ import annotations

import io

import torch
from torch import nn

from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import progress
from dpfy.training.progress import ProgressBar, ProgressLines, progress_display
from dpfy.training.trainer import PrivateTrainer, TrainerOptions


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_every_interval_with_step_epoch_and_time_and_only_public_fields():
    out, clock = io.StringIO(), _Clock()
    lines = ProgressLines("DP-SGD", 100, fields=("test", "eps"), interval=30.0, stream=out,
                          clock=clock)
    for step in range(1, 101):  # one step a second: lines at 30, 60 and 90 s, then the last
        clock.now = float(step)
        lines.update(step, step // 25, loss="0.5", test="0.9000", eps=f"{step / 100:.3f}")
    lines.close()
    printed = out.getvalue().splitlines()
    assert printed[0] == "DP-SGD: 100 steps; a progress line every 0:30 (no terminal)"
    assert printed[1] == ("DP-SGD: step 30/100 (30%), epoch 2, 0:30 elapsed, about 1:10 left, "
                          "test 0.9000, eps 0.300")
    assert [p.split(",")[0] for p in printed[2:]] == [
        "DP-SGD: step 60/100 (60%)", "DP-SGD: step 90/100 (90%)", "DP-SGD: step 100/100 (100%)"]
    assert "1:40 elapsed" in printed[-1] and "left" not in printed[-1]
    assert not any("loss" in p for p in printed)  # a training batch's loss is not a DP release


def _no_terminal(monkeypatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)  # rich counts these as a terminal
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)


def test_a_terminal_gets_the_rich_bar_and_a_pipe_gets_lines(monkeypatch):
    _no_terminal(monkeypatch)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    bar = progress_display("DP-SGD", 10, fields=("loss",))
    bar.close()
    assert isinstance(bar, ProgressBar)
    monkeypatch.delenv("TTY_COMPATIBLE")
    lines = progress_display("DP-SGD", 10, fields=("loss", "eps"))
    assert isinstance(lines, ProgressLines)  # pytest captures standard output: not a terminal


def test_training_without_a_terminal_prints_progress_lines(monkeypatch, capsys):
    _no_terminal(monkeypatch)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # a line after every step
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    trainer = PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(reduction="none"),
        x, y, PoissonSampler(60, 0.2, randomness=Randomness(0)),
        TrainerOptions(clip_norm=1.0, epochs=2, delta=1e-5, noise_multiplier=1.0,
                       max_physical_batch_size=16, randomness=Randomness(1), progress=True),
    )
    trainer.fit()
    printed = [p for p in capsys.readouterr().out.splitlines() if p.startswith("DP-SGD:")]
    total = trainer.total_steps
    assert printed[0].startswith(f"DP-SGD: {total} steps; a progress line every")
    assert f"step 1/{total} " in printed[1] and "epoch 1," in printed[1]
    assert printed[-1].startswith(f"DP-SGD: step {total}/{total} (100%), epoch 2, ")  # of 2
    assert "eps " in printed[-1]  # the ledger's epsilon after the first epoch


def test_feature_extraction_without_a_terminal_prints_lines_too(monkeypatch, capsys):
    from dpfy.features.extract import _progress

    _no_terminal(monkeypatch)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    with _progress("ScatterNet features", 100, True) as advance:
        for _ in range(4):
            advance(25)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("ScatterNet features: 100 images; a progress line every")
    assert printed[-1].startswith("ScatterNet features: image 100/100 (100%), 0:00 elapsed")
    assert not any("epoch" in p for p in printed)  # no epochs in an extraction

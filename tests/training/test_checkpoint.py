"""Checkpoint/resume: a resumed run accounts (and, seeded, trains) as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.accounting.balls_and_bins import MonteCarloAccountant
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import BallsAndBinsSampler, PoissonSampler
from dpfy.training.checkpoint import (
    CheckpointMismatchError,
    ledger_state,
    load_checkpoint,
    restore_ledger,
    save_checkpoint,
)
from dpfy.training.trainer import PrivateTrainer

N = 96


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g)
    return x, (x[:, 0] - x[:, 2] > 0).long()


def _build(kind: str, seed: int, ledger: Ledger, **kw) -> PrivateTrainer:
    """A trainer; ``seed`` changes init, sampling and noise (a resume must overwrite them)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    rng = Randomness(100 + seed)
    sampler = (
        PoissonSampler(N, 0.125, randomness=rng)
        if kind == "poisson"
        else BallsAndBinsSampler(N, 8, randomness=rng)
    )
    x, y = _data()
    return PrivateTrainer(
        model, opt, nn.CrossEntropyLoss(reduction="none"), x, y, sampler,
        clip_norm=1.0, epochs=3, delta=1e-3, noise_multiplier=1.1, max_physical_batch_size=8,
        ledger=ledger, randomness=Randomness(200 + seed), ema_decay=0.9, test_data=(x, y),
        accounting="rdp" if kind == "poisson" else MonteCarloAccountant(samples=2000,
                                                                        progress=False),
        **kw,
    )


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("kind", "file_ledger", "stop_at"), [
    ("poisson", True, 13),       # mid-epoch, ledger on disk
    ("balls_and_bins", False, 11),  # mid-epoch of an epoch sampler, ledger in memory
])
def test_resume_equals_uninterrupted(tmp_path, kind, file_ledger, stop_at):
    full = _build(kind, 0, Ledger(tmp_path / "full.jsonl" if file_ledger else None)).fit()
    assert full.steps == 24

    path = tmp_path / "run.jsonl" if file_ledger else None
    ckpt = tmp_path / "ckpt.pt"
    first = _build(kind, 0, Ledger(path), checkpoint_path=ckpt).fit(max_steps=stop_at)
    assert first.stopped == "max_steps" and first.steps == stop_at
    if file_ledger:
        first.ledger.close()

    resumed_trainer = _build(kind, 7, Ledger(path), checkpoint_path=ckpt).resume(ckpt)
    resumed = resumed_trainer.fit()
    assert resumed.steps == 24 and resumed.stopped == "completed"
    for a, b in zip(_params(full.trained_model), _params(resumed.trained_model), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_params(full.model), _params(resumed.model), strict=True):
        assert torch.equal(a, b)  # EMA weights too
    assert resumed.ledger.to_event() == full.ledger.to_event()
    assert resumed.privacy.epsilon == full.privacy.epsilon
    assert resumed.ledger.iteration == 24
    assert [s.loss for s in resumed.history.steps] == [s.loss for s in full.history.steps]
    if file_ledger:  # the file holds every release exactly once
        assert Ledger.load(path).iteration == 24


def test_ledger_that_lost_releases_is_refused_and_extra_ones_are_kept(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    trainer = _build("poisson", 0, ledger)
    trainer.fit(max_steps=5)
    state = trainer.state_dict()
    with pytest.raises(CheckpointMismatchError, match="lost recorded releases"):
        restore_ledger(Ledger(tmp_path / "other.jsonl"), state["ledger"])
    with pytest.raises(CheckpointMismatchError, match="Ledger"):
        restore_ledger(Ledger(), state["ledger"])
    trainer.fit(max_steps=7)  # two more steps after the checkpoint
    ledger.close()
    with pytest.warns(UserWarning, match="over-counts"):
        restore_ledger(Ledger(path), state["ledger"])
    memory = ledger_state(Ledger())
    with pytest.raises(CheckpointMismatchError, match="empty in-memory"):
        restore_ledger(Ledger(tmp_path / "x.jsonl"), memory)


def test_checkpoint_file_round_trip_and_atomic_write(tmp_path):
    path = save_checkpoint(tmp_path / "sub" / "c.pt", {"a": torch.arange(3), "b": {"c": 1}})
    data = load_checkpoint(path)
    assert torch.equal(data["a"], torch.arange(3)) and data["b"] == {"c": 1}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["c.pt"]  # no temp files left
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointMismatchError, match="not a dpfy checkpoint"):
        load_checkpoint(tmp_path / "other.pt")

"""Checkpoint/resume: a resumed run accounts (and, seeded, trains) as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.accounting.monte_carlo.accountant import MonteCarloAccountant
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import BallsAndBinsSampler, PoissonSampler, SampleSpec
from dpfy.training.checkpoint import (
    CheckpointMismatchError,
    ledger_state,
    load_checkpoint,
    restore_ledger,
    save_checkpoint,
)
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

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
        model,
        opt,
        nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        sampler,
        options=TrainerOptions(
            **kw,
            clip_norm=1.0,
            epochs=3,
            delta=1e-3,
            noise_multiplier=1.1,
            max_physical_batch_size=8,
            ledger=ledger,
            randomness=Randomness(200 + seed),
            ema_decay=0.9,
            test_data=(x, y),
            # plain sampling: seeded and cheap (auto's tilted sampler for several epochs spends
            # seconds on quadrature at each epoch's end); equal events give equal epsilons
            accounting="rdp" if kind == "poisson" else MonteCarloAccountant(
                samples=2000, method="plain", progress=False),
        ),
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


SPEC = SampleSpec("poisson", dataset_size=N, sampling_rate=0.125)


def _steps(ledger: Ledger, n: int, std: float = 1.0) -> None:
    for _ in range(n):
        ledger.record_sum_query(ledger.record_sample(SPEC), sensitivity=1.0, noise_std=std)


def test_resume_refuses_another_ledger_a_moved_copy_and_one_behind_or_forked(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    _steps(ledger, 3)
    ledger.flush()
    early = path.read_bytes()  # the file before the checkpoint
    _steps(ledger, 2)
    state = ledger_state(ledger)
    ledger.close()
    # (a) another ledger file: its run identifier differs
    with Ledger(tmp_path / "other.jsonl") as other:
        _steps(other, 9)
        with pytest.raises(CheckpointMismatchError, match="different ledger"):
            restore_ledger(other, state)
    with pytest.raises(CheckpointMismatchError, match="Ledger"):
        restore_ledger(Ledger(), state)
    # a copy under another path (same run id): refused unless the caller says it was moved
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    with Ledger(copy) as moved:
        with pytest.raises(CheckpointMismatchError, match="moved"):
            restore_ledger(moved, state)
        restore_ledger(moved, state, allow_moved=True)
    # (b) behind: the file was put back to its state before the checkpoint
    after = path.read_bytes()
    path.write_bytes(early)
    with Ledger(path) as behind, pytest.raises(CheckpointMismatchError, match="lost recorded"):
        restore_ledger(behind, state)
    # (b) forked: the early file continued differently, now as long as the checkpoint's
    path.write_bytes(early)
    with Ledger(path) as forked:
        _steps(forked, 4, std=9.0)
        with pytest.raises(CheckpointMismatchError, match="forked"):
            restore_ledger(forked, state)
    # ahead by steps after the checkpoint: accepted (write-ahead over-count)
    path.write_bytes(after)
    with Ledger(path) as ahead:
        _steps(ahead, 2)
    with Ledger(path) as ahead, pytest.warns(UserWarning, match="over-counts"):
        restore_ledger(ahead, state)
    memory = ledger_state(Ledger())
    with Ledger(tmp_path / "x.jsonl") as fresh, pytest.raises(
        CheckpointMismatchError, match="empty in-memory"
    ):
        restore_ledger(fresh, memory)


def test_a_secure_run_is_not_resumed_with_seeded_randomness(tmp_path):
    def build(rng_factory, ledger):
        torch.manual_seed(0)
        model = nn.Linear(5, 2)
        x, y = _data()
        return PrivateTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(
                reduction="none"),
            x,
            y,
            PoissonSampler(N, 0.125, randomness=rng_factory()),
            options=TrainerOptions(
                clip_norm=1.0,
                epochs=1,
                delta=1e-3,
                noise_multiplier=1.1,
                max_physical_batch_size=32,
                ledger=ledger,
                randomness=rng_factory(),
                accounting="rdp",
            ),
        )

    path, ckpt = tmp_path / "run.jsonl", tmp_path / "c.pt"
    with Ledger(path) as ledger:
        trainer = build(Randomness.secure_mode, ledger)
        trainer.fit(max_steps=2)
        trainer.save_checkpoint(ckpt)
    with Ledger(path) as ledger:
        with pytest.raises(CheckpointMismatchError, match="secure mode"):
            build(lambda: Randomness(0), ledger).resume(ckpt)
        assert ledger.iteration == 2  # refused before anything was restored
        build(Randomness.secure_mode, ledger).resume(ckpt)  # the same mode resumes


def test_a_crafted_checkpoint_cannot_run_code_on_load(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil.pt"
    torch.save({"format": "dpfy-checkpoint", "version": 2, "x": Payload()}, evil)
    with pytest.raises(CheckpointMismatchError, match="plain data"):
        load_checkpoint(evil)
    assert not marker.exists()
    with pytest.raises(ValueError, match="plain data"):
        save_checkpoint(tmp_path / "c.pt", {"x": Payload()})


def test_checkpoint_file_round_trip_and_atomic_write(tmp_path):
    path = save_checkpoint(tmp_path / "sub" / "c.pt", {"a": torch.arange(3), "b": {"c": 1}})
    data = load_checkpoint(path)
    assert torch.equal(data["a"], torch.arange(3)) and data["b"] == {"c": 1}
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["c.pt"]  # no temp files left
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointMismatchError, match="not a dpfy checkpoint"):
        load_checkpoint(tmp_path / "other.pt")

"""dpfy.lightning in real processes: two ranks (gloo) and a run killed with SIGKILL, resumed.

Both runs are one script (:data:`SCRIPT`, written to a temporary folder) that a module-scoped
fixture runs as a child process, one after the other; the tests read what they left behind.

* ``ddp``: ``DistributedDPStrategy`` on two CPU processes (Lightning's multiprocessing launch,
  start method ``fork``: the ranks do not import torch and Lightning again), seed 7, one epoch
  of ten Poisson batches; rank 0 saves the final weights and its epsilon. The same seed in one
  process (``DPStrategy``, here) draws the same batches and the same noise, so the weights must
  agree to float rounding: every step's clipped sum over the two ranks' rows is the one-process
  clipped sum of the same sample.
* ``kill``: ``DPStrategy`` (secure randomness) with a Lightning checkpoint every 3 steps kills
  itself with SIGKILL right after step 6: releases 4 to 6 are in the ledger but not in the
  checkpoint. Resuming the checkpoint on the same ledger must count all of them.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock

pl = pytest.importorskip("lightning.pytorch")

from dpfy.cli import main as dpfy_main  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.lightning import DPStrategy  # noqa: E402
from dpfy.training.checkpoint import CheckpointMismatchError  # noqa: E402
from dpfy.training.loader import share_rows  # noqa: E402
from dpfy.training.resume import ResumeMismatchError  # noqa: E402

STEPS, CHECKPOINT_EVERY, KILL_AT = 10, 3, 6

SCRIPT = '''
import os, signal, sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from dpfy.lightning import DistributedDPStrategy, DPStrategy

ROWS, BATCH, LR = 320, 32, 0.5  # ten Poisson batches an epoch (q = 1/10)


class TinyMLP(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.rand(ROWS, 784, generator=g)
        return DataLoader(TensorDataset(x, x[:, :10].argmax(1)), batch_size=BATCH, shuffle=True)


class KeepResult(pl.Callback):
    """Rank 0 saves its weights and epsilon (the ranks are children of this process)."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, module):
        if trainer.global_rank == 0:
            s = trainer.strategy
            torch.save({"weights": module.state_dict(), "epsilon": s.epsilon(),
                        "noise_multiplier": s.noise_multiplier}, self.out)


class KillAt(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:  # before this step's checkpoint (callbacks first)
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(strategy, callbacks, **options):
    return pl.Trainer(accelerator="cpu", strategy=strategy, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, **options)


def checkpointing(run_dir, ckpt_dir, every, kill=None, seed=None, clip_norm=0.1, **options):
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=clip_norm, run_dir=run_dir,
                          seed=seed)
    saving = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)
    return trainer(strategy, [saving] + ([KillAt(kill)] if kill else []), **options)


if __name__ == "__main__":
    torch.set_num_threads(1)
    root, every, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    refused = DistributedDPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1,
                                    run_dir=os.path.join(root, "ddp-refused"),
                                    start_method="fork")
    try:  # both ranks refuse at setup, before anything is written
        trainer(refused, [], devices=2, enable_checkpointing=False,
                accumulate_grad_batches=2).fit(TinyMLP())
    except Exception as error:
        with open(os.path.join(root, "ddp-refused.txt"), "w") as f:
            f.write(str(error))
    strategy = DistributedDPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1,
                                     run_dir=os.path.join(root, "ddp"), seed=7,
                                     start_method="fork")
    trainer(strategy, [KeepResult(os.path.join(root, "ddp.pt"))], devices=2,
            enable_checkpointing=False).fit(TinyMLP())
    # only rank 0 sees the ledger in run_dir; rank 1 must stop at once, not wait out a
    # 600 s timeout (this process would outlive the fixture's limit)
    again = DistributedDPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1,
                                  run_dir=os.path.join(root, "ddp"), start_method="fork",
                                  timeout=600)
    try:
        trainer(again, [], devices=2, enable_checkpointing=False).fit(TinyMLP())
    except Exception as error:
        with open(os.path.join(root, "ddp-again.txt"), "w") as f:
            f.write(str(error))
    for part, steps in (("first", every), ("rest", None)):  # the same run, stopped and resumed
        strategy = DistributedDPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1,
                                         run_dir=os.path.join(root, "ddp-split"), seed=7,
                                         start_method="fork")
        saving = ModelCheckpoint(dirpath=os.path.join(root, "ddp-ckpt-" + part),
                                 every_n_train_steps=every, save_top_k=-1)
        keep = KeepResult(os.path.join(root, "ddp-" + part + ".pt"))
        trainer(strategy, [saving, keep], devices=2, max_steps=steps or -1).fit(
            TinyMLP(), ckpt_path=None if steps else os.path.join(
                root, "ddp-ckpt-first", "epoch=0-step=%d.ckpt" % every))
    # then this process trains alone and kills itself mid-epoch
    checkpointing(os.path.join(root, "kill"), os.path.join(root, "ckpt"), every, kill).fit(
        TinyMLP())
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script's process (one import of torch and Lightning for both runs): its folder,
    exit code (SIGKILL: -9) and output. Run once per session: under pytest-xdist the workers
    share it through a file lock (a worker that gets some of this module's tests reads what
    the first one left), and its signing keys stay in its folder (``keys``)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "lightning-processes"
    with FileLock(str(shared / "lightning-processes.lock")):
        if not (root / "exit.txt").exists():
            root.mkdir(exist_ok=True)
            (root / "script.py").write_text(SCRIPT, encoding="utf-8")
            env = dict(os.environ, PYTHONWARNINGS="ignore", DPFY_KEY_DIR=str(root / "keys"))
            command = [sys.executable, str(root / "script.py"), str(root),
                       str(CHECKPOINT_EVERY), str(KILL_AT)]
            proc = subprocess.run(command, cwd=root, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=540,
                                  check=False)
            (root / "output.txt").write_text(proc.stdout, encoding="utf-8")
            (root / "exit.txt").write_text(str(proc.returncode), encoding="utf-8")
    code = int((root / "exit.txt").read_text())
    return root, root / "script.py", (code, (root / "output.txt").read_text())


def test_two_processes_spend_at_most_the_target_with_a_complete_signed_ledger(runs):
    root, _, (_, out) = runs
    path = root / "ddp" / "ledger.jsonl"
    assert (root / "ddp.pt").exists(), out[-3000:]
    verification = Ledger.verify(path)
    assert verification.complete, verification.describe()
    ledger = Ledger.load(path)
    assert ledger.ended == f"as planned: {STEPS} of {STEPS} planned releases"
    assert len(ledger.noise_multipliers()) == STEPS  # one release per step, by rank 0 alone
    assert ledger.metadata["workers"] == 2
    result = torch.load(root / "ddp.pt")
    assert 0 < result["epsilon"] <= 3.0
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert dpfy_main(["report", str(path), "--no-figures", "--out", str(root / "rep")]) == 0
    assert "differential privacy" in report.getvalue()
    assert "incomplete" not in report.getvalue().lower()
    assert (root / "ddp" / "report.md").exists()  # written by rank 0 at teardown


def test_two_processes_refuse_what_touches_gradients_outside_dpfy(runs):
    root, _, (_, out) = runs
    refusal = (root / "ddp-refused.txt").read_text()
    assert "accumulate_grad_batches must be 1 with DPStrategy" in refusal
    assert not (root / "ddp-refused").exists()
    # a refusal rank 0 alone sees (the ledger already in run_dir) stops both ranks at once
    assert "run_dir must be a folder without a ledger" in (root / "ddp-again.txt").read_text()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("size", "count"), [(1, 0), (1, 1), (5, 5), (8, 3), (7, 7), (64, 61)])
def test_the_ranks_parts_of_a_physical_batch_hold_each_real_row_once(world_size, size, count):
    """share_rows: the real rows of the parts, in rank order, are the batch's real rows; every
    part holds at least one row (an empty part is one weight-0 row)."""
    rows = np.arange(100, 100 + size)
    parts = [share_rows(rows, count, r, world_size) for r in range(world_size)]
    real = np.concatenate([part[:n] for part, n in parts])
    np.testing.assert_array_equal(real, rows[:count])
    assert all(len(part) >= max(n, 1) for part, n in parts)


def test_two_processes_make_the_one_process_update_of_the_same_sample(runs):
    """Same seed: same Poisson draws (rank 0's stream) and the same noise (drawn once), so the
    two-process weights equal the one-process weights up to the order of float sums."""
    root, script, (_, out) = runs
    assert (root / "ddp.pt").exists(), out[-3000:]
    TinyMLP = runpy.run_path(str(script))["TinyMLP"]  # the definitions; no run
    module = TinyMLP()
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1, run_dir=None, seed=7)
    pl.Trainer(strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(module)
    result = torch.load(root / "ddp.pt")
    assert result["noise_multiplier"] == strategy.noise_multiplier
    assert result["epsilon"] == strategy.epsilon()
    for name, weight in module.state_dict().items():
        torch.testing.assert_close(result["weights"][name], weight, rtol=0, atol=1e-6)
    assert not torch.equal(result["weights"]["net.0.weight"], TinyMLP().net[0].weight)


def test_two_processes_stopped_and_resumed_make_the_uninterrupted_run(runs):
    """The sampler's and the noise generator's states travel in rank 0's checkpoint and the
    other rank rebuilds its mirror ledger from rank 0's records: seeded, stopped after step 3
    and resumed on two ranks, the run ends with the weights of the run never stopped."""
    root, _, (_, out) = runs
    assert (root / "ddp-rest.pt").exists(), out[-3000:]
    whole, resumed = torch.load(root / "ddp.pt"), torch.load(root / "ddp-rest.pt")
    for name, weight in whole["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, rtol=0, atol=1e-6)
    path = root / "ddp-split" / "ledger.jsonl"
    assert Ledger.verify(path).complete
    ledger = Ledger.load(path)
    assert ledger.ended == f"as planned: {STEPS} of {STEPS} planned releases"
    assert ledger.metadata["resumed_from_checkpoint"]["releases_in_checkpoint"] == CHECKPOINT_EVERY
    assert resumed["epsilon"] == whole["epsilon"]


def test_a_killed_run_resumed_from_its_checkpoint_counts_every_release(runs, monkeypatch):
    root, script, (code, out) = runs
    monkeypatch.setenv("DPFY_KEY_DIR", str(root / "keys"))  # the run's key, to append
    assert code == -9, out[-3000:]  # SIGKILL
    path = root / "kill" / "ledger.jsonl"
    killed = Ledger.load(path)
    assert len(killed.noise_multipliers()) == KILL_AT  # written before each step, kept
    assert not Ledger.verify(path).complete  # no end record: the process died
    lines_before = path.read_bytes()
    ckpt = root / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"
    assert ckpt.exists() and not (root / "ckpt" / f"epoch=0-step={KILL_AT}.ckpt").exists()

    defs = runpy.run_path(str(script))
    refused = defs["checkpointing"](root / "kill", root / "resumed", CHECKPOINT_EVERY,
                                    clip_norm=0.2)
    with pytest.raises(ResumeMismatchError, match="^clip_norm must be 0.1"):
        refused.fit(defs["TinyMLP"](), ckpt_path=ckpt)
    assert path.read_bytes() == lines_before  # refused before anything was written

    resumed = defs["checkpointing"](root / "kill", root / "resumed", CHECKPOINT_EVERY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(defs["TinyMLP"](), ckpt_path=ckpt)
    assert any("recorded after the checkpoint" in str(w.message) for w in caught)
    assert path.read_bytes().startswith(lines_before)  # appended, never rewritten
    verification = Ledger.verify(path)
    assert verification.complete, verification.describe()
    ledger = Ledger.load(path)
    # the budget is the plan's: the 3 releases the kill lost are spent, 4 steps remain
    assert len(ledger.noise_multipliers()) == STEPS
    assert ledger.ended == f"as planned: {STEPS} of {STEPS} planned releases"
    assert resumed.global_step == CHECKPOINT_EVERY + (STEPS - KILL_AT)  # what the model got
    facts = ledger.metadata["resumed_from_checkpoint"]
    assert facts["releases_in_checkpoint"] == CHECKPOINT_EVERY
    assert facts["releases_lost"] == KILL_AT - CHECKPOINT_EVERY
    assert facts["randomness"] == "a fresh secure key"
    assert facts["key_commitments"]["noise"]  # the fresh key's, committed
    assert 0 < resumed.strategy.epsilon() <= 3.0


def test_a_checkpoint_without_the_private_state_is_refused(runs, tmp_path):
    root, script, _ = runs
    ckpt = root / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"
    bare = torch.load(ckpt, weights_only=False)
    del bare["dpfy"]
    torch.save(bare, tmp_path / "bare.ckpt")
    defs = runpy.run_path(str(script))
    trainer = defs["checkpointing"](tmp_path / "run", tmp_path / "ck", CHECKPOINT_EVERY)
    with pytest.raises(CheckpointMismatchError, match="^ckpt_path must be a checkpoint saved"):
        trainer.fit(defs["TinyMLP"](), ckpt_path=tmp_path / "bare.ckpt")
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_resumed_on_another_runs_ledger_is_refused_leaving_it_untouched(runs):
    root, script, _ = runs
    other = root / "ddp" / "ledger.jsonl"  # the two-rank run's, complete and signed
    before = other.read_bytes()
    defs = runpy.run_path(str(script))
    trainer = defs["checkpointing"](root / "ddp", root / "nowhere", CHECKPOINT_EVERY)
    with pytest.raises(CheckpointMismatchError, match="belongs to run"):
        trainer.fit(defs["TinyMLP"](), ckpt_path=root / "ckpt" / "epoch=0-step=3.ckpt")
    assert other.read_bytes() == before


def test_a_seeded_run_resumed_from_a_checkpoint_is_the_uninterrupted_run(tmp_path, runs):
    """The sampler's and the noise generator's states travel in the checkpoint: a seeded run
    stopped after step 3 and resumed ends with the weights of a run never stopped."""
    _, script, _ = runs
    defs = runpy.run_path(str(script))
    whole = defs["TinyMLP"]()
    defs["checkpointing"](tmp_path / "whole", tmp_path / "ck-whole", 100, seed=3).fit(whole)

    first = defs["checkpointing"](tmp_path / "split", tmp_path / "ck", CHECKPOINT_EVERY, seed=3,
                                  max_steps=CHECKPOINT_EVERY)  # stops after the checkpoint
    first.fit(defs["TinyMLP"]())
    second = defs["TinyMLP"]()
    defs["checkpointing"](tmp_path / "split", tmp_path / "ck2", 100, seed=3).fit(
        second, ckpt_path=tmp_path / "ck" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt")
    for name, weight in whole.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], weight, rtol=0, atol=1e-6)
    ledger = Ledger.load(tmp_path / "split" / "ledger.jsonl")
    assert len(ledger.noise_multipliers()) == STEPS
    assert ledger.metadata["resumed_from_checkpoint"]["releases_lost"] == 0
    assert Path(tmp_path / "split" / "report.md").exists()

"""dpfy.lightning.DPStrategy: a LightningModule trains with DP-SGD with one Trainer argument.

A tiny MLP on 320 synthetic MNIST-shaped rows (784 features, 10 classes), one epoch of ten
Poisson batches (q = 1/10), one process on the CPU.
"""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from dpfy.ledger import Ledger  # noqa: E402
from dpfy.lightning import DPStrategy  # noqa: E402
from dpfy.opacus import PrivacyEngine  # noqa: E402

ROWS, BATCH, LR = 320, 32, 0.5
EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "lightning_mnist.py"


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(ROWS, 784, generator=g)
    y = (x[:, :10].argmax(1)).long()  # a rule the MLP can learn
    return TensorDataset(x, y)


class TinyMLP(pl.LightningModule):
    """A user's LightningModule, written without any thought of privacy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def _trainer(strategy: DPStrategy, **options) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **options,
    )


def test_the_mnist_example_spends_at_most_its_target_with_a_complete_signed_ledger(tmp_path):
    """docs/examples/lightning_mnist.py: 512 MNIST images, 1 epoch, q = 1/8."""
    example = runpy.run_path(str(EXAMPLE))  # its definitions; main() is the script's body
    strategy = example["main"](str(tmp_path))

    path = tmp_path / "ledger.jsonl"
    verification = Ledger.verify(path)
    assert verification.complete, verification.describe()
    ledger = Ledger.load(path)
    steps = 512 // 64
    assert len(ledger.noise_multipliers()) == steps  # one release per step, all of the plan
    assert ledger.ended == f"as planned: {steps} of {steps} planned releases"
    assert strategy.noise_multiplier > 0
    assert 0 < strategy.epsilon() <= 3.0
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.json").exists()


def test_an_update_is_the_plain_private_loops_update_under_the_same_seed():
    """The Trainer adds nothing outside dpfy's clipping and noise: with the same seed (same
    Poisson draws, same noise), one epoch of Lightning equals one epoch of the Opacus-style
    loop over dpfy.opacus.PrivacyEngine, itself checked against a per-example loop."""
    module = TinyMLP()
    reference = copy.deepcopy(module)
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=0.1, run_dir=None, seed=7)
    _trainer(strategy).fit(module)

    engine = PrivacyEngine(run_dir=None, seed=7)
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=reference, optimizer=torch.optim.SGD(reference.parameters(), lr=LR),
        data_loader=reference.train_dataloader(), target_epsilon=3.0, target_delta=1e-5,
        epochs=1, max_grad_norm=0.1,
    )
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert len(strategy.ledger.noise_multipliers()) == len(engine.ledger.noise_multipliers())
    for ours, theirs in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), theirs.detach())
    assert any(not torch.equal(p, q) for p, q in zip(
        module.parameters(), TinyMLP().parameters(), strict=True))  # it did train


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches"),
        ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
        ({"precision": "bf16-mixed"}, "precision"),
    ],
)
def test_options_that_touch_gradients_outside_dpfy_are_refused(tmp_path, option, name):
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=1.0, run_dir=tmp_path)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        _trainer(strategy, **option).fit(TinyMLP())
    assert not (tmp_path / "ledger.jsonl").exists()  # refused before anything was written


class FailsAtStepTwo(TinyMLP):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise KeyError("the user's own error")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_fails_closes_its_ledger_saying_so(tmp_path):
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=1.0, run_dir=tmp_path)
    with pytest.raises(KeyError, match="own error"):
        _trainer(strategy).fit(FailsAtStepTwo())
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    assert Ledger.verify(tmp_path / "ledger.jsonl").complete
    assert ledger.ended == f"early (fit interrupted): 2 of {ROWS // BATCH} planned releases"


def test_dpstrategy_in_one_of_several_launched_processes_is_refused(tmp_path, monkeypatch):
    """Under torchrun (or any launcher setting RANK and WORLD_SIZE) each process would release
    a run of its own over the whole data: refused, naming the strategy that shares one run."""
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        monkeypatch.setenv(name, value)
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=1.0, run_dir=tmp_path)
    with pytest.raises(ValueError, match="^DPStrategy trains in one process.*Distributed"):
        _trainer(strategy).fit(TinyMLP())
    assert not (tmp_path / "ledger.jsonl").exists()


class WithBatchNorm(TinyMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 16), nn.BatchNorm1d(16), nn.Linear(16, 10))


def test_a_module_dpfy_cannot_make_private_leaves_no_ledger_behind(tmp_path):
    """BatchNorm mixes the examples of a batch: refused by make_private, after the ledger file
    was opened; the file (a header only) goes, so the fixed script can use the same run_dir."""
    run_dir = tmp_path / "run"
    strategy = DPStrategy(target_epsilon=3.0, delta=1e-5, clip_norm=1.0, run_dir=run_dir)
    with pytest.raises(Exception, match="BatchNorm"):
        _trainer(strategy).fit(WithBatchNorm())
    assert not run_dir.exists()

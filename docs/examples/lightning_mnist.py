"""DP-SGD in a ``lightning.Trainer``: MNIST, one epoch, with ``dpfy.lightning.DPStrategy``.

The LightningModule is written as for any Lightning run (a mean cross-entropy in
``training_step``, an optimizer in ``configure_optimizers``, a shuffled ``DataLoader``); the
only privacy line is the ``strategy=`` argument of the Trainer. A smoke-size run (the first 512
training images, batches of 64 in expectation) that takes seconds on a CPU::

    python docs/examples/lightning_mnist.py [RUN_DIR] [PROCESSES]

Writes ``RUN_DIR/ledger.jsonl`` (closed and signed when ``fit`` ends) and ``report.md`` /
``report.json`` beside it (default ``RUN_DIR``: ``runs/lightning-mnist``). ``PROCESSES`` > 1
trains on that many CPU processes with ``DistributedDPStrategy``: Lightning starts the others
(this script again), rank 0 draws the batches and the noise and writes the one ledger.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpfy.datasets import load_mnist
from dpfy.lightning import DistributedDPStrategy, DPStrategy


class MNISTClassifier(pl.LightningModule):
    def __init__(self, rows: int = 512) -> None:
        super().__init__()
        self.rows = rows
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)  # a mean over the batch, as usual
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        images, labels = load_mnist("train", limit=self.rows)
        return DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True)


def main(run_dir: str, processes: int = 1) -> DPStrategy | DistributedDPStrategy:
    privacy = dict(target_epsilon=3.0, delta=1e-5, clip_norm=1.0, run_dir=run_dir)
    if processes == 1:
        strategy, devices = DPStrategy(**privacy), {}
    else:  # gloo on CPU processes; on GPUs: accelerator="gpu" (nccl)
        strategy = DistributedDPStrategy(**privacy)
        devices = {"accelerator": "cpu", "devices": processes}
    trainer = pl.Trainer(max_epochs=1, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, **devices)
    trainer.fit(MNISTClassifier())
    if trainer.global_rank == 0:
        print(f"noise multiplier {strategy.noise_multiplier:.3f}, "
              f"epsilon {strategy.epsilon():.3f} at delta 1e-5 (target 3); ledger in {run_dir}")
    return strategy


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/lightning-mnist",
         int(sys.argv[2]) if len(sys.argv) > 2 else 1)

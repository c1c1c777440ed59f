"""The DP step reads the device once per chunk and never in the release (docs/devices.md).

Run on the ``meta`` device, where every value read (``item``, ``bool``, ``float``, ``int``,
``nonzero``, ``numpy``) raises: the one allowed read, ``tolist`` of the chunk's statistics, is
counted and answered with placeholders. The same code runs on a GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training.step import PrivateGradient


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("weights_on", ["cpu", "meta"])
def test_step_reads_the_device_once_per_chunk(secure, weights_on):
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))
    model = model.to("meta")
    pg = PrivateGradient(model, GaussianSumQuery(0.5, 1.0), expected_batch_size=8)
    # the attribution check reads the device once more on a chunk it checks (within its time
    # budget; it cannot run on meta tensors): the reads counted here are the step's own
    pg.attribution.every = 0
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.08))
    rng = Randomness.secure_mode() if secure else Randomness(0)
    x = torch.empty(8, 6, device="meta")
    y = torch.zeros(8, dtype=torch.long, device="meta")
    w = torch.ones(8, device=weights_on)
    reads: list[str] = []
    tolist = torch.Tensor.tolist

    def counted(self):
        if self.device.type != "meta":
            return tolist(self)
        reads.append("read")
        return [1.0] * self.numel()

    with mock.patch.object(torch.Tensor, "tolist", counted):
        for _ in range(2):
            for _ in range(2):
                pg.accumulate(x, y, loss_fn, weights=w)
                reads.append("accumulated")
            pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            reads.append("released")
    assert reads == ["read", "accumulated", "read", "accumulated", "released"] * 2
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())


def test_device_weights_are_refused_from_the_one_read_when_not_0_or_1():
    model = nn.Linear(3, 2).to("meta")
    pg = PrivateGradient(model, GaussianSumQuery(0.5, 1.0), expected_batch_size=4)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    x, y = torch.empty(4, 3, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    w = torch.ones(4, device="meta")
    # the read is [sum of squared norms, loss sum, real rows, weights valid]: valid = 0
    with mock.patch.object(torch.Tensor, "tolist", lambda self: [1.0, 1.0, 4.0, 0.0]):
        with pytest.raises(ValueError, match="weights must be 0"):
            pg.accumulate(x, y, loss_fn, weights=w)
    with pytest.raises(ValueError, match="weights must be 0"):  # CPU weights: checked at once
        pg.accumulate(x, y, loss_fn, weights=torch.tensor([1.0, 0.0, 2.0, 1.0]))

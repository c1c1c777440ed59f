"""The DP step with a ``torch.compile``d model (on CPU): the same clipped sum as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training.step import PrivateGradient

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def _clipped_sums(model: nn.Module, wrapped: nn.Module) -> list[torch.Tensor]:
    """Clipped gradient sums (noise off) of ``STEPS`` steps on fixed batches (no update)."""
    pg = PrivateGradient(wrapped, NoPrivacyQuery(0.3), expected_batch_size=8)
    pg.attribution.every = 0  # its one-example pass compiles batch-1 graphs: the step's counted
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    gen = torch.Generator().manual_seed(1)
    sums = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        weights = torch.ones(8)
        weights[-2:] = 0.0  # padding rows
        pg.accumulate(x, y, loss_fn, weights=weights)
        ledger = Ledger()
        sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.08))
        pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(0))
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        sums.append(torch.cat(grads).clone() * pg.expected_batch_size)
    return sums


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_compiled_model_gives_the_eager_clipped_sum(how):
    torch._dynamo.reset()
    eager = _model()
    want = _clipped_sums(eager, eager)
    model = _model()
    if how == "model.compile()":
        model.compile()
        wrapped = model
    else:
        wrapped = torch.compile(model)
    got = _clipped_sums(model, wrapped)
    assert sum(g.numel() for g in got) == sum(w.numel() for w in want) > 0
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() > 0.01  # a real gradient, not an empty capture
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    # each recorded layer is a graph break (its hook runs eagerly), compiled once for all steps
    from torch._dynamo.utils import counters

    assert 0 < counters["stats"]["unique_graphs"] <= 8

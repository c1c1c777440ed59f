"""dpfy.make_private: the Opacus-style entry point (loader, criterion, optimizer, ledger)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import dpfy
from dpfy import accounting
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateOptions
from dpfy.training.budget import BudgetExceededError
from dpfy.training.validate import UnsupportedModuleError


def _setup(seed: int = 0, n: int = 96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    return TensorDataset(x, y), model, torch.optim.SGD(model.parameters(), lr=0.5)


def _run(private, epochs=1, seen=None):
    model, optimizer, criterion, loader = private
    for _ in range(epochs):
        for x, y in loader:
            if seen is not None:
                seen.append((x.clone(), y.clone()))
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()


KW = dict(target_epsilon=4.0, delta=1e-5, epochs=2, clip_norm=1.0, expected_batch_size=16)


def test_end_to_end_ledger_epsilon_and_an_untouched_model():
    data, model, opt = _setup()
    keys, cls = list(model.state_dict()), type(model)
    private = dpfy.make_private(model, opt, data, randomness=Randomness(0), **KW)
    assert private.model is model and private.ledger.iteration == 0
    _run(private, epochs=2)
    z, steps = private.noise_multiplier, private.optimizer.steps
    assert steps == 12 and private.ledger.iteration == 12
    event = private.loader.sampler.privacy_event(z, steps=steps)
    assert private.ledger.to_event() == event
    eps = private.epsilon()
    assert eps == accounting.epsilon(private.ledger, 1e-5, "pld").epsilon
    assert eps <= 4.0 and abs(eps - 4.0) < 0.05  # calibrated to the target over 2 epochs
    assert type(model) is cls and list(model.state_dict()) == keys
    assert not any(m._forward_hooks for m in model.modules())  # no hook left behind
    assert private.ledger.metadata["trainer"] == "dpfy.make_private"


def test_secure_randomness_by_default():
    data, model, opt = _setup()
    private = dpfy.make_private(model, opt, data, **KW)
    assert private.optimizer._engine.randomness.secure
    assert private.loader.sampler.randomness.secure


def test_virtual_batches_release_once_per_logical_batch_like_one_big_batch():
    params, ledgers, shapes = [], [], []
    for physical in (None, 4):
        data, model, opt = _setup()
        private = dpfy.make_private(
            model,
            opt,
            data,
            randomness=Randomness(3),
            **KW,
            options=PrivateOptions(
                max_physical_batch_size=physical,
            ),
        )
        seen: list = []
        _run(private, seen=seen)
        params.append([p.detach().clone() for p in model.parameters()])
        ledgers.append(private.ledger)
        shapes.append({tuple(x.shape) for x, _ in seen})
    assert shapes[1] == {(4, 5)}  # fixed physical shape with weight-0 padding
    assert ledgers[0].iteration == ledgers[1].iteration == 6  # one sample per logical batch
    assert ledgers[0].to_event() == ledgers[1].to_event()
    for a, b in zip(*params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dict_dataset_with_padding_tokens():
    from tests.training.test_loader import Pooled, Tokens

    data, model = Tokens(32), Pooled()
    private = dpfy.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        data,
        randomness=Randomness(0),
        **KW,
        options=PrivateOptions(
            max_physical_batch_size=4,
        ),
    )
    model, optimizer, criterion, loader = private
    for batch in loader:
        optimizer.zero_grad()
        labels = batch.pop("labels")
        assert batch["input_ids"].shape == (4, 6)
        criterion(model(**batch), labels).backward()
        optimizer.step()
    assert private.ledger.iteration == len(loader) == 2


def test_workers_give_the_same_batches_as_the_main_process():
    runs = []
    for workers in (0, 2):
        data, model, opt = _setup()
        private = dpfy.make_private(
            model,
            opt,
            data,
            randomness=Randomness(5),
            **KW,
            options=PrivateOptions(
                num_workers=workers,
                max_physical_batch_size=8,
            ),
        )
        seen: list = []
        _run(private, seen=seen)
        runs.append((seen, [p.detach().clone() for p in model.parameters()]))
    (a, pa), (b, pb) = runs
    assert len(a) == len(b) > 6
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for u, v in zip(pa, pb, strict=True):
        torch.testing.assert_close(u, v)


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(data=_Stream()), TypeError, "IterableDataset"),
        (dict(data="loader"), TypeError, "pass the dataset, dpfy builds the loader"),
        (dict(sampler=torch.utils.data.RandomSampler(range(96))), TypeError, "sampler must be"),
        (dict(target_epsilon=0.0), ValueError, "target_epsilon must be in"),
        (dict(target_epsilon=math.inf), ValueError, "target_epsilon must be in"),
        (dict(target_epsilon=1e-6), ValueError, "target_epsilon=1e-06 cannot be met"),
        (dict(expected_batch_size=None), ValueError, "expected_batch_size"),
        (dict(model="batchnorm"), UnsupportedModuleError, "BatchNorm"),
        (dict(optimizer="foreign"), ValueError, "optimizer must update"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(change, error, match):
    data, model, opt = _setup()
    args = dict(model=model, optimizer=opt, data=data)
    if change.get("data") == "loader":
        change = dict(data=DataLoader(data, batch_size=16))
    if change.get("model") == "batchnorm":
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
        change = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    if change.get("optimizer") == "foreign":
        change = dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    args.update(change)
    kw = {**KW, **{k: v for k, v in change.items() if k in KW or k == "sampler"}}
    ledger = Ledger()
    with pytest.raises(error, match=match):
        dpfy.make_private(
            args["model"],
            args["optimizer"],
            args["data"],
            randomness=Randomness(0),
            **kw,
            options=PrivateOptions(
                ledger=ledger,
            ),
        )
    assert ledger.entries == () and ledger.iteration == 0


def test_misuse_is_caught_and_the_guard_stops_past_the_budget():
    data, model, opt = _setup()
    private = dpfy.make_private(
        model,
        opt,
        data,
        randomness=Randomness(0),
        **KW,
        options=PrivateOptions(
            max_physical_batch_size=4,
            on_budget="raise",
        ),
    )
    model, optimizer, criterion, loader = private
    it = iter(loader)
    x, y = next(it)
    with pytest.raises(RuntimeError, match="1 physical batch|0 of"):
        while True:  # step before backward at the end of a logical batch
            optimizer.step()
            x, y = next(it)
    it.close()
    data, model, opt = _setup()
    private = dpfy.make_private(
        model,
        opt,
        data,
        randomness=Randomness(0),
        sampler=PoissonSampler(96, 16 / 96, randomness=Randomness(1)),
        **{**KW, "epochs": 1},
        options=PrivateOptions(
            on_budget="raise",
        ),
    )
    _run(private)
    with pytest.raises(BudgetExceededError, match="planned for epochs=1"):
        _run(private)  # a second epoch would pass the plan the noise was calibrated to
    assert private.epsilon() <= 4.0
    assert np.isfinite(private.epsilon())

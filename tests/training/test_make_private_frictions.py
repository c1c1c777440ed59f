"""What a user porting a loop to dpfy.make_private meets: the planned epochs, the budget guard's
clean stop, a batch looked at outside the loop, and a given noise multiplier."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy import accounting
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.training import BudgetExceededError, PrivateOptions


def _setup(n: int = 48):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    return TensorDataset(x, (x[:, 0] > 0).long()), model, torch.optim.SGD(model.parameters(), 0.5)


def _epoch(private) -> int:
    """One epoch of the user's loop; the number of logical batches it released."""
    model, optimizer, criterion, loader = private
    before = optimizer.steps
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    return optimizer.steps - before


KW = dict(target_epsilon=4.0, delta=1e-5, epochs=2, clip_norm=1.0, expected_batch_size=12)


@pytest.mark.parametrize("on_budget", ["stop", "raise"])
def test_an_epoch_past_the_plan_is_an_error_never_an_empty_epoch(on_budget):
    data, model, opt = _setup()
    private = dpfy.make_private(
        model, opt, data, randomness=Randomness(0), **KW,
        options=PrivateOptions(on_budget=on_budget),
    )
    assert [_epoch(private), _epoch(private)] == [4, 4]
    lines = private.ledger.iteration
    with pytest.raises(BudgetExceededError, match="planned for epochs=2"):
        _epoch(private)
    assert private.ledger.iteration == lines  # nothing drawn, nothing written
    assert private.epsilon() <= 4.0


def test_the_guard_stops_an_epoch_cleanly_and_the_next_one_is_refused():
    ledger = Ledger()
    data, model, opt = _setup()
    first = dpfy.make_private(
        model, opt, data, randomness=Randomness(0), **KW, options=PrivateOptions(ledger=ledger)
    )
    _epoch(first)  # one of two planned epochs: part of the budget is spent
    data, model, opt = _setup()
    second = dpfy.make_private(
        model, opt, data, randomness=Randomness(1), **{**KW, "epochs": 1},
        options=PrivateOptions(ledger=ledger, on_budget="stop"),
    )
    with pytest.warns(UserWarning, match="budget guard"):
        done = _epoch(second)  # the guard ends the epoch before the target would be passed
    assert 0 < done < 4
    assert second.epsilon() <= 4.0
    with pytest.raises(BudgetExceededError):
        _epoch(second)


def test_a_batch_looked_at_outside_the_loop_costs_nothing():
    data, model, opt = _setup()
    private = dpfy.make_private(model, opt, data, randomness=Randomness(0), **KW)
    x, y = next(iter(private.loader))  # a look at the shapes, as with any DataLoader
    assert x.shape[1:] == (5,) and y.shape == x.shape[:1]
    with torch.no_grad():
        model(x)  # the loader's hooks went with the iterator
    assert private.ledger.iteration == 0 and private.ledger.samples == ()
    kept = iter(private.loader)  # an iterator kept alive is ended by the next loop
    next(kept)
    assert [_epoch(private), _epoch(private)] == [4, 4]  # the look used up no epoch
    with pytest.raises(BudgetExceededError, match="planned for epochs=2"):
        _epoch(private)
    assert len(private.ledger.samples) == private.ledger.iteration == 8


def test_a_loop_left_early_keeps_the_epoch_it_used():
    data, model, opt = _setup()
    private = dpfy.make_private(model, opt, data, randomness=Randomness(0), **KW)
    model, optimizer, criterion, loader = private
    for i, (x, y) in enumerate(loader):
        if i == 2:
            break  # the third batch is dropped unused
        criterion(model(x), y).backward()
        optimizer.step()
    assert _epoch(private) == 4  # the second (last planned) epoch
    with pytest.raises(BudgetExceededError):
        _epoch(private)
    assert private.ledger.iteration == 6


def test_a_given_noise_multiplier_needs_no_budget_and_has_no_planned_end():
    data, model, opt = _setup()
    private = dpfy.make_private(
        model, opt, data, target_epsilon=None, delta=None, epochs=None, clip_norm=1.0,
        expected_batch_size=12, randomness=Randomness(0),
        options=PrivateOptions(noise_multiplier=1.3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [_epoch(private) for _ in range(3)] == [4, 4, 4]
    assert private.ledger.noise_multipliers() == dict.fromkeys(range(12), 1.3)
    with pytest.raises(ValueError, match="delta must be given"):
        private.epsilon()
    assert private.epsilon(1e-5) == accounting.epsilon(private.ledger, 1e-5, "pld").epsilon
    data, model, opt = _setup()
    debug = dpfy.make_private(
        model, opt, data, target_epsilon=None, delta=None, epochs=1, clip_norm=1.0,
        expected_batch_size=12, options=PrivateOptions(noise_multiplier=0.0),
    )
    _epoch(debug)
    assert math.isinf(debug.epsilon(1e-5))  # no noise: the ledger says so


def test_calibration_still_needs_its_budget_and_plan():
    data, model, opt = _setup()
    with pytest.raises(ValueError, match="target_epsilon must be given"):
        dpfy.make_private(model, opt, data, **{**KW, "target_epsilon": None})
    with pytest.raises(ValueError, match="epochs must be given"):
        dpfy.make_private(model, opt, data, **{**KW, "epochs": None})


def test_frozen_parameters_may_sit_in_the_optimizer_as_in_a_fine_tuning_script():
    data, model, _ = _setup()
    model[0].weight.requires_grad_(False)  # frozen, but the script passes model.parameters()
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    private = dpfy.make_private(model, opt, data, randomness=Randomness(0), **KW)
    _epoch(private)
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    model[0].weight.grad = torch.ones_like(frozen)  # a gradient from before the private run
    with pytest.raises(ValueError, match="no gradient on frozen parameters"):
        dpfy.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **KW)

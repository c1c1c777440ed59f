"""An evaluation restores each submodule's own mode, not the root's for all of them."""

from __future__ import annotations

import torch
from torch import nn

from dpfy.models.modes import evaluating
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training.trainer import PrivateTrainer, TrainerOptions


def _mixed() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    model[1].eval()  # a part left in eval mode inside a model in train mode
    return model


def test_evaluating_restores_every_submodule_mode_even_on_error():
    model = _mixed()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False, True]
    try:
        with evaluating(model):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_the_trainers_evaluation_leaves_a_submodule_in_eval_mode_as_it_was():
    model = _mixed()
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    trainer = PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(reduction="none"),
        x, y, PoissonSampler(8, 0.5, randomness=Randomness(0)),
        TrainerOptions(clip_norm=1.0, epochs=1, delta=1e-5, noise_multiplier=1.0,
                       randomness=Randomness(0), test_data=(x, y)),
    )
    assert trainer.evaluate(model) is not None
    assert model[1].training is False and model.training is True

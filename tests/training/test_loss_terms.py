"""A loss term outside the per-example losses is refused with its fix; a constant factor is kept.

Through ``make_private`` the criterion returns a ``PrivateLoss`` whose backward clips each
example's gradient. A term added to it (a regulariser calling a submodule outside forward, a
forward hook's output, a penalty on a parameter) would reach the gradient unclipped and
unnoised, so it is refused at once with what to do instead; ``loss / k`` (gradient
accumulation scripts) and ``k * loss`` are the same per-example losses scaled.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfy
from dpfy.randomness import Randomness

LOSS = nn.CrossEntropyLoss(reduction="none")


def _private():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
        target_epsilon=4.0, delta=1e-5, epochs=1, clip_norm=0.5, expected_batch_size=6,
        loss_fn=LOSS, randomness=Randomness(0),
    )


@pytest.mark.parametrize("term", ["submodule", "parameter", "scalar tensor"])
def test_a_term_added_to_the_private_loss_is_refused_with_the_fix(term):
    model, _, criterion, loader = _private()
    batches = iter(loader)
    xb, yb = next(batches)
    loss = criterion(model(xb), yb)
    extra = {
        "submodule": lambda: model[0](xb).pow(2).sum(1).mean(),
        "parameter": lambda: 1e-4 * model[2].weight.pow(2).sum(),
        "scalar tensor": lambda: torch.tensor(0.0),
    }[term]()
    for combine in (lambda: loss + extra, lambda: extra + loss, lambda: loss - extra,
                    lambda: loss * extra):
        with pytest.raises(TypeError, match="compute every term of an example's loss in "
                                            "loss_fn|weight_decay") as err:
            combine()
        assert "\n" not in str(err.value)
    batches.close()


def test_a_constant_factor_scales_the_per_example_losses():
    model, _, criterion, loader = _private()
    batches = iter(loader)
    xb, yb = next(batches)
    loss = criterion(model(xb), yb)
    assert torch.equal((loss / 4).losses, loss.losses * 0.25)
    assert torch.equal((2 * loss).losses, loss.losses * 2.0)
    with pytest.raises(TypeError, match="non-zero number"):
        loss / 0
    (loss / 4).backward()  # one backward of the scaled losses goes through
    batches.close()

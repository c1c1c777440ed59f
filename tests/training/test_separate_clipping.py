"""Separate clipping of parameter-name groups at the privacy cost of one clip norm."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpfy import accounting
from dpfy.queries.nested import prefix_groups, separate_clipping
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

LOSS = nn.CrossEntropyLoss(reduction="none")
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(n: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def test_prefix_groups_split_names_and_refuse_typos():
    assert prefix_groups(NAMES, ["2."]) == {"2": ("2.weight", "2.bias"),
                                             "rest": ("0.weight", "0.bias")}
    # no rest group when every name is matched
    assert prefix_groups(NAMES, ["0.", "2."]) == {"0": ("0.weight", "0.bias"),
                                                  "2": ("2.weight", "2.bias")}
    # the first matching prefix wins, so a later one may be left with nothing: refused
    with pytest.raises(ValueError, match=r"\['0\.weight'\]"):
        prefix_groups(NAMES, ["0.", "0.weight"])
    with pytest.raises(ValueError, match=r"clip_groups must be prefixes .*\['head\.'\]"):
        prefix_groups(NAMES, ["head."])
    with pytest.raises(ValueError, match="at least one"):
        prefix_groups(NAMES, [])
    with pytest.raises(ValueError, match="repeat"):
        prefix_groups(NAMES, ["0.", "0."])
    with pytest.raises(ValueError, match="repeat"):  # one group name for two prefixes
        prefix_groups(NAMES, ["0.", "0"])


@pytest.mark.parametrize("k_prefixes", [["2."], ["0.", "2."], ["0.weight", "0.bias", "2."]])
def test_separate_clipping_costs_what_joint_clipping_costs(k_prefixes):
    z, c = 1.3, 0.7
    q = separate_clipping(NAMES, k_prefixes, c, z)
    k = len(q.specs)
    assert math.isclose(q.noise_multiplier, z, rel_tol=1e-12)
    for spec in q.specs.values():  # same noise per coordinate as joint clipping to c
        assert math.isclose(spec.clip_norm, c / math.sqrt(k), rel_tol=1e-12)
        assert math.isclose(spec.noise_std, z * c, rel_tol=1e-12)
    assert math.isclose(math.sqrt(sum(s.clip_norm ** 2 for s in q.specs.values())), c)


def test_each_group_is_clipped_to_its_own_share():
    """The clipped sum equals a per-example loop that clips each group to C / sqrt(k)."""
    model = _mlp()
    x, y = _data(10)
    c = 0.05
    q = separate_clipping(NAMES, ["2."], c, 1.0)
    pg = PrivateGradient(model, q, expected_batch_size=10)
    pg.accumulate(x, y, LOSS)
    got = pg.clipped_sum()
    params = dict(model.named_parameters())
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(10):
        model.zero_grad()
        LOSS(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for group in (("2.weight", "2.bias"), ("0.weight", "0.bias")):
            norm = math.sqrt(sum(float((params[n].grad ** 2).sum()) for n in group))
            factor = min(1.0, c / math.sqrt(2) / norm)
            for n in group:
                want[n] += factor * params[n].grad
    for n in params:
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7), n


def _fit(**kw):
    x, y = _data()
    model = _mlp()
    sampler = PoissonSampler(len(x), 16 / len(x), randomness=Randomness(1))
    trainer = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.3),
        LOSS,
        x,
        y,
        sampler,
        options=TrainerOptions(
            **kw,
            clip_norm=0.5,
            epochs=2,
            delta=1e-5,
            target_epsilon=4.0,
            max_physical_batch_size=8,
            randomness=Randomness(2),
        ),
    )
    return trainer, trainer.fit()


def test_a_run_with_separate_clipping_spends_what_a_joint_run_spends():
    joint, rj = _fit()
    sep, rs = _fit(clip_groups=("2.",))
    assert rs.noise_multiplier == rj.noise_multiplier
    eps = [accounting.epsilon(t.ledger, 1e-5, "pld").epsilon for t in (joint, sep)]
    assert eps[0] == pytest.approx(eps[1], rel=1e-9) and eps[1] <= 4.0 + 1e-6
    assert not all(torch.equal(a, b) for a, b in zip(
        joint.model.parameters(), sep.model.parameters(), strict=True))


def test_bad_clip_groups_are_refused_before_training():
    with pytest.raises(ValueError, match="clip_groups must be prefixes"):
        _fit(clip_groups=("head.",))

"""Automatic clipping (Bu et al. 2023; :mod:`dpfy.queries.clipping`): the clip function's bound,
its refusals, the clip norm as a pure step scale, and where a run records it.

The sensitivity property itself (one unit moves the clipped sum by at most C, 2C replaced, on
real models) is in ``tests/training/test_clipped_sum_sensitivity.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.config import CLIPPINGS, RunConfig
from dpfy.ledger import Ledger
from dpfy.ledger.hyperparameters import ledger_hyperparameters
from dpfy.queries import GaussianSumQuery
from dpfy.queries.clipping import CLIPPING_MODES, automatic_clip_weights, clip_weights_for
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateOptions
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

#: Norms from 0 to the largest float64, with the extremes and the values near gamma.
EDGE_NORMS = [0.0, 5e-324, 1e-300, 1e-12, 0.005, 0.01, 0.0100001, 0.5, 0.99, 1.0, 1.01, 7.0,
              1e6, 1e150, 1e300, 1.7976931348623157e308]


@pytest.mark.parametrize("clip", [1e-6, 0.1, 1.0, 37.0, 1e6])
@pytest.mark.parametrize("gamma", [1e-12, 0.01, 1.0, 1e3])
def test_no_automatically_clipped_norm_exceeds_c(clip: float, gamma: float) -> None:
    g = torch.Generator().manual_seed(int(clip * 1e3 + gamma * 7) % 2**31)
    norms = torch.cat([torch.tensor(EDGE_NORMS, dtype=torch.float64),
                       torch.rand(200, generator=g, dtype=torch.float64).mul(40).sub(20).exp()])
    w = automatic_clip_weights(norms, clip, gamma)
    assert w.dtype == torch.float64 and bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    assert bool((w * norms <= clip * (1 + 1e-12)).all())
    # the weight is C / (n + gamma): gamma keeps a zero gradient's weight finite
    assert float(w[0]) == pytest.approx(clip / gamma, rel=1e-12)
    assert torch.allclose(w, clip / (norms + gamma), rtol=1e-12, atol=1e-300)


def test_non_finite_norms_and_padding_get_weight_zero() -> None:
    norms = torch.tensor([math.inf, math.nan, 2.0, 0.0], dtype=torch.float64)
    w = automatic_clip_weights(norms, 1.0, 0.01, mask=torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert w.tolist() == [0.0, 0.0, 0.0, 100.0]
    with pytest.raises(ValueError, match=r"norms must be in \[0, inf\]"):
        automatic_clip_weights(torch.tensor([1.0, -0.5]), 1.0, 0.01)


def test_flat_mode_is_the_min_of_one_and_c_over_the_norm() -> None:
    norms = torch.tensor(EDGE_NORMS + [math.inf, math.nan], dtype=torch.float64)
    w = clip_weights_for("flat", norms, 0.5, 0.01)
    assert bool(torch.isfinite(w).all()) and bool((w <= 1).all())
    assert bool((w * norms.nan_to_num(0.0, posinf=0.0) <= 0.5 * (1 + 1e-12)).all())


def test_the_query_clips_a_batch_below_c_and_records_the_same_sensitivity() -> None:
    g = torch.Generator().manual_seed(1)
    grads = {"w": torch.randn(16, 3, 4, generator=g, dtype=torch.float64) * 5,
             "b": torch.randn(16, 4, generator=g, dtype=torch.float64)}
    grads["w"][3] = 0.0
    grads["b"][3] = 0.0  # an all-zero gradient: weight C / gamma, contribution 0
    flat = GaussianSumQuery(0.7, 1.3)
    auto = GaussianSumQuery(0.7, 1.3, clipping="automatic")
    assert auto.privacy_tuples() == flat.privacy_tuples() == ((0.7, 0.7 * 1.3),)
    assert auto.ledger_entries() == flat.ledger_entries()
    for i in range(16):  # each example alone: its clipped contribution is below C
        one = {k: v[i : i + 1] for k, v in grads.items()}
        s = auto.clip_and_sum(one)
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in s.values()))
        assert norm < 0.7 and bool(all(torch.isfinite(t).all() for t in s.values()))
    assert "clipping='automatic'" in repr(auto) and "automatic" in repr(
        NoPrivacyQuery(1.0, clipping="automatic"))


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda v: GaussianSumQuery(1.0, 1.0, clipping="automatic", stability=v), "stability"),
        (lambda v: NoPrivacyQuery(1.0, clipping="automatic", stability=v), "stability"),
        (lambda v: automatic_check(v), "clip_stability"),
    ],
)
@pytest.mark.parametrize("bad", [0.0, -0.01, math.inf, math.nan, "0.01", None])
def test_a_bad_gamma_is_refused_in_one_line(
    build: Callable[[object], object], name: str, bad: object
) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        build(bad)
    text = str(err.value)
    assert "\n" not in text and text.startswith(name) and "(0.0, inf)" in text


def automatic_check(value: object) -> None:
    from dpfy.queries.clipping import check_clipping

    check_clipping("automatic", value)


def test_a_bad_clipping_name_is_refused_in_one_line() -> None:
    assert CLIPPINGS == CLIPPING_MODES  # dpfy.config holds the names without importing torch
    for build in (lambda: GaussianSumQuery(1.0, 1.0, clipping="auto"),  # type: ignore[arg-type]
                  lambda: RunConfig(clipping="auto")):
        with pytest.raises(ValueError, match=r"^clipping must be one of \{flat, automatic\}, "
                                             r"got clipping='auto'$"):
            build()
    with pytest.raises(ValueError, match="clip_norm must be given"):
        NoPrivacyQuery(None, clipping="automatic")
    for dataset, mechanism in (("rotten-tomatoes", "dpsgd"), ("mnist", "bandmf")):
        with pytest.raises(ValueError, match=r"^clipping='automatic' applies only to DP-SGD"):
            RunConfig(clipping="automatic", dataset=dataset, mechanism=mechanism)
    assert RunConfig(clipping="automatic").recipe_options()["clipping"] == "automatic"
    assert RunConfig().recipe_options()["clipping"] is None


def _trained(clip: float, lr: float, clipping: str, **kw: object) -> tuple[nn.Module, Ledger]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sampler = PoissonSampler(64, 0.25, randomness=Randomness(1))
    trainer = PrivateTrainer(model, opt, nn.CrossEntropyLoss(reduction="none"), x.double(), y,
                             sampler, TrainerOptions(
                                 clip_norm=clip, epochs=1, delta=1e-5, noise_multiplier=1.0,
                                 accounting="rdp",
                                 randomness=Randomness(2), max_physical_batch_size=64,
                                 clipping=clipping, attribution_check=0, **kw))  # type: ignore[arg-type]
    trainer.fit()
    return model, trainer.ledger


def test_with_automatic_clipping_the_clip_norm_only_scales_the_step() -> None:
    """SGD with momentum: (C, lr) and (C', lr C / C') take the same steps on the same noise."""
    a, ledger = _trained(0.5, 0.4, "automatic")
    b, _ = _trained(2.0, 0.1, "automatic")
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12)
    c, _ = _trained(2.0, 0.1, "flat")  # flat clipping has no such identity
    assert not all(torch.allclose(p, q, rtol=1e-6) for p, q in
                   zip(a.parameters(), c.parameters(), strict=True))
    meta = ledger.metadata
    assert meta["clip_function"].startswith("automatic: g * C / (||g|| + 0.01)")
    assert ledger_hyperparameters(ledger)["clip_function"] == meta["clip_function"]


def test_the_trainer_refuses_automatic_clipping_with_separate_clip_groups() -> None:
    with pytest.raises(ValueError, match=r"^clipping must be 'flat' with clip_groups"):
        _trained(1.0, 0.1, "automatic", clip_groups=("0.",))


def test_make_private_takes_the_clip_function_and_records_it() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    kw = dict(target_epsilon=4.0, delta=1e-5, epochs=1, clip_norm=1.0, expected_batch_size=12)
    with pytest.raises(ValueError, match=r"^clip_stability must be in \(0.0, inf\)"):
        dpfy.make_private(model, opt, data, randomness=Randomness(0),
                          options=PrivateOptions(clipping="automatic", clip_stability=0.0), **kw)
    private = dpfy.make_private(model, opt, data, randomness=Randomness(0),
                                options=PrivateOptions(clipping="automatic"), **kw)
    query = private.optimizer._engine.pg.query
    assert getattr(query, "clipping", None) == "automatic"
    for xb, yb in private.loader:  # the run's facts are recorded with its first step
        private.optimizer.zero_grad()
        private.criterion(private.model(xb), yb).backward()
        private.optimizer.step()
        break
    assert private.ledger.metadata.get("clip_function", "").startswith("automatic")

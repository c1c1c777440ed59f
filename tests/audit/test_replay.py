"""Gray-box self-tests (record and replay, Cebere et al. 2026) over what the library ships.

Every registered norm rule, every Gaussian query and every sampler kind is replayed on
neighbouring batches with identical randomness (dpfy.audit.replay); the broken variants at the
end (monkeypatched here only) must each produce a finding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.audit.replay import replay_release, sampler_check
from dpfy.queries import AdaptiveClipQuery, GaussianSumQuery, JointClipQuery, NestedQuery
from dpfy.queries.adaptive import AdaptiveNestedQuery
from dpfy.sampling import registered_kinds
from dpfy.training.norms.registry import registered_types

torch.set_num_threads(1)
C, Z, B = 1.0, 1.3, 6


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)


def _case(kind: type[nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    """A tiny model whose trainable layers are ``kind`` (and a Linear), with an input."""
    g = torch.Generator().manual_seed(1)
    if kind is nn.Linear:
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)), torch.randn(
            B, 4, generator=g
        )
    if kind is nn.Conv1d:
        return nn.Sequential(nn.Conv1d(2, 3, 3), _Flat()), torch.randn(B, 2, 6, generator=g)
    if kind is nn.Conv2d:
        return nn.Sequential(nn.Conv2d(2, 2, 3), _Flat()), torch.randn(B, 2, 4, 4, generator=g)
    if kind is nn.Embedding:
        return nn.Sequential(nn.Embedding(7, 3), _Flat()), torch.randint(0, 7, (B, 3), generator=g)
    if kind is nn.LayerNorm:
        return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5)), torch.randn(B, 4, generator=g)
    if kind is nn.GroupNorm:
        return nn.Sequential(nn.GroupNorm(2, 4), _Flat()), torch.randn(B, 4, 3, generator=g)
    if kind is nn.RMSNorm:
        return nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5)), torch.randn(B, 4, generator=g)
    if kind is nn.EmbeddingBag:
        return nn.Sequential(nn.EmbeddingBag(7, 3), nn.Linear(3, 3)), torch.randint(
            0, 7, (B, 3), generator=g
        )
    if kind is nn.MultiheadAttention:
        return _Attend(), torch.randn(B, 3, 4, generator=g)
    if kind in _RECURRENT:
        return _Recur(kind), torch.randn(B, 3, 4, generator=g)
    raise AssertionError(f"no self-test case for the norm rule of {kind.__name__}: add one")


class _Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0].flatten(1)


_RECURRENT = (nn.RNN, nn.LSTM, nn.GRU, nn.RNNCell, nn.LSTMCell, nn.GRUCell)


class _Recur(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        cell = kind in (nn.RNNCell, nn.LSTMCell, nn.GRUCell)
        self.cell = cell
        self.layer = kind(4, 3) if cell else kind(4, 3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cell:
            return self.layer(x)[0].flatten(1)
        state = None
        for t in range(x.shape[1]):
            state = self.layer(x[:, t], state)
        return state[0] if isinstance(state, tuple) else state


def _factory(kind: type[nn.Module]):
    def make() -> nn.Module:
        torch.manual_seed(0)
        return _case(kind)[0]

    return make


def _targets(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    t = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    t[0] *= 1000.0  # row 0 (the one D' lacks) has a gradient far above C: clipping must act
    return t


def _loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (out * t).sum(1)


@pytest.mark.parametrize("kind", registered_types(), ids=lambda k: k.__name__)
def test_every_norm_rule_replays_clean(kind: type[nn.Module]) -> None:
    make = _factory(kind)
    x = _case(kind)[1]
    r = replay_release(
        make,
        lambda: GaussianSumQuery(C, Z),
        x,
        _targets(make(), x),
        _loss,
        expected_batch_size=5.0,
        clip_norm=C,
    )
    assert r.findings == ()
    assert 0.99 / Z < r.measured_ratio <= 1.0001 / Z  # the clipped row hits the sensitivity


def _params(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _queries(names: list[str]) -> dict[str, object]:
    half = {"a": tuple(names[:2]), "b": tuple(names[2:])}
    return {
        "gaussian_sum": lambda: GaussianSumQuery(C, Z),
        "nested": lambda: NestedQuery.from_noise_multiplier(half, {"a": 1.0, "b": 0.5}, Z),
        "joint": lambda: JointClipQuery(half, {"a": 1.0, "b": 2.0}, C, Z),
        "adaptive": lambda: AdaptiveClipQuery(C, Z, 100.0),
        "adaptive_nested": lambda: AdaptiveNestedQuery(half, C, Z, 100.0),
    }


@pytest.mark.parametrize("name", list(_queries(["w", "b", "w2", "b2"])))
def test_every_query_replays_clean(name: str) -> None:
    make = _factory(nn.Linear)
    x = _case(nn.Linear)[1]
    make_query = _queries(_params(make()))[name]
    r = replay_release(make, make_query, x, _targets(make(), x), _loss, expected_batch_size=5.0)
    assert r.findings == ()
    assert r.measured_ratio > 0.5 * r.declared_ratio  # the removed row is felt


@pytest.mark.parametrize("name", [k.name for k in registered_kinds() if k.sampler is not None])
def test_every_sampler_follows_its_spec(name: str) -> None:
    assert sampler_check(name) == ()

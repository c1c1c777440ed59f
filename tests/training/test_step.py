"""PrivateGradient against a naive per-example loop; noise, ledger and non-finite handling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.queries import AdaptiveClipQuery, GaussianSumQuery, NestedQuery
from dpfy.queries.sum import NoPrivacyQuery, gaussian_average_query
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

B = 8


class Scale(nn.Module):
    """A layer without a norm rule (generic vmap rule)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(d))
        self.shift = nn.Parameter(0.3 * torch.randn(d))

    def forward(self, x):
        return x * self.scale + self.shift


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.scale = nn.Linear(6, 8), nn.Tanh(), Scale(8)
        self.fc2 = nn.Linear(8, 3)
        self.temperature = nn.Parameter(torch.tensor(1.2))  # root parameter: generic rule

    def forward(self, x):
        return self.fc2(self.scale(self.act(self.fc1(x)))) * self.temperature


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 5)  # on [B, T, 6]
        self.shared = nn.Linear(5, 5)  # called twice
        self.deep = nn.Linear(5, 4)  # on [B, T, 2, 5]
        self.bil = nn.Bilinear(4, 4, 3)  # no rule

    def forward(self, tok):
        h = torch.tanh(self.lin(self.ln(self.emb(tok))))
        h = self.shared(h) + self.shared(h.flip(1)).tanh()
        h = torch.stack([h, h.cos()], dim=2)
        h = torch.tanh(self.deep(h)).mean((1, 2))
        return self.bil(h, h.sin())


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.g1 = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, 3, padding="same", dilation=2, groups=2, padding_mode="reflect")
        self.c3 = nn.Conv1d(6, 4, 3, stride=2, padding=1, padding_mode="circular")
        self.g2 = nn.GroupNorm(1, 4)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.g1(self.c1(x)))
        h = torch.relu(self.c2(h)).flatten(2)  # [B, 6, 16]
        h = torch.tanh(self.g2(self.c3(h)))  # [B, 4, 8]
        return self.fc(h.flatten(1)[:, :16])


def _data(name):
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, 3, (B,), generator=g)
    if name == "mlp":
        return MLP(), torch.randn(B, 6, generator=g), y
    if name == "seq":
        return Seq(), torch.randint(0, 11, (B, 5), generator=g), y
    return CNN(), torch.randn(B, 2, 8, 8, generator=g), y


LOSS = nn.CrossEntropyLoss(reduction="none")
WEIGHTS = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.float32)


def _rel_err(got, ref):
    num = math.sqrt(sum(float((got[n].double() - ref[n].double()).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].double().pow(2).sum()) for n in ref))
    return num / den


@pytest.mark.parametrize("name", ["mlp", "seq", "cnn"])
@pytest.mark.parametrize(
    "mb", [(None, "examples"), (3, "examples"), (2, "average")], ids=["plain", "mb3", "avg2"]
)
def test_clipped_sum_matches_per_example_loop(name, mb):
    torch.manual_seed(0)
    model, x, y = _data(name)
    size, mode = mb
    per_ex = per_example_gradients(model, x, y, LOSS)
    k = size if mode == "average" else 1
    unclipped = clipped_sum_reference(per_ex, None, weights=WEIGHTS, microbatch_size=k)
    assert unclipped  # sanity
    norms = [
        math.sqrt(sum(float(g[i].double().pow(2).sum()) / k**2 for g in per_ex.values()))
        for i in range(B)
    ]
    clip = sorted(norms)[B // 2]  # about half of the units get clipped
    ref = clipped_sum_reference(per_ex, clip, weights=WEIGHTS, microbatch_size=k)
    pg = PrivateGradient(
        model, NoPrivacyQuery(clip), expected_batch_size=6.5, microbatch_size=size,
        microbatch_mode=mode,
    )
    # two physical chunks of one logical step
    pg.accumulate(x[:4], y[:4], LOSS, WEIGHTS[:4])
    stats = pg.accumulate(x[4:], y[4:], LOSS, WEIGHTS[4:])
    assert stats.num_examples == 3
    assert _rel_err(pg.clipped_sum(), ref) <= 1e-5
    ledger, rng = Ledger(), Randomness(seed=0)
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.065))
    step = pg.release(ledger=ledger, sample_id=sid, randomness=rng)
    assert step.num_examples == 6 and step.num_chunks == 2
    grads = {n: p.grad for n, p in model.named_parameters()}
    denom = 6.5 / k
    assert _rel_err(grads, {n: v / denom for n, v in ref.items()}) <= 1e-5
    assert all(float(v.abs().sum()) == 0 for v in pg.clipped_sum().values())  # reset


@pytest.mark.parametrize("name", ["mlp", "seq", "cnn"])
def test_stale_accumulator_contents_never_reach_the_next_step(name):
    # The first chunk of a step writes its sums (beta = 0 GEMMs) instead of zeroing the
    # accumulator first; layers without that ability, and parameters that got no gradient,
    # are zeroed. Poison the buffers between steps: nothing of them may survive.
    torch.manual_seed(3)
    model, x, y = _data(name)
    ref = clipped_sum_reference(per_example_gradients(model, x, y, LOSS), 0.4, weights=WEIGHTS)
    pg = PrivateGradient(model, NoPrivacyQuery(0.4), expected_batch_size=6)
    pg.accumulate(x, y, LOSS, WEIGHTS)
    pg.reset()
    for buf in pg._buffers.values():  # private: the accumulator of the discarded step
        buf.fill_(math.nan)
    pg.accumulate(x[:4], y[:4], LOSS, WEIGHTS[:4])
    pg.accumulate(x[4:], y[4:], LOSS, WEIGHTS[4:])
    assert _rel_err(pg.clipped_sum(), ref) <= 1e-5


def test_per_layer_clipping_with_nested_query():
    torch.manual_seed(1)
    model, x, y = _data("mlp")
    names = [n for n, _ in model.named_parameters()]
    groups = {"fc1": ("fc1.weight", "fc1.bias"), "rest": tuple(n for n in names if "fc1" not in n)}
    clips = {"fc1": 0.3, "rest": 0.2}
    query = NestedQuery.from_noise_multiplier(groups, clips, 1.0)
    pg = PrivateGradient(model, query, expected_batch_size=8)
    pg.accumulate(x, y, LOSS, WEIGHTS)
    ref = clipped_sum_reference(
        per_example_gradients(model, x, y, LOSS), clips, weights=WEIGHTS, groups=groups
    )
    assert _rel_err(pg.clipped_sum(), ref) <= 1e-5


# statistical: fixed seeds (torch 2, Randomness 3): deterministic
def test_noise_std_matches_ledger_and_reaches_unused_parameters():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(40, 60), nn.Tanh(), nn.Linear(60, 2))
    unused = nn.Linear(30, 30)
    model.add_module("unused", unused)  # never called in forward: still gets noise

    def forward(x):
        return model[2](model[1](model[0](x)))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return forward(x)

    wrapper = Wrapper()
    clip, z, batch = 0.7, 1.3, 16
    query = GaussianSumQuery(clip, z)
    pg = PrivateGradient(wrapper, query, expected_batch_size=batch)
    x, y = torch.randn(batch, 40), torch.randint(0, 2, (batch,))
    pg.accumulate(x, y, LOSS)
    clipped = pg.clipped_sum()
    ledger, rng = Ledger(), Randomness(seed=3)
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=1000, sampling_rate=0.016))
    pg.release(ledger=ledger, sample_id=sid, randomness=rng)
    (entry,) = [e for e in ledger.entries if hasattr(e, "noise_std")]
    assert entry.sensitivity == pytest.approx(clip)
    assert entry.noise_std == pytest.approx(z * clip)
    for name, p in wrapper.named_parameters():
        noise = p.grad * batch - clipped[name]
        n = noise.numel()
        std = float(noise.double().pow(2).mean().sqrt())
        # chi-square: relative sd of the sample std is about 1/sqrt(2n); allow 5 sigma
        assert abs(std / (z * clip) - 1) < 5 / math.sqrt(2 * n) + 1e-3, name
    assert float(unused.weight.grad.abs().sum()) > 0


def test_nonfinite_examples_are_zeroed_and_counted():
    torch.manual_seed(4)
    model, x, y = _data("mlp")
    x = x.clone()
    x[1] = float("nan")
    x[2] = float("inf")  # a padding row: not counted, still dropped
    pg = PrivateGradient(model, NoPrivacyQuery(0.5), expected_batch_size=8)
    stats = pg.accumulate(x, y, LOSS, WEIGHTS.roll(0))
    assert stats.num_nonfinite == 1
    keep = WEIGHTS.clone()
    keep[1] = 0
    per_ex = per_example_gradients(model, torch.where(keep[:, None] > 0, x, 0.0), y, LOSS)
    ref = clipped_sum_reference(per_ex, 0.5, weights=keep)
    got = pg.clipped_sum()
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    assert _rel_err(got, ref) <= 1e-5


def test_average_mode_needs_twice_the_sensitivity():
    model, x, y = _data("mlp")
    with pytest.raises(ValueError, match="2 x clip_norm"):
        PrivateGradient(
            model, GaussianSumQuery(1.0, 1.0), expected_batch_size=8, microbatch_size=2,
            microbatch_mode="average",
        )
    query = GaussianSumQuery(1.0, 1.0, clipped_unit="microbatch_average")
    pg = PrivateGradient(
        model, query, expected_batch_size=8, microbatch_size=2, microbatch_mode="average"
    )
    pg.accumulate(x, y, LOSS)
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=800, sampling_rate=0.01))
    stats = pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    assert stats.denominator == 4.0
    (entry,) = [e for e in ledger.entries if hasattr(e, "noise_std")]
    assert (entry.sensitivity, entry.noise_std) == (2.0, 2.0)
    with pytest.raises(ValueError, match="multiple of microbatch_size"):
        pg.accumulate(x[:3], y[:3], LOSS)


def test_adaptive_query_and_bad_arguments():
    model, x, y = _data("mlp")
    query = AdaptiveClipQuery(1.0, 1.0, expected_batch_size=8, count_noise_std=2.0)
    pg = PrivateGradient(model, query, expected_batch_size=8)
    pg.accumulate(x, y, LOSS)
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=800, sampling_rate=0.01))
    pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    assert query.clip_norm != 1.0
    with pytest.raises(ValueError, match="expected_batch_size must be"):
        PrivateGradient(model, query, expected_batch_size=0)
    with pytest.raises(ValueError, match="microbatch_mode must be"):
        PrivateGradient(model, query, expected_batch_size=1, microbatch_mode="mean")
    with pytest.raises(ValueError, match="sum query"):
        PrivateGradient(model, gaussian_average_query(1.0, 1.0, 8), expected_batch_size=8)
    with pytest.raises(ValueError, match="per-example losses"):
        pg.accumulate(x, y, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="weights must"):
        pg.accumulate(x, y, LOSS, torch.full((B,), 0.5))
    assert all(not m._forward_hooks for m in model.modules())


def test_frozen_parameters_are_skipped_and_get_no_noise():
    torch.manual_seed(5)
    model, x, y = _data("cnn")
    model.c1.weight.requires_grad_(False)
    model.g1.requires_grad_(False)
    pg = PrivateGradient(model, NoPrivacyQuery(0.3), expected_batch_size=8)
    assert "c1.weight" not in pg.param_names_ and "c1.bias" in pg.param_names_
    stats = pg.accumulate(x, y, LOSS, return_norms=True)
    per_ex = per_example_gradients(model, x, y, LOSS)
    ref_norms = sum(g.double().reshape(B, -1).pow(2).sum(1) for g in per_ex.values()).sqrt()
    assert torch.allclose(stats.norms, ref_norms, rtol=1e-5)
    assert _rel_err(pg.clipped_sum(), clipped_sum_reference(per_ex, 0.3)) <= 1e-5
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=800, sampling_rate=0.01))
    pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    assert model.c1.weight.grad is None


def _release_once(pg, x, y, rng, ledger):
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=1000, sampling_rate=0.008))
    pg.accumulate(x, y, LOSS)
    return pg.release(ledger=ledger, sample_id=sid, randomness=rng)


def test_each_release_gives_new_gradients_that_match_a_fresh_release():
    # p.grad is a new tensor at every release (nothing of the step is kept between steps, so
    # zero_grad(set_to_none=True) frees it); a previous step's gradient is never rewritten.
    # Its values must be those of a query that writes into fresh tensors: the same draws, up
    # to the rounding of folding 1 / B into the clip weights and the noise std.
    torch.manual_seed(5)
    model, x, y = _data("mlp")

    class FreshOnly(GaussianSumQuery):  # a query without ``out=``: the fallback path
        fused_release = False

        def add_noise(self, clipped_sum, *, ledger, sample_id, randomness):
            return super().add_noise(
                clipped_sum, ledger=ledger, sample_id=sample_id, randomness=randomness
            )

    twin = MLP()
    twin.load_state_dict(model.state_dict())
    fast = PrivateGradient(model, GaussianSumQuery(0.5, 1.1), expected_batch_size=B)
    slow = PrivateGradient(twin, FreshOnly(0.5, 1.1), expected_batch_size=B)
    rng_a, rng_b, ledger = Randomness(seed=8), Randomness(seed=8), Ledger()
    _release_once(fast, x, y, rng_a, ledger)
    _release_once(slow, x, y, rng_b, ledger)
    first = {n: p.grad for n, p in model.named_parameters()}
    saved = {n: g.clone() for n, g in first.items()}
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6 * 0.55 / B, msg=n)
    _release_once(fast, x, y, rng_a, ledger)
    _release_once(slow, x, y, rng_b, ledger)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not first[n]  # a new tensor ...
        assert torch.equal(first[n], saved[n])  # ... and the previous one left as it was
        assert not torch.equal(p.grad, saved[n])  # fresh noise
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6 * 0.55 / B, msg=n)

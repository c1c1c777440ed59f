"""nn.EmbeddingBag norm rule (dpfy.training.norms.embedding_bag) against the per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.queries.sum import NoPrivacyQuery
from dpfy.training import PrivateGradient
from dpfy.training.norms.capture import capture_layers, plan_modules
from dpfy.training.norms.embedding_bag import BagGrads, BagMaxGrads
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from dpfy.training.norms.registry import norm_rule_for

V, D = 7, 3
# Rows are bags; -1 marks no entry (offsets layouts), read as index 0 by the 2-D layout.
# Repeated indices (also across the two bags of a unit of two), padding entries (0), an
# all-padding bag, an empty bag, ragged bags.
IDS = torch.tensor(
    [
        [1, 1, 2, 0],
        [3, 1, 2, 6],
        [0, 0, 0, 0],
        [2, 2, 2, 2],
        [-1, -1, -1, -1],
        [6, 5, -1, -1],
    ]
)
B = IDS.shape[0]


class _BagNet(nn.Module):
    """EmbeddingBag on bags of ``ids`` [B, L] (laid out as 2-D or as 1-D + offsets), a Linear.

    ``layout``: "2d" (positional call), "offsets" (keyword call), "offsets_last"
    (``include_last_offset=True``, positional call). ``twice``: the bag is called a second
    time on the reversed bags and the outputs are added.
    """

    def __init__(self, mode, padding_idx, layout, twice=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(
            V, D, mode=mode, padding_idx=padding_idx, include_last_offset=layout == "offsets_last"
        )
        self.lin = nn.Linear(D, 2)
        self.layout, self.twice = layout, twice

    def _call(self, ids, psw):
        if self.layout == "2d":
            ids = ids.clamp(min=0)
            return self.bag(ids) if psw is None else self.bag(ids, None, psw)
        real = ids >= 0
        counts = real.sum(1)
        ends = torch.cumsum(counts, 0)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        flat = ids[real]
        w = None if psw is None else psw[real]
        if self.layout == "offsets":
            return self.bag(input=flat, offsets=starts, per_sample_weights=w)
        offsets = torch.cat([ends.new_zeros(1), ends])
        return self.bag(flat, offsets, w)

    def forward(self, ids, psw=None):
        h = self._call(ids, psw)
        if self.twice:
            h = h + 0.5 * self._call(ids.flip(1), None if psw is None else psw.flip(1)).tanh()
        return torch.tanh(self.lin(h))


def _mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


def _close(got, ref, rtol=1e-9):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    assert float((got - ref).norm()) <= rtol * float(ref.norm()) + 1e-12, (got, ref)


def _setup(mode, padding_idx, layout, psw, twice=False):
    torch.manual_seed(0)
    model = _BagNet(mode, padding_idx, layout, twice).double()
    inputs = (IDS, torch.randn(IDS.shape, dtype=torch.float64)) if psw else (IDS,)
    y = torch.randn(B, 2, dtype=torch.float64)
    return model, inputs, y


def _units(per_ex, k):
    return {n: g.reshape(B // k, k, *g.shape[1:]).sum(1) for n, g in per_ex.items()}


def _layer_grads(model, inputs, y, k):
    """The bag's LayerGrads from one recorded forward/backward pass."""
    plans = plan_modules(model)
    idx = next(i for i, p in enumerate(plans) if p.module is model.bag)
    with capture_layers(plans, B) as rec:
        losses = _mse(model(*inputs), y)
        caps, _ = rec.backward(losses, torch.ones_like(losses))
    return plans[idx].rule(model.bag, caps[idx], k)


LAYOUTS = ("2d", "offsets", "offsets_last")
CASES = [
    (mode, pad, layout, False)
    for mode in ("sum", "mean", "max")
    for pad in (None, 0)
    for layout in LAYOUTS
] + [("sum", pad, layout, True) for pad in (None, 0) for layout in LAYOUTS]


@pytest.mark.parametrize("mode,padding_idx,layout,psw", CASES)
def test_layer_grads_match_loop(mode, padding_idx, layout, psw):
    model, inputs, y = _setup(mode, padding_idx, layout, psw)
    per_ex = per_example_gradients(model, inputs, y, _mse)
    for k in (1, 2):
        ref = _units(per_ex, k)["bag.weight"]  # [B // k, V, D]
        lg = _layer_grads(model, inputs, y, k)
        assert isinstance(lg, BagMaxGrads if mode == "max" else BagGrads)
        _close(lg.squared_norms()["weight"], ref.flatten(1).pow(2).sum(1))
        _close(lg.per_example("weight"), ref)
        w = torch.rand(B // k, dtype=torch.float64)
        want = torch.einsum("n,nvd->vd", w, ref)
        _close(lg.weighted_sum({"weight": w})["weight"], want)
        base = torch.randn(V, D, dtype=torch.float64)
        out = {"weight": base.clone()}
        assert lg.weighted_sum({"weight": w}, out) is out  # adds into ``out``
        _close(out["weight"], base + want)
        out = {"weight": torch.full((V, D), float("nan"), dtype=torch.float64)}
        lg.weighted_sum({"weight": w}, out, overwrite=True)
        _close(out["weight"], want)
        if padding_idx is not None:
            assert float(out["weight"][padding_idx].abs().sum()) == 0.0
        drop = torch.zeros(B // k, dtype=torch.bool)
        drop[0] = True
        lg.zero_rows(drop)
        sq = lg.squared_norms()["weight"]
        assert float(sq[0]) == 0.0
        _close(sq[1:], ref[1:].flatten(1).pow(2).sum(1))


def _check_end_to_end(model, inputs, y, clip=0.5):
    per_ex = per_example_gradients(model, inputs, y, _mse)
    for k in (1, 2):
        pg = PrivateGradient(
            model,
            NoPrivacyQuery(clip),
            expected_batch_size=1.0,
            microbatch_size=k if k > 1 else None,
            microbatch_mode="average" if k > 1 else "examples",
        )
        stats = pg.accumulate(inputs, y, _mse, return_norms=True)
        units = {n: g / k for n, g in _units(per_ex, k).items()}
        norms = sum(g.flatten(1).pow(2).sum(1) for g in units.values()).sqrt()
        _close(stats.norms, norms, rtol=1e-7)
        assert float(norms.max()) > clip  # some units are clipped
        ref = clipped_sum_reference(per_ex, clip, microbatch_size=k)
        total = pg.clipped_sum()
        for n in ref:
            _close(total[n], ref[n], rtol=1e-7)


@pytest.mark.parametrize("mode,padding_idx,layout,psw", [c for c in CASES if c[1] == 0])
def test_private_gradient_end_to_end(mode, padding_idx, layout, psw):
    model, inputs, y = _setup(mode, padding_idx, layout, psw)
    assert norm_rule_for(model.bag) is not None
    _check_end_to_end(model, inputs, y)


@pytest.mark.parametrize("mode,psw", [("sum", True), ("mean", False), ("max", False)])
def test_two_calls_in_one_forward(mode, psw):
    """Two calls of one bag: per example, the calls' contributions to a row are added first."""
    model, inputs, y = _setup(mode, 0, "offsets", psw, twice=True)
    per_ex = per_example_gradients(model, inputs, y, _mse)
    for k in (1, 2):
        ref = _units(per_ex, k)["bag.weight"]
        lg = _layer_grads(model, inputs, y, k)
        _close(lg.squared_norms()["weight"], ref.flatten(1).pow(2).sum(1))
        w = torch.rand(B // k, dtype=torch.float64)
        _close(lg.weighted_sum({"weight": w})["weight"], torch.einsum("n,nvd->vd", w, ref))
    _check_end_to_end(model, inputs, y)


def test_weighted_sum_chunks(monkeypatch):
    """The clipped sum of many entries is added in chunks with the same result."""
    import dpfy.training.norms.embedding_bag as eb

    model, inputs, y = _setup("sum", 0, "2d", True)
    lg = _layer_grads(model, inputs, y, 1)
    w = torch.rand(B, dtype=torch.float64)
    whole = lg.weighted_sum({"weight": w})["weight"]
    monkeypatch.setattr(eb, "CHUNK_ELEMENTS", 2 * D)
    _close(lg.weighted_sum({"weight": w})["weight"], whole, rtol=1e-12)

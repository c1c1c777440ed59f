"""Per-layer norm rules against the per-example loop reference (dpfy.training.norms)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.queries.sum import NoPrivacyQuery
from dpfy.training import PrivateGradient
from dpfy.training.norms import LinearForm
from dpfy.training.norms.capture import capture_layers, plan_modules
from dpfy.training.norms.linear import choose_mode
from dpfy.training.norms.reference import per_example_gradients
from dpfy.training.norms.registry import norm_rule_for, registered_types


def _norms_and_sum(model, x, y, loss_fn, group_size=1):
    """Unclipped per-example norms and gradient sum from the fast path."""
    pg = PrivateGradient(
        model,
        NoPrivacyQuery(),
        expected_batch_size=1.0,
        microbatch_size=group_size if group_size > 1 else None,
        microbatch_mode="average" if group_size > 1 else "examples",
    )
    stats = pg.accumulate(x, y, loss_fn, return_norms=True)
    return stats.norms, pg.clipped_sum()


def _reference(model, x, y, loss_fn):
    per_ex = per_example_gradients(model, x, y, loss_fn)
    sq = sum(g.double().reshape(g.shape[0], -1).pow(2).sum(1) for g in per_ex.values())
    return sq.sqrt(), {n: g.sum(0) for n, g in per_ex.items()}


def _close(got, ref, rtol=1e-5):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    assert float((got - ref).norm()) <= rtol * float(ref.norm()) + 1e-12, (got, ref)


def _mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


class _Head(nn.Module):
    """Layer under test, then a fixed nonlinearity and a sum to one output per example."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.tanh(self.layer(x)).flatten(1).sum(1, keepdim=True)


CONVS = [
    nn.Conv1d(3, 4, 3),
    nn.Conv1d(3, 6, 5, stride=2, padding=2, padding_mode="circular"),
    nn.Conv1d(4, 4, 3, groups=4, dilation=2, padding="same", bias=False),
    nn.Conv2d(2, 4, 3, stride=2, padding=1),
    nn.Conv2d(2, 4, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1)),
    nn.Conv2d(4, 6, 3, padding="same", groups=2, padding_mode="reflect"),
    nn.Conv2d(4, 4, 1, groups=4),
]


@pytest.mark.parametrize("mode", ["auto", "ghost", "materialize", "grouped"])
@pytest.mark.parametrize("conv", CONVS, ids=lambda c: repr(c))
def test_conv_norms_and_sum_match_loop(conv, mode, monkeypatch):
    import dpfy.training.norms.conv as conv_module

    if mode != "auto":
        chosen = "ghost" if mode == "ghost" else "materialize"
        monkeypatch.setattr(conv_module, "choose_mode", lambda *args: chosen)
    # materialise by patches (few channels) or by one grouped weight-gradient call
    monkeypatch.setattr(conv_module, "GROUPED_MIN_CHANNELS", 0 if mode == "grouped" else 10**9)
    torch.manual_seed(0)
    shape = (6, conv.in_channels, 9) if isinstance(conv, nn.Conv1d) else (6, conv.in_channels, 7, 8)
    x = torch.randn(*shape)
    y = torch.randn(6, 1)
    model = _Head(conv)
    per_ex = per_example_gradients(model, x, y, _mse)
    for k in (1, 2):  # per example, and microbatches of two (summed, divided by k)
        norms, total = _norms_and_sum(model, x, y, _mse, group_size=k)
        units = {n: g.reshape(6 // k, k, *g.shape[1:]).sum(1) / k for n, g in per_ex.items()}
        ref = sum(g.double().reshape(6 // k, -1).pow(2).sum(1) for g in units.values()).sqrt()
        _close(norms, ref)
        for n in units:
            _close(total[n], units[n].sum(0))


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("h", [1, 3])
def test_linear_form_modes_agree(mode, t, h):
    torch.manual_seed(1)
    a = torch.randn(6, h, t, 5, dtype=torch.float64)
    g = torch.randn(6, h, t, 4, dtype=torch.float64)
    lf = LinearForm(a, g, (h * 4, 5), bias_name="bias", mode=mode)
    per_ex = torch.einsum("nhto,nhtd->nhod", g, a)
    sq = lf.squared_norms()
    _close(sq["weight"], per_ex.pow(2).sum((1, 2, 3)))
    _close(sq["bias"], g.sum(2).pow(2).sum((1, 2)))
    w = torch.rand(6, dtype=torch.float64)
    ws = lf.weighted_sum({"weight": w, "bias": w})
    _close(ws["weight"], torch.einsum("n,nhod->hod", w, per_ex).reshape(h * 4, 5))
    _close(ws["bias"], (w[:, None] * g.sum(2).reshape(6, -1)).sum(0))


def test_choose_mode_prefers_cheaper():
    assert choose_mode(8, 1, 1, 512, 512, 4) == "ghost"  # no sequence: outer product
    assert choose_mode(8, 1, 4, 512, 512, 4) == "ghost"  # short sequence, wide layer
    assert choose_mode(8, 1, 784, 9, 16, 4) == "materialize"  # conv: many positions, small d*o


def test_linear_with_sequence_dims_and_two_calls():
    torch.manual_seed(2)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x):  # x [B, 2, 4, 5]; the same Linear is called twice
            return (self.lin(x).tanh() + self.lin(x.flip(1))).sum((1, 2))

    model = M()
    x, y = torch.randn(6, 2, 4, 5), torch.randn(6, 3)
    norms, total = _norms_and_sum(model, x, y, _mse)
    ref_norms, ref_total = _reference(model, x, y, _mse)
    _close(norms, ref_norms)
    for n in ref_total:
        _close(total[n], ref_total[n])


def test_embedding_repeated_indices_and_padding_idx():
    torch.manual_seed(3)
    emb = nn.Embedding(7, 4, padding_idx=0)
    model = nn.Sequential(emb, nn.Flatten(), nn.Linear(20, 2))
    x = torch.tensor([[1, 1, 2, 0, 0], [3, 4, 5, 6, 1], [0, 0, 0, 0, 0], [2, 2, 2, 2, 2]])
    y = torch.randn(4, 2)
    for k in (1, 2):
        norms, total = _norms_and_sum(model, x, y, _mse, group_size=k)
        per_ex = per_example_gradients(model, x, y, _mse)
        units = {n: g.reshape(4 // k, k, *g.shape[1:]).sum(1) / k for n, g in per_ex.items()}
        ref = sum(g.flatten(1).pow(2).sum(1) for g in units.values()).sqrt()
        _close(norms, ref)
        _close(total["0.weight"], units["0.weight"].sum(0))
        assert float(total["0.weight"][0].abs().sum()) == 0.0  # padding row gets no gradient


def test_embedding_scale_grad_by_freq_is_refused():
    # refused when the step is built, before any batch is seen
    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True), nn.Flatten())
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=2)


@pytest.mark.parametrize(
    "layer,shape",
    [
        (nn.LayerNorm(6), (5, 6)),
        (nn.LayerNorm((3, 4)), (5, 2, 3, 4)),
        (nn.GroupNorm(2, 4), (5, 4, 3, 3)),
        (nn.GroupNorm(2, 4), (5, 4)),
        (nn.RMSNorm(6), (5, 3, 6)),
    ],
    ids=lambda v: repr(v),
)
def test_normalization_affine_grads(layer, shape):
    torch.manual_seed(4)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p))
    model = _Head(layer)
    x, y = torch.randn(*shape), torch.randn(shape[0], 1)
    norms, total = _norms_and_sum(model, x, y, _mse)
    ref_norms, ref_total = _reference(model, x, y, _mse)
    _close(norms, ref_norms)
    for n in ref_total:
        _close(total[n], ref_total[n])


class _Gated(nn.Module):
    """No rule: a direct parameter next to a child Linear (which keeps its own rule)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.sigmoid(self.gate)


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(4, 3, 2)
        self.temperature = nn.Parameter(torch.tensor(1.5))  # root-level parameter

    def forward(self, x):
        return self.bil(x[:, :4], x[:, 4:]) * self.temperature


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("model_fn", [_Gated, _Pair])
def test_fallback_vmap_rule(model_fn):
    torch.manual_seed(5)
    model = model_fn()
    x = torch.randn(7, 7 if model_fn is _Pair else 4)
    y = torch.randn(7, 2 if model_fn is _Pair else 4)
    plans = plan_modules(model)
    assert any(p.rule is None for p in plans)
    norms, total = _norms_and_sum(model, x, y, _mse)
    ref_norms, ref_total = _reference(model, x, y, _mse)
    _close(norms, ref_norms)
    for n in ref_total:
        _close(total[n], ref_total[n])


def test_registry_is_by_exact_type():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert nn.Linear in registered_types() and nn.GroupNorm in registered_types()
    assert norm_rule_for(nn.Linear(2, 2)) is not None
    assert norm_rule_for(MyLinear(2, 2)) is None  # subclass -> generic rule


def test_hooks_removed_even_on_error():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="boom"), capture_layers(plan_modules(model)):
        model(torch.randn(2, 3))
        raise RuntimeError("boom")
    assert not model[0]._forward_hooks


class _TiedLM(nn.Module):
    """Embedding and output projection sharing one table, plus a Linear tied transposed-free."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.mid = nn.Linear(4, 4)
        self.mid2 = nn.Linear(4, 4)
        self.mid2.weight = self.mid.weight
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x)))
        return self.head(torch.tanh(self.mid2(h)))


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_tied_weights_are_exact(mode, monkeypatch):
    import dpfy.training.norms.linear as linear_module

    monkeypatch.setattr(linear_module, "choose_mode", lambda *args: mode)
    torch.manual_seed(0)
    model = _TiedLM()
    plans = plan_modules(model)
    assert {p.name for p in plans} == {"emb", "mid", "mid2", "head"}
    assert plans[-1].qualified("weight") == "emb.weight"
    x = torch.randint(0, 7, (5, 6))
    y = torch.randint(0, 7, (5, 6))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out.transpose(1, 2), t, reduction="none").sum(1)

    norms, total = _norms_and_sum(model, x, y, loss_fn)
    ref_norms, ref_total = _reference(model, x, y, loss_fn)
    _close(norms, ref_norms)
    assert set(total) == set(ref_total)
    for n in ref_total:
        _close(total[n], ref_total[n])


def test_inplace_output_modification_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    pg = PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=2)
    with pytest.raises(ValueError, match="in place"):
        pg.accumulate(torch.randn(2, 3), torch.randn(2, 1), _mse)
    assert not model[0]._forward_hooks


def test_non_batch_first_input_refused():
    class Folded(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):  # [B, T, 3] folded into [B*T, 3]: rows are not examples
            return self.lin(x.reshape(-1, 3)).reshape(x.shape[0], -1)

    pg = PrivateGradient(Folded(), NoPrivacyQuery(1.0), expected_batch_size=2)
    with pytest.raises(ValueError, match="batch size"):
        pg.accumulate(torch.randn(2, 4, 3), torch.randn(2, 4), _mse)


class _Gain(nn.Module):
    """A user layer (``x * gain``) that the library has no norm rule for."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        return x * self.gain


@pytest.fixture
def scratch_rules(monkeypatch):
    """A copy of the norm-rule registry that the test may change (restored afterwards)."""
    from dpfy.training.norms import registry

    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))


def _gain_rule(module, captures, group_size):
    from dpfy.training.norms.registry import MaterializedGrads, fold_rows, tensor_sum

    per_ex = tensor_sum([cap.args[0] * cap.grad_outputs[0] for cap in captures])
    return MaterializedGrads({"gain": fold_rows(per_ex, group_size)})


def test_user_registered_norm_rule_is_used_and_exact(scratch_rules):
    from dpfy.training.norms import register_norm_rule

    register_norm_rule(_Gain)(_gain_rule)
    model = nn.Sequential(nn.Linear(4, 3), _Gain(3), nn.Tanh(), nn.Linear(3, 2))
    assert norm_rule_for(model[1]) is _gain_rule
    assert [p.rule is _gain_rule for p in plan_modules(model)].count(True) == 1
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    norms, total = _norms_and_sum(model, x, y, _mse)
    ref_norms, ref_total = _reference(model, x, y, _mse)
    _close(norms, ref_norms)
    for n in ref_total:
        _close(total[n], ref_total[n])


def test_duplicate_norm_rule_is_refused_unless_replaced(scratch_rules):
    from dpfy.training.norms import register_norm_rule

    before = norm_rule_for(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already registered for Linear.*replace=True"):
        register_norm_rule(nn.Linear)(_gain_rule)
    with pytest.raises(ValueError, match="Linear"):  # all or nothing: _Gain stays unregistered
        register_norm_rule(_Gain, nn.Linear)(_gain_rule)
    assert norm_rule_for(nn.Linear(2, 2)) is before and norm_rule_for(_Gain(2)) is None
    register_norm_rule(_Gain)(_gain_rule)
    with pytest.raises(ValueError, match="_Gain"):
        register_norm_rule(_Gain)(_gain_rule)

    def other(module, captures, group_size):
        return _gain_rule(module, captures, group_size)

    register_norm_rule(_Gain, replace=True)(other)
    assert norm_rule_for(_Gain(2)) is other

"""Recurrent layers and cells (dpfy.training.norms.recurrent) against the per-example loop.

Everything in float64: the recomputed output must equal the module's own to 1e-10, and the
per-example squared norms and weighted sums must match the reference to 1e-6 (relative).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from dpfy.queries.sum import NoPrivacyQuery
from dpfy.training import PrivateGradient
from dpfy.training.norms import recurrent
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from dpfy.training.norms.registry import Capture, norm_rule_for, recompute_for

B, T, D_IN = 4, 5, 3
LENGTHS = {
    None: [T] * B,
    "sorted": [5, 4, 4, 2],
    "unsorted": [3, 5, 3, 1],  # ties: the repacked order must be the module's own
}


def _mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


class RecurrentHead(nn.Module):
    """A recurrent layer on batch-first data, optionally packed, with ``h0``/``c0`` given
    batch-first ([B, layers*dirs, H], transposed inside) so that the per-example loop can
    slice every input on dim 0; returns features of the output and of the final states."""

    def __init__(self, layer: nn.RNNBase, packed: str | None = None):
        super().__init__()
        self.layer, self.packed = layer, packed

    def forward(self, x, lengths, h0=None, c0=None):
        layer = self.layer
        if self.packed is not None:
            inp = pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=self.packed == "sorted"
            )
        else:
            inp = x if layer.batch_first else x.transpose(0, 1)
        if h0 is None:
            out, hidden = layer(inp)
        elif isinstance(layer, nn.LSTM):
            out, hidden = layer(inp, (h0.transpose(0, 1), c0.transpose(0, 1)))
        else:
            out, hidden = layer(inp, hx=h0.transpose(0, 1))
        if self.packed is not None:
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        elif not layer.batch_first:
            out = out.transpose(0, 1)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        feats = [torch.tanh(out).flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states]
        return torch.cat(feats, 1)


class CellLoop(nn.Module):
    """A cell called once per time step in a Python loop (hx omitted at the first step
    unless ``h0`` is given), as a user's model would."""

    def __init__(self, cell: nn.RNNCellBase):
        super().__init__()
        self.cell = cell

    def forward(self, x, h0=None):
        lstm = isinstance(self.cell, nn.LSTMCell)
        hx = None if h0 is None else ((h0, torch.zeros_like(h0)) if lstm else h0)
        outs = []
        for t in range(x.shape[1]):
            hx = self.cell(x[:, t]) if hx is None else self.cell(x[:, t], hx)
            outs.append(hx[0] if lstm else hx)
        return torch.tanh(torch.stack(outs, 1)).flatten(1)


LAYERS = {
    "rnn-tanh": lambda: nn.RNN(D_IN, 4),
    "rnn-relu-2x-bi-nobias": lambda: nn.RNN(
        D_IN, 4, num_layers=2, nonlinearity="relu", bidirectional=True, bias=False,
        batch_first=True,
    ),
    "lstm": lambda: nn.LSTM(D_IN, 4),
    "lstm-2x-bi": lambda: nn.LSTM(D_IN, 4, num_layers=2, bidirectional=True, batch_first=True),
    "lstm-proj-2x-bi": lambda: nn.LSTM(
        D_IN, 5, num_layers=2, bidirectional=True, proj_size=3, batch_first=True
    ),
    "gru-2x-bi": lambda: nn.GRU(D_IN, 4, num_layers=2, bidirectional=True),
    "gru-nobias": lambda: nn.GRU(D_IN, 4, bias=False, batch_first=True),
}

CASES = [
    ("rnn-tanh", None, False),
    ("rnn-tanh", "sorted", True),
    ("rnn-relu-2x-bi-nobias", None, True),
    ("rnn-relu-2x-bi-nobias", "unsorted", False),
    ("lstm", None, False),
    ("lstm-2x-bi", "unsorted", True),
    ("lstm-proj-2x-bi", "sorted", True),
    ("lstm-proj-2x-bi", None, False),
    ("gru-2x-bi", "unsorted", True),
    ("gru-2x-bi", None, False),
    ("gru-nobias", "sorted", False),
]


def _rnn_case(name, packed, with_h0, seed=0):
    torch.manual_seed(seed)
    layer = LAYERS[name]().double()
    model = RecurrentHead(layer, packed)
    dirs = 2 if layer.bidirectional else 1
    h_out = layer.proj_size or layer.hidden_size
    x = torch.randn(B, T, D_IN, dtype=torch.float64)
    inputs: tuple = (x, torch.tensor(LENGTHS[packed]))
    if with_h0:
        h0 = torch.randn(B, layer.num_layers * dirs, h_out, dtype=torch.float64)
        c0 = torch.randn(B, layer.num_layers * dirs, layer.hidden_size, dtype=torch.float64)
        inputs = (*inputs, h0, c0) if isinstance(layer, nn.LSTM) else (*inputs, h0)
    with torch.no_grad():
        y = torch.randn_like(model(*inputs))
    return model, layer, inputs, y


def _cell_case(kind, with_h0, seed=0):
    torch.manual_seed(seed)
    cell = {"rnn": nn.RNNCell(D_IN, 4, nonlinearity="relu"), "lstm": nn.LSTMCell(D_IN, 4),
            "gru": nn.GRUCell(D_IN, 4)}[kind].double()
    model = CellLoop(cell)
    x = torch.randn(B, T, D_IN, dtype=torch.float64)
    inputs: tuple = (x, torch.randn(B, 4, dtype=torch.float64)) if with_h0 else (x,)
    with torch.no_grad():
        y = torch.randn_like(model(*inputs))
    return model, cell, inputs, y


def _assert_same(got, ref):
    """Same structure, shapes, packing layout and values (to 1e-10)."""
    assert type(got) is type(ref), (type(got), type(ref))
    if isinstance(ref, PackedSequence):
        assert torch.equal(got.batch_sizes, ref.batch_sizes)
        for a, b in ((got.sorted_indices, ref.sorted_indices),
                     (got.unsorted_indices, ref.unsorted_indices)):
            assert (a is None and b is None) or torch.equal(a, b)
        _assert_same(got.data, ref.data)
    elif isinstance(ref, tuple):
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            _assert_same(a, b)
    else:
        assert got.shape == ref.shape and got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def _fast(model, layer, inputs, y, scale, group_size, check_output=True, retain=False):
    """The recompute and the rule driven by hand, as the private step drives them: the
    layer's forward hook swaps in the recomputed output; one backward to the targets."""
    recompute, rule = recompute_for(layer), norm_rule_for(layer)
    calls = []

    def hook(module, args, kwargs, output):
        redone = recompute(module, args, kwargs, output)
        if check_output:
            _assert_same(redone.output, output)
        calls.append((args, kwargs, redone))
        return redone.output

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        losses = _mse(model(*inputs), y)
    finally:
        handle.remove()
    targets = [t for _, _, r in calls for t in r.targets]
    grads = iter(
        torch.autograd.grad(
            losses, targets, grad_outputs=scale, retain_graph=retain, materialize_grads=True
        )
    )
    caps = [
        Capture(args, kwargs, tuple(next(grads) for _ in r.targets), extra=r.extra)
        for args, kwargs, r in calls
    ]
    return rule(layer, caps, group_size), losses, calls


def _units(per_ex, scale, k):
    """Per-unit gradients ``sum of scale_i g_i`` over groups of k consecutive rows."""
    out = {}
    for n, g in per_ex.items():
        g = g * scale.reshape(-1, *([1] * (g.dim() - 1)))
        out[n.split(".", 1)[1]] = g.reshape(g.shape[0] // k, k, *g.shape[1:]).sum(1)
    return out


def _rel(got, ref):
    num = float((got.double() - ref.double()).norm())
    return num / max(float(ref.double().norm()), 1e-300)


def _check_rule(lg, units, layer):
    trainable = {n for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    sq = lg.squared_norms()
    assert set(sq) == trainable == set(units)
    v = torch.rand(next(iter(units.values())).shape[0], dtype=torch.float64)
    ws = lg.weighted_sum(dict.fromkeys(sq, v))
    for n, g in units.items():
        assert _rel(sq[n], g.flatten(1).pow(2).sum(1)) <= 1e-6, n
        assert _rel(ws[n], torch.einsum("n,n...->...", v, g)) <= 1e-6, n


@pytest.fixture(params=["ghost", "materialize"])
def gate_mode(request, monkeypatch):
    """The gate weights' norms by the shared-Gram ghost form or the materialising linear
    forms (the cost model picks one by the shapes; both must be exact)."""
    ghost = request.param == "ghost"
    monkeypatch.setattr(recurrent, "ghost_cheaper", lambda *args: ghost)
    return request.param


@pytest.mark.parametrize("name,packed,with_h0", CASES, ids=lambda v: str(v))
def test_recurrent_rule_matches_loop(name, packed, with_h0, gate_mode):
    model, layer, inputs, y = _rnn_case(name, packed, with_h0)
    per_ex = per_example_gradients(model, inputs, y, _mse)
    scale = torch.rand(B, dtype=torch.float64) + 0.5
    for k in (1, 2):
        lg, _, _ = _fast(model, layer, inputs, y, scale, k)
        _check_rule(lg, _units(per_ex, scale, k), layer)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_cell_loop_matches_loop(kind, with_h0, gate_mode):
    model, cell, inputs, y = _cell_case(kind, with_h0)
    per_ex = per_example_gradients(model, inputs, y, _mse)
    scale = torch.rand(B, dtype=torch.float64) + 0.5
    for k in (1, 2):
        lg, _, calls = _fast(model, cell, inputs, y, scale, k)
        assert len(calls) == T
        _check_rule(lg, _units(per_ex, scale, k), cell)


def test_frozen_parameters_are_not_reported():
    model, layer, inputs, y = _rnn_case("gru-2x-bi", "unsorted", True)
    layer.weight_hh_l0.requires_grad_(False)
    layer.bias_ih_l1_reverse.requires_grad_(False)
    per_ex = per_example_gradients(model, inputs, y, _mse)
    scale = torch.ones(B, dtype=torch.float64)
    lg, _, _ = _fast(model, layer, inputs, y, scale, 1)
    _check_rule(lg, _units(per_ex, scale, 1), layer)


class _Chain(nn.Module):
    """``layer``'s layers one at a time (single-layer modules sharing its Parameters), the
    given dropout masks between them: the computation the recomputed layer hands on, for a
    per-example loop (``masks`` [B, T, F] per layer > 0, sliced with the batch)."""

    def __init__(self, layer: nn.RNNBase):
        super().__init__()
        self.layer = layer
        dirs = 2 if layer.bidirectional else 1
        self.subs = []
        for i in range(layer.num_layers):
            width = layer.input_size if i == 0 else dirs * layer.hidden_size
            sub = type(layer)(width, layer.hidden_size, batch_first=True,
                              bidirectional=layer.bidirectional)
            for name, _ in list(sub.named_parameters()):
                delattr(sub, name)
                setattr(sub, name, getattr(layer, name.replace("_l0", f"_l{i}")))
            self.subs.append(sub)

    def forward(self, x, *masks):
        states = []
        for i, sub in enumerate(self.subs):
            if i > 0:
                x = x * masks[i - 1]
            x, hidden = sub(x)
            states.append(hidden if isinstance(hidden, tuple) else (hidden,))
        feats = [torch.tanh(x).flatten(1)]
        for j in range(len(states[0])):
            feats.append(torch.cat([s[j] for s in states], 0).transpose(0, 1).flatten(1))
        return torch.cat(feats, 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LSTM(D_IN, 4, num_layers=3, dropout=0.5, batch_first=True),
        lambda: nn.GRU(D_IN, 3, num_layers=2, dropout=0.4, bidirectional=True, batch_first=True),
    ],
    ids=["lstm-3x", "gru-2x-bi"],
)
def test_dropout_between_layers_in_training(make, gate_mode):
    """In training mode the recurrence draws its own dropout masks (every layer run here);
    the rule matches the per-example loop over the same computation with those masks."""
    torch.manual_seed(5)
    layer = make().double().train()
    model = RecurrentHead(layer, None)
    x = torch.randn(B, T, D_IN, dtype=torch.float64)
    inputs = (x, torch.tensor(LENGTHS[None]))
    dirs = 2 if layer.bidirectional else 1
    states = (2 if isinstance(layer, nn.LSTM) else 1) * layer.num_layers * dirs
    y = torch.randn(B, T * dirs * layer.hidden_size + states * layer.hidden_size,
                    dtype=torch.float64)
    scale = torch.rand(B, dtype=torch.float64) + 0.5
    lg, _, calls = _fast(model, layer, inputs, y, scale, 1, check_output=False)
    tracks = calls[0][2].extra
    masks = [tr.mask.transpose(0, 1) for tr in tracks[dirs::dirs]]  # layers > 0, batch first
    assert len(masks) == layer.num_layers - 1 and all(m is not None for m in masks)
    assert 0.0 in masks[0]  # dropout did drop
    per_ex = per_example_gradients(_Chain(layer), (x, *masks), y, _mse)
    _check_rule(lg, _units(per_ex, scale, 1), layer)


def test_time_major_output_is_contiguous():
    model, layer, inputs, _ = _rnn_case("gru-2x-bi", None, False)
    x = inputs[0].transpose(0, 1).contiguous()
    redone = recompute_for(layer)(layer, (x,), {}, layer(x))
    assert redone.output[0].is_contiguous()
    _assert_same(redone.output, layer(x))


@pytest.mark.parametrize(
    "layer,x",
    [
        (nn.LSTM(D_IN, 4), torch.randn(T, D_IN)),
        (nn.GRU(D_IN, 4, batch_first=True), torch.randn(T, D_IN)),
        (nn.GRUCell(D_IN, 4), torch.randn(D_IN)),
    ],
    ids=["lstm", "gru", "gru-cell"],
)
def test_unbatched_input_is_refused(layer, x):
    with pytest.raises(ValueError, match="batch"):
        recompute_for(layer)(layer, (x,), {}, layer(x))


# -- end to end: PrivateGradient (clipped sums against the loop) ---------------------------


def _private_clipped_sum(model, inputs, y, weights, k):
    per_ex = per_example_gradients(model, inputs, y, _mse)
    units = _units(per_ex, weights, k)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in units.values()]).sum(0).sqrt() / k
    clip = float(norms.sort().values[len(norms) // 2])  # about half of the units clipped
    pg = PrivateGradient(
        model, NoPrivacyQuery(clip), expected_batch_size=float(B),
        microbatch_size=k if k > 1 else None,
        microbatch_mode="average" if k > 1 else "examples",
    )
    pg.accumulate(inputs, y, _mse, weights)
    ref = clipped_sum_reference(per_ex, clip, weights=weights, microbatch_size=k)
    got = pg.clipped_sum()
    num = math.sqrt(sum(float((got[n].double() - ref[n]).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    return num / den


E2E = [
    ("lstm-proj-2x-bi", None, True),
    ("gru-nobias", None, True),
    ("lstm-2x-bi", "unsorted", True),
    ("lstm-proj-2x-bi", "sorted", False),
    ("gru-2x-bi", None, True),
    ("rnn-relu-2x-bi-nobias", "unsorted", False),
]


@pytest.mark.parametrize("name,packed,with_h0", E2E, ids=lambda v: str(v))
@pytest.mark.parametrize("k", [1, 2])
def test_private_gradient_recurrent(name, packed, with_h0, k):
    model, _, inputs, y = _rnn_case(name, packed, with_h0, seed=3)
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert _private_clipped_sum(model, inputs, y, weights, k) <= 1e-6


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("k", [1, 2])
def test_private_gradient_cell_loop(kind, k):
    model, _, inputs, y = _cell_case(kind, with_h0=kind == "gru", seed=4)
    weights = torch.ones(B, dtype=torch.float64)
    assert _private_clipped_sum(model, inputs, y, weights, k) <= 1e-6


def test_private_gradient_refuses_unbatched():
    model = nn.Sequential(nn.GRU(D_IN, 4))
    pg = PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=1.0)
    with pytest.raises(ValueError, match="batch dimension"):
        pg.accumulate(torch.randn(T, D_IN), torch.zeros(T, 4), lambda out, y: _mse(out[0], y))


# -- what flows out of the layer: its input's and initial states' gradients, and the batch
# gradients of its parameters (the coverage check's) ---------------------------------------


class Upstream(nn.Module):
    """Trainable layers before the recurrent one: a Linear on its input and one making
    ``h0`` (and ``c0``) from the first step, so their per-example gradients need the
    gradients the recurrence hands back to its input and initial states."""

    def __init__(self, layer: nn.RNNBase, packed: str | None):
        super().__init__()
        self.pre = nn.Linear(D_IN, D_IN)
        dirs = 2 if layer.bidirectional else 1
        self.states = layer.num_layers * dirs
        self.h_out = layer.proj_size or layer.hidden_size
        width = self.states * (self.h_out + layer.hidden_size)
        self.init = nn.Linear(D_IN, width)
        self.head = RecurrentHead(layer, packed)

    def forward(self, x, lengths):
        layer = self.head.layer
        s = torch.tanh(self.init(x[:, 0]))
        h0 = s[:, : self.states * self.h_out].reshape(x.shape[0], self.states, self.h_out)
        if isinstance(layer, nn.LSTM):
            c0 = s[:, self.states * self.h_out :].reshape(x.shape[0], self.states, -1)
            return self.head(self.pre(x), lengths, h0, c0)
        return self.head(self.pre(x), lengths, h0)


UPSTREAM = [
    ("lstm-proj-2x-bi", "unsorted"),
    ("gru-2x-bi", "sorted"),
    ("gru-2x-bi", None),
    ("rnn-tanh", "unsorted"),
    ("rnn-relu-2x-bi-nobias", None),
    ("lstm", None),
]


@pytest.mark.parametrize("name,packed", UPSTREAM, ids=lambda v: str(v))
def test_gradients_handed_back_upstream(name, packed):
    torch.manual_seed(7)
    model = Upstream(LAYERS[name](), packed).double()
    inputs = (torch.randn(B, T, D_IN, dtype=torch.float64), torch.tensor(LENGTHS[packed]))
    with torch.no_grad():
        y = torch.randn_like(model(*inputs))
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    assert _private_clipped_sum(model, inputs, y, weights, 1) <= 1e-6


@pytest.mark.parametrize(
    "name,packed", [*UPSTREAM, ("lstm-2x-bi", "sorted")], ids=lambda v: str(v)
)
def test_batch_gradients_match_the_module(name, packed):
    """Through the recomputed call, autograd's gradients of the input, the initial states and
    the parameters (the probes' backward) are the module's own."""
    torch.manual_seed(8)
    model = Upstream(LAYERS[name](), packed).double()
    layer = model.head.layer
    inputs = (torch.randn(B, T, D_IN, dtype=torch.float64), torch.tensor(LENGTHS[packed]))
    params = list(model.parameters())
    v = torch.randn_like(model(*inputs))
    ref = torch.autograd.grad((model(*inputs) * v).sum(), params)

    def hook(module, args, kwargs, output):
        return recompute_for(module)(module, args, kwargs, output).output

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        got = torch.autograd.grad((model(*inputs) * v).sum(), params)
    finally:
        handle.remove()
    for (n, _), a, b in zip(model.named_parameters(), got, ref, strict=True):
        assert _rel(a, b) <= 1e-10, n

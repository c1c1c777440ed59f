"""Every layer class with parameters in ``torch.nn``: exact against the per-example loop, or
refused when the step is built, and ``check_module`` says which before anything runs.

The classes are enumerated from the ``torch.nn`` namespace: a class that a later torch adds
fails :func:`test_every_torch_nn_layer_is_classified` until it is put in one of the tables
below. Each exact case compares the clipped sum (clip at the median norm, one padding row)
and the per-example norms with :func:`dpfy.training.norms.reference.per_example_gradients` in
float64 (relative error <= 1e-6), in every norm mode of the linear-form rules where the
layer has one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpfy.accounting import epsilon
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient, check_module
from dpfy.training.norms.coverage import CoverageError
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from dpfy.training.validate import Severity

B = 4
DT = torch.float64
WEIGHTS = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=DT)  # the last row is padding


class Net(nn.Module):
    """The layer under test inside a small model: ``body(layer, *inputs)`` -> [B, ...]."""

    def __init__(self, layer: nn.Module, body: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.layer = layer
        self.body = body

    def forward(self, *inputs: Any) -> torch.Tensor:
        out = self.body(self.layer, *inputs)
        return torch.tanh(out).reshape(out.shape[0], -1).sum(1, keepdim=True)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


def _plain(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _first(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)[0]


def _cell_loop(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state = None
    for t in range(x.shape[1]):
        state = layer(x[:, t], state)
    return state[0] if isinstance(state, tuple) else state


def _packed(layer: nn.Module, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    out, _ = layer(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


def _time_major(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x.transpose(0, 1))[0].transpose(0, 1)


def _attention(layer: nn.Module, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return layer(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def _encoder(layer: nn.Module, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return layer(x, src_key_padding_mask=pad)


def _with_padding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [B, T, ...] and a key padding mask [B, T] with padded positions in two rows."""
    pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
    pad[1, -2:] = True
    pad[2, -1] = True
    return x, pad


def _decoder(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, x[:, :3])


def _seq2seq(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, x[:, :3])


def _bilinear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x[:, :3], x[:, 3:])


def _bag(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return layer(ids)


def _linear_ce(layer: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return layer(x, target).unsqueeze(1)


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, 10, shape)


# name -> (layer factory, body, inputs factory, modes). "modes": the layer's rule builds
# linear forms, so it is also run with ghost and materialised norms forced.
EXACT: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[[], Any], bool]] = {
    "Linear": (lambda: nn.Linear(6, 3), _plain, lambda: _x(B, 5, 6), True),
    "Bilinear": (lambda: nn.Bilinear(3, 2, 2), _bilinear, lambda: _x(B, 5), False),
    "Conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1), _plain, lambda: _x(B, 2, 6), True),
    "Conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2), _plain, lambda: _x(B, 2, 6, 6), True),
    "Conv3d": (lambda: nn.Conv3d(2, 2, 2), _plain, lambda: _x(B, 2, 3, 3, 3), True),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3), _plain, lambda: _x(B, 2, 4), False),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 2, 2), _plain, lambda: _x(B, 2, 3, 3), False),
    "ConvTranspose3d": (
        lambda: nn.ConvTranspose3d(2, 2, 2), _plain, lambda: _x(B, 2, 2, 2, 2), False
    ),
    "Embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), _plain, lambda: _ids(B, 5), False),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 4, mode="mean"), _bag, lambda: _ids(B, 5), False),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _plain, lambda: _x(B, 4, 5), False),
    "LayerNorm": (lambda: nn.LayerNorm(6), _plain, lambda: _x(B, 3, 6), False),
    "RMSNorm": (lambda: nn.RMSNorm(6), _plain, lambda: _x(B, 3, 6), False),
    "InstanceNorm1d": (
        lambda: nn.InstanceNorm1d(3, affine=True), _plain, lambda: _x(B, 3, 5), False
    ),
    "InstanceNorm2d": (
        lambda: nn.InstanceNorm2d(3, affine=True), _plain, lambda: _x(B, 3, 4, 4), False
    ),
    "InstanceNorm3d": (
        lambda: nn.InstanceNorm3d(2, affine=True), _plain, lambda: _x(B, 2, 3, 3, 3), False
    ),
    "PReLU": (lambda: nn.PReLU(3), _plain, lambda: _x(B, 3, 5), False),
    "RNN": (
        lambda: nn.RNN(3, 4, num_layers=2, bidirectional=True, batch_first=True),
        _first, lambda: _x(B, 5, 3), True,
    ),
    "LSTM": (
        lambda: nn.LSTM(3, 4, batch_first=True), _packed,
        lambda: (_x(B, 5, 3), torch.tensor([5, 3, 4, 2])), True,
    ),
    "GRU": (lambda: nn.GRU(3, 4, num_layers=2), _time_major, lambda: _x(B, 5, 3), True),
    "RNNCell": (lambda: nn.RNNCell(3, 4), _cell_loop, lambda: _x(B, 3, 3), True),
    "LSTMCell": (lambda: nn.LSTMCell(3, 4), _cell_loop, lambda: _x(B, 3, 3), True),
    "GRUCell": (lambda: nn.GRUCell(3, 4), _cell_loop, lambda: _x(B, 3, 3), True),
    "MultiheadAttention": (
        lambda: nn.MultiheadAttention(6, 2, batch_first=True), _attention,
        lambda: _with_padding(_x(B, 5, 6)), True,
    ),
    "TransformerEncoderLayer": (
        lambda: nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0, batch_first=True), _encoder,
        lambda: _with_padding(_x(B, 4, 6)), True,
    ),
    "TransformerEncoder": (
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False,
        ),
        _encoder, lambda: _with_padding(_x(B, 4, 6)), False,
    ),
    "TransformerDecoderLayer": (
        lambda: nn.TransformerDecoderLayer(6, 2, 8, dropout=0.0, batch_first=True), _decoder,
        lambda: _x(B, 4, 6), True,
    ),
    "TransformerDecoder": (
        lambda: nn.TransformerDecoder(
            nn.TransformerDecoderLayer(6, 2, 8, dropout=0.0, batch_first=True), 1
        ),
        _decoder, lambda: _x(B, 4, 6), False,
    ),
    "Transformer": (
        lambda: nn.Transformer(6, 2, 1, 1, 8, dropout=0.0, batch_first=True), _seq2seq,
        lambda: _x(B, 4, 6), False,
    ),
    "LinearCrossEntropyLoss": (
        lambda: nn.LinearCrossEntropyLoss(5, 3, reduction="none"), _linear_ce,
        lambda: (_x(B, 5), torch.tensor([0, 2, 1, 2])), False,
    ),
}

# name -> (layer factory, text the refusal must contain)
REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), "GroupNorm"),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), "GroupNorm"),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(3), "GroupNorm"),
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(3), "GroupNorm"),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), "GroupNorm"),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), "GroupNorm"),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), "GroupNorm"),
    "LazyLinear": (lambda: nn.LazyLinear(3), "dummy batch"),
    "LazyConv1d": (lambda: nn.LazyConv1d(3, 2), "dummy batch"),
    "LazyConv2d": (lambda: nn.LazyConv2d(3, 2), "dummy batch"),
    "LazyConv3d": (lambda: nn.LazyConv3d(3, 2), "dummy batch"),
    "LazyConvTranspose1d": (lambda: nn.LazyConvTranspose1d(3, 2), "dummy batch"),
    "LazyConvTranspose2d": (lambda: nn.LazyConvTranspose2d(3, 2), "dummy batch"),
    "LazyConvTranspose3d": (lambda: nn.LazyConvTranspose3d(3, 2), "dummy batch"),
    "LazyInstanceNorm1d": (lambda: nn.LazyInstanceNorm1d(affine=True), "dummy batch"),
    "LazyInstanceNorm2d": (lambda: nn.LazyInstanceNorm2d(affine=True), "dummy batch"),
    "LazyInstanceNorm3d": (lambda: nn.LazyInstanceNorm3d(affine=True), "dummy batch"),
    "AdaptiveLogSoftmaxWithLoss": (
        lambda: nn.AdaptiveLogSoftmaxWithLoss(6, 10, [4]), "CrossEntropyLoss"
    ),
    "DataParallel": (lambda: nn.DataParallel(nn.Linear(3, 2)), "DistributedDataParallel"),
}

#: Refused configurations of layers that are exact otherwise.
REFUSED_OPTIONS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "InstanceNorm1d-running-stats": (
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        "track_running_stats",
    ),
    "Embedding-max-norm": (lambda: nn.Embedding(10, 4, max_norm=1.0), "max_norm"),
    "EmbeddingBag-sparse": (lambda: nn.EmbeddingBag(10, 4, sparse=True), "sparse"),
    "TransformerEncoderLayer-seq-first": (
        lambda: nn.TransformerEncoderLayer(6, 2, 8), "batch_first=True"
    ),
}

#: Classes whose instances hold parameters only for other modules to use; tested below.
HOLDERS = {"Module", "ParameterList", "ParameterDict"}
#: Parameter-free layers whose constructor needs more than sizes.
PARAMETER_FREE = {"FractionalMaxPool2d", "FractionalMaxPool3d"}
#: Abstract bases and containers, covered through their subclasses and users.
BASES = {"Container", "RNNBase", "RNNCellBase", "Sequential", "ModuleList", "ModuleDict"}


def _torch_nn_modules() -> list[str]:
    return sorted(
        name
        for name in dir(nn)
        if inspect.isclass(getattr(nn, name)) and issubclass(getattr(nn, name), nn.Module)
    )


def _has_parameters(name: str) -> bool:
    """Whether the class's default construction (or the one in our tables) holds parameters."""
    cls = getattr(nn, name)
    try:
        module = cls()
    except TypeError:
        return True  # needs sizes: it is a layer with parameters, or must be in a table
    return any(True for _ in module.parameters())


def test_every_torch_nn_layer_is_classified():
    classified = set(EXACT) | set(REFUSED) | HOLDERS | BASES | PARAMETER_FREE
    unclassified = [
        name for name in _torch_nn_modules()
        if name not in classified and _has_parameters(name)
    ]
    # parameter-free layers that need constructor arguments (pools, pads, losses, ...) are
    # recognised by constructing them from their signature's required ints
    unclassified = [name for name in unclassified if not _parameter_free(name)]
    assert unclassified == [], (
        f"torch.nn layers with parameters that the zoo does not classify: {unclassified}; "
        "add each to EXACT (with a test model) or REFUSED (with its refusal)"
    )


def _parameter_free(name: str) -> bool:
    cls = getattr(nn, name)
    params = inspect.signature(cls).parameters.values()
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for arg in (2, (2,), 0.5):
        try:
            module = cls(*([arg] * len(required)))
        except Exception:  # noqa: BLE001 - try the next argument type
            continue
        return not any(True for _ in module.parameters())
    return False


def _verdict(model: nn.Module) -> str:
    issues = check_module(model)
    return "refused" if any(i.severity is Severity.ERROR for i in issues) else "exact"


def _force_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "auto":
        return
    import dpfy.training.norms.conv as conv_rules
    import dpfy.training.norms.linear as linear_rules

    monkeypatch.setattr(linear_rules, "choose_mode", lambda *a: mode)
    monkeypatch.setattr(conv_rules, "choose_mode", lambda *a: mode)


def _exact_cases() -> list[Any]:
    cases = []
    for name, (_, _, _, modes) in EXACT.items():
        for mode in ("auto", "ghost", "materialize") if modes else ("auto",):
            cases.append(pytest.param(name, mode, id=f"{name}-{mode}"))
    return cases


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum(1)


def _compare(model: nn.Module, inputs: Any, coverage: str = "every") -> dict[str, torch.Tensor]:
    """Clipped sum and norms of the fast path against the per-example loop (float64); returns
    the fast path's clipped sum."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    device = next(model.parameters()).device  # tests/test_cuda.py runs this on a GPU
    y = torch.randn(B, 1, dtype=DT).to(device)
    weights = WEIGHTS.to(device)
    per_ex = per_example_gradients(model, inputs, y, _loss)
    norms = torch.stack(
        [g.reshape(B, -1).pow(2).sum(1) for g in per_ex.values()]
    ).sum(0).sqrt()
    clip = float(norms[:3].median())
    pg = PrivateGradient(
        model, NoPrivacyQuery(clip), expected_batch_size=float(B), coverage_check=coverage
    )
    stats = pg.accumulate(inputs, y, _loss, weights=weights, return_norms=True)
    assert stats.norms is not None
    torch.testing.assert_close(stats.norms[:3], norms[:3], rtol=1e-6, atol=1e-12)
    ref = clipped_sum_reference(per_ex, clip, weights=weights)
    got = pg.clipped_sum()
    num = math.sqrt(sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    assert num <= 1e-6 * den, f"relative error {num / den:.3g}"
    return got


@pytest.mark.parametrize("name,mode", _exact_cases())
def test_exact_layer_matches_the_per_example_loop(name, mode, monkeypatch):
    make, body, make_inputs, _ = EXACT[name]
    torch.manual_seed(0)
    model = Net(make(), body).to(DT)
    assert _verdict(model) == "exact", check_module(model)
    _force_mode(monkeypatch, mode)
    _compare(model, make_inputs())


@pytest.mark.parametrize("name", sorted(REFUSED) + sorted(REFUSED_OPTIONS))
def test_refused_layer_is_refused_when_the_step_is_built(name):
    make, fix = REFUSED[name] if name in REFUSED else REFUSED_OPTIONS[name]
    model = nn.Sequential(nn.Identity(), make())
    assert _verdict(model) == "refused"
    with pytest.raises(ValueError) as info:
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=float(B))
    message = str(info.value)
    assert "'1'" in message or " 1 (" in message, message  # the module's path
    assert fix in message and "Fix" in message, message


class _Holder(nn.Module):
    """Parameters in a ParameterList / ParameterDict, and one of the module's own."""

    def __init__(self) -> None:
        super().__init__()
        self.plist = nn.ParameterList(
            [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))]
        )
        self.pdict = nn.ParameterDict({"scale": nn.Parameter(torch.randn(3))})
        self.own = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.plist[0], self.plist[1]) * self.pdict["scale"]
        return h + self.own


class _ChildByFunctional(nn.Module):
    """A parent without parameters of its own using its child's weight functionally."""

    def __init__(self, d: int = 4, o: int = 3) -> None:
        super().__init__()
        self.child = nn.Linear(d, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(x), self.child.weight, self.child.bias)


@pytest.mark.parametrize("holder", [_Holder, _ChildByFunctional])
def test_parameters_used_by_a_parent_are_exact(holder):
    torch.manual_seed(1)
    model = Net(holder(), _plain).to(DT)
    assert _verdict(model) == "exact"
    _compare(model, _x(B, 4), coverage="first")


def test_parameter_used_inside_and_outside_its_module_is_refused_before_a_release():
    """A weight used by its module's call *and* functionally by the parent: the first chunk
    refuses it, naming the parameter; the ledger holds a sample record only, which spends
    nothing (a sample without a release is not accounted)."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x) + F.linear(x, self.child.weight)

    model = Net(Both(), _plain).to(DT)
    ledger = Ledger()
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.04))
    with pytest.raises(CoverageError, match=r"'layer\.child\.weight' of module 'layer\.child'"):
        pg.accumulate(_x(B, 4), torch.zeros(B, 1, dtype=DT), _loss)
    assert sid == 0
    assert epsilon(ledger.to_event(), 1e-5).epsilon == 0.0


class _Mixed(nn.Module):
    """MultiheadAttention, LSTM, an LSTMCell loop, GRU, F.linear on a child's weight, Conv1d,
    GroupNorm and Embedding in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.cell = nn.LSTMCell(5, 4)
        self.gru = nn.GRU(4, 3, batch_first=True)
        self.out = _ChildByFunctional(3, 2)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.norm(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h = h + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        h, _ = self.lstm(h)
        state = None
        steps = []
        for t in range(h.shape[1]):
            state = self.cell(h[:, t], state)
            steps.append(state[0])
        g, _ = self.gru(torch.stack(steps, 1))
        return self.out(g[:, -1])


def test_a_model_mixing_the_layers_is_exact():
    torch.manual_seed(2)
    model = _Mixed().to(DT)
    assert _verdict(model) == "exact"
    ids = torch.randint(0, 12, (B, 5))
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[0, -2:] = True
    y = torch.randn(B, 2, dtype=DT)
    per_ex = per_example_gradients(model, (ids, pad), y, _loss)
    norms = torch.stack([g.reshape(B, -1).pow(2).sum(1) for g in per_ex.values()]).sum(0).sqrt()
    clip = float(norms.median())
    pg = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=float(B))
    stats = pg.accumulate((ids, pad), y, _loss, return_norms=True)
    torch.testing.assert_close(stats.norms, norms, rtol=1e-6, atol=1e-12)
    ref = clipped_sum_reference(per_ex, clip)
    got = pg.clipped_sum()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-10)
    # the second chunk uses the plan the first one settled (the head's weight through its
    # parent `out`, the smallest module that was called)
    pg.reset()
    pg.accumulate((ids, pad), y, _loss)
    for name in ref:
        torch.testing.assert_close(pg.clipped_sum()[name], ref[name], rtol=1e-6, atol=1e-10)


class _TwoOutputs(nn.Module):
    """A layer of the user's own (generic rule) returning (h, c) with h computed from c: the
    recorded gradient of c must not also carry the path through h."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.tanh(x @ self.w)
        return torch.sigmoid(c) * c, c


def _both_outputs(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h, c = layer(x)
    return h + 2.0 * c


def test_generic_outputs_computed_from_one_another_are_not_counted_twice():
    torch.manual_seed(3)
    model = Net(_TwoOutputs(), _both_outputs).to(DT)
    _compare(model, _x(B, 4))


def test_a_wrong_rule_is_caught_before_anything_is_released(monkeypatch):
    """The check holds the rules to account too: a rule that doubles its gradients is refused
    on the first chunk, with the parameter named."""
    from dpfy.training.norms import linear, registry

    def doubled(module, captures, group_size):
        lg = linear.linear_rule(module, captures, group_size)
        lg.g = 2.0 * lg.g
        return lg

    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES) | {nn.Linear: doubled})
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)).to(DT)
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))
    with pytest.raises(CoverageError, match=r"parameter '0\.weight' of module '0' \(Linear\)"):
        pg.accumulate(_x(B, 3), torch.zeros(B, 1, dtype=DT), _loss)

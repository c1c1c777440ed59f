"""Model shapes a user audit found refused badly or falsely: each is now exact against the
per-example loop (float64, relative 1e-6), or refused when the step is built (at the latest
in the first chunk, before anything is released) with a ValueError naming the module's path
and what to do; ``check_module`` gives the same verdict beforehand where the model shows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint

from dpfy.accounting import epsilon
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.sampling import SampleSpec
from dpfy.training import PrivateGradient, check_module
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from dpfy.training.validate import Severity

B = 4
DT = torch.float64


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum(1)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


class Net(nn.Module):
    """``encoder`` (a Sequential holding the layer under test), then a Linear head."""

    def __init__(self, layer: nn.Module, width: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential(layer, nn.Tanh())
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _assert_exact(model: nn.Module, x: torch.Tensor) -> None:
    """Norms and clipped sum (clip at the median norm) equal the per-example loop's."""
    y = _x(B, 1)
    per_ex = per_example_gradients(model, x, y, _loss)
    norms = torch.stack([g.reshape(B, -1).pow(2).sum(1) for g in per_ex.values()]).sum(0).sqrt()
    clip = float(norms.median())
    pg = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=float(B),
                         coverage_check="every")
    stats = pg.accumulate(x, y, _loss, return_norms=True)
    assert stats.norms is not None
    torch.testing.assert_close(stats.norms, norms, rtol=1e-6, atol=1e-12)
    ref = clipped_sum_reference(per_ex, clip)
    got = pg.clipped_sum()
    assert set(got) == set(ref)
    num = math.sqrt(sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    assert num <= 1e-6 * den, f"relative error {num / den:.3g}"


def _refused_in_first_chunk(model: nn.Module, x: torch.Tensor, *needles: str) -> str:
    """The first chunk raises a ValueError containing ``needles``; no gradient is written and
    the ledger holds a sample record only (a sample without a release spends nothing)."""
    ledger = Ledger()
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))
    ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.04))
    with pytest.raises(ValueError) as info:
        pg.accumulate(x, _x(B, 1), _loss)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert all(p.grad is None for p in model.parameters())
    assert epsilon(ledger.to_event(), 1e-5).epsilon == 0.0
    return message


def _refused_when_built(model: nn.Module, *needles: str) -> None:
    issues = [i for i in check_module(model) if i.severity is Severity.ERROR]
    assert len(issues) == 1, issues
    with pytest.raises(ValueError) as info:
        PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))
    for needle in needles:
        assert needle in str(issues[0]) and needle in str(info.value), str(info.value)


# ---- 1. parametrizations ------------------------------------------------------------------


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


class _Scaled(nn.Module):
    """A parametrization with a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale


def _parametrized(kind: str) -> nn.Module:
    layer = nn.Linear(4, 4)
    if kind == "weight_norm":
        parametrizations.weight_norm(layer)
    elif kind == "orthogonal":
        parametrizations.orthogonal(layer)
    elif kind == "symmetric":
        parametrize.register_parametrization(layer, "weight", _Symmetric())
    elif kind == "own-parameter":
        parametrize.register_parametrization(layer, "weight", _Scaled())
    return layer


@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "symmetric", "own-parameter"])
def test_parametrized_layer_is_exact(kind):
    torch.manual_seed(0)
    model = Net(_parametrized(kind)).to(DT)
    issues = check_module(model)
    assert [(i.path, i.severity) for i in issues] == [("encoder.0", Severity.NOTE)]
    assert "parametrization of 'weight'" in issues[0].module_type
    plans = PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=float(B)).plans_
    assert [p.name for p in plans] == ["encoder.0", "head"]
    _assert_exact(model, _x(B, 4))


def test_old_weight_norm_is_exact():
    torch.manual_seed(1)
    layer = nn.Linear(4, 4)
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(layer)
    model = Net(layer).to(DT)
    issues = check_module(model)
    assert [(i.path, i.module_type, i.severity) for i in issues] == [
        ("encoder.0", "Linear with torch.nn.utils.weight_norm", Severity.NOTE)
    ]
    _assert_exact(model, _x(B, 4))
    model(_x(B, 4)).sum().backward()  # the weight the hook set is an ordinary tensor again


def test_spectral_norm_is_refused_when_the_step_is_built():
    model = Net(parametrizations.spectral_norm(nn.Linear(4, 4))).to(DT)
    _refused_when_built(
        model,
        "module 'encoder.0' (Linear with a spectral_norm parametrization of 'weight')",
        "power-iteration",
        "remove_parametrizations",
    )
    old = Net(torch.nn.utils.spectral_norm(nn.Linear(4, 4))).to(DT)
    _refused_when_built(
        old, "module 'encoder.0' (Linear with torch.nn.utils.spectral_norm)", "remove_spectral_norm"
    )
    old.requires_grad_(False)
    old.head.requires_grad_(True)
    PrivateGradient(old, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))  # frozen


# ---- 2. what torch.func cannot transform, in a layer of the generic rule ----------------------


class _Legacy(torch.autograd.Function):
    """Non-static forward (the style before PyTorch 1.3), called through ``apply``."""

    def forward(ctx, x, w):  # noqa: N805 - the legacy signature
        ctx.save_for_backward(x, w)
        return x * w

    def backward(ctx, g):  # noqa: N805
        x, w = ctx.saved_tensors
        return g * w, g * x


class _NoVmapRule(torch.autograd.Function):
    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class _Gate(nn.Module):
    """A layer of the user's own (generic rule): ``op(x, gain)``."""

    def __init__(self, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.gain)


@pytest.mark.parametrize(
    "op,needles",
    [
        (_Legacy.apply, ("autograd.Function", "generate_vmap_rule")),
        (_NoVmapRule.apply, ("autograd.Function", "generate_vmap_rule")),
        (lambda x, w: F.dropout(x * w, 0.5), ("dropout", "outside this module")),
    ],
    ids=["legacy-function", "function-without-vmap", "dropout"],
)
def test_what_torch_func_cannot_transform_is_refused_before_a_release(op, needles):
    model = Net(_Gate(op)).to(DT)
    assert "refused in the first chunk" in check_module(model)[0].reason
    _refused_in_first_chunk(model, _x(B, 4), "module 'encoder.0'", *needles, "freeze")


# ---- 3. Opacus' recurrent layers --------------------------------------------------------------


@pytest.mark.parametrize("name,torch_name", [("DPLSTM", "LSTM"), ("DPGRU", "GRU")])
def test_opacus_recurrent_layers_are_refused_with_the_fix(name, torch_name):
    layers = pytest.importorskip("opacus.layers")
    dp_layer = getattr(layers, name)(3, 4, batch_first=True)

    class Rnn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = dp_layer
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    _refused_when_built(Rnn(), f"module 'rnn' ({name})", f"use torch.nn.{torch_name}")
    fixed = getattr(nn, torch_name)(3, 4, batch_first=True)  # the fix holds: same keys
    fixed.load_state_dict(dp_layer.state_dict())
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(fixed(x)[0], dp_layer(x)[0])


# ---- 4. modules run with autograd off inside forward ----------------------------------------


class _Branches(nn.Module):
    """``a`` with autograd on; ``b`` as ``kind`` says; the head ``c``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.kind == "no_grad":  # a gate from b, treated as a constant
            with torch.no_grad():
                gate = torch.sigmoid(self.b(h))
            h = h * gate
        elif self.kind == "both":  # b trained through one call, a constant in the other
            with torch.no_grad():
                gate = torch.sigmoid(self.b(h))
            h = torch.tanh(self.b(h)) * gate
        elif self.kind == "reentrant":
            h = checkpoint(self.b, h, use_reentrant=True)
        elif self.kind == "by-hand":  # reentrant checkpointing written without a Function
            with torch.no_grad():
                out = self.b(h)
            h = _RerunInBackward.apply(out, h, self.b)
        return self.c(h)


class _RerunInBackward(torch.autograd.Function):
    """Passes ``out`` on; its backward runs ``module`` again and calls ``backward`` itself."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module = module
        return out.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            torch.autograd.backward(ctx.module(x), g)
        return None, x.grad, None


@pytest.mark.parametrize("kind", ["no_grad", "both"])
def test_a_module_called_under_no_grad_is_exact(kind):
    torch.manual_seed(2)
    model = _Branches(kind).to(DT)
    _assert_exact(model, _x(B, 4))


@pytest.mark.parametrize("kind", ["reentrant", "by-hand"])
def test_reentrant_checkpointing_is_refused_before_a_release(kind):
    torch.manual_seed(3)
    model = _Branches(kind).to(DT)
    _refused_in_first_chunk(model, _x(B, 4), "'b' (Linear)", "use_reentrant=False")


def test_a_step_run_under_no_grad_is_refused():
    model = _Branches("no_grad").to(DT)
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(B))
    with torch.no_grad(), pytest.raises(ValueError, match="carry no gradient.*'a' \\(Linear\\)"):
        pg.accumulate(_x(B, 4), _x(B, 1), _loss)
    assert all(p.grad is None for p in model.parameters())

"""dpfy.training.validate: collect every problem, explain it, fix a copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.training.validate import (
    Finding,
    Severity,
    UnsupportedModuleError,
    check_module,
    fix_module,
    module_checks_for,
    register_module_check,
    validate_module,
)


def _bad_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 12, 3),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.Sequential(
            nn.Conv2d(12, 8, 3),
            nn.BatchNorm2d(8),
            nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
        ),
        nn.Flatten(),
        nn.Linear(8 * 24 * 24, 10),
        nn.BatchNorm1d(10, affine=False),
    )


def test_collects_every_problem():
    issues = check_module(_bad_model())
    errors = [(i.path, i.module_type) for i in issues if i.severity is Severity.ERROR]
    assert errors == [
        ("1", "BatchNorm2d"),
        ("3.1", "BatchNorm2d"),
        ("3.2", "InstanceNorm2d"),
        ("6", "BatchNorm1d"),
    ]
    # a refused layer gets no "generic rule" note beside its error: the verdict is the error
    notes = [(i.path, i.module_type) for i in issues if i.severity is Severity.NOTE]
    assert ("3.2", "InstanceNorm2d") not in notes


def test_error_message_explains_and_offers_fix():
    with pytest.raises(UnsupportedModuleError) as info:
        validate_module(_bad_model())
    message = str(info.value)
    assert "4 layer problem(s)" in message
    assert "mean and variance of the whole batch" in message
    assert "GroupNorm" in message and "fix_module" in message
    assert len([i for i in info.value.issues if i.severity is Severity.ERROR]) == 4


def test_fixer_returns_fixed_copy_and_keeps_original():
    model = _bad_model()
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    before = [type(m).__name__ for m in model.modules()]
    fixed = fix_module(model)
    assert [type(m).__name__ for m in model.modules()] == before
    assert model[3][2].track_running_stats
    assert validate_module(fixed) == [i for i in check_module(fixed)]
    assert all(i.severity is Severity.NOTE for i in check_module(fixed))
    gn = fixed[1]
    assert isinstance(gn, nn.GroupNorm) and gn.num_channels == 12 and gn.num_groups == 12
    assert torch.equal(gn.weight, torch.full((12,), 2.0))
    assert gn.weight.data_ptr() != model[1].weight.data_ptr()
    assert isinstance(fixed[6], nn.GroupNorm) and not fixed[6].affine
    out = fixed(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10)
    # per-example: one example's output does not depend on another one's input
    x = torch.randn(2, 1, 28, 28)
    y = x.clone()
    y[1] += 5.0
    fixed.train()
    assert torch.allclose(fixed(x)[0], fixed(y)[0], atol=1e-5)


def test_group_count_divides_channels():
    fixed = fix_module(nn.Sequential(nn.BatchNorm2d(48), nn.BatchNorm1d(7)), max_groups=32)
    assert fixed[0].num_groups == 24 and fixed[1].num_groups == 7
    assert isinstance(fix_module(nn.BatchNorm2d(4)), nn.GroupNorm)


def test_embedding_and_model_level_problems():
    model = nn.Sequential(
        nn.Embedding(10, 4, max_norm=1.0),
        nn.EmbeddingBag(10, 4, sparse=True),
        nn.Embedding(10, 4, scale_grad_by_freq=True),
    )
    reasons = [i.reason for i in check_module(model) if i.severity is Severity.ERROR]
    assert len(reasons) == 3
    assert any("renormalises" in r for r in reasons) and any("sparse" in r for r in reasons)
    assert any("how often" in r for r in reasons)
    assert check_module(fix_module(model)) == [
        i for i in check_module(fix_module(model)) if i.severity is Severity.NOTE
    ]
    frozen = nn.Linear(3, 2).requires_grad_(False)
    assert "no trainable parameters" in check_module(frozen)[0].reason
    lazy = nn.LazyLinear(3)
    assert any("not initialised" in i.reason for i in check_module(lazy))


def test_clean_model_passes_and_fallback_layers_are_notes():
    clean = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4, 2))
    assert check_module(clean) == []
    generic = nn.Sequential(nn.Bilinear(3, 3, 4))
    notes = validate_module(generic)
    assert [(i.path, i.severity) for i in notes] == [("0", Severity.NOTE)]
    assert "generic rule" in notes[0].reason


def test_tied_parameters_and_reused_modules_are_fine():
    # tied parameters are clipped exactly (the owners' contributions are summed per example)
    shared = nn.Linear(4, 4)
    assert check_module(nn.Sequential(shared, nn.Tanh(), shared)) == []
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    assert check_module(nn.Sequential(a, b)) == []


class _Leaky(nn.Module):
    """A user layer that keeps a running mean of its inputs (not private)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        self.seen.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.lin(x)


def _leaky_check(module):
    return [Finding("it averages its inputs into a buffer released with the model.",
                    "drop the buffer.")]


@pytest.fixture
def scratch_checks(monkeypatch):
    """A copy of the module-check registry that the test may change (restored afterwards)."""
    from dpfy.training import validate

    monkeypatch.setattr(validate, "_CHECKS", dict(validate._CHECKS))


def test_user_registered_check_runs_for_the_type_and_its_subclasses(scratch_checks):
    register_module_check(_Leaky)(_leaky_check)

    class SubLeaky(_Leaky):
        pass

    model = nn.Sequential(_Leaky(), nn.Tanh(), SubLeaky(), nn.BatchNorm1d(3))
    errors = [(i.path, i.module_type, i.severity) for i in check_module(model)
              if i.severity is Severity.ERROR]
    assert errors == [("0", "_Leaky", Severity.ERROR), ("2", "SubLeaky", Severity.ERROR),
                      ("3", "BatchNorm1d", Severity.ERROR)]
    with pytest.raises(UnsupportedModuleError, match="averages its inputs"):
        validate_module(model)
    assert module_checks_for(SubLeaky()) == (_leaky_check,)


def test_duplicate_module_check_is_refused_unless_replaced(scratch_checks):
    with pytest.raises(ValueError, match="already registered for _BatchNorm.*replace=True"):
        register_module_check(nn.modules.batchnorm._BatchNorm)(_leaky_check)
    with pytest.raises(ValueError, match="Embedding"):  # all or nothing
        register_module_check(_Leaky, nn.Embedding)(_leaky_check)
    assert module_checks_for(_Leaky()) == ()
    register_module_check(_Leaky)(_leaky_check)
    with pytest.raises(ValueError, match="_Leaky"):
        register_module_check(_Leaky)(_leaky_check)

    def quiet(module):
        return ()

    register_module_check(_Leaky, replace=True)(quiet)
    assert module_checks_for(_Leaky()) == (quiet,)
    assert check_module(nn.Sequential(_Leaky())) == []

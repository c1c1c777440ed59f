"""The attribution check: one example's gradient computed alone against what the rules gave it.

The coverage check proves the recorded per-example gradients *sum* right; rows given to the
wrong example still sum right. These tests plant such faults in a norm rule and check that the
step is refused before anything is released, that correct models (dropout, user-level groups
with padding rows, seeded runs) are never refused, and that the check changes no result.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from torch import nn

import dpfy
from dpfy.queries import GaussianSumQuery
from dpfy.randomness import Randomness
from dpfy.training import PrivateGradient
from dpfy.training.norms import attribution, wide
from dpfy.training.norms.attribution import AttributionCheckWarning, AttributionError
from dpfy.training.norms.linear import LinearForm

LOSS = nn.CrossEntropyLoss(reduction="none")
B = 6


def _mlp(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Dropout(dropout), nn.Linear(5, 3))


def _data(n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _pg(model: nn.Module, every: int = 1) -> PrivateGradient:
    pg = PrivateGradient(model, GaussianSumQuery(0.5, 1.0), expected_batch_size=float(B))
    pg.attribution.every, pg.attribution.budget = every, None  # every chunk, no time budget
    return pg


def _exchange_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that gives example i the norm of example i + 1: the sum is unchanged."""
    norms = LinearForm.squared_norms

    def rolled(self: LinearForm) -> dict[str, torch.Tensor]:
        return {k: v.roll(1) for k, v in norms(self).items()}

    monkeypatch.setattr(LinearForm, "squared_norms", rolled)


def test_rows_given_to_the_wrong_example_are_refused_before_any_release(monkeypatch):
    _exchange_rows(monkeypatch)
    model = _mlp()
    pg = _pg(model)
    x, y = _data()
    with pytest.raises(AttributionError, match=r"'0.weight' of module '0' \(Linear\)") as err:
        pg.accumulate(x, y, LOSS)
    assert str(B) not in str(err.value)  # no fact of the private batch in the message
    assert all(p.grad is None for p in model.parameters())


def test_without_the_check_the_same_fault_goes_through(monkeypatch):
    # the coverage check compares sums only: exchanged rows pass it
    _exchange_rows(monkeypatch)
    pg = _pg(_mlp(), every=0)
    pg.accumulate(*_data(), LOSS)


def test_the_check_is_refused_through_make_private_too(monkeypatch):
    _exchange_rows(monkeypatch)
    x, y = _data(24)
    model = _mlp()
    model, optimizer, criterion, loader = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.TensorDataset(x, y), target_epsilon=4.0, delta=1e-5, epochs=1,
        clip_norm=0.5, expected_batch_size=6, loss_fn=LOSS, randomness=Randomness(0),
        options=dpfy.training.PrivateOptions(attribution_check=1),
    )
    batches = iter(loader)
    xb, yb = next(batches)
    with pytest.raises(AttributionError):
        criterion(model(xb), yb).backward()
    batches.close()


def test_dropout_stands_the_check_down_instead_of_refusing():
    model = _mlp(dropout=0.5)
    pg = _pg(model)
    pg.accumulate(*_data(), LOSS)
    assert pg.attribution.stochastic is True
    pg.accumulate(*_data(), LOSS)  # no further alone passes


def test_user_level_groups_with_padding_rows_are_not_refused():
    for mode, unit in (("sum", "example"), ("average", "microbatch_average")):
        pg = PrivateGradient(
            _mlp(), GaussianSumQuery(0.5, 1.0, clipped_unit=unit), expected_batch_size=3.0,
            microbatch_size=2, microbatch_mode=mode,
        )
        pg.attribution.every, pg.attribution.budget = 1, None
        x, y = _data()
        for _ in range(8):  # a random unit each time
            pg.accumulate(x, y, LOSS, weights=torch.tensor([1.0, 0, 1, 1, 1, 0]))


def test_the_check_changes_neither_the_result_nor_the_random_streams():
    x, y = _data()
    sums, draws = [], []
    for every in (1, 0):
        torch.manual_seed(0)
        model = _mlp(dropout=0.2)
        pg = _pg(model, every=every)
        torch.manual_seed(1)
        pg.accumulate(x, y, LOSS)
        draws.append(torch.rand(3))
        sums.append(pg.clipped_sum())
    assert all(torch.equal(sums[0][k], sums[1][k]) for k in sums[0])
    assert torch.equal(draws[0], draws[1])


def test_a_loss_that_needs_the_whole_batch_turns_the_check_off_with_a_warning():
    scale = torch.arange(1.0, B + 1)

    def scaled(outputs, targets):  # closes over one scale per row of the chunk
        return LOSS(outputs, targets) * scale

    pg = _pg(_mlp())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pg.accumulate(*_data(), scaled)
    assert any(issubclass(w.category, AttributionCheckWarning) for w in seen)
    assert str(B) not in str(seen[-1].message)
    assert pg.attribution.every == 0


def test_attribution_check_must_be_a_non_negative_integer():
    x, y = _data(24)
    model = _mlp()
    with pytest.raises(ValueError, match="attribution_check"):
        dpfy.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.TensorDataset(x, y), target_epsilon=4.0, delta=1e-5, epochs=1,
            clip_norm=0.5, expected_batch_size=6, loss_fn=LOSS,
            options=dpfy.training.PrivateOptions(attribution_check=-1),
        )


def test_a_zero_gradient_does_not_settle_that_the_model_is_deterministic():
    # A loss at its minimum gives every parameter a zero gradient: two seeds agree there even
    # with dropout on. The verdict waits for a real gradient; the model is then learnt to be
    # stochastic and is not refused.
    model = _mlp(dropout=0.5)
    nn.init.zeros_(model[3].weight)
    nn.init.zeros_(model[3].bias)

    def square(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs - targets.unsqueeze(1).float()).pow(2).sum(1)

    pg = _pg(model)
    x, y = _data()
    pg.accumulate(x, torch.zeros_like(y), square)  # outputs 0 = targets: zero gradient
    assert pg.attribution.stochastic is None
    for _ in range(4):
        pg.accumulate(x, y, square)
    assert pg.attribution.stochastic is True


def test_dropout_switched_on_later_in_the_run_is_learnt_again():
    model = _mlp(dropout=0.5)
    model[2].eval()  # dropout off, as in a pretrained encoder loaded in eval mode
    pg = _pg(model)
    x, y = _data()
    pg.accumulate(x, y, LOSS)
    assert pg.attribution.stochastic is False
    model.train()  # every submodule in train mode: dropout on
    for _ in range(4):
        pg.accumulate(x, y, LOSS)
    assert pg.attribution.stochastic is True
    model[2].eval()
    assert pg.attribution.stochastic is False  # the first verdict, for the first modes


class _Centred(nn.Module):
    """Centres a hidden layer over the batch: each example's output depends on the others."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(torch.tanh(h - h.mean(0, keepdim=True)))


def test_a_batch_mixing_operation_is_refused_by_default_on_the_first_chunk():
    model = _Centred()
    pg = PrivateGradient(model, GaussianSumQuery(0.5, 1.0), expected_batch_size=float(B))
    with pytest.raises(AttributionError, match="mixes the examples"):
        pg.accumulate(*_data(), LOSS)
    assert all(p.grad is None for p in model.parameters())


def test_the_default_budget_checks_the_first_chunk_and_then_within_its_share():
    x, y = _data()
    pg = PrivateGradient(_mlp(), GaussianSumQuery(0.5, 1.0), expected_batch_size=float(B))
    assert pg.attribution.every == 1 and pg.attribution.budget == 0.05
    pg.attribution.budget = 1e-12  # a share no check fits in: the first chunk only
    for _ in range(5):
        pg.accumulate(x, y, LOSS)
    assert pg.attribution.runs == 1
    pg.attribution.budget = None  # every chunk, whatever it costs
    for _ in range(3):
        pg.accumulate(x, y, LOSS)
    assert pg.attribution.runs == 4


def test_attribution_budget_must_be_a_share_in_zero_one():
    x, y = _data(24)
    model = _mlp()
    with pytest.raises(ValueError, match="attribution_budget"):
        dpfy.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.TensorDataset(x, y), target_epsilon=4.0, delta=1e-5, epochs=1,
            clip_norm=0.5, expected_batch_size=6, loss_fn=LOSS,
            options=dpfy.training.PrivateOptions(attribution_budget=0.0),
        )


def _perturb_unit(monkeypatch: pytest.MonkeyPatch, unit: int, factor: float) -> None:
    """A rule that reports unit ``unit``'s norms times ``factor`` (rounding of the size seen on a
    saturated softmax when ``factor`` is 1 + 3e-3), and the check picks that unit."""
    norms = LinearForm.squared_norms

    def scaled(self: LinearForm) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in norms(self).items()}
        for v in out.values():
            v[unit] = v[unit] * factor**2
        return out

    monkeypatch.setattr(LinearForm, "squared_norms", scaled)
    monkeypatch.setattr(attribution._PICK, "choice", lambda units: unit)


def _saturated_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A linear classifier and a batch whose last example is learnt so well that its gradient
    is about 1e-20 of its neighbours' (a softmax saturated at a margin of ~50)."""
    model = nn.Sequential(nn.Linear(4, 3))
    x, y = _data()
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[0].weight[:, 0] = torch.tensor([25.0, -25.0, 0.0])
    x[:, 0] = 0.0  # every other example: logits 0, an ordinary gradient
    x[-1] = torch.tensor([2.0, 0.0, 0.0, 0.0])  # logits (50, -50, 0): class 0, certain
    y[-1] = 0
    return model, x, y


def test_rounding_on_a_saturated_example_far_below_its_neighbours_is_not_refused(monkeypatch):
    # norms of 1e-20 beside 1e-1 differ by rounding in their third digit between the batch
    # and the alone pass (seen on ScatterNet-linear MNIST); the sum cannot see them
    model, x, y = _saturated_data()
    _perturb_unit(monkeypatch, B - 1, 1 + 3e-3)
    pg = _pg(model)
    pg.accumulate(x, y, LOSS)
    assert pg.attribution.runs == 1


def test_the_same_error_on_a_unit_at_the_chunks_scale_is_refused(monkeypatch):
    # the floor follows the chunk's median norm: a unit of ordinary size may not be off by it
    model, x, y = _saturated_data()
    _perturb_unit(monkeypatch, 0, 1 + 3e-3)
    with pytest.raises(AttributionError, match=r"'0.weight' of module '0' \(Linear\)"):
        _pg(model).accumulate(x, y, LOSS)
    assert all(p.grad is None for p in model.parameters())


def test_two_passes_equal_within_the_agreement_tolerance_do_not_differ():
    # what allclose(rtol=1e-6) accepted, the fingerprints accept: a deterministic model is
    # never called stochastic (norms within r * L2, sums within r * L1, by the triangle
    # inequality), even when a gradient's entries cancel in its sum
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.randn(300, generator=g, dtype=torch.float64)
        a = a - a.mean()  # a sum near 0: a relative test on the sum alone would fail
        b = a * (1 + 0.9e-6 * (2 * torch.rand(300, generator=g, dtype=torch.float64) - 1))
        assert torch.allclose(a, b, rtol=1e-6, atol=0.0)
        fa, fb = wide.fingerprint(a)[None], wide.fingerprint(b)[None]
        assert not attribution._differ(fa, fb)


def test_a_dropout_mask_drawn_anew_tells_the_passes_apart():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        a = torch.randn(50, generator=g)
        keep = torch.rand(50, generator=g) > 0.1
        keep2 = torch.rand(50, generator=g) > 0.1
        if torch.equal(keep, keep2):
            continue
        prints = [wide.fingerprint(a * k / 0.9) for k in (keep, keep2)]
        assert attribution._differ(prints[0][None], prints[1][None])


def test_the_alone_passes_hold_one_parameter_sized_set_at_a_time(monkeypatch):
    # each pass's gradients are reduced to 4 numbers per parameter and freed before the next
    # pass starts: at the second pass, no gradient of the first is alive
    model = _mlp()
    x, y = _data()
    alive: list[int] = []
    live_grads: list[weakref.ref[torch.Tensor]] = []
    grad = torch.autograd.grad
    params = set(map(id, model.parameters()))

    def counting(outputs, inputs, **kw):  # type: ignore[no-untyped-def]
        out = grad(outputs, inputs, **kw)
        if {id(t) for t in inputs} == params:  # an alone pass: all the parameters
            alive.append(len([t for t in live_grads if t() is not None]))
            live_grads.extend(weakref.ref(t) for t in out if t is not None)
        return out

    monkeypatch.setattr(torch.autograd, "grad", counting)
    pg = _pg(model)
    pg.accumulate(x, y, LOSS)
    assert pg.attribution.stochastic is False and alive == [0, 0]

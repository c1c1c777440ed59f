"""dpfy.opacus.PrivacyEngine: each example's gradient as Opacus defines it, dpfy's ledger and
randomness underneath, and a refusal (with the reason) for every Opacus option that would break
the guarantee."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from dpfy import accounting
from dpfy import events as ev
from dpfy.ledger import Ledger
from dpfy.opacus import PrivacyEngine
from dpfy.opacus.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention
from dpfy.opacus.utils.batch_memory_manager import BatchMemoryManager
from dpfy.opacus.validators import ModuleValidator
from dpfy.training import BudgetExceededError, UnsupportedModuleError

N, BATCH, C = 20, 5, 0.7


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ()


class LossInside(nn.Module):
    """A model that computes its own mean loss from ``labels``, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x, labels=None):
        logits = self.body(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return loss, logits


def _train(*, model=None, reduction="mean", physical=None, mode="hooks", seen=None, z=0.0,
           epochs=2):
    """A seeded Opacus-style run; returns the model and the engine."""
    model = _model() if model is None else model
    engine = PrivacyEngine(seed=0, run_dir=None)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(_data(), batch_size=BATCH),
        noise_multiplier=z, max_grad_norm=C, loss_reduction=reduction, grad_sample_mode=mode,
        criterion=nn.CrossEntropyLoss(reduction=reduction),
    )
    assert out[0] is model  # not wrapped
    model, opt, loader = out[0], out[1], out[-1]
    ce = nn.CrossEntropyLoss(reduction=reduction)
    for _ in range(epochs):
        cut = contextlib.nullcontext(loader) if physical is None else BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical, optimizer=opt
        )
        with cut as batches:
            _epoch(model, opt, batches, out, mode, ce, seen)
    return model, engine


def _epoch(model, opt, batches, out, mode, ce, seen) -> None:
    """The loop of an Opacus script, as the user wrote it."""
    for x, y in batches:
        if seen is not None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            seen.append((x.clone(), y.clone(), state))
        opt.zero_grad()
        if isinstance(model, LossInside):
            loss = model(x, labels=y)[0]
        elif mode == "ghost":
            loss = out[2](model(x), y)
        elif ce.reduction == "mean":
            loss = nn.functional.cross_entropy(model(x), y)  # a functional loss in the loop
        else:
            loss = ce(model(x), y)
        loss.backward()
        opt.step()


def _clipped_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """sum_i clip_C(grad of example i's loss) / expected batch size, one example at a time."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = [p.grad for p in model.parameters()]
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        for t, g in zip(total, grads, strict=True):
            t += g * min(1.0, C / float(norm))
    expected = N / math.ceil(N / BATCH)  # Opacus' rate 1 / len(data_loader), times N
    return [t / expected for t in total]


def test_hooks_mode_gives_each_example_its_own_clipped_gradient():
    seen = []
    model, _ = _train(seen=seen)
    assert len(seen) == 2 * math.ceil(N / BATCH)
    states = [s for _, _, s in seen] + [model.state_dict()]
    reference = _model()
    for (x, y, before), after in zip(seen, states[1:], strict=True):
        reference.load_state_dict(before)
        step = _clipped_mean(reference, x, y)
        for p, (name, b) in zip(step, before.items(), strict=True):
            assert torch.allclose(b - after[name], p, atol=1e-6), name


@pytest.mark.parametrize(
    "variant",
    [
        dict(physical=2),  # padded physical batches: weight-0 rows count for nothing
        dict(reduction="sum"),  # a summed loss: no division by the batch size
        dict(mode="ghost"),  # dpfy's own per-example losses from the criterion
        dict(model="loss inside"),  # the model's own scalar loss (transformers style)
        dict(model="loss inside", physical=3),
    ],
)
def test_every_way_of_writing_the_loop_gives_the_same_update(variant):
    if variant.get("model") == "loss inside":
        variant = {**variant, "model": LossInside()}
    expected, _ = _train()
    got, _ = _train(**variant)
    for (name, a), b in zip(expected.state_dict().items(), got.state_dict().values(),
                            strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_the_ledger_is_the_accountant_and_the_randomness_is_secure_by_default():
    engine = PrivacyEngine(accountant="rdp")  # Opacus' default secure_mode=False
    model = _model()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=1.0,
        max_grad_norm=C,
    )
    assert engine.get_epsilon(1e-5) == 0.0 and len(engine.accountant) == 0
    x, y = next(iter(loader))  # a look at a batch writes nothing
    assert len(engine.ledger.samples) == 0
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    path = engine.run_dir / "ledger.jsonl"
    assert str(engine.run_dir).startswith("runs/opacus-")
    ledger = Ledger.load(path)
    assert ledger.metadata["secure_randomness"] is True
    assert len(engine.accountant) == len(loader) == 4
    eps = engine.get_epsilon(1e-5)
    assert eps == engine.accountant.get_epsilon(delta=1e-5)
    assert eps == accounting.epsilon(ledger, 1e-5, "rdp").epsilon
    with pytest.raises(NotImplementedError, match="never stepped by hand"):
        engine.accountant.step(noise_multiplier=1.0, sample_rate=0.25)
    report = engine.write_report(1e-5) / "report.md"
    assert "Ledger integrity: intact and signed" in report.read_text(encoding="utf-8")


def test_a_seed_makes_a_reproducible_experiment_recorded_as_one(tmp_path):
    a, engine = _train(z=1.0)
    b, _ = _train(z=1.0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert engine.ledger.metadata["secure_randomness"] is False
    seeded = PrivacyEngine(seed=0, run_dir=tmp_path / "seeded")
    model = _model()
    model, opt, loader = seeded.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=1.0,
        max_grad_norm=C,
    )
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    report = (seeded.write_report(1e-5) / "report.md").read_text(encoding="utf-8")
    assert "not a DP release" in report
    with pytest.raises(ValueError, match="seed must be None with secure_mode=True"):
        PrivacyEngine(secure_mode=True, seed=0)
    assert PrivacyEngine(secure_mode=True).seed is None  # secure without torchcsprng
    with pytest.raises(NotImplementedError, match="privacy state is its ledger"):
        seeded.save_checkpoint(path="ckpt.pt", module=model)


def test_an_epoch_past_the_calibrated_plan_is_refused():
    engine = PrivacyEngine()
    model = _model()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=BATCH), target_epsilon=5.0,
        target_delta=1e-5, epochs=1, max_grad_norm=C,
    )
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.get_epsilon(1e-5) <= 5.0
    with pytest.raises(BudgetExceededError, match="planned for epochs=1"):
        next(iter(loader))


def test_shuffled_batches_are_accounted_as_shuffled_not_as_poisson():
    engine = PrivacyEngine(run_dir=None)
    model = _model()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=BATCH, shuffle=True), noise_multiplier=1.0,
        max_grad_norm=C, poisson_sampling=False,
    )
    seen = set()
    for x, y in loader:
        assert len(x) == BATCH
        seen.update(map(tuple, x.tolist()))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(seen) == N  # every example once per epoch
    assert engine.accountant.mechanism() == "shuffle"
    # no amplification is known for shuffling: one epoch is one Gaussian release per example
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(accounting.epsilon(ev.Gaussian(1.0), 1e-5).epsilon, rel=1e-3)
    poisson = ev.SelfComposed(ev.PoissonSampled(BATCH / N, ev.Gaussian(1.0)), N // BATCH)
    assert eps > accounting.epsilon(poisson, 1e-5).epsilon  # what Opacus would have printed


def test_gdp_is_accounted_with_the_pld_bound_and_says_so():
    with pytest.warns(UserWarning, match="not an upper bound"):
        engine = PrivacyEngine(accountant="gdp")
    assert engine.accountant.mechanism() == "pld" and engine.accountant.requested == "gdp"
    with pytest.raises(ValueError, match="accountant must be one of"):
        PrivacyEngine(accountant="moments")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(clipping="per_layer"), ValueError, "clipping must be 'flat'"),
        (dict(clipping="adaptive"), ValueError, "clipping must be 'flat'"),
        (dict(max_grad_norm=[1.0, 1.0]), ValueError, "one float"),
        (dict(noise_generator=torch.Generator()), ValueError, "PrivacyEngine\\(seed=...\\)"),
        (dict(batch_first=False), ValueError, "batch_first must be True"),
        (dict(grad_sample_mode="ghost_fsdp"), ValueError, "ghost_fsdp"),
        (dict(grad_sample_mode="jit"), ValueError, "grad_sample_mode must be one of"),
        (dict(loss_reduction="none"), ValueError, "loss_reduction must be one of"),
        (dict(augmentation_multiplicity=2), TypeError, "unexpected keyword"),
        (dict(data_loader=_data()), TypeError, "must be a torch DataLoader"),
        (dict(data_loader=DataLoader(_Stream(), batch_size=BATCH)), TypeError, "IterableDataset"),
        (dict(poisson_sampling=False, data_loader=DataLoader(
            _data(), batch_size=BATCH, sampler=WeightedRandomSampler([1.0] * N, N))),
         ValueError, "cannot state"),
        (dict(module=nn.Sequential(nn.Linear(6, 3), nn.BatchNorm1d(3))), UnsupportedModuleError,
         "BatchNorm"),
    ],
)
def test_options_that_would_break_the_guarantee_are_refused_before_anything_is_written(
    change, error, match, tmp_path
):
    module = change.pop("module", _model())
    args = dict(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=1.0,
                max_grad_norm=C)
    args.update(change)
    engine = PrivacyEngine(run_dir=tmp_path / "run")
    with pytest.raises(error, match=match):
        engine.make_private(**args)
    assert not (tmp_path / "run").exists()


def test_a_run_dir_holding_a_ledger_is_refused(tmp_path):
    Ledger(tmp_path / "ledger.jsonl").close()
    model = _model()
    with pytest.raises(FileExistsError, match="a ledger belongs to one run"):
        PrivacyEngine(run_dir=tmp_path).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=BATCH), noise_multiplier=1.0,
            max_grad_norm=C,
        )


def test_the_validator_and_the_layers_are_dpfys():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3),
                          nn.BatchNorm2d(8))
    errors = ModuleValidator.validate(model, strict=False)
    assert len(errors) == 2 and all(isinstance(e, UnsupportedModuleError) for e in errors)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        ModuleValidator.validate(model, strict=True)
    fixed = ModuleValidator.fix(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
    assert isinstance(fixed[1], nn.GroupNorm) and ModuleValidator.is_valid(fixed)
    assert (DPLSTM, DPGRU, DPRNN, DPMultiheadAttention) == (
        nn.LSTM, nn.GRU, nn.RNN, nn.MultiheadAttention)


def test_the_import_paths_of_opacus_tutorials_work():
    import dpfy.opacus.utils.batch_memory_manager as by_path
    from dpfy.opacus.utils import batch_memory_manager
    from dpfy.opacus.validators.module_validator import ModuleValidator as by_module

    assert by_path is batch_memory_manager and by_path.BatchMemoryManager is BatchMemoryManager
    assert by_module is ModuleValidator

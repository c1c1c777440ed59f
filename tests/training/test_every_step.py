"""Every step of a Poisson run, through the entry points users call: each model shape that once
broke the sensitivity bound (or trained silently wrong) is exact against the naive per-example
loop on every release, or refused before the first release, naming the module.

Poisson batches vary in size, so a size that coincides with the batch size (a sequence as long
as the batch, a codebook with as many rows) shows up on some steps and not on others. The low
level (``PrivateGradient``) is covered in ``test_layout.py``, ``test_refusals.py`` and
``test_attribution.py``; here the same classes go through ``dpfy.make_private`` and
``dpfy.opacus`` with a ledger, noise 0 (so a release is its clipped sum, read back from
``.grad``) and float64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

import dpfy
from dpfy.ledger import Ledger
from dpfy.opacus import PrivacyEngine
from dpfy.randomness import Randomness
from dpfy.training import PrivateOptions
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from tests.training.test_layout import BatchFirst, Quantise
from tests.training.test_layout import TimeMajorLinear as TimeMajor

CLIP, N, E, T = 0.5, 24, 6, 6  # clip norm, examples, expected batch, sequence length
LOSS = nn.CrossEntropyLoss(reduction="none")
# Poisson batch sizes of the seeded sampler (q = E / N, Randomness(0)): 3, 6, 5, 11, so the
# second step's batch is as long as the sequence and as the codebook, the first is not.


class Codebook(nn.Module):
    """A user layer (generic rule) handed a shared tensor with E rows."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("book", torch.randn(E, 3))
        self.q, self.head = Quantise(), nn.Linear(E, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, 3]
        return self.head(torch.tanh(self.q(x.mean(1), self.book)))


class PerExampleLoop(BatchFirst):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [self.inp(x[i : i + 1]) for i in range(x.shape[0])]
        return self.head(torch.tanh(torch.cat(rows)).mean(1))


class Centred(BatchFirst):
    """A parameter-free op that mixes the examples: centring over the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).mean(1)
        return self.head(torch.tanh(h - h.mean(0, keepdim=True)))


class UnderNoGrad(BatchFirst):
    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(3, 4)  # trainable, called under no_grad: contributes nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = self.side(x).mean(1)
        return self.head(torch.tanh(self.inp(x)).mean(1) + s)


def _weight_normed() -> nn.Module:
    model = BatchFirst()
    parametrizations.weight_norm(model.inp)
    return model


EXACT: dict[str, Callable[[], nn.Module]] = {
    "batch-first, T == B on step 2": BatchFirst,
    "codebook with E rows": Codebook,
    "weight_norm parametrization": _weight_normed,
    "trainable module under no_grad": UnderNoGrad,
}
REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "time-major view": (TimeMajor, r"'inp' \(Linear\)"),
    "per-example loop in forward": (PerExampleLoop, r"'inp' \(Linear\)"),
    "centring over the batch": (Centred, r"'inp'|mix|batch"),
}


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, T, 3, generator=g), torch.randint(0, 2, (N,), generator=g))


def _native(build: Callable[[], nn.Module], run_dir) -> tuple:
    torch.manual_seed(0)
    model = build()
    model, opt, criterion, loader = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.0), _data(), target_epsilon=None,
        delta=1e-5, clip_norm=CLIP, expected_batch_size=E, loss_fn=LOSS, epochs=1,
        randomness=Randomness(0),
        options=PrivateOptions(noise_multiplier=0.0, ledger=Ledger(run_dir / "ledger.jsonl")),
    )
    return model, opt, lambda out, y: criterion(out, y), loader, run_dir / "ledger.jsonl"


def _opacus(build: Callable[[], nn.Module], run_dir) -> tuple:
    torch.manual_seed(0)
    model = build()
    engine = PrivacyEngine(accountant="rdp", run_dir=run_dir, seed=0)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(_data(), batch_size=E), noise_multiplier=0.0,
        max_grad_norm=CLIP,
    )
    return model, opt, lambda out, y: LOSS(out, y).mean(), loader, run_dir / "ledger.jsonl"


def _run(entry, build, run_dir) -> tuple[list[int], list[float]]:
    """One epoch; per release, the batch size and the largest relative error of E * .grad
    against the naive clipped sum over the batch's rows."""
    model, opt, loss, loader, _ = entry(build, run_dir)
    sizes: list[int] = []
    errors: list[float] = []
    for x, y in loader:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        want = clipped_sum_reference(per_example_gradients(model, x, y, LOSS), CLIP)
        sizes.append(int(x.shape[0]))
        errors.append(max(
            float((p.grad * E - want[n]).norm() / (want[n].norm() + 1e-30))
            for n, p in model.named_parameters() if n in want
        ))
    return sizes, errors


ENTRIES = {"make_private": _native, "dpfy.opacus": _opacus}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", EXACT)
def test_exact_on_every_release_of_a_poisson_run(entry, case, tmp_path):
    sizes, errors = _run(ENTRIES[entry], EXACT[case], tmp_path)
    assert T in sizes[1:] and sizes[0] != T  # the coincidence comes after the first step
    assert max(errors) < 1e-6, (sizes, errors)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", REFUSED)
def test_refused_before_the_first_release(entry, case, tmp_path):
    build, names = REFUSED[case]
    model, opt, loss, loader, ledger = ENTRIES[entry](build, tmp_path)
    with pytest.raises(ValueError, match=names):
        for x, y in loader:
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
    assert not Ledger.load(ledger).noise_multipliers()  # nothing released

"""Opacus 1.6's public names under dpfy.opacus: each imports from its Opacus path or is refused
with one line (dpfy.opacus._surface); docs/opacus_names.md is generated from the installed
Opacus; the stand-alone accountants agree with Opacus' to its tolerance."""

from __future__ import annotations

import importlib
import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dpfy.opacus import PrivacyEngine
from dpfy.opacus._surface import SURFACE, ours, resolve

ROOT = Path(__file__).resolve().parents[2]
HAVE_OPACUS = importlib.util.find_spec("opacus") is not None


def _generator():
    spec = importlib.util.spec_from_file_location(
        "opacus_names", ROOT / "benchmarks" / "opacus_names.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_name_of_the_table_imports_or_is_refused_in_one_line():
    for module, names in SURFACE.items():
        target = importlib.import_module(ours(module))  # stub modules import too
        for name, status in names.items():
            if status.startswith("="):
                assert getattr(target, name) is resolve(status), f"{module}.{name}"
                continue
            with pytest.raises(ImportError) as caught:
                exec(f"from {ours(module)} import {name}", {})  # noqa: S102
            text = str(caught.value)
            assert text == f"{module}.{name} is not part of dpfy.opacus: {status}"
            assert "\n" not in text
    with pytest.raises(ImportError, match="cannot import name 'Nope'"):  # not an Opacus name
        exec("from dpfy.opacus.accountants import Nope", {})  # noqa: S102


def test_the_docs_table_is_the_installed_opacus_surface():
    if not HAVE_OPACUS:
        pytest.skip("opacus is not installed (the bench extra): no surface to compare")
    generator = _generator()
    page = (ROOT / "docs" / "opacus_names.md").read_text(encoding="utf-8")
    assert generator.table() == page, "run: python benchmarks/opacus_names.py"
    assert "| missing |" not in page
    listed = {f"{m}.{n}" for m, n in generator.opacus_names()}
    assert {"opacus.accountants.RDPAccountant", "opacus.distributed."
            "DifferentiallyPrivateDistributedDataParallel", "opacus.data_loader.DPDataLoader",
            "opacus.accountants.utils.get_noise_multiplier"} <= listed


def test_the_stand_alone_accountants_agree_with_opacus():
    if not HAVE_OPACUS:
        pytest.skip("opacus is not installed (the bench extra)")
    from dpfy.opacus.accountants import PRVAccountant, RDPAccountant, create_accountant
    from dpfy.opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    from dpfy.opacus.accountants.utils import get_noise_multiplier
    from opacus.accountants import PRVAccountant as TheirPRV
    from opacus.accountants import RDPAccountant as TheirRDP
    from opacus.accountants.analysis import rdp as their_rdp
    from opacus.accountants.utils import get_noise_multiplier as their_z

    ours_rdp, theirs = RDPAccountant(), TheirRDP()
    for z, q, n in ((1.1, 0.01, 30), (0.9, 0.02, 10)):
        for _ in range(n):
            ours_rdp.step(noise_multiplier=z, sample_rate=q)
            theirs.step(noise_multiplier=z, sample_rate=q)
    assert ours_rdp.history == theirs.history and len(ours_rdp) == 40
    eps, order = ours_rdp.get_privacy_spent(delta=1e-5)  # Opacus' grid: Opacus' numbers
    assert (eps, order) == pytest.approx(theirs.get_privacy_spent(delta=1e-5), rel=1e-9)
    assert ours_rdp.get_epsilon(1e-5) <= eps  # dpfy's finer orders: equal or smaller
    curve = compute_rdp(q=0.01, noise_multiplier=1.1, steps=30, orders=[2, 8.5, 32])
    expected = their_rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=30, orders=[2, 8.5, 32])
    assert curve == pytest.approx(expected, rel=1e-9)
    assert get_privacy_spent(orders=[2, 8.5, 32], rdp=curve, delta=1e-5) == pytest.approx(
        their_rdp.get_privacy_spent(orders=[2, 8.5, 32], rdp=expected, delta=1e-5), rel=1e-9)
    prv, their_prv = PRVAccountant(), TheirPRV()
    prv.history = their_prv.history = [(1.1, 0.01, 30)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert abs(prv.get_epsilon(1e-5) - their_prv.get_epsilon(1e-5)) <= 0.011
        z_theirs = their_z(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, epochs=1)
    z = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, epochs=1)
    check = create_accountant("rdp")
    check.history = [(z, 0.01, 100)]
    assert check.get_epsilon(1e-5) <= 3.0 and z == pytest.approx(z_theirs, rel=0.02)


def test_the_engines_accountant_has_opacus_history_and_privacy_spent():
    from dpfy.opacus.accountants import RDPAccountant
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,)))
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="rdp", seed=0, run_dir=None)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.3, max_grad_norm=1.0,
    )
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.accountant.history == [(1.3, 0.25, 4)]
    alone = RDPAccountant()
    alone.history = engine.accountant.history
    eps, order = engine.accountant.get_privacy_spent(delta=1e-5)
    assert (eps, order) == alone.get_privacy_spent(delta=1e-5)
    assert engine.get_epsilon(1e-5) <= eps and math.isfinite(order)


def test_make_functional_ddp_and_from_data_loader():
    from dpfy.opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from dpfy.opacus.grad_sample.functorch import make_functional

    from dpfy.opacus.data_loader import DPDataLoader

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    fmodel, params = make_functional(model)
    assert torch.equal(fmodel(params, x), model(x))

    def loss(p, xi, yi):  # the per-example loop of Opacus' CIFAR-10 example, by torch.func
        return nn.functional.cross_entropy(fmodel(p, xi[None]), yi[None])

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[2:3]), y[2:3]).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(g[2], p.grad, atol=1e-6)
    with pytest.raises(NotImplementedError, match="runs in one process"):
        DPDDP(model)
    with pytest.raises(NotImplementedError, match="make_private"):
        DPDataLoader.from_data_loader(None)

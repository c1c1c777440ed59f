"""dpfy.opacus over a whole script: the ledger closes itself (the plan's end, ``write_report``,
interpreter exit, an exception) and resumes when the script goes on; ``BatchMemoryManager``
hands the loop real rows only; a script's next run (Opacus' ``--n-runs``) takes the loader
the first one returned; ``model._module`` saves the user's plain model."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy.ledger import Ledger
from dpfy.opacus import PrivacyEngine
from dpfy.opacus.privacy_engine import _sampler
from dpfy.opacus.utils.batch_memory_manager import BatchMemoryManager
from dpfy.report.statement import build_report
from dpfy.training import closing


def _data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _epochs(model, opt, loader, epochs: int) -> None:
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


def test_the_ledger_closes_at_the_plan_and_a_next_run_resumes_it(tmp_path):
    engine = PrivacyEngine(accountant="rdp", run_dir=tmp_path / "run")
    model = _model()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), target_epsilon=4.0, target_delta=1e-5,
        epochs=2, max_grad_norm=1.0,
    )
    path = engine.run_dir / "ledger.jsonl"
    _epochs(model, opt, loader, 1)
    assert not Ledger.load(path).verification.complete  # half the plan: still open
    _epochs(model, opt, loader, 1)
    closed = Ledger.load(path)  # the planned epochs are done: closed without being asked
    assert closed.verification.complete and closed.ended == "as planned: 8 of 8 planned releases"

    # the next run of the script (--n-runs): a fresh model, the loader the first run returned
    model2 = _model()
    model2, opt2, loader2 = engine.make_private(
        module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
    )
    _epochs(model2, opt2, loader2, 1)
    text = path.read_text(encoding="utf-8")
    assert text.count('"type":"resume"') == 1 and not Ledger.load(path).verification.complete
    report = (engine.write_report() / "report.md").read_text(encoding="utf-8")
    assert "Incomplete" not in report and "ended early" not in report
    again = Ledger.load(path)
    assert again.verification.complete and len(again.noise_multipliers()) == 8 + 4
    assert again.ended == "write_report: 4 releases (no planned end)"


def test_an_uncaught_exception_ends_the_ledger_early_at_exit_and_the_report_says_so(
    tmp_path, monkeypatch
):
    engine = PrivacyEngine(accountant="rdp", run_dir=tmp_path / "run")
    model = _model()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), target_epsilon=4.0, target_delta=1e-5,
        epochs=2, max_grad_norm=1.0,
    )
    with pytest.raises(RuntimeError, match="mid-run"):
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                if epoch == 1 and i == 1:
                    raise RuntimeError("the script fails mid-run")
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    # what the interpreter does next: it records the uncaught exception, then runs atexit
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script fails mid-run"),
                        raising=False)
    live = weakref.WeakSet([opt.private._engine.closer])  # this run's only
    monkeypatch.setattr(closing, "_LIVE", live)
    closing._close_at_exit()
    ledger = Ledger.load(engine.run_dir / "ledger.jsonl")
    assert ledger.verification.complete  # closed and signed
    assert ledger.ended == (
        "early (the interpreter exited after an uncaught RuntimeError): 5 of 8 planned releases"
    )
    statement = build_report(ledger, delta=1e-5).formal_statement
    assert "ended early" in statement and "not the planned run" in statement


def test_batch_memory_manager_hands_the_loop_the_sampled_rows_only():
    data = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.zeros(40, dtype=torch.long))
    torch.manual_seed(0)
    model = nn.Linear(1, 2)
    engine = PrivacyEngine(seed=0, run_dir=None)
    original = DataLoader(data, batch_size=10)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=original, noise_multiplier=1.0, max_grad_norm=1.0,
    )
    # the batches the run's sampler draws (the same seeded stream, drawn again)
    drawn = [b.tolist() for b in _sampler(original, True, engine._sampling_stream()).batches(0)]
    logical, seen, sizes = [], [], []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as cut:
        for x, y in cut:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            before = len(engine.accountant)
            opt.step()
            sizes.append(len(x))
            logical += x[:, 0].long().tolist()
            if len(engine.accountant) > before:  # the logical batch was released
                seen.append(logical)
                logical = []
    assert seen == [b if b else [0] for b in drawn]  # an empty draw: one weight-0 row
    assert max(sizes) == 3 and min(sizes) < 3  # the last physical batch is not padded to 3


def test_model_module_saves_the_users_plain_model(tmp_path):
    model = _model()
    before = list(model.state_dict())
    engine = PrivacyEngine(seed=0, run_dir=None)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=6), noise_multiplier=0.5, max_grad_norm=1.0,
    )
    _epochs(model, opt, loader, 1)
    assert model._module is model and list(model.state_dict()) == before  # not a submodule
    torch.save(model._module.state_dict(), tmp_path / "model.pt")  # Opacus scripts' last line
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))
    x = _data().tensors[0]
    assert torch.equal(plain(x), model(x))


def test_under_torchrun_one_line_from_rank_0_then_every_rank_leaves_its_group(
    monkeypatch, capsys
):
    import torch.distributed as dist
    from ports import free_port

    port = free_port()
    for rank in (1, 0):
        launch = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        for key, value in launch.items():
            monkeypatch.setenv(key, value)
        if rank == 0:  # a group to leave (of one process: the test is one process)
            dist.init_process_group("gloo", rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{port}")
        model = _model()
        with pytest.raises(SystemExit) as ended:
            PrivacyEngine(run_dir=None).make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(_data(), batch_size=6), noise_multiplier=1.0,
                max_grad_norm=1.0,
            )
        assert ended.value.code == 1 and not dist.is_initialized()
        printed = capsys.readouterr().err.splitlines()
        if rank == 0:
            assert len(printed) == 1
            assert printed[0].startswith("dpfy: RuntimeError: make_private in 2 processes: "
                                         "dpfy.opacus runs in one process")
        else:
            assert printed == []  # rank 1 says nothing: rank 0's line is the run's


@pytest.mark.parametrize("penalty", ["weights", "second_call"])
def test_a_loss_term_outside_the_models_outputs_is_refused_not_dropped(tmp_path, penalty):
    """A term that reaches the parameters without passing through model(batch)'s outputs has
    no per-example gradient; Opacus drops it silently, dpfy.opacus refuses the step."""
    engine = PrivacyEngine(accountant="rdp", run_dir=tmp_path / "run")
    model = _model()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    batches = iter(loader)  # kept alive: the batch is out while the loop holds it
    x, y = next(batches)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    if penalty == "weights":
        loss = loss + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
    else:  # the first layer called again on the batch, outside the model's forward
        loss = loss + model[0](x).pow(2).mean()
    loss.backward()
    with pytest.raises(ValueError, match=r"reached parameter\(s\) 0\.bias, 0\.weight"):
        opt.step()
    assert not Ledger.load(engine.run_dir / "ledger.jsonl").noise_multipliers()  # no release


def test_a_plain_loss_still_steps_after_the_refusal_check(tmp_path):
    engine = PrivacyEngine(accountant="rdp", run_dir=tmp_path / "run")
    model = _model()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=6), noise_multiplier=1.0, max_grad_norm=1.0,
    )
    _epochs(model, opt, loader, 1)
    assert len(Ledger.load(engine.run_dir / "ledger.jsonl").noise_multipliers()) == 4

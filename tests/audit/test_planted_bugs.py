"""Planted bugs: each test breaks one thing in the release path (monkeypatched here only), runs a
tiny real run with the broken code, and the audit's gray-box checks (dpfy.audit.run.check_run,
everything ``dpfy audit`` runs except the canary attack) must flag it. The unmodified run types
at the end must pass the same checks with no finding.

The seven bugs: noise at half the recorded std; the Linear bias left out of the per-example
norm; Poisson sampling at twice the recorded rate; division by the actual batch size; LayerNorm
or GroupNorm parameters left out of the per-example norm; the same noise used on two
consecutive steps; the ledger missing one of the run's eight steps.

Three more, each unseen by the checks above: no noise on tensors larger than 2^16 values
(above every probe and canary tensor; the noise check on the run's own model sees it); secure
generators keyed from a constant (two "secure" runs, identical weights: the key registry
refuses the second run, the audit names a run made beside another registry); a ledger file
whose lines state twice the noise while the records in memory and the noise drawn are right
(make_private and dpfy.opacus runs: the epsilon the writer recorded at close is above the
file's). Unmodified make_private, dpfy.opacus and seeded runs pass the same checks; the
`dpfy train` runs are in tests/test_cli.py (secure and seeded) and the HF DPTrainer run in
tests/test_hf_trainer.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dpfy.audit import run as run_mod
from dpfy.audit.counts import recorded_epsilon_check
from dpfy.audit.keys import key_check
from dpfy.audit.probes import replay_layer_types
from dpfy.audit.run import RunChecks
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query, run_in_process
from dpfy.fed.simulation import LocalTraining
from dpfy.ledger import Ledger
from dpfy.queries import base as query_base
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler, make_sampler
from dpfy.training import PrivateTrainer, TrainerOptions
from dpfy.training.distributed import Distributed
from dpfy.training.launch import run_local
from dpfy.training.norms import registry
from dpfy.training.norms.linear import LinearForm
from dpfy.training.norms.registry import MaterializedGrads
from dpfy.training.step import PrivateGradient

torch.set_num_threads(1)
N, C, Z = 64, 1.0, 1.0  # 64 examples, batches of 16 (q = 1/4): 4 steps per epoch, 2 epochs


# -- the run types ------------------------------------------------------------------------------
class _Text(nn.Module):
    """Embedding, LayerNorm, mean over positions, Linear: the layers of a small transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(ids)).mean(1))
        return out


def _case(name: str) -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "cnn_groupnorm":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)
        )
        return model, torch.randn(N, 1, 6, 6, generator=g)
    if name == "text_layernorm":
        return _Text(), torch.randint(0, 20, (N, 5), generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.randn(N, 8, generator=g)


_SAMPLERS = {"mlp": "poisson", "cnn_groupnorm": "fixed_size", "text_layernorm": "balls_and_bins"}
_ACCOUNTING = {"poisson": "rdp", "fixed_size": "pld", "balls_and_bins": "random_allocation"}


def _trainer(name: str, sampler_kind: str, dist: Distributed | None = None) -> PrivateTrainer:
    model, x = _case(name)
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))
    sampler = make_sampler(sampler_kind, N, 16, randomness=Randomness(1))
    return PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(reduction="none"),
        x, y, sampler,
        TrainerOptions(clip_norm=C, epochs=2, delta=1e-5, noise_multiplier=Z,
                       accounting=_ACCOUNTING[sampler_kind], max_physical_batch_size=8,
                       randomness=Randomness(2), distributed=dist),
    )


def _finish(trainer: PrivateTrainer) -> tuple[Ledger, dict[str, Any]]:
    """Train; record what ``dpfy train`` records at the end (``stopped``) and its summary."""
    result = trainer.fit()
    trainer.ledger.record_metadata(stopped=result.stopped)
    return trainer.ledger, {"steps": result.steps, "stopped": result.stopped}


def _worker(d: Distributed) -> tuple[Ledger, dict[str, Any]] | None:
    torch.set_num_threads(1)
    out = _finish(_trainer("mlp", "poisson", d))
    return out if d.releases else None


@functools.cache
def _multi_worker_run() -> tuple[Ledger, dict[str, Any]]:
    """An unmodified 2-process run: its ledger says ``workers = 2``, so the audit runs the
    distributed self-test (2 processes again), with whatever is planted at audit time."""
    ran = run_local(_worker, 2, timeout=60.0)
    assert ran is not None
    return ran


def _federated() -> tuple[Ledger, None]:
    ledger = Ledger()
    cohort = CohortSampler(8, "fixed_size", clients_per_round=3, randomness=Randomness(1))
    server = DPFedAvg(cohort, client_update_query(C, Z), ledger, randomness=Randomness(2))
    model, x = _case("mlp")
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))
    clients = [(x[i::8], y[i::8]) for i in range(8)]
    run_in_process(server, model, clients, 4, local=LocalTraining(batch_size=8))
    return ledger, None


def _run(kind: str) -> RunChecks:
    """One run of ``kind`` with whatever is planted, then the audit's gray-box checks."""
    if kind == "federated":
        ledger, summary = _federated()
    elif kind == "multi_worker":  # one 2-process run for the file (spawning costs seconds)
        ledger, summary = _multi_worker_run()
    else:
        ledger, summary = _finish(_trainer(kind, _SAMPLERS[kind]))
    return run_mod.check_run(ledger, summary)


def _flags(checks: RunChecks, *needles: str) -> None:
    for needle in needles:
        assert any(needle in f for f in checks.findings), (needle, checks.findings)


def _without_attribution_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm rule that under-reports is refused at run time by the attribution check
    (tests/training/test_attribution.py); here the audit must find it on its own."""
    from dpfy.training.norms.attribution import AttributionCheck

    monkeypatch.setattr(AttributionCheck, "due", lambda self: False)


# -- 1. noise at half the recorded std ----------------------------------------------------------
def test_half_the_noise_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    draw = query_base._draw

    def half(flat: Any, stds: Any, randomness: Any, dst: Any, scale: float) -> None:
        draw(flat, {n: s / 2 for n, s in stds.items()}, randomness, dst, scale)

    monkeypatch.setattr(query_base, "_draw", half)
    checks = _run("mlp")
    _flags(checks, "Linear: noise: parameter", "dpsgd: noise: the released gradient")


# -- 2. the Linear bias left out of clipping ----------------------------------------------------
def test_linear_bias_out_of_clipping_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_attribution_check(monkeypatch)
    norms = LinearForm.squared_norms

    def without_bias(self: LinearForm) -> dict[str, torch.Tensor]:
        out = norms(self)
        if self.bias_name is not None:
            out[self.bias_name] = torch.zeros_like(out[self.bias_name])
        return out

    monkeypatch.setattr(LinearForm, "squared_norms", without_bias)
    _flags(_run("mlp"), "Linear: sensitivity", "Linear: clipped sum")


# -- 3. Poisson sampling at twice the recorded rate ---------------------------------------------
def test_twice_the_sampling_rate_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    def doubled(self: PoissonSampler) -> np.ndarray:
        q = min(1.0, 2.0 * self.sampling_rate)
        return np.flatnonzero(self.randomness.bernoulli(q, self.dataset_size))

    monkeypatch.setattr(PoissonSampler, "_draw_step", doubled)
    _flags(_run("mlp"), "poisson: batch sizes")


# -- 4. division by the actual batch size -------------------------------------------------------
def test_division_by_the_actual_batch_size_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    release = PrivateGradient.release

    def by_actual(self: PrivateGradient, **kw: Any) -> Any:
        actual = max(self._examples, 1)
        stats = release(self, **kw)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(stats.denominator / actual)  # noisy sum / actual batch size
        return stats  # and the step still reports the expected one

    monkeypatch.setattr(PrivateGradient, "release", by_actual)
    _flags(_run("mlp"), "Linear: clipped sum", "Linear: noise: parameter")


# -- 5. LayerNorm / GroupNorm left out of clipping ----------------------------------------------
class _Unnormed(MaterializedGrads):
    """The parameters' gradients are summed with the clip weights, but their norms count 0."""

    def squared_norms(self) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v) for k, v in super().squared_norms().items()}


def _unclipped(rule: Callable[..., Any]) -> Callable[..., Any]:
    def broken(module: nn.Module, captures: list[Any], group_size: int) -> _Unnormed:
        return _Unnormed(rule(module, captures, group_size).grads)

    return broken


@pytest.mark.parametrize(("run", "kind"), [("cnn_groupnorm", nn.GroupNorm),
                                           ("text_layernorm", nn.LayerNorm)])
def test_norm_layers_out_of_clipping_are_flagged(
    run: str, kind: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_attribution_check(monkeypatch)
    for t in (nn.LayerNorm, nn.GroupNorm):
        monkeypatch.setitem(registry._RULES, t, _unclipped(registry._RULES[t]))
    checks = _run(run)
    _flags(checks, f"{kind.__name__}: sensitivity", f"{kind.__name__}: clipped sum")
    assert f"{kind.__module__}.{kind.__qualname__}" in checks.replayed_layer_types
    # the fixed Linear probe the replay used before cannot see this bug
    assert replay_layer_types(None, clip_norm=C, noise_multiplier=Z).findings == ()


# -- 6. the same noise on two consecutive steps -------------------------------------------------
def _plant_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every second release adds the previous release's noise again (the stream still advances
    as usual, so the replay's identical seeds and the noise std cannot tell)."""
    draw = query_base._draw
    state: dict[str, Any] = {"calls": 0, "last": None}

    def reuse(flat: Any, stds: Any, randomness: Any, dst: Any, scale: float) -> None:
        draw(flat, stds, randomness, dst, scale)
        noise = {n: (dst[n] - flat[n]).clone() for n in flat}
        last = state["last"]
        same = last is not None and all(
            n in last and last[n].shape == v.shape for n, v in noise.items()
        )
        if state["calls"] % 2 == 1 and same:
            for n in flat:
                dst[n].copy_(flat[n] + last[n])
        state["last"], state["calls"] = noise, state["calls"] + 1

    monkeypatch.setattr(query_base, "_draw", reuse)


# statistical: self-test noise under a fixed OS key (fixed_os_key; rank 0 draws): deterministic
@pytest.mark.parametrize("run", ["mlp", "federated",
                                 pytest.param("multi_worker", marks=pytest.mark.slow)])
@pytest.mark.usefixtures("fixed_os_key")
def test_noise_used_on_two_steps_is_flagged(run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_reuse(monkeypatch)
    name = {"mlp": "dpsgd", "federated": "federated", "multi_worker": "distributed"}[run]
    unit = "round" if run == "federated" else "step"
    checks = _run(run)
    _flags(checks, f"{name}: independence: the noise of {unit}s")
    # the noise has the recorded std and the replay's identical seeds hide the reuse: the
    # independence test is the only check that sees it
    others = [f for f in checks.findings if "noise:" in f or "ledger:" in f or ": " not in f
              or f.split(":")[0] not in ("dpsgd", "federated", "distributed")]
    assert others == [], checks.findings


# -- 7. the ledger records 7 of the run's 8 steps -----------------------------------------------
@pytest.mark.parametrize("lost", [3, 7])
def test_a_step_missing_from_the_ledger_is_flagged(
    lost: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = PrivateTrainer._step

    def unrecorded(self: PrivateTrainer, indices: np.ndarray, epoch: int) -> Any:
        if self.global_step_ != lost:
            return step(self, indices, epoch)
        kept, self.ledger = self.ledger, Ledger()  # this step's records go nowhere
        try:
            return step(self, indices, epoch)
        finally:
            self.ledger = kept

    monkeypatch.setattr(PrivateTrainer, "_step", unrecorded)
    checks = _run("mlp")
    _flags(checks, "ledger: 7 steps recorded, but the run completed the sampler's plan of 2 "
           "epochs x 4 steps = 8", "ledger: 7 steps recorded, but the run's summary.json counts 8")
    if lost < 7:
        _flags(checks, f"ledger: step(s) [{lost}] of 0..7 have no sample record")


# -- no false alarm on unmodified runs ----------------------------------------------------------
_LAYERS = {
    "mlp": ("linear.Linear",),
    "cnn_groupnorm": ("conv.Conv2d", "linear.Linear", "normalization.GroupNorm"),
    "text_layernorm": ("linear.Linear", "normalization.LayerNorm", "sparse.Embedding"),
    "federated": ("linear.Linear",),  # no layer types recorded: the Linear probe
    "multi_worker": ("linear.Linear",),
}


# statistical: self-test noise under a fixed OS key (fixed_os_key; rank 0 draws): deterministic
@pytest.mark.parametrize("run", ["mlp", "cnn_groupnorm", "text_layernorm", "federated",
                                 pytest.param("multi_worker", marks=pytest.mark.slow)])
@pytest.mark.usefixtures("fixed_os_key")
def test_unmodified_runs_pass(run: str) -> None:
    checks = _run(run)
    assert checks.findings == ()
    assert checks.replayed_layer_types == tuple(f"torch.nn.modules.{t}" for t in _LAYERS[run])
    assert checks.not_replayed_layer_types == ()
    path = {"federated": "federated", "multi_worker": "distributed"}.get(run, "dpsgd")
    assert checks.tests_run == ("replay", "sampler", "ledger counts", "recorded epsilon", "keys",
                                path)


# -- 8. noise skipped on tensors larger than any probe or canary --------------------------------
BIG = 1 << 16  # above the canary model's largest tensor (Embedding 200 x 250 = 50,000 values)


def _big_model() -> nn.Module:
    """A run whose first layer holds 300 x 256 = 76,800 values (no bias: every tensor large,
    so the real-model check needs one noise-only release)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 256, bias=False), nn.Tanh(),
                         nn.Linear(256, 3, bias=False))


def _big_run() -> tuple[nn.Module, Ledger, dict[str, Any]]:
    model = _big_model()
    x = torch.randn(N, 300, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))
    trainer = PrivateTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(reduction="none"),
        x, y, make_sampler("poisson", N, 16, randomness=Randomness(1)),
        TrainerOptions(clip_norm=C, epochs=2, delta=1e-5, noise_multiplier=Z, accounting="rdp",
                       max_physical_batch_size=16, randomness=Randomness(2)),
    )
    ledger, summary = _finish(trainer)
    return model, ledger, summary


def test_a_noise_skip_on_large_tensors_is_flagged_on_the_real_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dpfy.audit.canary import CanaryModel
    from dpfy.audit.probes import _builders

    draw = query_base._draw

    def skip_big(flat: Any, stds: Any, randomness: Any, dst: Any, scale: float) -> None:
        draw(flat, {n: 0.0 if flat[n].numel() > BIG else s for n, s in stds.items()},
             randomness, dst, scale)

    monkeypatch.setattr(query_base, "_draw", skip_big)
    model, ledger, summary = _big_run()
    checks = run_mod.check_run(ledger, summary, model=model)
    _flags(checks, "real model: parameter '0.weight' ((256, 300), 76800 values) got noise of "
           "std 0 x")
    assert checks.real_model is not None and checks.real_model.releases == 1
    # every other check runs on smaller tensors than the bug's threshold and sees nothing
    assert [f for f in checks.findings if not f.startswith("real model")] == []
    probes = [p.numel() for build, _ in _builders().values() for p in build().parameters()]
    canary = CanaryModel(100, 100, 200, 250)  # the model of `dpfy audit`'s canaries
    assert max(probes + [p.numel() for p in canary.parameters()]) < BIG


def test_half_the_noise_on_the_real_model_is_flagged_and_a_correct_run_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real-model check's own power and false alarm: no finding on the unmodified run; on
    every tensor, half the noise."""
    from dpfy.audit.realmodel import model_noise_check

    model, ledger, summary = _big_run()
    checks = run_mod.check_run(ledger, summary, model=model)
    assert checks.findings == () and "real model" in checks.tests_run
    assert checks.real_model is not None and checks.real_model.half_noise_miss < 1e-100
    draw = query_base._draw
    monkeypatch.setattr(query_base, "_draw", lambda f, s, r, d, k: draw(
        f, {n: v / 2 for n, v in s.items()}, r, d, k))
    half = model_noise_check(model, noise_std=Z * C, clip_norm=C, noise_multiplier=Z,
                             expected_batch_size=16.0, secure=False)
    assert len(half.findings) == 2 and all(0.45 < r < 0.55 for r in half.std_ratio.values())


# -- library runs: make_private and dpfy.opacus, each a tiny file-ledger run --------------------
def _data() -> Any:
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _loop(model: nn.Module, opt: Any, loss: Any, loader: Any) -> None:
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()


def _make_private_run(path: Path, randomness: Randomness | None = None) -> nn.Module:
    """``make_private`` over 2 planned epochs of 4 steps (secure unless ``randomness``); its
    ledger closes itself at the plan's end, recording the epsilon it accounted."""
    from dpfy import make_private
    from dpfy.training.private import PrivateOptions

    model = _mlp()
    model, opt, crit, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), _data(), target_epsilon=8.0,
        delta=1e-5, epochs=2, clip_norm=C, expected_batch_size=16, randomness=randomness,
        options=PrivateOptions(ledger=Ledger(path)),
    )
    _loop(model, opt, crit, loader)
    return model


def _opacus_run(run_dir: Path) -> nn.Module:
    from torch.utils.data import DataLoader

    from dpfy.opacus import PrivacyEngine

    engine = PrivacyEngine(accountant="rdp", run_dir=run_dir)
    model = _mlp()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(_data(), batch_size=16), noise_multiplier=Z, max_grad_norm=C,
    )
    _loop(model, opt, nn.functional.cross_entropy, loader)
    engine.write_report(delta=1e-5)  # the run set no delta: the report's is recorded
    return model


def _library_checks(path: Path, model: nn.Module | None = None) -> tuple[str, ...]:
    """What the new checks of ``dpfy audit`` find in a library run's ledger file: the epsilon
    its writer recorded, its keys and, given its ``model``, the noise on every tensor."""
    ledger = Ledger.load(path)
    found = (*recorded_epsilon_check(ledger), *key_check(ledger.metadata)[0])
    if model is not None:
        real = run_mod._real_model(ledger, run_mod._configuration(ledger), model, 0)
        assert not isinstance(real, str), real
        found += real.findings
    return found


# -- 9. secure generators keyed with a constant -------------------------------------------------
class _ConstantOS:
    """``os`` as dpfy.randomness sees it, its ``urandom`` a fixed byte sequence that starts
    again for every run (a generator keyed from a constant)."""

    def __init__(self) -> None:
        self.calls = 0

    def urandom(self, n: int) -> bytes:
        self.calls += 1
        return bytes([self.calls % 251]) * n

    def __getattr__(self, name: str) -> Any:
        import os

        return getattr(os, name)


def _constant_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import dpfy.randomness

    monkeypatch.setattr(dpfy.randomness, "os", _ConstantOS())


@pytest.mark.usefixtures("fixed_os_key")  # a key registry of this test's own
def test_a_repeated_key_refuses_the_second_run_and_the_audit_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpfy.ledger.commitments import RepeatedKeyError

    _constant_keys(monkeypatch)
    first = _make_private_run(tmp_path / "a.jsonl")
    _constant_keys(monkeypatch)  # the same keys again: the second "secure" run
    with pytest.raises(RepeatedKeyError, match="another run registered"):
        _make_private_run(tmp_path / "b.jsonl")
    # the same run on a machine with another registry starts, and the audit (reading this
    # machine's registry) names the key the first run drew
    registry = str(tmp_path / "other-machine")
    with monkeypatch.context() as other:
        other.setenv("DPFY_KEY_REGISTRY", registry)
        _constant_keys(other)
        second = _make_private_run(tmp_path / "c.jsonl")
    found = _library_checks(tmp_path / "c.jsonl")
    for name in ("noise", "sampling"):
        assert any(f"keys: the {name} generator's key (commitment" in f for f in found), found
    assert _library_checks(tmp_path / "a.jsonl") == ()
    # the weights are the same: what the bug costs
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(),
                                                   strict=True))


@pytest.mark.usefixtures("fixed_os_key")
def test_two_generators_of_one_run_with_one_key_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dpfy.randomness
    from dpfy.ledger.commitments import RepeatedKeyError

    monkeypatch.setattr(dpfy.randomness, "os", _SameKeyOS())
    with pytest.raises(RepeatedKeyError, match="noise and sampling generators drew one key"):
        _make_private_run(tmp_path / "a.jsonl")
    assert not (tmp_path / "a.jsonl").exists() or Ledger.load(tmp_path / "a.jsonl").entries == ()


class _SameKeyOS(_ConstantOS):
    def urandom(self, n: int) -> bytes:
        return bytes(n)


@pytest.mark.usefixtures("fixed_os_key")
def test_one_generator_in_two_runs_is_no_repeat() -> None:
    """A generator handed to a second run continues its keystream: registered again, not
    refused; the same key drawn by another generator is."""
    from dpfy.ledger.commitments import RepeatedKeyError
    from dpfy.training.keys import key_facts

    noise, sampling = Randomness.secure_mode(), Randomness.secure_mode()
    first, again = key_facts(noise, sampling), key_facts(noise, sampling)
    assert first == again and set(first["key_registration"]) == {"noise", "sampling"}
    assert key_check(first)[0] == ()
    twin = Randomness.secure_mode()
    twin.key_commitments()
    assert twin._stream is not None
    twin._stream.commitments[:] = noise.key_commitments()  # as if it drew noise's key
    with pytest.raises(RepeatedKeyError, match="another run registered"):
        key_facts(twin)


@pytest.mark.usefixtures("fixed_os_key")
def test_dpfy_train_refuses_one_key_in_one_line_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dpfy.randomness
    from dpfy.cli import main

    monkeypatch.setattr(dpfy.randomness, "os", _SameKeyOS())
    code = main(["train", "mnist", "--out", str(tmp_path / "run"), "--epochs", "1",
                 "--train-limit", "64", "--test-limit", "64"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "drew one key" in err, err
    assert not (tmp_path / "run" / "ledger.jsonl").exists()


# -- 10. a ledger file that overstates the noise (the records in memory and the noise are right) -
def _overstating_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfy.ledger.records import SumQueryRecord

    to_dict = SumQueryRecord.to_dict

    def doubled(self: SumQueryRecord) -> dict[str, Any]:
        out = to_dict(self)
        out["noise_std"] = 2.0 * self.noise_std
        return out

    monkeypatch.setattr(SumQueryRecord, "to_dict", doubled)


@pytest.mark.parametrize("path", ["make_private", "opacus"])
@pytest.mark.usefixtures("fixed_os_key")
def test_a_ledger_file_that_overstates_the_noise_is_flagged(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpfy.ledger import LedgerIntegrityError
    from dpfy.report.statement import build_report

    _overstating_file(monkeypatch)
    if path == "make_private":
        file = tmp_path / "ledger.jsonl"
        model = _make_private_run(file)
    else:  # write_report states the engine's in-memory ledger: right; the file is not
        file, model = tmp_path / "run" / "ledger.jsonl", _opacus_run(tmp_path / "run")
    monkeypatch.undo()
    ledger = Ledger.load(file)
    assert ledger.verification.complete  # a valid, signed chain: the chain cannot see it
    assert recorded_epsilon_check(ledger)[0].startswith("recorded epsilon: ledger")
    assert _library_checks(file, model) == recorded_epsilon_check(ledger)  # the noise is right
    with pytest.raises(LedgerIntegrityError, match="below the"):
        build_report(ledger, delta=1e-5)


# -- no false alarm on the library runs ---------------------------------------------------------
# statistical: the real-model check's secure noise under a fixed OS key: deterministic
@pytest.mark.usefixtures("fixed_os_key")
def test_a_make_private_run_passes_every_check(tmp_path: Path) -> None:
    model = _make_private_run(tmp_path / "mp.jsonl")
    ledger = Ledger.load(tmp_path / "mp.jsonl")
    checks = run_mod.check_run(ledger, None, model=model)  # everything `dpfy audit` checks
    assert checks.findings == () and checks.notes == ()
    assert {"recorded epsilon", "keys", "real model"} <= set(checks.tests_run)
    meta = ledger.metadata
    assert meta["epsilon"] > 0 and meta["delta"] == 1e-5 and meta["key_registry"] == "local"


@pytest.mark.usefixtures("fixed_os_key")
def test_an_opacus_run_and_a_seeded_run_pass_the_new_checks(tmp_path: Path) -> None:
    model = _opacus_run(tmp_path / "opacus")
    assert _library_checks(tmp_path / "opacus" / "ledger.jsonl", model) == ()
    assert "epsilon" in Ledger.load(tmp_path / "opacus" / "ledger.jsonl").metadata
    seeded = _make_private_run(tmp_path / "seeded.jsonl", Randomness(0))
    assert _library_checks(tmp_path / "seeded.jsonl", seeded) == ()
    assert key_check(Ledger.load(tmp_path / "seeded.jsonl").metadata)[1] == (
        "keys: a seeded run (not a DP release): no key to commit to",)

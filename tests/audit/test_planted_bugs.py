"""Planted bugs: each test breaks one thing in the release path (monkeypatched here only), runs a
tiny real run with the broken code, and the audit's gray-box checks (dpfy.audit.run.check_run,
everything ``dpfy audit`` runs except the canary attack) must flag it. The unmodified run types
at the end must pass the same checks with no finding.

The seven bugs: noise at half the recorded std; the Linear bias left out of the per-example
norm; Poisson sampling at twice the recorded rate; division by the actual batch size; LayerNorm
or GroupNorm parameters left out of the per-example norm; the same noise used on two
consecutive steps; the ledger missing one of the run's eight steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dpfy.audit import run as run_mod
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
    assert checks.tests_run == ("replay", "sampler", "ledger counts", path)

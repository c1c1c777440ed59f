"""A sampler kind and an accountant registered *after* ``import dpfy`` reach every consumer.

The kind ("interleaved": batch t of each epoch holds examples t, t + T, ..., the same order
every epoch) and the accountant ("zcdp_demo": zero-concentrated DP, Bun and Steinke 2016) are
defined here and nowhere else. Nothing in the library is edited or reloaded for them: the
ledger, the schema checks of correlated noise, planning, calibration and the ``dpfy``
command line read the registries when they run. Both registries are monkeypatched copies,
so the registrations vanish with the test.
"""

from __future__ import annotations

import importlib
import math
from typing import ClassVar

import numpy as np
import pytest
from typer.testing import CliRunner

from dpfy import events as ev
from dpfy.accounting import PrivacyResult, _api
from dpfy.accounting import epsilon as account
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.correlated import Cyclic, SingleEpoch
from dpfy.ledger import Ledger
from dpfy.ledger.matrix import check_schema_spec
from dpfy.sampling import BaseSampler, SamplerKind, SampleSpec, register_kind, registered_kinds
from dpfy.sampling.kinds import kind_names
from dpfy.sampling.spec import spec_event

#: the module of the kind table
kind_table = importlib.import_module("dpfy.sampling.kinds")

# --- the new sampler kind ----------------------------------------------------------------


class InterleavedSampler(BaseSampler):
    """Batch t of every epoch holds the examples t, t + T, t + 2T, ... (no randomness)."""

    kind: ClassVar[str] = "interleaved"
    _epoch_layout: ClassVar[bool] = True

    def __init__(self, dataset_size: int, steps_per_epoch: int, *, randomness=None) -> None:
        super().__init__(dataset_size, randomness=randomness)
        self.steps_per_epoch = steps_per_epoch
        self.expected_batch_size = dataset_size / steps_per_epoch

    @classmethod
    def from_batch_size(cls, dataset_size, batch_size, *, max_batch_size=None, randomness=None):
        return cls(dataset_size, math.ceil(dataset_size / batch_size), randomness=randomness)

    def _draw_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        batch_of = np.arange(self.dataset_size) % self.steps_per_epoch
        order = np.argsort(batch_of, kind="stable")
        return order, np.bincount(batch_of, minlength=self.steps_per_epoch)

    def sample_spec(self) -> SampleSpec:
        return self._spec(steps_per_epoch=self.steps_per_epoch)


INTERLEAVED = SamplerKind(
    name="interleaved",
    event=lambda spec, z, epochs: ev.Deterministic(
        z, spec.required_int("steps_per_epoch"), epochs, adjacency=spec.adjacency_value
    ),
    needs=("steps_per_epoch",),
    adjacency="zero_out",
    epoch_structured=True,
    once_per_epoch=True,
    cyclic=True,
    assumptions="batch t holds examples t, t + T, ...: no amplification",
    sampler=InterleavedSampler,
    cli=True,
)

# --- the new accountant ------------------------------------------------------------------


class ZCDPDemo:
    """zCDP of Gaussian compositions (Bun and Steinke 2016): rho = sum 1/(2 z^2) over the
    releases that can touch one unit, epsilon = rho + 2 sqrt(rho log(1/delta)).

    It declares the calibration capability; ``searched`` counts the coarse evaluations.
    """

    name = "zcdp_demo"

    def __init__(self) -> None:
        self.searched = 0

    def _rho(self, event: ev.Event) -> float | None:
        if isinstance(event, ev.Gaussian):
            return 1.0 / (2.0 * event.noise_multiplier**2)
        if isinstance(event, ev.Deterministic):  # each unit in one step per epoch
            return event.epochs / (2.0 * event.noise_multiplier**2)
        if isinstance(event, ev.SelfComposed):
            inner = self._rho(event.event)
            return None if inner is None else event.count * inner
        if isinstance(event, ev.Composed):
            parts = [self._rho(e) for e in event.events]
            return None if any(p is None for p in parts) else sum(p for p in parts if p)
        return None

    def unsupported(self, event: ev.Event) -> str | None:
        return None if self._rho(event) is not None else f"zcdp_demo cannot account {event!r}"

    def _eps(self, event: ev.Event, delta: float) -> float:
        rho = self._rho(event)
        assert rho is not None
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        eps = self._eps(event, delta)
        return PrivacyResult(eps, delta, self.name, event.adjacency_relation.value)

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        rho = self._rho(event)
        assert rho is not None
        d = math.exp(-((epsilon - rho) ** 2) / (4.0 * rho)) if epsilon > rho else 1.0
        return PrivacyResult(epsilon, d, self.name, event.adjacency_relation.value)

    def calibration_search(self, delta: float):
        def search(event: ev.Event, coarse: bool) -> float:
            self.searched += coarse
            return self._eps(event, delta)

        return search


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> ZCDPDemo:
    """The new kind and accountant, registered in copies of both registries."""
    monkeypatch.setattr(kind_table, "_KINDS", dict(kind_table._KINDS))
    monkeypatch.setattr(_api, "_ACCOUNTANTS", dict(_api._ACCOUNTANTS))
    monkeypatch.setattr(_api, "_AUTO", list(_api._AUTO))
    register_kind(INTERLEAVED)
    accountant = ZCDPDemo()
    _api.register_accountant(accountant)
    return accountant


# --- the ledger ----------------------------------------------------------------------------


def test_the_ledger_knows_a_kind_registered_after_import(registered, tmp_path):
    assert "interleaved" in kind_names()
    with pytest.raises(ValueError, match="interleaved"):  # the list of kinds is read now
        SampleSpec("no_such_kind")
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    sampler = InterleavedSampler(100, 10)
    for epoch in range(2):
        for _ in sampler.batches(epoch):
            sid = ledger.record_sample(sampler.sample_spec(), epoch=epoch)
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0)
    ledger.close()
    event = Ledger.load(path).to_event()  # the file's specs name the new kind
    assert event == spec_event(sampler.sample_spec(), 2.0, 2) == ev.Deterministic(2.0, 10, 2)
    result = account(event, 1e-5, method="zcdp_demo")
    assert result.method == "zcdp_demo" and math.isfinite(result.epsilon)


def test_the_schema_checks_read_the_new_kinds_epoch_facts(registered):
    spec = SampleSpec("interleaved", steps_per_epoch=4)
    check_schema_spec(Cyclic(4), spec, index=5, epoch=1)  # cyclic: accepted
    check_schema_spec(SingleEpoch(), spec, index=3)
    assert "interleaved" in kind_names("cyclic") and "interleaved" in kind_names("once_per_epoch")
    plain = SamplerKind(
        name="plain_epochs", event=INTERLEAVED.event, needs=("steps_per_epoch",),
        adjacency="zero_out", epoch_structured=True,
    )
    register_kind(plain)
    with pytest.raises(ValueError, match="interleaved"):  # the message lists the new kind
        check_schema_spec(Cyclic(4), SampleSpec("plain_epochs", steps_per_epoch=4))
    with pytest.raises(ValueError, match="once per epoch"):
        check_schema_spec(SingleEpoch(), SampleSpec("plain_epochs", steps_per_epoch=4))


def test_a_row_states_consistent_epoch_facts():
    with pytest.raises(ValueError, match="cyclic needs once_per_epoch"):
        SamplerKind(name="bad", event=INTERLEAVED.event, epoch_structured=True, cyclic=True)
    with pytest.raises(ValueError, match="once_per_epoch needs epoch_structured"):
        SamplerKind(name="bad", event=INTERLEAVED.event, once_per_epoch=True)


# --- planning and calibration --------------------------------------------------------------


def test_planning_plans_the_new_kind(registered):
    from dpfy.planning import plan

    result = plan(10_000, 4.0, 1e-6, max_steps=200, sampler="interleaved", runner_ups=1)
    best = result.recommendation
    assert best.sampler == "interleaved"
    sampler = InterleavedSampler.from_batch_size(10_000, best.batch_size)
    event = sampler.privacy_event(best.noise_multiplier, steps=best.steps)
    assert best.privacy_event() == event and isinstance(event, ev.Deterministic)
    assert best.epsilon <= 4.0 and account(event, 1e-6).epsilon == best.epsilon


def test_a_run_is_planned_with_the_new_kind_and_accountant(registered):
    from dpfy.run_accounting import calibrate_run

    run = calibrate_run(2.0, 1000, 100, 1e-5, epochs=3, sampler="interleaved",
                        method="zcdp_demo")
    assert run.result.method == "zcdp_demo" and run.result.epsilon <= 2.0
    assert registered.searched > 0  # the accountant's declared search ran the coarse phase


def test_calibration_uses_a_declared_search_and_stays_on_the_safe_side(registered):
    def make(z: float) -> ev.Event:
        return ev.SelfComposed(ev.Gaussian(z), 100)

    z = calibrate_noise_multiplier(make, 1.0, 1e-6, method="zcdp_demo")
    assert registered.searched > 0
    assert account(make(z), 1e-6, method="zcdp_demo").epsilon <= 1.0


# --- the command line ----------------------------------------------------------------------

EPSILON = ["epsilon", "--dataset-size", "1000", "--batch-size", "100", "-z", "2",
           "--delta", "1e-5", "--epochs", "3", "--sampler", "deterministic"]


def test_the_cli_offers_an_accountant_registered_after_import(registered):
    from dpfy import cli

    runner = CliRunner()
    shown = runner.invoke(cli.app, ["epsilon", "--help"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0 and "zcdp_demo" in shown.output
    assert "rdp_tuning" in shown.output  # every registered accountant, built-ins too
    ran = runner.invoke(cli.app, [*EPSILON, "--method", "zcdp_demo", "--json"])
    assert ran.exit_code == 0, ran.output
    assert '"method": "zcdp_demo"' in ran.output


def test_the_cli_refuses_an_accountant_that_is_not_registered(capsys):
    from dpfy import cli

    assert "zcdp_demo" not in _api.accountants()
    assert cli.main([*EPSILON, "--method", "zcdp_demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "zcdp_demo" in err and "rdp_tuning" in err


def test_registrations_are_gone_after_the_tests():
    assert "interleaved" not in {r.name for r in registered_kinds()}
    assert "zcdp_demo" not in _api.accountants()

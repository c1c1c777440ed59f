"""The table of sampler kinds: a new kind is one sampler class plus one registered row.

The first test is the worked example of ``docs/architecture.md`` (section 4.1, "A sampler"):
a "strided" sampler (batch t of every epoch holds examples t, t + T, t + 2T, ...) is defined
here and nowhere else, and works end to end: make_sampler, the ledger, the accountant.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import pytest

import dpfy.sampling.kinds
from dpfy import accounting
from dpfy import events as ev
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import (
    BaseSampler,
    SamplerKind,
    SampleSpec,
    make_sampler,
    register_kind,
    registered_kinds,
)
from dpfy.sampling.factory import SAMPLER_KINDS
from dpfy.sampling.kinds import kind, unregister_kind
from dpfy.sampling.spec import spec_event

# --- the worked example: a new sampler kind -------------------------------------------------


class StridedSampler(BaseSampler):
    """Batch t of every epoch holds the examples t, t + T, t + 2T, ... (no randomness)."""

    kind: ClassVar[str] = "strided"
    _epoch_layout: ClassVar[bool] = True  # one layout per epoch, cut into steps_per_epoch batches

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


STRIDED = SamplerKind(
    name="strided",
    event=lambda spec, z, epochs: ev.Deterministic(
        z, spec.required_int("steps_per_epoch"), epochs, adjacency=spec.adjacency_value
    ),
    needs=("steps_per_epoch",),
    adjacency="zero_out",
    epoch_structured=True,
    assumptions="batch t holds examples t, t + T, ...: no amplification, each example once "
    "per epoch",
    sampler=StridedSampler,
)


@pytest.fixture
def strided():
    register_kind(STRIDED)
    yield STRIDED
    unregister_kind("strided")


def test_a_new_kind_works_end_to_end(strided):
    sampler = make_sampler("strided", dataset_size=100, batch_size=10)
    assert isinstance(sampler, StridedSampler) and sampler.steps_per_epoch == 10

    ledger = Ledger()
    for epoch in range(2):
        for _ in sampler.batches(epoch):
            sid = ledger.record_sample(sampler.sample_spec(), epoch=epoch)
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0)  # z = 2
    assert sorted(np.concatenate(list(sampler.batches(0)))) == list(range(100))

    event = ledger.to_event()
    assert event == sampler.privacy_event(2.0, epochs=2) == ev.Deterministic(2.0, 10, 2)
    assert math.isfinite(accounting.epsilon(event, 1e-5).epsilon)


# --- the registry ----------------------------------------------------------------------------


def test_the_registry_refuses_a_duplicate_name_unless_replace():
    with pytest.raises(ValueError, match="'poisson' is already registered"):
        register_kind(kind("poisson"))
    original = kind("poisson")
    try:
        register_kind(dataclasses.replace(original, assumptions="changed"), replace=True)
        assert kind("poisson").assumptions == "changed"
    finally:
        register_kind(original, replace=True)
    assert kind("poisson") is original


def test_lookup_accepts_dashes_and_names_unknown_kinds():
    assert kind("balls-and-bins") is kind("balls_and_bins")
    assert kind("balls_and_bins").cli_name == "balls-and-bins"
    with pytest.raises(ValueError, match="kind must be one of"):
        kind("nope")


def test_unregistered_kinds_disappear_everywhere(strided):
    assert "strided" in SAMPLER_KINDS and SampleSpec("strided", steps_per_epoch=3)
    unregister_kind("strided")
    try:
        assert "strided" not in SAMPLER_KINDS
        with pytest.raises(ValueError, match="sampler must be one of"):
            SampleSpec("strided", steps_per_epoch=3)
    finally:
        register_kind(STRIDED)


# --- the table and its consumers agree -------------------------------------------------------

_VALUES = {"sampling_rate": 0.1, "batch_size": 10, "steps_per_epoch": 10, "dataset_size": 100}
_BUILTIN = (
    "poisson", "balls_and_bins", "shuffle", "deterministic", "fixed_size", "full_batch", "cyclic"
)


def test_the_builtin_rows():
    assert tuple(r.name for r in registered_kinds()) == _BUILTIN
    # full_batch has no sampler class
    assert tuple(SAMPLER_KINDS) == tuple(k for k in _BUILTIN if k != "full_batch")
    assert {r.name for r in registered_kinds() if r.truncates} == {"poisson", "balls_and_bins"}
    epochal = {r.name for r in registered_kinds() if r.epoch_structured}
    assert epochal == {"balls_and_bins", "shuffle", "deterministic", "cyclic"}
    accountants = {r.name: r.default_accountant for r in registered_kinds()}
    assert accountants["poisson"] == "pld" and accountants["balls_and_bins"] == "random_allocation"
    # the package's attribute ``kinds`` is the table's module, not shadowed by a function
    assert dpfy.sampling.kinds.registered_kinds is registered_kinds


@pytest.mark.parametrize("name", _BUILTIN)
def test_the_table_and_sample_spec_agree(name):
    row = kind(name)
    fields = {f: _VALUES[f] for f in row.needs}
    spec = SampleSpec(name, **fields)
    assert spec.adjacency == row.adjacency
    for missing in row.needs:
        with pytest.raises(ValueError, match=f"needs {missing}"):
            SampleSpec(name, **{f: v for f, v in fields.items() if f != missing})
    for adjacency in (a.value for a in ev.Adjacency):
        if adjacency in row.allowed_adjacency:
            SampleSpec(name, **fields, adjacency=adjacency)
        else:
            with pytest.raises(ValueError, match="adjacency must be"):
                SampleSpec(name, **fields, adjacency=adjacency)
    truncated = {**fields, "dataset_size": 100, "max_batch_size": 20}
    if row.truncates:
        assert spec_event(SampleSpec(name, **truncated), 1.0, 2) != spec_event(spec, 1.0, 2)
    else:
        with pytest.raises(ValueError, match="max_batch_size applies to"):
            SampleSpec(name, **truncated)


_RUNS = [(n, None) for n in SAMPLER_KINDS] + [(n, 12) for n in SAMPLER_KINDS if kind(n).truncates]


@pytest.mark.parametrize(("name", "max_batch_size"), _RUNS)
@pytest.mark.parametrize("steps", [1, 7, 25])  # one step; within one epoch; a partial 3rd epoch
def test_every_samplers_event_is_its_ledgers_event(name, max_batch_size, steps):
    sampler = make_sampler(name, 100, 10, max_batch_size=max_batch_size, randomness=Randomness(0))
    ledger, done = Ledger(), 0
    for epoch in range(3):
        for _ in sampler.batches(epoch):
            if done < steps:
                sid = ledger.record_sample(sampler.sample_spec(), epoch=epoch)
                ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.5)
                done += 1
    # The ledger writes one repetition as the bare step (EventBuilder); so does ev.compose.
    assert ledger.to_event() == ev.compose(sampler.privacy_event(1.5, steps=steps))


def test_the_cli_offers_the_tables_kinds():
    from dpfy import cli_options

    offered = [r.cli_name for r in registered_kinds() if r.cli]
    assert [m.value for m in cli_options.SamplerName] == offered
    assert [m.value for m in cli_options.TrainSampler] == ["poisson", "balls-and-bins", "cyclic"]

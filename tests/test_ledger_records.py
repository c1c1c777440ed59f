"""Ledger records: to_dict/from_dict, one replay path, and accounting a ledger as its event."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from dpfy import accounting
from dpfy.ledger import Ledger, register_record
from dpfy.ledger.hyperparameters import ledger_hyperparameters
from dpfy.ledger.records import (
    EndRecord,
    HeaderRecord,
    MetadataRecord,
    NonPrivateRecord,
    ResumeRecord,
    SampleRecord,
    SignatureRecord,
    SumQueryRecord,
    record_from_dict,
)
from dpfy.sampling import SampleSpec

POISSON = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)
SRC = Path(__file__).resolve().parents[1] / "src" / "dpfy"

RECORDS = [
    HeaderRecord(run_id="ab" * 16),
    HeaderRecord(version=1),
    HeaderRecord(run_id="ab" * 16, public_key="ef" * 32),
    ResumeRecord(truncated_previous=True),
    ResumeRecord(truncated_previous=True, cut="cd" * 32),
    EndRecord(count=12, samples=4),
    EndRecord(count=12, samples=4, releases=5),
    SignatureRecord(13, "01" * 64),
    SampleRecord(3, POISSON, epoch=2, step=7),
    SampleRecord(
        0, SampleSpec("balls_and_bins", dataset_size=100, steps_per_epoch=10, max_batch_size=20)
    ),
    SumQueryRecord(3, 1.5, 0.75, "layer1"),
    SumQueryRecord(0, 0.0, 0.0),
    NonPrivateRecord(3, "debug", "no noise"),
    NonPrivateRecord(None, "label counts", "released exactly"),
    MetadataRecord({"model": "mlp", "lr": 0.1, "layers": [3, 4]}),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_type_round_trips_through_json(record):
    data = json.loads(json.dumps(record.to_dict()))
    assert record_from_dict(data) == record
    assert type(record).from_dict(data) == record


def test_every_record_type_has_a_round_trip_case():
    kinds = {type(r).kind for r in RECORDS}
    assert kinds == {
        "header", "resume", "end", "signature", "sample", "sum_query", "non_private", "metadata"
    }


def test_registry_refuses_duplicates_and_unknown_types():
    with pytest.raises(ValueError, match="'sum_query' is already registered"):
        register_record(SumQueryRecord)
    with pytest.raises(ValueError, match="unknown entry type 'bogus'"):
        record_from_dict({"type": "bogus"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        record_from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"type": "sum_query", "sample_id": 0, "sensitivity": 1, "noise_std": -1}, "noise_std"),
        ({"type": "sum_query", "sample_id": "0", "sensitivity": 1, "noise_std": 1}, "sample_id"),
        ({"type": "sample", "sample_id": 0, "epoch": -1, "spec": {"sampler": "full_batch"}},
         "epoch"),
        ({"type": "sample", "sample_id": 0, "epoch": 0, "spec": [1]}, "spec must be an object"),
        ({"type": "metadata", "info": [1]}, "metadata info must be an object"),
        ({"type": "header", "format": "other", "version": 1}, "format must be"),
        ({"type": "header", "format": "dpfy-ledger", "version": 99}, "version must be"),
        ({"type": "resume", "truncated_previous": "yes"}, "truncated_previous"),
    ],
)
def test_records_validate_their_own_fields(data, match):
    with pytest.raises(ValueError, match=match):
        record_from_dict(data)


def _run(path=None):
    ledger = Ledger(path)
    ledger.record_metadata(model="mlp", clip_norm=1.0)
    for step in range(4):
        sid = ledger.record_sample(POISSON, step=step)
        ledger.record_sum_queries(sid, [(1.0, 1.5, "a"), (0.5, 1.0, "b")])
    ledger.record_metadata(test_accuracy=0.9)
    return ledger


def test_load_resume_checkpoint_and_prefix_share_the_one_replay_path(tmp_path, monkeypatch):
    from dpfy.training.checkpoint import ledger_state, restore_ledger

    path = tmp_path / "run.jsonl"
    original = _run(path)
    original.close()
    replayed: list[str] = []
    real = Ledger._replay

    def spy(self, record, **kwargs):
        replayed.append(type(record).kind)
        return real(self, record, **kwargs)

    monkeypatch.setattr(Ledger, "_replay", spy)
    copies = {}
    copies["load"] = Ledger.load(path)
    lines = path.read_text().splitlines()
    assert replayed == [json.loads(line)["type"] for line in lines]  # header included
    replayed.clear()
    memory = Ledger.from_records(original.entries)
    copies["checkpoint"] = Ledger()
    replayed.clear()
    restore_ledger(copies["checkpoint"], ledger_state(memory))
    assert replayed == [type(r).kind for r in original.entries]
    replayed.clear()
    copies["prefix"] = copies["load"].prefix()
    assert replayed == [type(r).kind for r in original.entries]
    copies["resume"] = Ledger(path)
    copies["resume"].close()
    for name, copy in copies.items():
        assert copy.entries == original.entries, name
        assert copy.to_event() == original.to_event(), name
        assert copy.metadata == {"model": "mlp", "clip_norm": 1.0, "test_accuracy": 0.9}, name


def test_prefix_keeps_the_first_samples_and_writes_a_loadable_file(tmp_path):
    ledger = _run()
    two = ledger.prefix(2, path=tmp_path / "two.jsonl")
    two.close()
    assert two.iteration == 2 and two.metadata == {"model": "mlp", "clip_norm": 1.0}
    assert Ledger.load(tmp_path / "two.jsonl").entries == two.entries
    shorter = Ledger()
    for step in range(2):
        sid = shorter.record_sample(POISSON, step=step)
        shorter.record_sum_queries(sid, [(1.0, 1.5, "a"), (0.5, 1.0, "b")])
    assert two.to_event() == shorter.to_event()
    assert ledger.prefix(0).iteration == 0 and ledger.prefix(9).entries == ledger.entries


def test_replay_refuses_reused_ids_and_unknown_samples():
    ledger = _run()
    with pytest.raises(ValueError, match="sample_id must be a new integer"):
        ledger.replay([SampleRecord(0, POISSON)])
    with pytest.raises(ValueError, match="sample_id must be an id returned by record_sample"):
        Ledger.from_records([SumQueryRecord(7, 1.0, 1.0)])


def test_old_report_names_still_work():
    from dpfy.ledger.hyperparameters import ledger_hyperparameters as old_hyper
    from dpfy.report.statement import prefix_ledger

    ledger = _run()
    assert prefix_ledger(ledger, 2).entries == ledger.prefix(2).entries
    assert old_hyper(ledger) == ledger_hyperparameters(ledger)
    hyper = ledger_hyperparameters(ledger)
    assert hyper["steps"] == 4 and hyper["clip_norm"] == 1.0
    assert hyper["l2_sensitivity_per_query"] == {"a": [1.0], "b": [0.5]}


# -- accounting a ledger ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "rdp", "pld"])
def test_accounting_a_ledger_is_accounting_its_event(method):
    ledger = _run()
    event = ledger.to_event()
    assert accounting.epsilon(ledger, 1e-5, method) == accounting.epsilon(event, 1e-5, method)
    assert accounting.delta(ledger, 1.0, method) == accounting.delta(event, 1.0, method)


def test_compare_accepts_a_ledger():
    ledger = _run()
    assert accounting.compare(ledger, 1e-5) == accounting.compare(ledger.to_event(), 1e-5)


@pytest.mark.parametrize("method", ["auto", "rdp", "pld", "gaussian"])
@pytest.mark.parametrize("sample_id", [None, 0])
def test_non_private_release_is_infinite_for_ledger_and_event(method, sample_id):
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("full_batch"))
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0)
    ledger.record_non_private(sample_id, name="labels", reason="released exactly")
    for source in (ledger, ledger.to_event()):
        res = accounting.epsilon(source, 1e-5, method)
        assert res.epsilon == math.inf and res.delta == 1e-5
        assert any("non-private" in note for note in res.notes)
        assert accounting.delta(source, 1.0, method).delta == 1.0


def test_accounting_refuses_what_is_neither_event_nor_source():
    with pytest.raises(ValueError, match="event must be a dpfy.events.Event"):
        accounting.epsilon(object(), 1e-5)  # type: ignore[arg-type]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_ledger_and_accounting_do_not_import_each_other():
    ledger_files = [SRC / "ledger.py", *sorted((SRC / "ledger").glob("**/*.py"))]
    for path in filter(Path.exists, ledger_files):
        bad = {n for n in _imports(path) if n.startswith(("dpfy.accounting", "torch"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    for path in sorted((SRC / "accounting").glob("**/*.py")):
        bad = {n for n in _imports(path) if n.startswith(("dpfy.ledger", "torch"))}
        assert not bad, f"accounting/{path.name} imports {sorted(bad)}"

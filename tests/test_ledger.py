"""Ledger: records, JSON-lines round trip, write-ahead, truncation, grouping into events."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfy import accounting
from dpfy import events as ev
from dpfy.ledger import Ledger, LedgerFormatError
from dpfy.ledger.ledger import LedgerTruncationWarning, effective_noise_multiplier
from dpfy.ledger.records import SumQueryRecord
from dpfy.sampling import SampleSpec

POISSON = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)


def _ledger_with(spec, zs, *, epochs=None, path=None):
    ledger = Ledger(path)
    for i, z in enumerate(zs):
        sid = ledger.record_sample(spec, epoch=0 if epochs is None else epochs[i], step=i)
        ledger.record_sum_query(sid, sensitivity=2.0, noise_std=2.0 * z, name="g")
    return ledger


# -- SampleSpec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampler": "bogus"}, "sampler must be one of"),
        ({"sampler": "poisson"}, "needs sampling_rate"),
        ({"sampler": "poisson", "sampling_rate": 0.0}, "sampling_rate must be in"),
        ({"sampler": "poisson", "sampling_rate": 0.1, "max_batch_size": 5}, "needs dataset_size"),
        ({"sampler": "fixed_size", "batch_size": 10}, "needs dataset_size"),
        ({"sampler": "fixed_size", "batch_size": 10, "dataset_size": 5}, "batch_size must be"),
        ({"sampler": "balls_and_bins"}, "needs steps_per_epoch"),
        ({"sampler": "shuffle", "steps_per_epoch": 3, "max_batch_size": 4}, "max_batch_size"),
        ({"sampler": "full_batch", "adjacency": "replace_one"}, "adjacency must be"),
        ({"sampler": "full_batch", "adjacency": "nope"}, "adjacency must be one of"),
        ({"sampler": "full_batch", "unit": ""}, "unit must be"),
        ({"sampler": "deterministic", "steps_per_epoch": 0}, "steps_per_epoch must be"),
    ],
)
def test_sample_spec_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SampleSpec(**kwargs)


def test_sample_spec_round_trip():
    spec = SampleSpec("balls_and_bins", dataset_size=100, steps_per_epoch=10, max_batch_size=20)
    assert SampleSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# -- recording and validation -------------------------------------------------------------------


def test_record_validates_arguments():
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    with pytest.raises(ValueError, match="sample_id must be an id"):
        ledger.record_sum_query(sid + 1, sensitivity=1.0, noise_std=1.0)
    with pytest.raises(ValueError, match="noise_std must be in"):
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=-1.0)
    with pytest.raises(ValueError, match="sensitivity must be in"):
        ledger.record_sum_query(sid, sensitivity=math.inf, noise_std=1.0)
    with pytest.raises(ValueError, match="metadata must be JSON"):
        ledger.record_metadata(model=object())
    with pytest.raises(ValueError, match="spec must be"):
        ledger.record_sample({"sampler": "poisson"})
    assert len(ledger) == 1 and ledger.iteration == 1


def test_file_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    ledger = Ledger(path)
    ledger.record_metadata(model="mlp", lr=0.1)
    for step in range(3):
        sid = ledger.record_sample(POISSON, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.5, name="layer1")
        ledger.record_sum_query(sid, sensitivity=0.5, noise_std=1.0, name="layer2")
    ledger.close()
    loaded = Ledger.load(path)
    assert loaded.entries == ledger.entries
    assert loaded.to_event() == ledger.to_event()
    assert loaded.metadata == {"model": "mlp", "lr": 0.1}
    assert loaded.truncated_lines == 0
    with pytest.raises(RuntimeError, match="read-only"):
        loaded.record_sample(POISSON)


def test_write_ahead_entry_is_on_disk_before_return(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    ledger = Ledger(path)
    sid = ledger.record_sample(POISSON)
    before = len(synced)
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0)
    # Another reader sees the entry as soon as the call returns, and it was fsynced.
    last = path.read_text().splitlines()[-1]
    assert json.loads(last)["type"] == "sum_query"
    assert len(synced) == before + 1
    # Several queries of one sample: all on disk, one fsync.
    ledger.record_sum_queries(sid, [(1.0, 2.0, "a"), (0.5, 1.0, "b")])
    assert [json.loads(x)["name"] for x in path.read_text().splitlines()[-2:]] == ["a", "b"]
    assert len(synced) == before + 2
    with pytest.raises(ValueError, match="noise_std must be in"):
        ledger.record_sum_queries(sid, [(1.0, 2.0, "ok"), (1.0, math.nan, "bad")])
    assert len(_sum_queries(ledger)) == 3  # nothing of the rejected batch was written


def test_import_needs_no_torch():
    code = "import sys, dpfy.ledger; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resume_appends_and_keeps_ids_unique(tmp_path):
    path = tmp_path / "run.jsonl"
    first = _ledger_with(POISSON, [1.0, 1.0], path=path)
    first.close()
    resumed = Ledger(path)
    sid = resumed.record_sample(POISSON)
    resumed.record_sum_query(sid, sensitivity=2.0, noise_std=2.0)
    assert sid == 2
    assert Ledger.load(path).to_event() == ev.SelfComposed(
        ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 3
    )


# -- malformed and truncated files --------------------------------------------------------------


def test_malformed_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "run.jsonl"
    _ledger_with(POISSON, [1.0, 1.0], path=path).close()
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = '{"type": "sum_query", oops\n'
    path.write_text("".join(lines))
    with pytest.raises(LedgerFormatError, match="line 3: not valid JSON"):
        Ledger.load(path)
    # Hand-edited lines break the hash chain first; without verification (forensics) the
    # record checks still name the line.
    lines[2] = '{"type": "sum_query", "sample_id": 0, "sensitivity": 1, "noise_std": -1}\n'
    path.write_text("".join(lines))
    with pytest.raises(LedgerFormatError, match="line 3: hash chain broken"):
        Ledger.load(path)
    with pytest.raises(LedgerFormatError, match="line 3: noise_std must be in"):
        Ledger.load(path, verify=False)
    lines[2] = '{"type": "sum_query", "sample_id": 7, "sensitivity": 1, "noise_std": 1}\n'
    path.write_text("".join(lines))
    with pytest.raises(LedgerFormatError, match="line 3: sample_id must be an id"):
        Ledger.load(path, verify=False)
    path.write_text('{"type": "sample"}\n')
    with pytest.raises(LedgerFormatError, match="line 1: the first line must be"):
        Ledger.load(path)


def _sum_queries(ledger):
    return [r for r in ledger.entries if isinstance(r, SumQueryRecord)]


def test_every_truncation_point_parses_and_never_undercounts(tmp_path):
    """Cut a finished ledger at every byte: it loads, and every complete entry is counted."""
    path = tmp_path / "run.jsonl"
    full = _ledger_with(POISSON, [1.0, 2.0], path=path)
    full.close()
    data = path.read_bytes()
    header_end = data.index(b"\n") + 1
    cut_path = tmp_path / "cut.jsonl"
    for cut in range(header_end, len(data) + 1):
        cut_path.write_bytes(data[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ledger = Ledger.load(cut_path)
        complete = data[:cut].count(b"\n")  # lines that were fully written
        written = [
            json.loads(line) for line in data[:cut].split(b"\n")[1:complete] if line.strip()
        ]
        n_released = sum(1 for obj in written if obj["type"] == "sum_query")
        assert len(_sum_queries(ledger)) >= n_released
        partial = data[:cut].split(b"\n")[-1]
        try:
            json.loads(partial or b"{}")
            cut_mid_entry = False
        except ValueError:
            cut_mid_entry = True
        assert ledger.truncated_lines == int(cut_mid_entry)
        warned = any(issubclass(w.category, LedgerTruncationWarning) for w in caught)
        assert warned == cut_mid_entry


def test_truncated_sum_query_with_intact_fields_is_counted(tmp_path):
    path = tmp_path / "run.jsonl"
    _ledger_with(POISSON, [1.0], path=path).close()
    text = path.read_text()
    sid_line = '{"type":"sum_query","sample_id":0,"sensitivity":3.0,"noise_std":1.5,"na'
    path.write_text(text + sid_line)
    with pytest.warns(LedgerTruncationWarning, match="recovered and counted"):
        ledger = Ledger.load(path)
    assert ledger.truncated_lines == 1
    assert ledger.noise_multipliers()[0] == pytest.approx(effective_noise_multiplier(
        [2.0, 3.0], [2.0, 1.5]))


def test_resume_after_truncation_marks_the_cut_line(tmp_path):
    path = tmp_path / "run.jsonl"
    _ledger_with(POISSON, [1.0], path=path).close()
    with open(path, "a") as f:
        f.write('{"type":"sample","sample_id":1,"ep')
    with pytest.warns(LedgerTruncationWarning):
        resumed = Ledger(path)
    sid = resumed.record_sample(POISSON)
    resumed.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    resumed.close()
    with pytest.warns(LedgerTruncationWarning):
        again = Ledger.load(path)  # the cut line is now in the middle, marked, still accepted
    assert again.truncated_lines == 1
    assert [r.sample_id for r in _sum_queries(again)] == [0, 1]


def test_resume_after_a_complete_line_without_newline(tmp_path):
    path = tmp_path / "run.jsonl"
    _ledger_with(POISSON, [1.0], path=path).close()
    path.write_text(path.read_text().rstrip("\n"))
    resumed = Ledger(path)
    resumed.record_sum_query(resumed.record_sample(POISSON), sensitivity=2.0, noise_std=2.0)
    resumed.close()
    assert Ledger.load(path).to_event() == ev.SelfComposed(
        ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 2
    )


_WRITER = """
import sys
from dpfy.ledger import Ledger
from dpfy.sampling import SampleSpec
ledger = Ledger(sys.argv[1])
spec = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)
for step in range(100000):
    sid = ledger.record_sample(spec, step=step)
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0, name="x" * 200)
    print(step, flush=True)   # the "released" noisy value
"""


def test_killed_writer_leaves_a_parsable_ledger_that_never_undercounts(tmp_path):
    path = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    released = 0
    for line in proc.stdout:
        released = int(line) + 1
        if released >= 300:
            break
    proc.kill()  # SIGKILL mid-run: no cleanup, possibly mid-write
    proc.wait()
    released += sum(1 for _ in proc.stdout)  # values printed before the kill
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerTruncationWarning)
        ledger = Ledger.load(path)
    assert released >= 300
    assert len(_sum_queries(ledger)) >= released
    event = ledger.to_event()
    assert event.count >= released


# -- grouping (McMahan Eq. 1) and the sampler -> event mapping ----------------------------------


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.01, 10.0), st.floats(0.01, 10.0)), min_size=1, max_size=6
    )
)
def test_grouping_follows_mcmahan_equation_1(pairs):
    ledger = Ledger()
    sid = ledger.record_sample(POISSON)
    for s, sigma in pairs:
        ledger.record_sum_query(sid, sensitivity=s, noise_std=sigma)
    expected = sum((s / sigma) ** 2 for s, sigma in pairs) ** -0.5
    assert ledger.noise_multipliers()[sid] == pytest.approx(expected, rel=1e-12)
    assert ledger.to_event() == ev.PoissonSampled(0.01, ev.Gaussian(ledger.noise_multipliers()[0]))


def test_effective_noise_multiplier_limits():
    assert effective_noise_multiplier([1.0, 0.5], [1.2, 0.9]) == pytest.approx(
        (1.0 / 1.2**2 + 0.5**2 / 0.9**2) ** -0.5, rel=1e-15
    )
    assert effective_noise_multiplier([0.0, 0.0], [1.0, 0.0]) == math.inf
    assert effective_noise_multiplier([1.0, 1.0], [1.0, 0.0]) == 0.0
    assert effective_noise_multiplier([3.0], [6.0]) == 2.0


def test_poisson_runs_fold_and_change_with_z():
    ledger = _ledger_with(POISSON, [1.0, 1.0, 1.0, 2.0, 1.0])
    g = ev.PoissonSampled
    assert ledger.to_event() == ev.Composed(
        (
            ev.SelfComposed(g(0.01, ev.Gaussian(1.0)), 3),
            g(0.01, ev.Gaussian(2.0)),
            g(0.01, ev.Gaussian(1.0)),
        )
    )


def test_truncated_poisson_fixed_size_and_full_batch():
    trunc = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01, max_batch_size=20)
    assert _ledger_with(trunc, [1.5] * 4).to_event() == ev.TruncatedPoisson(
        0.01, 1.5, 4, 1000, 20
    )
    fixed = SampleSpec("fixed_size", dataset_size=1000, batch_size=10)
    assert _ledger_with(fixed, [1.5] * 2).to_event() == ev.SelfComposed(
        ev.FixedSizeSampled(10, 1000, ev.Gaussian(1.5)), 2
    )
    full = SampleSpec("full_batch")
    assert _ledger_with(full, [3.0]).to_event() == ev.Gaussian(3.0)


@pytest.mark.parametrize(
    ("sampler", "event_cls"),
    [("balls_and_bins", ev.BallsAndBins), ("shuffle", ev.Shuffled),
     ("deterministic", ev.Deterministic)],
)
def test_epoch_samplers_use_min_z_and_count_partial_epochs(sampler, event_cls):
    spec = SampleSpec(sampler, dataset_size=100, steps_per_epoch=3)
    zs = [2.0, 1.5, 2.0, 2.0, 2.0, 2.0, 3.0]  # epochs 0, 1 complete; epoch 2 partial
    ledger = _ledger_with(spec, zs, epochs=[0, 0, 0, 1, 1, 1, 2])
    assert ledger.to_event() == ev.Composed(
        (event_cls(1.5, 3, 1), event_cls(2.0, 3, 1), event_cls(3.0, 3, 1))
    )
    # Equal epochs fold; an epoch label holding two epochs' samples counts as two epochs.
    ledger = _ledger_with(spec, [1.0] * 9, epochs=[0] * 6 + [1] * 3)
    with pytest.warns(UserWarning, match="charging 2 epochs"):
        assert ledger.to_event() == event_cls(1.0, 3, 3)


def test_truncated_balls_and_bins():
    spec = SampleSpec("balls_and_bins", dataset_size=100, steps_per_epoch=4, max_batch_size=40)
    assert _ledger_with(spec, [1.0] * 5, epochs=[0] * 4 + [1]).to_event() == (
        ev.TruncatedBallsAndBins(1.0, 4, 2, 100, 40)
    )


def test_non_private_entries_and_zero_noise():
    ledger = _ledger_with(POISSON, [1.0, 1.0])
    assert not _has_non_private(ledger.to_event())
    sid = ledger.record_sample(POISSON)
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=0.0, name="oops")
    assert _has_non_private(ledger.to_event())
    ledger = _ledger_with(POISSON, [1.0])
    ledger.record_non_private(None, name="val_accuracy", reason="exact metric on train data")
    event = ledger.to_event()
    assert event.events[-1] == ev.NonPrivate("val_accuracy: exact metric on train data")
    # Zero sensitivity costs nothing; a sample without releases costs nothing.
    ledger = Ledger()
    ledger.record_sample(POISSON)
    sid = ledger.record_sample(POISSON)
    ledger.record_sum_query(sid, sensitivity=0.0, noise_std=0.0)
    assert ledger.to_event() == ev.Composed(())


def _has_non_private(event):
    if isinstance(event, ev.NonPrivate):
        return True
    return any(_has_non_private(c) for c in ev._children(event))


def test_one_unit_of_privacy_per_ledger():
    ledger = Ledger()
    ledger.record_sample(POISSON)
    ledger.record_sample(SampleSpec("full_batch", unit="user"))
    with pytest.raises(ValueError, match="one unit of privacy"):
        ledger.to_event()


# -- accounting ---------------------------------------------------------------------------------


def test_non_private_ledger_reports_infinite_epsilon():
    ledger = _ledger_with(POISSON, [1.0])
    ledger.record_non_private(0, name="debug", reason="no noise")
    assert accounting.epsilon(ledger, 1e-5).epsilon == math.inf


_Z = effective_noise_multiplier([1.0, 0.5], [1.2, 0.9])  # McMahan Eq. 1 (checked above)


@pytest.mark.parametrize(
    ("spec", "direct", "method"),
    [
        (POISSON, ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(_Z)), 20), "rdp"),
        (POISSON, ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(_Z)), 20), "pld"),
        (
            SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01, max_batch_size=30),
            ev.TruncatedPoisson(0.01, _Z, 20, 1000, 30),
            "rdp",
        ),
        (SampleSpec("full_batch"), ev.SelfComposed(ev.Gaussian(_Z), 20), "gaussian"),
        (
            SampleSpec("fixed_size", batch_size=10, dataset_size=1000),
            ev.SelfComposed(ev.FixedSizeSampled(10, 1000, ev.Gaussian(_Z)), 20),
            "rdp",
        ),
        (SampleSpec("deterministic", steps_per_epoch=10), ev.Deterministic(_Z, 10, 2), "gaussian"),
        (SampleSpec("shuffle", steps_per_epoch=10), ev.Shuffled(_Z, 10, 2), "shuffle"),
    ],
    ids=["poisson-rdp", "poisson-pld", "truncated-rdp", "full-gaussian", "fixed-rdp",
         "deterministic-gaussian", "shuffle-shuffle"],
)
def test_accounting_the_ledger_equals_accounting_the_event(spec, direct, method):
    from dpfy.accounting import delta, epsilon

    ledger = Ledger()
    for step in range(20):
        sid = ledger.record_sample(spec, epoch=step // 10, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.2, name="layer1")
        ledger.record_sum_query(sid, sensitivity=0.5, noise_std=0.9, name="layer2")
    assert ledger.to_event() == direct
    got = epsilon(ledger, 1e-5, method=method)
    want = epsilon(direct, 1e-5, method=method)
    assert got.epsilon == pytest.approx(want.epsilon, rel=1e-12, abs=1e-12)
    assert 0 < got.epsilon < math.inf
    if method == "rdp":  # and the other direction
        assert delta(ledger, got.epsilon, method=method).delta == pytest.approx(
            delta(direct, got.epsilon, method=method).delta, rel=1e-12
        )


def test_a_ledger_whose_directory_is_missing_fails_with_one_error(tmp_path, monkeypatch):
    """The open fails; the half-built file object then closes quietly (no second error)."""
    import gc

    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(FileNotFoundError):
        Ledger(str(tmp_path / "missing" / "ledger.jsonl"))
    gc.collect()
    assert unraisable == []

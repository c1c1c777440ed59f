"""Ledger integrity: the hash chain, the end record, one writer, and writes that fail cleanly."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import warnings

import pytest

from dpfy import accounting
from dpfy.ledger import Ledger, LedgerFormatError, LedgerIntegrityError, logfile
from dpfy.ledger.ledger import LedgerTruncationWarning
from dpfy.ledger.logfile import LedgerLockedError, LedgerWriteError
from dpfy.sampling import SampleSpec

POISSON = SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01)
DELTA = 1e-5


def _run(path, steps=6, std=1.0):
    with Ledger(path) as ledger:
        ledger.record_metadata(model="mlp")
        for step in range(steps):
            sid = ledger.record_sample(POISSON, step=step)
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=std, name="grad")
    return ledger


def _lines(path):
    return path.read_bytes().split(b"\n")[:-1]


def _write(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))


# -- the format ----------------------------------------------------------------------------------


def test_every_line_is_chained_and_close_writes_the_end_record(tmp_path):
    path = tmp_path / "run.jsonl"
    ledger = _run(path)
    objs = [json.loads(line) for line in _lines(path)]
    assert objs[0]["version"] == 2 and len(objs[0]["run_id"]) == 32
    assert objs[-2] == {"type": "end", "count": len(objs) - 2, "samples": 6, "releases": 6,
                        "prev": objs[-2]["prev"]}
    assert objs[-1]["type"] == "signature" and objs[-1]["lines"] == len(objs) - 1
    v = Ledger.load(path).verification
    assert v.status == "intact and signed" and v.lines == len(objs)
    assert v.run_id == objs[0]["run_id"]
    assert v.head == ledger.head == ledger.verification.head
    assert "intact and signed (hash chain over" in v.describe()


def test_resuming_continues_the_chain_and_an_open_ledger_is_not_verified(tmp_path):
    path = tmp_path / "run.jsonl"
    run_id = _run(path, steps=2).run_id
    resumed = Ledger(path)
    assert resumed.run_id == run_id
    resumed.record_sum_query(resumed.record_sample(POISSON), sensitivity=1.0, noise_std=1.0)
    resumed.flush()
    assert Ledger.load(path).verification.status == "intact, open or crash-cut"
    assert resumed.verification.status == "intact, open or crash-cut"
    resumed.close()
    assert resumed.verification.status == "intact and signed"
    loaded = Ledger.load(path)
    assert loaded.verification.status == "intact and signed" and loaded.iteration == 3


def test_crash_cut_last_line_is_not_a_broken_chain_and_resume_chains_past_it(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path, steps=2)
    lines = _lines(path)[:-1]  # the end record is gone: the writer crashed
    path.write_bytes(b"".join(line + b"\n" for line in lines) + b'{"type":"sample","sampl')
    with pytest.warns(LedgerTruncationWarning):
        assert Ledger.load(path).verification.status == "intact, open or crash-cut"
    with pytest.warns(LedgerTruncationWarning):
        with Ledger(path) as resumed:
            resumed.record_sum_query(resumed.record_sample(POISSON), sensitivity=1.0,
                                     noise_std=1.0)
    with pytest.warns(LedgerTruncationWarning):
        loaded = Ledger.load(path)
    assert loaded.verification.status == "intact and signed" and loaded.iteration == 3


# -- tampering ----------------------------------------------------------------------------------


def _tampered(path, edit):
    lines = _lines(path)
    objs = [json.loads(line) for line in lines]
    _write(path, edit(lines, objs))


def _dump(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("name", "edit", "line"),
    [
        ("delete every sum query",
         lambda lines, objs: [x for x, o in zip(lines, objs, strict=True)
                              if o["type"] != "sum_query"], 4),
        ("double every noise std",
         lambda lines, objs: [_dump({**o, "noise_std": 2 * o["noise_std"]})
                              if o["type"] == "sum_query" else x
                              for x, o in zip(lines, objs, strict=True)], 5),
        ("edit one number",
         lambda lines, objs: lines[:4] + [lines[4].replace(b'"sampling_rate":0.01',
                                                           b'"sampling_rate":0.001')] + lines[5:],
         6),
        ("reorder two steps",
         lambda lines, objs: lines[:2] + lines[4:6] + lines[2:4] + lines[6:], 3),
        ("delete trailing steps but keep the end record",
         lambda lines, objs: lines[:-6] + lines[-2:], 11),
    ],
)
def test_tampering_is_refused_naming_the_first_broken_line(tmp_path, name, edit, line):
    path = tmp_path / "run.jsonl"
    _run(path)
    honest = accounting.epsilon(Ledger.load(path), DELTA, "rdp").epsilon
    _tampered(path, edit)
    with pytest.raises(LedgerIntegrityError, match=f"line {line}: hash chain broken") as err:
        Ledger.load(path)
    assert err.value.line == line
    with pytest.raises(LedgerIntegrityError):
        Ledger(path)  # nothing is appended to a broken file either
    forensic = Ledger.load(path, verify=False)  # explicit opt-out: loads, says it is broken
    assert forensic.verification.status == "broken"
    assert forensic.verification.broken_line == line
    assert Ledger.verify(path).broken_line == line
    assert accounting.epsilon(forensic, DELTA, "rdp").epsilon <= honest  # why it must refuse


def test_deleting_trailing_steps_and_the_end_record_is_not_verified(tmp_path):
    path = tmp_path / "run.jsonl"
    _run(path)
    _write(path, _lines(path)[:-6])
    v = Ledger.load(path).verification
    assert v.status == "intact, open or crash-cut" and "no end record" in v.reason
    # the end record's count is chained too
    _run(path2 := tmp_path / "b.jsonl")
    lines = _lines(path2)
    end = json.loads(lines[-2])
    _write(path2, lines[:-2] + [_dump({**end, "count": 3})])
    with pytest.raises(LedgerIntegrityError, match="end record counts 3"):
        Ledger.load(path2)


def test_empty_file_is_not_a_ledger_and_a_version_1_file_is_unverified(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(LedgerFormatError, match="empty file: not a dpfy ledger"):
        Ledger.load(empty)
    v1 = tmp_path / "v1.jsonl"
    v1.write_text(
        '{"type":"header","format":"dpfy-ledger","version":1}\n'
        '{"type":"sample","sample_id":0,"epoch":0,"spec":' + json.dumps(POISSON.to_dict())
        + '}\n{"type":"sum_query","sample_id":0,"sensitivity":1.0,"noise_std":1.0,"name":""}\n'
    )
    old = Ledger.load(v1)
    assert old.iteration == 1 and old.verification.status == "unverified (no chain)"
    assert old.run_id is None
    with pytest.raises(LedgerFormatError, match="version 1 file"):
        Ledger(v1)  # no appending without a chain
    assert v1.read_text().count("\n") == 3


# -- one writer ----------------------------------------------------------------------------------

_HOLDER = """
import sys, time
from dpfy.ledger import Ledger
ledger = Ledger(sys.argv[1])
print("locked", flush=True)
sys.stdin.readline()
ledger.close()
"""


def test_a_second_writer_is_refused_in_another_process_and_in_this_one(tmp_path):
    path = tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(LedgerLockedError, match="another process") as err:
            Ledger(path)
        assert str(path) in str(err.value)
        assert Ledger.load(path).iteration == 0  # reading needs no lock
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    first = Ledger(path)  # released by the other process's close
    with pytest.raises(LedgerLockedError):
        Ledger(path)
    first.close()
    Ledger(path).close()


def test_the_lock_is_released_when_the_writer_dies(tmp_path):
    path = tmp_path / "run.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    proc.kill()
    proc.wait(timeout=30)
    with Ledger(path) as ledger:
        assert ledger.iteration == 0
    assert Ledger.load(path).verification.status == "intact and signed"


# -- writes that fail ----------------------------------------------------------------------------


def _disk_full_after(nbytes):
    """A write_fully that writes ``nbytes`` of the data, then fails with ENOSPC."""
    real = logfile.write_fully

    def write(fd, data):
        if nbytes:
            real(fd, data[:nbytes])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


def test_a_failed_write_leaves_the_file_loadable_and_refuses_further_appends(tmp_path,
                                                                              monkeypatch):
    path = tmp_path / "run.jsonl"
    ledger = Ledger(path)
    ledger.record_sum_query(ledger.record_sample(POISSON), sensitivity=1.0, noise_std=1.0)
    before = path.read_bytes()
    sid = ledger.record_sample(POISSON)
    monkeypatch.setattr(logfile, "write_fully", _disk_full_after(40))  # a partial write
    with pytest.raises(LedgerWriteError, match="No space left") as err:
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == before  # cut back: no partial record
    monkeypatch.undo()
    with pytest.raises(LedgerWriteError, match="refuses further appends"):
        ledger.record_sample(POISSON)
    ledger.close()  # no end record after a failure
    loaded = Ledger.load(path)
    assert loaded.iteration == 1 and loaded.verification.status == "intact, open or crash-cut"


def test_resuming_a_crash_cut_file_on_a_full_disk_leaves_it_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    _run(path, steps=2)
    cut = b"".join(line + b"\n" for line in _lines(path)[:-1]) + b'{"type":"sum_query","sa'
    path.write_bytes(cut)
    for nbytes in (0, 1, 30):
        monkeypatch.setattr(logfile, "write_fully", _disk_full_after(nbytes))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerTruncationWarning)
            with pytest.raises(LedgerWriteError):
                Ledger(path)
        assert path.read_bytes() == cut
    monkeypatch.undo()
    with pytest.warns(LedgerTruncationWarning):
        assert Ledger.load(path).iteration == 2
    with pytest.warns(LedgerTruncationWarning):
        Ledger(path).close()  # the lock was released by the failed opens


# -- the report ----------------------------------------------------------------------------------


def test_the_report_states_the_chain_and_dpfy_report_refuses_a_tampered_ledger(tmp_path, capsys):
    from dpfy.cli import main
    from dpfy.report import build_report

    path = tmp_path / "run.jsonl"
    ledger = _run(path)
    rep = build_report(Ledger.load(path), delta=DELTA, method="rdp", ledger_path=str(path))
    assert rep.ledger_integrity["status"] == "intact and signed"
    assert rep.ledger_integrity["head"] == ledger.head
    line = (f"- Ledger integrity: intact and signed (hash chain over 16 lines, run "
            f"{ledger.run_id[:8]}…")
    assert line in rep.to_markdown()
    assert rep.to_dict()["ledger_integrity"]["run_id"] == ledger.run_id
    forensic_copy = tmp_path / "copy.jsonl"
    _write(forensic_copy, [x for x in _lines(path) if b"sum_query" not in x])
    rep = build_report(Ledger.load(forensic_copy, verify=False), delta=DELTA, method="rdp")
    assert "- Ledger integrity: BROKEN at line 4:" in rep.to_markdown()
    assert main(["report", str(forensic_copy), "--delta", "1e-5", "--no-figures"]) == 2
    out, err = capsys.readouterr()
    message = (out + err).strip()
    assert "line 4: hash chain broken" in message and "Traceback" not in message
    assert len(message.splitlines()) == 1

"""Faults leave no debris: every fault and every malformed ledger header ends in one line that
names the file, exit code 2, no traceback, no 0-byte file; a fault before the first release
leaves a run directory that a re-run can use, one after it keeps the ledger closed."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dpfy import _files
from dpfy._files import write_atomic
from dpfy.cli import main
from dpfy.ledger import Ledger
from dpfy.ledger.signing import LedgerKeyError
from dpfy.publication import claimed_run_dir
from dpfy.sampling import SampleSpec


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err
    assert "Warning" not in captured.err, captured.err  # no raw warning line
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def small_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed, signed ledger of three releases (no training)."""
    path = tmp_path_factory.mktemp("ledger") / "ledger.jsonl"
    with Ledger(path) as ledger:
        for step in range(3):
            sid = ledger.record_sample(
                SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01), step=step
            )
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
        ledger.record_metadata(delta=1e-5)
    return path


def _with_header(source: Path, field: str, value: object) -> list[str]:
    lines = source.read_text(encoding="ascii").splitlines()
    header = json.loads(lines[0])
    header[field] = value
    return [json.dumps(header, separators=(",", ":")), *lines[1:]]


#: Each header field with values of the wrong type (the version with every JSON type).
MISTYPED = [("version", v) for v in ("2", None, [2], 2.0, True, {"v": 2})] + [
    (field, v) for field in ("format", "run_id", "public_key", "type") for v in (None, [2])
]


@pytest.mark.parametrize(("field", "value"), MISTYPED)
def test_a_mistyped_header_field_is_one_line_naming_the_file(
    small_ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str,
    value: object,
) -> None:
    bad = tmp_path / "ledger.jsonl"
    bad.write_text("\n".join(_with_header(small_ledger, field, value)) + "\n", encoding="ascii")
    code = main(["report", str(bad), "--no-figures", "--out", str(tmp_path / "report")])
    line = _one_line(capsys)
    assert code == 2 and line.startswith("dpfy: error: ") and str(bad) in line, line
    assert not (tmp_path / "report").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------
# the pieces: a file written whole or not at all, a ledger that could not start, a run
# directory after a fault
# ---------------------------------------------------------------------------------------------


def _failing(errno_: int):
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno_, os.strerror(errno_))

    return fail


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EACCES])
def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    target = tmp_path / "model.pt"
    failing = types.SimpleNamespace(**vars(os))
    failing.fsync = _failing(errno_)
    monkeypatch.setattr(_files, "os", failing)
    with pytest.raises(OSError) as caught:
        write_atomic(target, b"weights")
    assert caught.value.errno == errno_ and caught.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    write_atomic(target, lambda f: f.write(b"weights"))
    assert target.read_bytes() == b"weights" and list(tmp_path.iterdir()) == [target]


def test_a_ledger_whose_key_cannot_be_stored_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("DPFY_KEY_DIR", str(blocked))
    path = tmp_path / "run" / "ledger.jsonl"
    path.parent.mkdir()
    with pytest.raises(LedgerKeyError):
        Ledger(path)
    assert list(path.parent.iterdir()) == []  # no 0-byte ledger blocks the next try
    monkeypatch.setenv("DPFY_KEY_DIR", str(tmp_path / "keys"))
    Ledger(path).close()
    assert Ledger.verify(path).status == "intact and signed"


def test_output_to_a_full_device_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    full = open("/dev/full", "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    monkeypatch.setattr(sys, "stdout", full)
    code = main(["epsilon", "-n", "1000", "-b", "10", "-z", "1.0", "--delta", "1e-5",
                 "--steps", "10", "--method", "rdp"])
    monkeypatch.undo()
    with contextlib.suppress(OSError):  # what is still buffered cannot be written either
        full.close()
    line = _one_line(capsys)
    assert code == 2 and "No space left on device" in line, line


_FSIZE_CHILD = """
import resource, sys
from pathlib import Path
from dpfy._files import write_atomic
out = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
write_atomic(out / "summary.json", "{}")
try:
    write_atomic(out / "model.pt", b"w" * 100_000)
except OSError as err:
    print(err.errno, err.filename)
"""


def test_a_file_size_limit_leaves_whole_files(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr  # SIGXFSZ is ignored: the write fails with EFBIG
    assert done.stdout == f"{errno.EFBIG} {tmp_path / 'model.pt'}\n", done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no model debris


def _run_that_fails(out: Path, *, release: bool) -> None:
    with claimed_run_dir(out):
        (out / "run.toml").write_text("dataset = 'mnist'\n")
        ledger = Ledger(out / "ledger.jsonl")
        sid = ledger.record_sample(SampleSpec("poisson", dataset_size=10, sampling_rate=0.1))
        if release:
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
        (out / "figures").mkdir()
        (out / "model.pt").write_bytes(b"")  # what a full disk left
        ledger.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "model.pt"))


def test_a_fault_before_the_first_release_leaves_a_directory_to_run_again(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    keys = Path(os.environ["DPFY_KEY_DIR"])
    before = set(keys.iterdir())
    with pytest.raises(OSError) as caught:
        _run_that_fails(out, release=False)
    assert not out.exists() and set(keys.iterdir()) == before
    assert "nothing was released" in caught.value.__notes__[0]
    out.mkdir()
    (out / "README").write_text("mine")  # what the directory held before is kept
    with pytest.raises(OSError):
        _run_that_fails(out, release=False)
    assert [p.name for p in out.iterdir()] == ["README"]


def test_a_fault_after_releases_keeps_the_ledger_and_says_to_use_a_new_out(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    with pytest.raises(OSError) as caught:
        _run_that_fails(out, release=True)
    assert sorted(p.name for p in out.iterdir()) == ["figures", "ledger.jsonl", "run.toml"]
    assert Ledger.verify(out / "ledger.jsonl").status == "intact and signed"
    note = caught.value.__notes__[0]
    assert "keeps the 1 releases" in note and "give a new --out" in note


def test_a_cut_ledger_is_reported_incomplete_without_a_raw_warning(
    small_ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cut = tmp_path / "ledger.jsonl"
    cut.write_bytes(small_ledger.read_bytes()[:-40])  # a crash in the middle of the last line
    code = main(["report", str(cut), "--no-figures", "--out", str(tmp_path / "report")])
    captured = capsys.readouterr()
    assert code == 0 and "Incomplete" in captured.out
    assert "LedgerTruncationWarning" not in captured.err and "Traceback" not in captured.err
    assert all(line.startswith("dpfy: ") for line in captured.err.splitlines()), captured.err
    assert "was cut short" in captured.err


def test_a_report_of_the_same_head_keeps_the_audit_section(
    small_ledger: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpfy.audit.run import write_section

    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_bytes(small_ledger.read_bytes())
    assert main(["report", str(run / "ledger.jsonl"), "--no-figures"]) == 0
    data = json.loads((run / "report.json").read_text())
    section = {"method": "one-run-train", "verdict": "no violation found",
               "epsilon_lower": 0.0, "audited_claim": data["epsilon"],
               "run_epsilon": data["epsilon"], "confidence": 0.95}
    write_section(run, data, section)  # what an audit adds
    assert main(["report", str(run / "ledger.jsonl"), "--no-figures"]) == 0
    capsys.readouterr()
    assert json.loads((run / "report.json").read_text())["audit"] == section
    assert "no violation found" in (run / "report.md").read_text()


# ---------------------------------------------------------------------------------------------
# `dpfy train`: a fault before the first release, and one while the model is saved
# ---------------------------------------------------------------------------------------------

TINY = ["--epochs", "1", "--batch-size", "32", "--train-limit", "64", "--test-limit", "32",
        "--seed", "0", "--threads", "1"]


def test_train_with_an_unusable_key_directory_leaves_an_out_to_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("DPFY_KEY_DIR", str(blocked))
    out = tmp_path / "run"
    code = main(["train", "mnist", "--out", str(out), *TINY])
    line = _one_line(capsys)
    assert code == 2 and "signing key" in line and str(blocked) in line, line
    assert "nothing was released" in line
    assert not out.exists()  # so the same --out runs as a new one (no 0-byte ledger.jsonl)


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
def test_train_on_a_full_disk_keeps_the_closed_ledger_and_no_model_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    disk_full = types.SimpleNamespace(**vars(os))  # dpfy._files' view of os only
    disk_full.fsync = _failing(errno.ENOSPC)
    monkeypatch.setattr(_files, "os", disk_full)  # every whole-file write fails
    out = tmp_path / "run"
    code = main(["train", "mnist", "--out", str(out), *TINY])
    line = _one_line(capsys)
    assert code == 2 and f"cannot use {out / 'model.pt'}: No space left on device" in line
    assert "keeps the 2 releases" in line and "give a new --out" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["ledger.jsonl"]  # no 0-byte model.pt
    ledger = Ledger.load(out / "ledger.jsonl")
    assert ledger.verification.status == "intact and signed"  # closed, and its end record says how
    end = json.loads((out / "ledger.jsonl").read_text().splitlines()[-2])
    assert end["type"] == "end" and end["ended"].startswith("early (the run failed: OSError)")


def test_a_fault_while_a_run_holds_its_ledger_closes_it_saying_so(tmp_path: Path) -> None:
    from dpfy.training.skeleton import closed_on_fault

    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=10, sampling_rate=0.1))
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    with pytest.raises(OSError), closed_on_fault(ledger):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run.toml"))
    assert Ledger.verify(path).status == "intact and signed"
    assert Ledger.load(path).ended == "early (the run failed: OSError): 1 releases before the fault"

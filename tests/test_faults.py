"""Faults leave no debris: every fault and every malformed ledger header ends in one line that
names the file, exit code 2, no traceback, no 0-byte file; a fault before the first release
leaves a run directory that a re-run can use, one after it keeps the ledger closed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpfy.cli import main
from dpfy.ledger import Ledger
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

"""``dpfy audit RUN_DIR``: the Audit section of a run's report, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpfy import runs
from dpfy.cli import main
from dpfy.ledger import Ledger
from dpfy.report.statement import PrivacyReport
from dpfy.sampling import SampleSpec

torch.set_num_threads(1)


def _run_dir(tmp_path: Path, z: float = 1.0) -> Path:
    """A small run: 20 Poisson steps of a GaussianSumQuery(C=0.5, z), its ledger and report."""
    run = tmp_path / "run"
    run.mkdir()
    ledger = Ledger(run / "ledger.jsonl")
    ledger.record_metadata(clip_norm=0.5, noise_multiplier=z, expected_batch_size=10.0)
    for step in range(20):
        sid = ledger.record_sample(
            SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01), step=step
        )
        ledger.record_sum_query(sid, sensitivity=0.5, noise_std=0.5 * z)
    ledger.record_metadata(delta=1e-5)
    ledger.close()
    runs.report_ledger(run / "ledger.jsonl", out=run, figures=False)
    return run


def test_the_report_has_no_audit_until_one_runs() -> None:
    fields = {f.name for f in PrivacyReport.__dataclass_fields__.values()}
    assert "audit" in fields


# statistical: dpsgd self-test under a fixed OS key (fixed_os_key), attack seed 0: deterministic
@pytest.mark.usefixtures("fixed_os_key")
def test_audit_writes_the_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path)
    assert "## Audit" not in (run / "report.md").read_text()
    code = main(["audit", str(run), "--trials", "40000", "--confidence", "0.9", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    section = json.loads(out)
    assert section["method"] == "canary" and section["confidence"] == 0.9
    assert section["audited_claim"] == pytest.approx(4.377, abs=0.01)  # one release, z = 1
    assert 0.5 < section["epsilon_lower"] < section["audited_claim"] < section["ceiling"]
    assert section["self_tests"] == [] and section["verdict"] == "no violation found"
    md = (run / "report.md").read_text()
    assert "## Audit" in md and "Ceiling of the method" in md and "no violation found" in md
    assert "| Layer types replayed | Linear |" in md  # no types recorded: the Linear probe
    assert section["self_tests_run"] == [
        "replay", "sampler", "ledger counts", "recorded epsilon", "keys", "dpsgd"]
    report = json.loads((run / "report.json").read_text())
    assert report["audit"]["epsilon_lower"] == section["epsilon_lower"]
    assert report["epsilon"] > 0  # the rest of the report is kept


# statistical: dpsgd self-test under a fixed OS key (fixed_os_key), attack seed 0: deterministic
@pytest.mark.usefixtures("fixed_os_key")
def test_one_run_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path)
    code = main(["audit", str(run), "--method", "one-run", "--trials", "5000", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    section = json.loads(out)
    assert section["method"] == "one-run" and section["guesses"] == 100
    assert 0.0 < section["epsilon_lower"] <= section["ceiling"] < 3.6
    # the f-DP reading of the same counts: tighter, and below the release's exact 1/z
    assert section["epsilon_lower"] < section["fdp_epsilon_lower"] <= section["fdp_ceiling"]
    assert 0.0 < section["fdp_mu_lower"] <= section["audited_mu"]
    assert section["verdict"] == "no violation found"


def test_a_ledger_short_of_the_plan_is_a_violation(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)  # 20 steps recorded
    ledger = Ledger(run / "ledger.jsonl")  # reopened: the run facts of a 3 x 10 step plan
    ledger.record_metadata(epochs=3, steps_per_epoch=10, stopped="completed")
    ledger.close()
    (run / "report.json").unlink()  # the report of the ledger as it now is
    runs.report_ledger(run / "ledger.jsonl", out=run, figures=False)
    section = runs.audit_and_report(run, method="one-run", trials=1000)
    assert section["verdict"].startswith("VIOLATION")
    assert any("sampler's plan of 3 epochs x 10 steps = 30" in f for f in section["self_tests"])
    # a summary.json that counts the planned 30 steps is refused by the cross-check, by name
    (run / "summary.json").write_text(json.dumps({"steps": 30}))
    with pytest.raises(ValueError, match="summary.json steps: published 30, the ledger gives 20"):
        runs.audit_and_report(run, method="one-run", trials=1000)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["audit", "/nonexistent/run"], "run_dir"),
        (["audit", "RUN", "--confidence", "1"], "confidence"),
        (["audit", "RUN", "--trials", "1"], "trials"),
        (["audit", "RUN", "--method", "black-box"], "method"),
    ],
)
def test_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    run = _run_dir(tmp_path)
    args = [str(run) if a == "RUN" else a for a in args]
    assert main(args) == 2
    _, err = capsys.readouterr()
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_directory_without_a_report_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="ledger.jsonl"):
        runs.audit_and_report(tmp_path)
    # a ledger alone (a federated server's directory): one line naming the step that writes it
    run = _run_dir(tmp_path)
    (run / "report.json").unlink()
    assert main(["audit", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds ledger.jsonl but no report.json: write the run's report there first" in err
    assert "dpfy report" in err and len(err.splitlines()) == 1 and "Traceback" not in err

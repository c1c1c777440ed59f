"""Privacy reports: every checklist field present and consistent with the ledger."""

from __future__ import annotations

import json
import math

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.cli import main
from dpfy.ledger import Ledger
from dpfy.report import build_report, write_report
from dpfy.report.statement import REPORT_FIELDS, privacy_tier
from dpfy.sampling import SampleSpec

N, Q, Z, C, STEPS = 10_000, 0.01, 1.1, 0.5, 200


def poisson_ledger(path=None) -> Ledger:
    ledger = Ledger(path, fsync=False)
    spec = SampleSpec("poisson", dataset_size=N, sampling_rate=Q)
    ledger.record_metadata(clip_norm=C, learning_rate=0.5, delta=1e-5, test_accuracy=0.9)
    for step in range(STEPS):
        sid = ledger.record_sample(spec, step=step)
        ledger.record_sum_query(sid, sensitivity=C, noise_std=Z * C, name="gradient")
    return ledger


def shuffle_ledger(path) -> Ledger:
    ledger = Ledger(path, fsync=False)
    spec = SampleSpec("shuffle", dataset_size=N, batch_size=100, steps_per_epoch=100)
    ledger.record_metadata(delta=1e-5)
    for epoch in range(2):
        for step in range(100):
            sid = ledger.record_sample(spec, epoch=epoch, step=step)
            ledger.record_sum_query(sid, sensitivity=1.0, noise_std=2.0, name="gradient")
    return ledger


def test_every_field_present_and_consistent_with_ledger(tmp_path):
    ledger = poisson_ledger()
    rep = build_report(ledger, delta=1e-5)
    data = rep.to_dict()
    for field in REPORT_FIELDS:
        assert field in data, field
        assert data[field] not in (None, "", {}), field
    direct = accounting.epsilon(
        ev.SelfComposed(ev.PoissonSampled(Q, ev.Gaussian(Z)), STEPS), 1e-5
    )
    assert rep.epsilon == pytest.approx(direct.epsilon, rel=1e-12)
    assert rep.accounting_method == direct.method
    assert rep.adjacency == "add_or_remove"
    assert rep.unit_of_privacy == "example"
    assert rep.sampler["sampler"] == "poisson"
    assert rep.hyperparameters["steps"] == STEPS
    assert rep.hyperparameters["sampling_rate"] == Q
    assert rep.hyperparameters["noise_multiplier"] == pytest.approx(Z, rel=1e-12)
    assert rep.hyperparameters["clip_norm"] == C
    assert rep.hyperparameters["epochs"] == pytest.approx(STEPS * Q)
    assert rep.delta_times_n == pytest.approx(1e-5 * N)
    assert rep.privacy_tier == privacy_tier(rep.epsilon)
    assert rep.utility["test_accuracy"] == 0.9
    assert rep.rdp_curve is not None and len(rep.rdp_curve["orders"]) == len(rep.rdp_curve["rdp"])
    assert f"{rep.epsilon:.5g}" in rep.formal_statement
    # both provable methods are listed beside the chosen one, which is the tightest
    assert {"rdp", "pld"} <= set(k for k, v in rep.other_methods.items() if isinstance(v, dict))
    assert rep.epsilon <= min(
        v["epsilon"] for v in rep.other_methods.values() if isinstance(v, dict)
    ) + 1e-12


def test_markdown_and_figures_written(tmp_path):
    ledger = poisson_ledger()
    rep = write_report(build_report(ledger, delta=1e-5), ledger, tmp_path)
    md = (tmp_path / "report.md").read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["epsilon"] == pytest.approx(rep.epsilon)
    for heading in ("# Privacy report", "## Checklist", "## Assumptions", "## Reproduce",
                    "## DP hyperparameters", "## Figures", "## Attack risk"):
        assert heading in md
    # every table row has the same number of cells as its header
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table and all(line.count("|") - line.count("\\|") == 3 for line in table)
    assert set(rep.figures) == {"epsilon_over_training", "epsilon_vs_delta",
                                "accountant_comparison", "attack_risk"}
    # the attack-risk table is the report's TPR bound, from the ledger's event
    from dpfy.accounting.risk import attack_risk

    want = attack_risk(ledger.to_event()).to_dict()["tpr_at_fpr"]
    assert data["attack_risk"]["tpr_at_fpr"] == pytest.approx(want)
    assert set(want) == {"0.001", "0.01", "0.1"}
    for fpr, tpr in want.items():
        assert f"| {fpr} | {tpr:.4g}" in md
    for path in rep.figures.values():
        assert (tmp_path / path).stat().st_size > 10_000  # a real PNG, not an empty file


def test_non_private_ledger_says_so():
    ledger = poisson_ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=N, sampling_rate=Q))
    ledger.record_non_private(sid, name="debug", reason="NoPrivacyQuery")
    rep = build_report(ledger, delta=1e-5)
    assert math.isinf(rep.epsilon)
    assert rep.formal_statement.startswith("NO differential privacy guarantee")
    assert "Tier 3" in rep.privacy_tier


def test_cli_report_reaccounts_the_same_epsilon(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    ledger = poisson_ledger(path)
    ledger.close()
    code = main(["report", str(path), "--json", "--no-figures", "--method", "pld"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    expected = accounting.epsilon(Ledger.load(path), 1e-5, "pld").epsilon
    assert data["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert data["accounting_method"] == "pld"
    assert (tmp_path / "report.md").exists()


def test_cli_report_on_shuffle_ledger_refuses_poisson_and_shows_honest_bounds(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    shuffle_ledger(path).close()
    for method in ("pld", "rdp"):
        assert main(["report", str(path), "--method", method, "--no-figures"]) == 2
        err = capsys.readouterr().err
        assert "Shuffled" in err and "Traceback" not in err
    assert main(["report", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["accounting_method"] == "shuffle"
    # no amplification: 2 epochs of a Gaussian with z = 2 is mu = sqrt(2) / 2 GDP
    exact = accounting.epsilon(ev.SelfComposed(ev.Gaussian(2.0), 2), 1e-5, "gaussian").epsilon
    assert data["epsilon"] == pytest.approx(exact, rel=1e-6)
    assert 0 < data["epsilon_lower"] <= data["epsilon"]
    poisson = [k for k in data["other_methods"] if "NOT valid" in k]
    assert poisson, "the report shows the (invalid) Poisson number for comparison"
    assert data["other_methods"][poisson[0]] < data["epsilon"]
    assert any("NO amplification" in a for a in data["assumptions"])
    md = (tmp_path / "report.md").read_text()
    assert "lower bound" in md


@pytest.mark.slow
@pytest.mark.usefixtures("image_chunks_of_64", "one_thread")  # --threads 1, put back after
def test_train_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "mnist", "--epochs", "1", "--batch-size", "128", "--train-limit",
                 "512", "--test-limit", "256", "--out", str(out), "--threads", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for name in ("model.pt", "ledger.jsonl", "report.md", "report.json", "summary.json",
                 "figures/epsilon_over_training.png"):
        assert (out / name).exists(), name
    data = json.loads((out / "report.json").read_text())
    assert data["epsilon"] <= 3.0
    ledger = Ledger.load(out / "ledger.jsonl")
    assert data["epsilon"] == pytest.approx(
        accounting.epsilon(ledger, 1e-5, "pld").epsilon, rel=1e-12
    )
    assert data["hyperparameters"]["steps"] == ledger.iteration
    assert 0.0 <= data["utility"]["test_accuracy"] <= 1.0
    # dpfy report on the run's ledger reproduces the same epsilon
    assert main(["report", str(out / "ledger.jsonl"), "--json", "--no-figures",
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["epsilon"] == pytest.approx(data["epsilon"], rel=1e-12)


@pytest.mark.parametrize(
    ("sampling", "noise", "release", "statement"),
    [
        ("secure (AES-256-CTR, OS key)", "secure (AES-256-CTR, OS key)", "DP release:",
         "The training run satisfies"),
        ("seeded (seed 0)", "seeded (seed 0)", "Seeded experiment — not a DP release",
         "Not a DP release (seeded experiment)"),
        ("secure (AES-256-CTR, OS key)", "seeded (seed 3)", "Seeded experiment — not a DP release",
         "Not a DP release (seeded experiment)"),
        (None, None, "Randomness not recorded", "The training run satisfies"),
    ],
)
def test_report_names_the_randomness_and_says_whether_it_is_a_dp_release(
    tmp_path, sampling, noise, release, statement
):
    ledger = poisson_ledger()
    if sampling is not None:
        ledger.record_metadata(sampling_randomness=sampling, noise_randomness=noise)
    rep = write_report(build_report(ledger, delta=1e-5), ledger, tmp_path, figures=False)
    assert rep.release.startswith(release)
    assert rep.formal_statement.startswith(statement)
    assert f"{rep.epsilon:.5g}" in rep.formal_statement
    recorded = "not recorded in the ledger"
    assert (rep.sampling_randomness, rep.noise_randomness) == (
        sampling or recorded, noise or recorded
    )
    md = (tmp_path / "report.md").read_text()
    assert md.splitlines()[2] == f"> {rep.release}"  # the first thing a reader sees
    assert f"| Sampling randomness | {rep.sampling_randomness} |" in md
    assert f"| Noise randomness | {rep.noise_randomness} |" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["release"] == rep.release and data["noise_randomness"] == rep.noise_randomness
    if release.startswith("Seeded"):  # the seed appears only where the randomness is named
        assert "the (epsilon, delta) below describes the mechanism only" in rep.release
        assert "seed 0" not in rep.formal_statement and "seed 3" not in rep.formal_statement


def test_a_ledger_of_two_stages_reports_both_samplers():
    """LP-FT: a full-batch probe, then Poisson fine-tuning, in one ledger."""
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("full_batch", dataset_size=500))
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=20.0, name="probe")
    for step in range(3):
        sid = ledger.record_sample(
            SampleSpec("poisson", dataset_size=500, sampling_rate=0.1), step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0, name="gradient")
    report = build_report(ledger, delta=1e-5)
    stages = report.sampler["stages"]
    assert [s["sampler"] for s in stages] == ["full_batch", "poisson"]
    assert report.assumptions[0].startswith("stage 1 of 2 (full_batch): ")
    assert report.assumptions[1].startswith("stage 2 of 2 (poisson): ")
    assert "poisson" in report.to_markdown().split("Sampler actually used")[1].split("\n")[0]

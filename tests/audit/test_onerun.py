"""One-run audit of a real `dpfy train` run: canaries in the training set, both scores, both
analyses, the Audit section, and bad input refused before anything runs."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dpfy import runs
from dpfy.audit.onerun import center_by_label, count_correct, make_canaries
from dpfy.audit.stats import one_run_ceiling
from dpfy.cli import main
from dpfy.config import RunConfig
from dpfy.randomness import Randomness
from dpfy.training import recipes


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe pads every batch to 1024 rows and draws figures: same run, less waiting
    (the test split is cut by ``test_limit`` in ``_train``)."""
    real = recipes.train_image_classifier

    def small_chunks(config, recipe=None, hooks=None):  # type: ignore[no-untyped-def]
        recipe = recipes.ImageRecipe() if recipe is None else recipe
        return real(config, dataclasses.replace(recipe, max_physical_batch_size=64), hooks)

    monkeypatch.setattr(recipes, "train_image_classifier", small_chunks)
    monkeypatch.setattr(runs, "_report_files",
                        functools.partial(runs._report_files, figures=False))
    torch.set_num_threads(1)


def _train(tmp: Path, **kw: Any) -> runs.TrainedRun:
    opts: dict[str, Any] = dict(
        out=tmp, delta=1e-5, epochs=2, batch_size=16, train_limit=100, learning_rate=1.0,
        clip_norm=1.0, audit_canaries=50, audit_guesses=10, test_limit=500,
    )
    opts.update(kw)
    return runs.train_and_report(RunConfig(dataset="mnist", **opts))


def test_little_noise_gives_a_positive_bound_written_to_the_report(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", target_epsilon=100.0, epochs=8, audit_canaries=100,
                 audit_guesses=20, seed=0)
    a = run.report.audit
    assert a["method"] == "one-run-train" and a["trials"] == 100 and a["guesses"] == 20
    white = next(r for r in a["scores"] if r["score"] == "white-box")
    assert white["epsilon_lower"] > 0.0  # benchmarks/audit.py (d), same run: 19 of 20, 1.10
    assert white["fdp_epsilon_lower"] > white["epsilon_lower"]
    assert 0 < a["epsilon_lower"] <= a["ceiling"] < run.report.epsilon
    assert a["ceiling"] == pytest.approx(one_run_ceiling(100, 20, delta=1e-5, confidence=0.975))
    assert a["steps_scored"] == sum(1 for _ in run.model.history.steps)
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["audit"]["epsilon_lower"] == a["epsilon_lower"]
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Audit" in md and "f-DP (Gaussian) lower bound" in md and "not evidence" in md
    ledger = (tmp_path / "run" / "ledger.jsonl").read_text()
    assert '"audit_canaries":100' in ledger
    # N counts the data and the included canaries
    assert run.report.sampler["dataset_size"] == 100 + a["included"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bounds_stay_below_the_claim_of_a_correct_run(tmp_path: Path, seed: int) -> None:
    run = _train(tmp_path / "run", target_epsilon=2.0, seed=seed)
    a = run.report.audit
    assert a["verdict"] == "no violation found"
    for row in a["scores"]:
        assert row["epsilon_lower"] <= run.report.epsilon
        assert row["fdp_epsilon_lower"] <= run.report.epsilon


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(audit_canaries=1), "audit_canaries must be an integer in"),
        (dict(audit_canaries=101), "audit_canaries must be"),
        (dict(audit_canaries=50, audit_guesses=51), "audit_guesses must be an integer in"),
        (dict(audit_canaries=None, audit_guesses=10), "audit_guesses needs audit_canaries"),
        (dict(audit_confidence=1.0), "audit_confidence must be in"),
        (dict(workers=2), "needs workers=1"),
        (dict(mechanism="bandmf", sampler="cyclic"), "needs mechanism='dpsgd'"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _train(tmp_path / "run", target_epsilon=2.0, seed=0, **kw)
    assert not (tmp_path / "run").exists()


def test_the_cli_never_shows_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in (["--audit-canaries", "1"], ["--audit-canaries", "500"],
                  ["--audit-canaries", "20", "--audit-guesses", "21"],
                  ["--audit-canaries", "20", "--audit-confidence", "2"]):
        code = main(["train", "mnist", "--train-limit", "100", "--out", str(tmp_path / "x"),
                     *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("dpfy: error:") and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_guessing_rule_and_centering_against_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        m = int(rng.integers(2, 30))
        k = int(rng.integers(1, m + 1))
        scores, coins = rng.normal(size=m), rng.random(m) < 0.5
        ranked = sorted(range(m), key=lambda i: scores[i])
        want = sum(coins[i] for i in ranked[m - k // 2:]) if k // 2 else 0
        want += sum(not coins[i] for i in ranked[: k - k // 2])
        assert count_correct(scores, coins, k) == want
    labels = np.array([0, 0, 1, 1, 1])
    out = center_by_label(np.array([1.0, 3.0, 0.0, 3.0, 6.0]), labels)
    assert out.tolist() == [-1.0, 1.0, -3.0, 0.0, 3.0]


def test_canaries_coins_are_fair_and_seeded_runs_repeat() -> None:
    a = make_canaries(4000, Randomness(3), pixel_stats=(0.5, 0.25))
    b = make_canaries(4000, Randomness(3), pixel_stats=(0.5, 0.25))
    assert np.array_equal(a.included, b.included) and torch.equal(a.inputs, b.inputs)
    assert abs(a.included.mean() - 0.5) < 0.03
    assert set(a.labels.tolist()) == set(range(10))
    assert float(a.inputs.min()) >= -2.0 and float(a.inputs.max()) <= 2.0
    x, y = a.training_rows()
    assert len(x) == len(y) == int(a.included.sum())


def test_the_cli_trains_audits_and_prints_the_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "mnist", "--train-limit", "60", "--epochs", "1", "--batch-size", "16",
                 "--clip-norm", "1", "--audit-canaries", "20", "--seed", "0",
                 "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0
    assert "one-run audit (20 canaries, 4 guesses" in out and "ceiling" in out
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["audit"]["method"] == "one-run-train"
    assert "--audit-canaries 20 --audit-guesses 4" in data["reproduce"]["train_command"]

"""The `dpfy` command: JSON fields, agreement with the library, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.cli import main

BASE = ["--dataset-size", "60000", "--batch-size", "256", "--delta", "1e-5"]


def run_json(capsys, args):
    code = main([*args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_epsilon_json_matches_library(capsys):
    out = run_json(capsys, ["epsilon", *BASE, "--noise-multiplier", "1.1", "--epochs", "2"])
    for key in ("epsilon", "delta", "method", "sampling_rate", "noise_multiplier", "steps"):
        assert key in out
    assert out["sampling_rate"] == pytest.approx(256 / 60000)
    steps = out["steps"]
    assert steps == 2 * round(60000 / 256)  # Poisson: an epoch is round(1/q) steps
    event = ev.SelfComposed(ev.PoissonSampled(256 / 60000, ev.Gaussian(1.1)), steps)
    assert out["epsilon"] == pytest.approx(accounting.epsilon(event, 1e-5).epsilon, rel=1e-12)
    assert out["adjacency"] == "add_or_remove"


def test_epsilon_method_rdp_and_steps(capsys):
    out = run_json(
        capsys,
        ["epsilon", *BASE, "--noise-multiplier", "1.0", "--steps", "1000", "--method", "rdp"],
    )
    assert out["method"] == "rdp"
    assert out["steps"] == 1000


def test_calibrate_round_trip(capsys):
    out = run_json(capsys, ["calibrate", "--target-epsilon", "3", *BASE, "--epochs", "3"])
    assert out["epsilon"] <= 3.0
    assert out["noise_multiplier"] > 0
    back = run_json(
        capsys,
        ["epsilon", *BASE, "--noise-multiplier", repr(out["noise_multiplier"]), "--epochs", "3"],
    )
    assert back["epsilon"] == pytest.approx(out["epsilon"], rel=1e-9)
    assert back["epsilon"] <= 3.0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["epsilon", *BASE, "--noise-multiplier", "-1", "--epochs", "1"], "noise_multiplier"),
        (
            ["epsilon", "--dataset-size", "100", "--batch-size", "10", "--delta", "1.5",
             "--noise-multiplier", "1", "--epochs", "1"],
            "delta",
        ),
        (["epsilon", *BASE, "--noise-multiplier", "1"], "--epochs or --steps"),
        (["epsilon", *BASE, "--noise-multiplier", "1", "--epochs", "1", "--steps", "5"],
         "--epochs or --steps"),
        (
            ["epsilon", "--dataset-size", "100", "--batch-size", "1000", "--delta", "1e-5",
             "--noise-multiplier", "1", "--epochs", "1"],
            "batch_size",
        ),
        (["epsilon", *BASE, "--noise-multiplier", "abc", "--epochs", "1"], "noise-multiplier"),
        (["epsilon", *BASE, "--noise-multiplier", "1", "--epochs", "1", "--sampler", "x"],
         "sampler"),
        (
            ["epsilon", *BASE, "--noise-multiplier", "1", "--epochs", "1", "--sampler",
             "shuffle", "--method", "rdp"],
            "shuffle",
        ),
        (
            ["epsilon", *BASE, "--noise-multiplier", "1", "--epochs", "1", "--sampler",
             "shuffle", "--method", "pld"],
            "shuffle",
        ),
        (["calibrate", "--target-epsilon", "-1", *BASE, "--epochs", "1"], "target_epsilon"),
        (["report", "/nonexistent/ledger.jsonl"], "ledger"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, args, needle):
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle.lower() in lines[0].lower()


def test_console_script_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "dpfy.cli", "epsilon", *BASE, "--noise-multiplier", "0",
         "--epochs", "1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "noise_multiplier must be in" in proc.stderr


def test_shuffle_reports_honest_bounds(capsys):
    out = run_json(
        capsys,
        ["epsilon", "--dataset-size", "10000", "--batch-size", "100", "--delta", "1e-5",
         "--noise-multiplier", "1.0", "--epochs", "1", "--sampler", "shuffle"],
    )
    assert out["method"] == "shuffle"
    # No amplification: one epoch is one Gaussian mechanism with z = 1 per example.
    exact = accounting.epsilon(ev.Gaussian(1.0), 1e-5, method="gaussian").epsilon
    assert out["epsilon"] == pytest.approx(exact, rel=1e-6)
    assert out["epsilon_lower"] <= out["epsilon"]


def test_plan_json_meets_budget_under_the_real_accountant(capsys):
    out = run_json(
        capsys,
        ["plan", "--dataset-size", "60000", "--target-epsilon", "3", "--delta", "1e-5",
         "--max-steps", "2000"],
    )
    rec = out["recommendation"]
    event = ev.SelfComposed(
        ev.PoissonSampled(rec["batch_size"] / 60000, ev.Gaussian(rec["noise_multiplier"])),
        rec["steps"],
    )
    assert accounting.epsilon(event, 1e-5).epsilon <= 3.0
    assert rec["steps"] <= 2000
    assert out["explanation"]


# ---------------------------------------------------------------------------------------------
# dpfy train / dpfy features: secure by default, --seed N is a seeded experiment
# ---------------------------------------------------------------------------------------------
# One torch thread: the two test workers already keep both cores busy, and a second thread
# spinning beside the other worker costs more CPU than it saves on 32-row batches.
TINY_TRAIN = ["--epochs", "1", "--batch-size", "32", "--train-limit", "128", "--test-limit", "256",
              "--threads", "1"]
SECURE = "secure (AES-256-CTR, OS key)"


def _no_figures(patch: pytest.MonkeyPatch) -> None:
    """Tiny image runs without their fixed cost: physical batches of 64 rows (the recipe pads
    every batch of 32 to 1024 rows) and the report without its figures (seconds of drawing per
    run). These tests read the ledger, report.md/json and model; padding and figures are
    tested elsewhere (tests/training, tests/test_report.py, tests/test_runs.py)."""
    import dataclasses
    import functools

    from dpfy import runs
    from dpfy.training import recipes

    real = recipes.train_image_classifier

    def small_chunks(config, recipe=None, hooks=None):  # type: ignore[no-untyped-def]
        recipe = recipes.default_recipe(config.model) if recipe is None else recipe
        return real(config, dataclasses.replace(recipe, max_physical_batch_size=64), hooks)

    patch.setattr(recipes, "train_image_classifier", small_chunks)
    patch.setattr(runs, "_report_files", functools.partial(runs._report_files, figures=False))


def _dpfy(args):
    """Run the command, returning (exit code, what it printed)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """Two default runs and two ``--seed 0`` runs with otherwise identical arguments."""
    import torch

    root = tmp_path_factory.mktemp("train")
    runs = {}
    threads = torch.get_num_threads()  # --threads sets it for the process: put it back after
    with pytest.MonkeyPatch.context() as patch:
        _no_figures(patch)
        try:
            for name, extra in [("secure_a", []), ("secure_b", []),
                                ("seeded_a", ["--seed", "0"]), ("seeded_b", ["--seed", "0"])]:
                code, printed = _dpfy(["train", "mnist", "--out", str(root / name), *TINY_TRAIN,
                                       *extra])
                assert code == 0, printed
                runs[name] = (root / name, printed)
        finally:
            torch.set_num_threads(threads)
    return runs


def _model(run_dir):
    import torch

    return torch.load(run_dir / "model.pt", weights_only=True)


def test_default_train_is_a_secure_dp_release_and_its_report_has_no_seed(train_runs):
    import re

    from dpfy.ledger import Ledger

    run_dir, printed = train_runs["secure_a"]
    meta = Ledger.load(run_dir / "ledger.jsonl").metadata
    assert meta["sampling_randomness"] == meta["noise_randomness"] == SECURE
    assert "--seed" not in meta["train_command"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["sampling_randomness"] == report["noise_randomness"] == SECURE
    assert report["release"].startswith("DP release")
    assert report["formal_statement"].startswith("The training run satisfies")
    md = (run_dir / "report.md").read_text()
    assert md.splitlines()[2].startswith("> DP release")
    retrain = next(line for line in md.splitlines() if line.startswith("- re-train:"))
    assert retrain.startswith("- re-train: `dpfy train mnist") and "--seed" not in retrain
    assert "--seed" not in md and not re.search(r"seed\W*\d", md)
    assert "DP release" in printed


def test_seeded_train_report_says_it_is_not_a_dp_release(train_runs):
    from dpfy.ledger import Ledger

    run_dir, printed = train_runs["seeded_a"]
    meta = Ledger.load(run_dir / "ledger.jsonl").metadata
    assert meta["sampling_randomness"] == meta["noise_randomness"] == "seeded (seed 0)"
    md = (run_dir / "report.md").read_text()
    headline = md.splitlines()[2]
    assert headline.startswith("> Seeded experiment — not a DP release")
    assert "anyone with the seed and the data can reproduce the model exactly" in headline
    statement = md.splitlines()[4]
    assert statement.startswith("**Not a DP release") and "seed 0" not in statement
    retrain = next(line for line in md.splitlines() if line.startswith("- re-train:"))
    assert "--seed 0" in retrain
    assert "not a DP release" in " ".join(printed.split())


def test_two_default_runs_differ_and_two_seeded_runs_are_identical(train_runs):
    import torch

    secure_a, secure_b = _model(train_runs["secure_a"][0]), _model(train_runs["secure_b"][0])
    assert any(not torch.equal(secure_a[k], secure_b[k]) for k in secure_a)
    seeded_a, seeded_b = _model(train_runs["seeded_a"][0]), _model(train_runs["seeded_b"][0])
    assert seeded_a.keys() == seeded_b.keys()
    assert all(torch.equal(seeded_a[k], seeded_b[k]) for k in seeded_a)


def test_secure_runs_commit_to_distinct_keys_and_seeded_runs_say_seeded(train_runs):
    from dpfy.audit.keys import key_check
    from dpfy.ledger import Ledger

    meta = {k: Ledger.load(train_runs[k][0] / "ledger.jsonl").metadata for k in train_runs}
    a, b = (meta[k]["key_commitments"] for k in ("secure_a", "secure_b"))
    assert len({*a["noise"], *a["sampling"], *b["noise"], *b["sampling"]}) == 4
    for name in ("secure_a", "secure_b"):  # each found in this session's registry, once
        assert key_check(meta[name]) == ((), ())
    assert meta["seeded_a"]["key_commitments"] == "seeded"
    assert key_check(meta["seeded_a"]) == (
        (), ("keys: a seeded run (not a DP release): no key to commit to",))


# statistical: the real-model check's secure noise under a fixed OS key (fixed_os_key)
@pytest.mark.usefixtures("fixed_os_key")
@pytest.mark.parametrize("name", ["secure_a", "seeded_a"])
def test_the_real_model_and_recorded_epsilon_checks_pass_on_train_runs(train_runs, name):
    from dpfy.audit import run as run_mod
    from dpfy.audit.counts import recorded_epsilon_check
    from dpfy.audit.realmodel import run_model
    from dpfy.ledger import Ledger

    run_dir = train_runs[name][0]
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    model, why = run_model(run_dir, ledger.metadata)
    assert model is not None, why
    real = run_mod._real_model(ledger, run_mod._configuration(ledger), model, 0)
    assert not isinstance(real, str) and real.findings == () and real.tensors == 8
    assert recorded_epsilon_check(ledger) == ()


def test_features_default_is_secure_and_seed_makes_it_seeded(tmp_path, monkeypatch):
    import numpy as np

    from dpfy import runs
    from dpfy.ledger import Ledger

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 6))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)
    monkeypatch.setattr(
        runs, "_feature_data", lambda name, extractor: (x[:300], y[:300], x[300:], y[300:])
    )
    base = ["features", "mnist", "--method", "dp-ls"]
    for name, extra in [("secure", []), ("seeded", ["--seed", "5"])]:
        code, printed = _dpfy([*base, "--out", str(tmp_path / name), *extra])
        assert code == 0, printed
    secure = Ledger.load(tmp_path / "secure" / "ledger.jsonl").metadata
    seeded = Ledger.load(tmp_path / "seeded" / "ledger.jsonl").metadata
    assert secure["noise_randomness"] == SECURE
    assert seeded["noise_randomness"] == "seeded (seed 5)"
    secure_md = (tmp_path / "secure" / "report.md").read_text()
    seeded_md = (tmp_path / "seeded" / "report.md").read_text()
    assert secure_md.splitlines()[2].startswith("> DP release")
    assert seeded_md.splitlines()[2].startswith("> Seeded experiment — not a DP release")
    assert "`dpfy features mnist" in secure_md and "--seed" not in secure_md
    assert "--seed 5" in seeded_md


@pytest.mark.usefixtures("one_thread")  # TINY_TRAIN's --threads 1, put back after the test
def test_train_precision_bf16_is_recorded_and_repeated(tmp_path, monkeypatch):
    from dpfy.ledger import Ledger

    _no_figures(monkeypatch)
    run_dir = tmp_path / "bf16"
    code, printed = _dpfy(["train", "mnist", "--out", str(run_dir), *TINY_TRAIN, "--seed", "0",
                           "--precision", "bf16"])
    assert code == 0, printed
    meta = Ledger.load(run_dir / "ledger.jsonl").metadata
    assert meta["precision"] == "bf16"
    assert "--precision bf16" in meta["train_command"]
    code = main(["train", "mnist", "--out", str(tmp_path / "bad"), "--precision", "fp8"])
    assert code == 2 and not (tmp_path / "bad").exists()


def test_missing_optional_package_is_one_line(monkeypatch, capsys):
    # A capability whose extra is not installed: one line naming the package, no traceback.
    from dpfy import cli, run_accounting

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(run_accounting, "account_run", missing)
    code = cli.main(["epsilon", "-n", "1000", "-b", "10", "-z", "1", "--delta", "1e-5",
                     "--steps", "10"])
    err = capsys.readouterr().err
    assert code == 2
    assert "transformers" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "command", ["train", "epsilon", "calibrate", "plan", "features", "tune", "report", "audit"]
)
def test_help_names_value_types_not_parser_functions(command):
    from typer.testing import CliRunner

    from dpfy.cli import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    # metavars: FLOAT / INTEGER (typer on click), <float> / <integer> (typer on its own click)
    out = result.output
    assert not any(bad in out for bad in ("PARSE", "LAMBDA", "<parse", "<lambda")), out
    typed = any(name in out for name in ("FLOAT", "INTEGER", "<float>", "<integer>"))
    assert typed or command in ("report", "audit")

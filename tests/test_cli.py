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

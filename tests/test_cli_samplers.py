"""`dpfy epsilon` and `dpfy calibrate` accept every sampler kind the library has."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.cli import main
from dpfy.sampling import registered_kinds

N, B = 10_000, 100
BASE = ["--dataset-size", str(N), "--delta", "1e-5"]


def run_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    code = main([*args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_every_kind_is_offered_on_the_command_line() -> None:
    assert {r.name for r in registered_kinds() if r.cli} == {r.name for r in registered_kinds()}


def test_fixed_size_epsilon_matches_library(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        ["epsilon", *BASE, "--batch-size", str(B), "--noise-multiplier", "1.5", "--epochs", "2",
         "--sampler", "fixed-size"],
    )
    assert out["sampler"] == "fixed-size" and out["adjacency"] == "replace_one"
    assert out["steps"] == 2 * (N // B)
    event = ev.SelfComposed(ev.FixedSizeSampled(B, N, ev.Gaussian(1.5)), out["steps"])
    assert out["epsilon"] == pytest.approx(accounting.epsilon(event, 1e-5).epsilon, rel=1e-12)


def test_full_batch_epsilon_is_the_gaussian(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        ["epsilon", *BASE, "--batch-size", str(N), "--noise-multiplier", "2.0", "--epochs", "3",
         "--sampler", "full-batch"],
    )
    assert out["steps"] == 3 and out["sampling_rate"] == 1.0
    event = ev.SelfComposed(ev.Gaussian(2.0), 3)
    assert out["epsilon"] == pytest.approx(accounting.epsilon(event, 1e-5).epsilon, rel=1e-12)
    assert out["method"] == "gaussian"


@pytest.mark.parametrize(("sampler", "batch"), [("fixed-size", B), ("full-batch", N)])
def test_calibrate_round_trips(
    capsys: pytest.CaptureFixture[str], sampler: str, batch: int
) -> None:
    args = [*BASE, "--batch-size", str(batch), "--epochs", "2", "--sampler", sampler]
    out = run_json(capsys, ["calibrate", "--target-epsilon", "3", *args])
    assert out["epsilon"] <= 3.0 and out["sampler"] == sampler
    z = out["noise_multiplier"]
    back = run_json(capsys, ["epsilon", *args, "--noise-multiplier", repr(z)])
    assert back["epsilon"] == pytest.approx(out["epsilon"], rel=1e-9)
    lower = run_json(capsys, ["epsilon", *args, "--noise-multiplier", repr(z * 0.99)])
    assert lower["epsilon"] > 3.0  # the calibrated z is (nearly) the smallest that meets it


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch-size", "100", "--sampler", "full-batch"], "batch_size must equal"),
        (["--batch-size", str(N), "--sampler", "full-batch", "--max-batch-size", "5"],
         "max_batch_size"),
        (["--batch-size", "100", "--sampler", "fixed-size", "--max-batch-size", "200"],
         "max_batch_size"),
    ],
)
def test_bad_combinations_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code = main(["epsilon", *BASE, "--noise-multiplier", "1", "--epochs", "1", *args])
    _, err = capsys.readouterr()
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("sampler", ["fixed-size", "full-batch"])
def test_plan_for_the_sampler_that_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, sampler: str
) -> None:
    from dpfy import planning

    # the plan the command computes is kept and checked below (a plan costs seconds: the
    # library call is the command's own, not a second computation of it)
    made: list[tuple[tuple, dict, planning.Plan]] = []
    real = planning.plan

    def kept(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append((args, kwargs, real(*args, **kwargs)))
        return made[-1][2]

    monkeypatch.setattr(planning, "plan", kept)
    out = run_json(
        capsys,
        ["plan", "--dataset-size", "20000", "--target-epsilon", "4", "--delta", "1e-5",
         "--max-steps", "300", "--sampler", sampler],
    )
    name = sampler.replace("-", "_")
    assert out["sampler"] == name
    rec = out["recommendation"]
    assert rec["sampler"] == name and rec["epsilon"] <= 4.0
    if sampler == "full-batch":
        assert rec["batch_size"] == 20000 and out["adjacency"] == "add_or_remove"
    else:
        assert out["adjacency"] == "replace_one"
    ((args, kwargs, p),) = made
    assert args == (20000, 4.0, 1e-5) and kwargs["max_steps"] == 300
    assert kwargs["sampler"] == sampler and kwargs.get("max_examples_processed") is None
    assert (rec["batch_size"], rec["noise_multiplier"], rec["steps"]) == (
        p.recommendation.batch_size, p.recommendation.noise_multiplier, p.recommendation.steps)
    for o in (p.recommendation, *p.runner_ups):
        event = o.privacy_event()
        assert accounting.epsilon(event, 1e-5).epsilon <= 4.0
        # the sampler's own event: a lower z would exceed the target
        lower = dataclasses.replace(o, noise_multiplier=o.noise_multiplier * 0.98)
        assert accounting.epsilon(lower.privacy_event(), 1e-5).epsilon > 4.0


def test_plan_rejects_an_unknown_sampler() -> None:
    from dpfy.planning import plan

    with pytest.raises(ValueError, match="kind must be one of"):
        plan(20000, 4.0, 1e-5, max_steps=300, sampler="bogus")

"""The library pipelines of dpfy.runs, called from Python without the command, and the command
holding none of them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dpfy.cli
import dpfy.cli_options
from dpfy import accounting, run_accounting, runs
from dpfy import events as ev
from dpfy.config import RunConfig
from dpfy.ledger import Ledger
from dpfy.sampling import SampleSpec

N, Q, Z, C, STEPS = 10_000, 0.01, 1.1, 0.5, 200


def poisson_ledger(path: Path) -> Ledger:
    ledger = Ledger(path, fsync=False)
    spec = SampleSpec("poisson", dataset_size=N, sampling_rate=Q)
    ledger.record_metadata(delta=1e-5, target_epsilon=5.0, accuracy_by_step=[[100, 0.5]])
    for step in range(STEPS):
        sid = ledger.record_sample(spec, step=step)
        ledger.record_sum_query(sid, sensitivity=C, noise_std=Z * C, name="gradient")
    ledger.close()
    return ledger


def poisson_epsilon(method: str = "auto") -> float:
    event = ev.SelfComposed(ev.PoissonSampled(Q, ev.Gaussian(Z)), STEPS)
    return accounting.epsilon(event, 1e-5, method=method).epsilon


def test_report_ledger_uses_the_recorded_delta_and_writes_beside_the_ledger(tmp_path):
    path = tmp_path / "ledger.jsonl"
    poisson_ledger(path)
    run = runs.report_ledger(path, method="pld", figures=False)
    assert run.report.epsilon == pytest.approx(poisson_epsilon("pld"), rel=1e-12)
    assert run.report.delta == 1e-5
    assert run.out_dir == tmp_path and run.ledger_path == path
    assert run.report_path == tmp_path / "report.md" and run.report_path.exists()
    assert json.loads((tmp_path / "report.json").read_text())["accounting_method"] == "pld"
    assert run.statement == run.report.formal_statement


def test_report_ledger_refuses_a_missing_file_and_a_missing_delta(tmp_path):
    with pytest.raises(ValueError, match="ledger_path"):
        runs.report_ledger(tmp_path / "none.jsonl")
    path = tmp_path / "ledger.jsonl"
    Ledger(path, fsync=False).close()
    with pytest.raises(ValueError, match="delta"):
        runs.report_ledger(path)
    assert not (tmp_path / "report.md").exists()


def test_features_and_report_on_given_features(tmp_path):
    rng = __import__("numpy").random.default_rng(0)
    x = rng.normal(size=(400, 6))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0).astype(int)
    run = runs.features_and_report(
        "toy", method="dp-ls", target_epsilon=2.0, out=tmp_path / "run",
        data=(x[:300], y[:300], x[300:], y[300:]), limit=250, classes=[0, 1, 2],
    )
    assert type(run.model).__name__ == "DPLeastSquaresClassifier"
    assert 0.0 <= run.test_accuracy <= 1.0 and run.seconds >= 0.0
    for name in ("ledger.jsonl", "report.md", "report.json"):
        assert (tmp_path / "run" / name).exists(), name
    assert run.report.epsilon <= 2.0 * (1 + 1e-9)
    meta = Ledger.load(run.ledger_path).metadata
    assert meta["dataset"] == "toy" and meta["test_accuracy"] == run.test_accuracy
    # no seed given: the noise is secure and the report says the run is a DP release
    assert meta["noise_randomness"] == "secure (AES-256-CTR, OS key)"
    assert run.report.release.startswith("DP release")
    from dpfy.publication import unclassified_fields

    assert unclassified_fields(tmp_path / "run") == []  # a release, public or configuration


def test_features_and_report_takes_the_class_list_from_the_dataset_definition(tmp_path):
    """The classes of `dpfy features mnist` are the ten digits whatever the labels hold."""
    rng = __import__("numpy").random.default_rng(1)
    x = rng.normal(size=(120, 4))
    y = (x[:, 0] > 0).astype(int)  # only digits 0 and 1 occur
    run = runs.features_and_report(
        "mnist", method="dp-newton", target_epsilon=2.0, out=tmp_path / "run",
        data=(x[:100], y[:100], x[100:], y[100:]),
    )
    assert list(run.model.classes_) == list(range(10)) and run.model.coef_.shape == (10, 4)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"limit": 1}, "limit"),
        ({"delta": 1.0}, "delta"),
        ({"method": "dp-sgd"}, "method"),
        ({"dataset": "cifar"}, "dataset"),
        ({"dataset": "toy", "data": ([[0.0]], [0], [[0.0]], [0])}, "classes"),
    ],
)
def test_features_and_report_refuses_bad_input_before_writing(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        runs.features_and_report(**{"out": tmp_path / "run", **kwargs})
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"epochs": 0}, "epochs"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"dataset": "cifar"}, "dataset"),
    ],
)
def test_train_and_report_refuses_bad_input_before_writing(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        runs.train_and_report(RunConfig(**{"dataset": "mnist", "out": tmp_path / "run", **kwargs}))
    assert not (tmp_path / "run").exists()


def test_pipelines_refuse_a_run_directory_that_holds_a_ledger(tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    with pytest.raises(ValueError, match="new run directory"):
        runs.train_and_report(RunConfig(dataset="mnist", out=tmp_path))
    with pytest.raises(ValueError, match="new run directory"):
        runs.features_and_report("mnist", out=tmp_path)


def test_account_and_calibrate_run_agree_with_the_accountant():
    run = run_accounting.account_run(60_000, 256, 1.1, 1e-5, epochs=2)
    event = ev.SelfComposed(ev.PoissonSampled(256 / 60_000, ev.Gaussian(1.1)), run.steps)
    assert run.steps == 2 * round(60_000 / 256)
    assert run.result.epsilon == pytest.approx(accounting.epsilon(event, 1e-5).epsilon)
    assert run.sampling_rate == 256 / 60_000 and run.comparison is None
    every = run_accounting.account_run(60_000, 256, 1.1, 1e-5, steps=100, method="all")
    assert every.comparison and {"rdp", "pld"} <= set(every.comparison)
    cal = run_accounting.calibrate_run(3.0, 60_000, 256, 1e-5, epochs=3)
    assert cal.result.epsilon <= 3.0
    back = run_accounting.account_run(60_000, 256, cal.noise_multiplier, 1e-5, epochs=3)
    assert back.result.epsilon == pytest.approx(cal.result.epsilon, rel=1e-9)
    with pytest.raises(ValueError, match="epochs or --steps"):
        run_accounting.account_run(60_000, 256, 1.1, 1e-5)


def test_plan_with_figures(tmp_path):
    plan, figures = run_accounting.plan_with_figures(1000, 2.0, 1e-6, max_steps=100)
    assert figures == [] and plan.recommendation.steps <= 100
    _, figures = run_accounting.plan_with_figures(1000, 2.0, 1e-6, max_steps=100, plot_dir=tmp_path)
    assert [p.name for p in figures] == ["plan_options.png", "privacy_wall.png"]
    assert all(p.stat().st_size > 5_000 for p in figures)


def test_pipelines_run_without_the_command_or_matplotlib(tmp_path):
    """A Python user never imports dpfy.cli (nor typer); no figures, no matplotlib."""
    poisson_ledger(tmp_path / "ledger.jsonl")
    code = (
        "import sys\n"
        "from dpfy import run_accounting, runs\n"
        f"run = runs.report_ledger({str(tmp_path / 'ledger.jsonl')!r}, figures=False)\n"
        "run_accounting.account_run(1000, 10, 1.0, 1e-5, epochs=1)\n"
        "assert run.report_path.exists()\n"
        "bad = [m for m in ('dpfy.cli', 'typer', 'matplotlib', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("image_chunks_of_64", "one_thread")  # threads=1, put back after
def test_train_and_report_small(tmp_path):
    run = runs.train_and_report(RunConfig(
        dataset="mnist", out=tmp_path / "run", epochs=1, batch_size=128, train_limit=512,
        threads=1, test_limit=256,
    ))
    for name in ("model.pt", "ledger.jsonl", "report.md", "report.json", "summary.json",
                 "figures/epsilon_over_training.png"):
        assert (run.out_dir / name).exists(), name
    assert run.report.epsilon <= 3.0
    assert run.report.hyperparameters["steps"] == Ledger.load(run.ledger_path).iteration
    assert run.report.reproduce["train_command"].startswith("dpfy train mnist")
    assert "--seed" not in run.report.reproduce["train_command"]  # secure by default
    assert run.report.sampling_randomness == run.report.noise_randomness == (
        "secure (AES-256-CTR, OS key)"
    )
    assert 0.0 <= run.test_accuracy <= 1.0 and run.model.ledger_path == str(run.ledger_path)


# ---------------------------------------------------------------------------------------------
# the command holds no pipeline
# ---------------------------------------------------------------------------------------------
MAX_STATEMENTS = 12  # top-level statements of a function body: parse, call dpfy.runs, print


def _cli_tree() -> ast.Module:
    """The command line: ``dpfy.cli`` (commands) and ``dpfy.cli_options`` (their parsing)."""
    body = []
    for module in (dpfy.cli, dpfy.cli_options):
        body += ast.parse(Path(module.__file__).read_text(encoding="utf-8")).body
    return ast.Module(body=body, type_ignores=[])


def _functions() -> list[ast.FunctionDef]:
    return [n for n in ast.walk(_cli_tree()) if isinstance(n, ast.FunctionDef)]


def test_cli_reaches_the_library_only_through_the_pipeline_modules():
    # Besides the pipelines (dpfy.runs: train, report, features, audit; dpfy.run_accounting:
    # epsilon, calibrate, plan), the command reads the sampler table and the accountant registry
    # for its option choices, the argument rules for its option parsers, and builds dpfy train's
    # RunConfig (parsing).
    imported = set()
    for node in ast.walk(_cli_tree()):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpfy"):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("dpfy")}
    imported = {name for name in imported if not name.startswith("dpfy.cli_options.")}
    expected = {
        "dpfy.runs", "dpfy.run_accounting", "dpfy._validate", "dpfy.sampling.registered_kinds",
        "dpfy.accounting.accountants", "dpfy.config.RunConfig", "dpfy.tuning_runs",
    }
    assert imported == expected, imported


def test_each_command_makes_one_library_call():
    commands = {
        f.name for f in _functions() if any("command" in ast.unparse(d) for d in f.decorator_list)
    }
    assert commands >= {"epsilon", "calibrate", "report", "plan", "train", "features", "tune"}
    for function in _functions():
        calls = [
            ast.unparse(n.func) for n in ast.walk(function)
            # a pipeline call (runs.f, run_accounting.f); building an option record
            # (run_accounting.SomeOptions) is parsing
            if isinstance(n, ast.Call)
            and ast.unparse(n.func).split(".")[0] in ("runs", "run_accounting", "tuning_runs")
            and ast.unparse(n.func).split(".")[1][0].islower()
        ]
        assert len(calls) == (function.name in commands), (function.name, calls)


def test_cli_functions_are_short():
    long = {}
    for function in _functions():
        body = [
            b for b in function.body
            if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))
        ]
        if len(body) > MAX_STATEMENTS:
            long[function.name] = len(body)
    assert not long, f"pipeline logic in cli.py (top-level statements per function): {long}"

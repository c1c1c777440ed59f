"""The ``dpfy`` command.

Every command validates its input and, on bad input, exits with code 2 and a one-line message
(never a traceback). Every epsilon printed names its accounting method and adjacency.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

# Typer ships its own copy of click in recent versions; take the exception classes from the
# public BadParameter's ancestry so this works with either layout.
_MRO = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
_UsageError: type[Exception] = _MRO["UsageError"]
_ClickException: type[Exception] = _MRO["ClickException"]

app = typer.Typer(
    name="dpfy",
    help="Differentially private ML training and accounting that tells the truth.",
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
)


class SamplerName(StrEnum):
    poisson = "poisson"
    balls_and_bins = "balls-and-bins"
    shuffle = "shuffle"
    deterministic = "deterministic"


class MethodName(StrEnum):
    auto = "auto"
    rdp = "rdp"
    pld = "pld"
    gaussian = "gaussian"
    monte_carlo = "monte_carlo"
    shuffle = "shuffle"
    all = "all"


class UsageProblem(Exception):
    """Bad input found by a command: reported in one line with exit code 2."""


# ---------------------------------------------------------------------------------------------
# shared option types
# ---------------------------------------------------------------------------------------------
DatasetSize = Annotated[int, typer.Option("--dataset-size", "-n", help="Number of examples N.")]
BatchSize = Annotated[
    int, typer.Option("--batch-size", "-b", help="Expected batch size B (Poisson: q = B/N).")
]
Epochs = Annotated[float | None, typer.Option("--epochs", help="Passes over the data.")]
Steps = Annotated[int | None, typer.Option("--steps", help="Number of training steps.")]
Delta = Annotated[float, typer.Option("--delta", help="Target delta, in (0, 1).")]
Sampler = Annotated[
    SamplerName, typer.Option("--sampler", help="The batch sampler that actually runs.")
]
Method = Annotated[MethodName, typer.Option("--method", help="Accounting method.")]
MaxBatch = Annotated[
    int | None,
    typer.Option("--max-batch-size", help="Truncate batches to this size (costs extra delta)."),
]
Samples = Annotated[
    int | None, typer.Option("--samples", help="Monte Carlo samples (Balls-and-Bins).")
]
ErrorProb = Annotated[
    float,
    typer.Option("--error-probability", help="Monte Carlo: probability the bound fails."),
]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for Monte Carlo accounting.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def _num(value: float) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _emit(payload: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        print(json.dumps({k: _num(v) for k, v in payload.items()}, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in payload.items():
        if value is None or key == "results":
            continue
        if isinstance(value, float):
            value = f"{value:.6g}"
        table.add_row(key, str(value))
    Console().print(table)
    for name, res in payload.get("results", {}).items():
        line = res if isinstance(res, str) else f"epsilon = {res['epsilon']:.6g}"
        Console().print(f"  [bold]{name}[/bold]: {line}")


def _resolve_steps(dataset_size: int, batch_size: int, epochs: float | None, steps: int | None):
    from dpfy._validate import check_range

    check_range("dataset_size", dataset_size, 1, None, integer=True)
    check_range("batch_size", batch_size, 1, dataset_size, integer=True)
    if (epochs is None) == (steps is None):
        raise UsageProblem("give exactly one of --epochs or --steps")
    if steps is not None:
        check_range("steps", steps, 1, None, integer=True)
    else:
        check_range("epochs", epochs, 0.0, None, low_open=True)
    return epochs, steps


def _sampler(kind: SamplerName, dataset_size: int, batch_size: int, max_batch_size: int | None):
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler

    return make_sampler(
        kind.value.replace("-", "_"),
        dataset_size=dataset_size,
        batch_size=batch_size,
        max_batch_size=max_batch_size,
        randomness=Randomness(0),
    )


def _accountant(method: MethodName, samples: int | None, error_probability: float, seed):
    """A method name, or a configured Monte Carlo accountant when MC options were given."""
    if method is MethodName.monte_carlo or (
        method is MethodName.auto and (samples is not None or seed is not None)
    ):
        from dpfy.accounting.balls_and_bins import MonteCarloAccountant

        kwargs: dict[str, Any] = {"error_probability": error_probability}
        if samples is not None:
            kwargs["samples"] = samples
        if seed is not None:
            kwargs["seed"] = seed
        return MonteCarloAccountant(**kwargs)
    return method.value


def _result_fields(res) -> dict[str, Any]:
    out = {
        "epsilon": res.epsilon,
        "delta": res.delta,
        "method": res.method,
        "adjacency": res.adjacency,
        "provable": res.provable,
    }
    if res.epsilon_estimate is not None:
        out["epsilon_estimate"] = res.epsilon_estimate
    if res.epsilon_lower is not None:
        out["epsilon_lower"] = res.epsilon_lower
    if res.error_probability is not None:
        out["error_probability"] = res.error_probability
    if res.notes:
        out["notes"] = "; ".join(res.notes)
    return out


@app.command()
def epsilon(
    dataset_size: DatasetSize,
    batch_size: BatchSize,
    noise_multiplier: Annotated[
        float, typer.Option("--noise-multiplier", "-z", help="Noise std / clip norm.")
    ],
    delta: Delta,
    epochs: Epochs = None,
    steps: Steps = None,
    sampler: Sampler = SamplerName.poisson,
    method: Method = MethodName.auto,
    max_batch_size: MaxBatch = None,
    samples: Samples = None,
    error_probability: ErrorProb = 1e-3,
    seed: Seed = None,
    as_json: AsJson = False,
) -> None:
    """Epsilon spent by a training run, accounted for the sampler that actually runs."""
    from dpfy import accounting

    epochs, steps = _resolve_steps(dataset_size, batch_size, epochs, steps)
    smp = _sampler(sampler, dataset_size, batch_size, max_batch_size)
    event = smp.privacy_event(noise_multiplier, epochs=epochs, steps=steps)
    payload = _run_fields(sampler, dataset_size, batch_size, smp, epochs, steps)
    payload["noise_multiplier"] = noise_multiplier
    if method is MethodName.all:
        results = accounting.compare(event, delta)
        best = accounting.epsilon(event, delta)
        payload.update(_result_fields(best))
        payload["results"] = {
            k: (v if isinstance(v, str) else _result_fields(v)) for k, v in results.items()
        }
    else:
        acc = _accountant(method, samples, error_probability, seed)
        payload.update(_result_fields(accounting.epsilon(event, delta, method=acc)))
    _emit(payload, as_json, "dpfy epsilon")


def _run_fields(sampler, dataset_size, batch_size, smp, epochs, steps) -> dict[str, Any]:
    """The run's description shared by ``epsilon`` and ``calibrate`` output."""
    total = int(steps) if steps is not None else math.ceil(epochs * smp.steps_per_epoch - 1e-9)
    return {
        "sampler": sampler.value,
        "dataset_size": dataset_size,
        "batch_size": batch_size,
        "sampling_rate": batch_size / dataset_size,
        "steps": total,
        "epochs": epochs,
    }


@app.command()
def calibrate(
    target_epsilon: Annotated[
        float, typer.Option("--target-epsilon", help="Epsilon the run must not exceed.")
    ],
    dataset_size: DatasetSize,
    batch_size: BatchSize,
    delta: Delta,
    epochs: Epochs = None,
    steps: Steps = None,
    sampler: Sampler = SamplerName.poisson,
    method: Method = MethodName.auto,
    max_batch_size: MaxBatch = None,
    samples: Samples = None,
    error_probability: ErrorProb = 1e-3,
    seed: Seed = None,
    as_json: AsJson = False,
) -> None:
    """Smallest noise multiplier whose epsilon stays at or below the target (safe side)."""
    from dpfy import accounting
    from dpfy._validate import check_range
    from dpfy.accounting.calibrate import calibrate_noise_multiplier

    check_range("target_epsilon", target_epsilon, 0.0, None, low_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if method is MethodName.all:
        raise UsageProblem("--method all is for `dpfy epsilon`; calibrate with one method")
    epochs, steps = _resolve_steps(dataset_size, batch_size, epochs, steps)
    smp = _sampler(sampler, dataset_size, batch_size, max_batch_size)
    acc = _accountant(method, samples, error_probability, seed)

    def make_event(z: float):
        return smp.privacy_event(z, epochs=epochs, steps=steps)

    z = calibrate_noise_multiplier(make_event, target_epsilon, delta, method=acc)
    res = accounting.epsilon(make_event(z), delta, method=acc)
    payload = _run_fields(sampler, dataset_size, batch_size, smp, epochs, steps)
    payload.update(target_epsilon=target_epsilon, noise_multiplier=z)
    payload.update(_result_fields(res))
    _emit(payload, as_json, "dpfy calibrate")


@app.command()
def report(
    ledger_path: Annotated[Path, typer.Argument(help="A ledger file (JSON lines).")],
    delta: Annotated[
        float | None,
        typer.Option("--delta", help="Delta of the statement (default: the run's delta)."),
    ] = None,
    method: Method = MethodName.auto,
    out: Annotated[
        Path | None, typer.Option("--out", help="Directory for report.md/json and figures.")
    ] = None,
    figures: Annotated[bool, typer.Option("--figures/--no-figures")] = True,
    as_json: AsJson = False,
) -> None:
    """Re-account a ledger with every applicable method and write the privacy report."""
    from dpfy.ledger import Ledger
    from dpfy.report import build_report, write_report

    if not ledger_path.is_file():
        raise UsageProblem(f"ledger_path must be an existing ledger file, got {str(ledger_path)!r}")
    if method is MethodName.all:
        raise UsageProblem("--method all is for `dpfy epsilon`; reports list every method anyway")
    ledger = Ledger.load(ledger_path)
    meta = ledger.metadata
    if delta is None:
        if "delta" not in meta:
            raise UsageProblem("the ledger records no delta: pass --delta")
        delta = float(meta["delta"])
    rep = build_report(
        ledger,
        delta=delta,
        method=method.value,
        utility=meta.get("utility"),
        ledger_path=str(ledger_path),
    )
    out_dir = out if out is not None else ledger_path.parent
    rep = write_report(
        rep,
        ledger,
        out_dir,
        figures=figures,
        target_epsilon=meta.get("target_epsilon"),
        accuracy_by_step=[tuple(x) for x in meta.get("accuracy_by_step", [])] or None,
    )
    if as_json:
        print(rep.to_json())
        return
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{rep.formal_statement}[/bold]")
    for name, res in rep.other_methods.items():
        cell = res if isinstance(res, str) else f"epsilon = {_num(res['epsilon'])}"
        if isinstance(res, dict) and res.get("epsilon_lower") is not None:
            cell += f" (lower bound {res['epsilon_lower']:.4g})"
        console.print(f"  {name}: {cell}")
    console.print(f"report: {out_dir / 'report.md'}")


@app.command()
def plan(
    dataset_size: DatasetSize,
    target_epsilon: Annotated[
        float, typer.Option("--target-epsilon", help="Epsilon budget of the final run.")
    ],
    delta: Delta,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Most DP-SGD steps you will run.")
    ] = None,
    max_examples_processed: Annotated[
        int | None,
        typer.Option("--max-examples-processed", help="Compute budget: batch size x steps."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write the options and privacy-wall figures to this folder."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Recommend (batch size, noise multiplier, steps) that meet the budget (Poisson, PLD/RDP)."""
    from dpfy.planning import plan as make_plan

    if max_steps is not None:
        from dpfy._validate import check_range

        check_range("max_steps", max_steps, 1, None, integer=True)
    result = make_plan(
        dataset_size,
        target_epsilon,
        delta,
        max_steps=max_steps,
        max_examples_processed=max_examples_processed,
    )
    figures: list[Path] = []
    if plot is not None:
        from dpfy.report import plots_tan

        figures.append(plots_tan.plan_options(result, plot / "plan_options.png"))
        figures.append(
            plots_tan.privacy_wall(
                plot / "privacy_wall.png", target_epsilons=(target_epsilon,), delta=delta
            )
        )
    if as_json:
        payload = result.to_dict()
        if figures:
            payload["figures"] = [str(p) for p in figures]
        print(json.dumps(payload, default=str))
        return
    print(result.summary())
    for path in figures:
        print(f"figure: {path}")


class DatasetName(StrEnum):
    mnist = "mnist"
    fashion_mnist = "fashion-mnist"


class TrainSampler(StrEnum):
    poisson = "poisson"
    balls_and_bins = "balls-and-bins"


@app.command()
def train(
    dataset: Annotated[DatasetName, typer.Argument(help="Training data (offline packages).")],
    target_epsilon: Annotated[
        float, typer.Option("--target-epsilon", help="Privacy budget of the run.")
    ] = 3.0,
    delta: Annotated[float, typer.Option("--delta", help="Target delta, in (0, 1).")] = 1e-5,
    sampler: Annotated[
        TrainSampler, typer.Option("--sampler", help="Batch sampler (decides the accounting).")
    ] = TrainSampler.poisson,
    epochs: Annotated[
        int | None, typer.Option("--epochs", help="Passes over the data (default 10).")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", help="Expected batch size (default 1024).")
    ] = None,
    learning_rate: Annotated[
        float | None, typer.Option("--learning-rate", help="SGD step size (default 2.0).")
    ] = None,
    clip_norm: Annotated[
        float | None, typer.Option("--clip-norm", help="Per-example clip norm (default 0.1).")
    ] = None,
    secure: Annotated[
        bool, typer.Option("--secure/--seeded", help="CSPRNG noise and sampling.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed (seeded mode).")] = 0,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory.")] = None,
    train_limit: Annotated[
        int | None, typer.Option("--train-limit", help="Use only this many training images.")
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="Torch threads.")] = None,
) -> None:
    """Train a CNN with DP-SGD, then write the model, ledger and privacy report to --out."""
    import time

    from dpfy._validate import check_range

    check_range("target_epsilon", target_epsilon, 0.0, None, low_open=True, high_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if epochs is not None:
        check_range("epochs", epochs, 1, None, integer=True)
    if batch_size is not None:
        check_range("batch_size", batch_size, 1, None, integer=True)
    if learning_rate is not None:
        check_range("learning_rate", learning_rate, 0.0, None, low_open=True)
    if clip_norm is not None:
        check_range("clip_norm", clip_norm, 0.0, None, low_open=True, high_open=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = out if out is not None else Path("runs") / f"{dataset.value}-{stamp}"
    if (out_dir / "ledger.jsonl").exists():
        raise UsageProblem(f"out must be a new run directory, {out_dir}/ledger.jsonl exists")
    run = train_and_report(
        dataset=dataset.value,
        out_dir=out_dir,
        target_epsilon=target_epsilon,
        delta=delta,
        sampler=sampler.value.replace("-", "_"),
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        clip_norm=clip_norm,
        secure=secure,
        seed=seed,
        train_limit=train_limit,
        threads=threads,
    )
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{run['statement']}[/bold]")
    console.print(
        f"test accuracy {100 * run['test_accuracy']:.2f} %, training took {run['seconds']:.0f} s"
    )
    console.print(f"run directory: {out_dir}   report: {out_dir / 'report.md'}")


def train_and_report(
    *, dataset: str, out_dir: Path, target_epsilon: float, delta: float, **options: Any
) -> dict[str, Any]:
    """Train with :func:`dpfy.training.recipes.train_image_classifier`, then account the ledger
    (not the trainer's numbers) and write ``report.md``, ``report.json`` and figures."""
    import shlex

    from dpfy.ledger import Ledger
    from dpfy.report import build_report, write_report
    from dpfy.training.recipes import train_image_classifier

    options = {k: v for k, v in options.items() if v is not None}  # None: the recipe's default
    summary = train_image_classifier(
        dataset,
        target_epsilon=target_epsilon,
        delta=delta,
        out_dir=out_dir,
        progress=True,
        **options,
    )
    options.update(
        epochs=summary.epochs,
        batch_size=summary.batch_size,
        learning_rate=summary.learning_rate,
        clip_norm=summary.clip_norm,
    )
    accuracy_by_step = [
        [int(e.steps), float(e.test_accuracy)]
        for e in summary.history.epochs
        if e.test_accuracy is not None
    ]
    argv = ["dpfy", "train", dataset, "--target-epsilon", f"{target_epsilon:g}", "--delta",
            f"{delta:g}", "--out", str(out_dir)]
    keys = ("sampler", "epochs", "batch_size", "learning_rate", "clip_norm", "seed", "train_limit")
    for key in keys:
        if options.get(key) is not None:
            value = str(options[key]).replace("_", "-") if key == "sampler" else options[key]
            argv += [f"--{key.replace('_', '-')}", str(value)]
    summary.ledger.record_metadata(
        delta=delta,
        target_epsilon=target_epsilon,
        accuracy_by_step=accuracy_by_step,
        train_command=shlex.join(argv),
    )
    summary.ledger.close()  # the run is over: flush buffered metadata, refuse further appends
    ledger_path = Path(summary.ledger_path)
    ledger = Ledger.load(ledger_path)
    report = build_report(
        ledger, delta=delta, method=summary.accounting, ledger_path=str(ledger_path)
    )
    report = dataclasses.replace(
        report, reproduce={**report.reproduce, "train_command": shlex.join(argv)}
    )
    report = write_report(
        report,
        ledger,
        out_dir,
        target_epsilon=target_epsilon,
        accuracy_by_step=[tuple(x) for x in accuracy_by_step],
    )
    return {
        "statement": report.formal_statement,
        "epsilon": report.epsilon,
        "test_accuracy": summary.test_accuracy,
        "seconds": summary.seconds,
        "report": report,
    }


class FeatureDataset(StrEnum):
    fashion_mnist = "fashion-mnist"
    mnist = "mnist"
    rotten_tomatoes = "rotten-tomatoes"


class FeatureMethod(StrEnum):
    dp_fc = "dp-fc"
    dp_ls = "dp-ls"
    dp_newton = "dp-newton"
    dp_adam = "dp-adam"


@app.command()
def features(
    dataset: Annotated[FeatureDataset, typer.Argument(help="Data whose features to learn from.")],
    method: Annotated[
        FeatureMethod, typer.Option("--method", help="DP learner (Mehta et al.).")
    ] = FeatureMethod.dp_fc,
    target_epsilon: Annotated[
        float, typer.Option("--target-epsilon", help="Privacy budget.")
    ] = 1.0,
    delta: Annotated[float, typer.Option("--delta", help="Target delta, in (0, 1).")] = 1e-5,
    seed: Annotated[int, typer.Option("--seed", help="Noise seed.")] = 0,
    limit: Annotated[
        int | None, typer.Option("--limit", help="Use only this many training examples.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory.")] = None,
) -> None:
    """Learn a linear classifier with DP on pretrained features; write ledger and report.

    Features (EfficientNet-Lite0 for images, all-MiniLM-L6-v2 for the rotten-tomatoes
    snippets) are extracted once and cached; the first run takes a while.
    """
    import time

    import numpy as np

    from dpfy import features as feats
    from dpfy._validate import check_range
    from dpfy.features import extract
    from dpfy.ledger import Ledger
    from dpfy.report import build_report, prefix_ledger, write_report

    check_range("target_epsilon", target_epsilon, 0.0, None, low_open=True, high_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if limit is not None:
        check_range("limit", limit, 2, None, integer=True)
    out_dir = out or Path("runs") / f"features-{dataset.value}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out_dir / "ledger.jsonl").exists():
        raise UsageProblem(f"out must be a new run directory, {out_dir}/ledger.jsonl exists")
    if dataset is FeatureDataset.rotten_tomatoes:
        x, y, is_test = extract.text_features()
        x_train, y_train, x_test, y_test = x[~is_test], y[~is_test], x[is_test], y[is_test]
    else:
        x_train, y_train = extract.image_features(dataset.value, "train")
        x_test, y_test = extract.image_features(dataset.value, "test")
    if limit is not None:
        x_train, y_train = x_train[:limit], y_train[:limit]
    estimator = {
        FeatureMethod.dp_fc: feats.DPFeatureCovarianceClassifier,
        FeatureMethod.dp_ls: feats.DPLeastSquaresClassifier,
        FeatureMethod.dp_newton: feats.DPNewtonClassifier,
        FeatureMethod.dp_adam: feats.DPAdamClassifier,
    }[method](epsilon=target_epsilon, delta=delta, random_state=seed)
    start = time.perf_counter()
    estimator.fit(x_train, y_train)
    seconds = time.perf_counter() - start
    accuracy = float(np.mean(estimator.predict(x_test) == np.asarray(y_test)))
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger = prefix_ledger(estimator.ledger_, path=out_dir / "ledger.jsonl")
    ledger.record_metadata(
        dataset=dataset.value,
        estimator=type(estimator).__name__,
        delta=delta,
        target_epsilon=target_epsilon,
        test_accuracy=accuracy,
        wall_time_seconds=seconds,
        released_output="the linear classifier's weights",
    )
    ledger.close()
    ledger = Ledger.load(out_dir / "ledger.jsonl")
    report = build_report(ledger, delta=delta, ledger_path=str(out_dir / "ledger.jsonl"))
    report = write_report(report, ledger, out_dir, figures=False)
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{report.formal_statement}[/bold]")
    rho = estimator.privacy_.zcdp_rho
    console.print(
        f"{type(estimator).__name__}: test accuracy {100 * accuracy:.2f} % (fit {seconds:.1f} s);"
        f" the paper's zCDP view of the same run: rho = {rho:.4g}"
    )
    console.print(f"report: {out_dir / 'report.md'}")


# ---------------------------------------------------------------------------------------------
# entry point: one-line errors, exit code 2
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the ``dpfy`` command; returns the exit code (bad input: 2, one line, no traceback)."""
    command = typer.main.get_command(app)
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        args = ["--help"]
    try:
        result = command.main(args=args, prog_name="dpfy", standalone_mode=False)
    except _UsageError as exc:
        print(f"dpfy: error: {_one_line(exc.format_message())}", file=sys.stderr)
        return 2
    except _ClickException as exc:
        print(f"dpfy: error: {_one_line(exc.format_message())}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))
    except (UsageProblem, ValueError, FileNotFoundError) as exc:
        print(f"dpfy: error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 2
    except (typer.Exit, typer.Abort) as exc:
        return int(getattr(exc, "exit_code", 130))
    except Exception as exc:  # noqa: BLE001 - click's Exit/Abort from either click copy
        if type(exc).__name__ == "Exit":
            return int(getattr(exc, "exit_code", 0))
        if type(exc).__name__ == "Abort":
            print("dpfy: aborted", file=sys.stderr)
            return 130
        raise
    return int(result) if isinstance(result, int) else 0


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

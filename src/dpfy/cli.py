"""The ``dpfy`` command: parse options, call :mod:`dpfy.runs`, print, map errors to exit codes.

The pipelines themselves (train, fit, account, report, plan) live in :mod:`dpfy.runs`, which
checks every argument. On bad input a command exits with code 2 and a one-line message (never
a traceback). Every epsilon printed names its accounting method and adjacency.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import click
import typer
from click.core import ParameterSource

# The argument rules every pipeline applies (dpfy._validate), re-exported by dpfy.runs: the
# option parsers below refuse a bad value with the same rule before a command runs.
from dpfy import runs as _rules

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


def _sampler_enum(name: str, *, train: bool) -> Any:
    """A StrEnum of the sampler kinds the table offers on the command line (dashed spelling)."""
    from dpfy.sampling import kinds

    rows = [r for r in kinds() if (r.cli_train if train else r.cli)]
    return StrEnum(name, {r.name: r.cli_name for r in rows})


if TYPE_CHECKING:
    from dpfy.config import RunConfig

    # generated from the table at run time, so opaque to a type checker
    SamplerName: TypeAlias = Any
    TrainSampler: TypeAlias = Any
else:
    #: Samplers of the accounting commands (rows of dpfy.sampling.kinds with ``cli``).
    SamplerName = _sampler_enum("SamplerName", train=False)


def _method_names() -> tuple[str, ...]:
    """The ``--method`` choices: ``auto``, every registered accountant, ``all``."""
    from dpfy.accounting import accountants

    return ("auto", *accountants(), "all")


class _RegistryChoice(click.Choice):  # type: ignore[type-arg]
    """A ``click.Choice`` whose choices are read from a registry whenever they are needed
    (help, parsing, completion), so an accountant registered after ``dpfy.cli`` was imported
    is offered and one never registered is refused with the usual one-line error."""

    def __init__(self, names: Callable[[], tuple[str, ...]]) -> None:
        self._names = names
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._names()


class UsageProblem(Exception):
    """Bad input found by a command: reported in one line with exit code 2."""


# ---------------------------------------------------------------------------------------------
# option parsers: every option of a kind is checked by the same rule of dpfy._validate, at parse
# time, so a bad value is refused (one line naming the option) before anything runs or is written
# ---------------------------------------------------------------------------------------------
def _parsed(name: str, convert: Callable[[str], Any], check: Callable[[str, Any], None]) -> Any:
    """A typer ``parser``: ``convert`` the text, then ``check(name, value)``; a failure is a
    ``BadParameter`` (exit 2, one line) carrying the project's message."""

    def parse(text: Any) -> Any:
        if not isinstance(text, str):  # a default value, already of its type
            return text
        try:
            value = convert(text)
        except ValueError:
            kind = "an integer" if convert is int else "a number"
            raise typer.BadParameter(f"{name} must be {kind}, got {name}={text[:40]!r}") from None
        try:
            check(name, value)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from None
        return value

    return parse


def _count(name: str, low: int = 1) -> Any:
    """Every integer option: an integer in [low, MAX_COUNT]."""
    return _parsed(name, int, lambda n, v: _rules.check_int(n, v, low))


def _positive(name: str, high: float = math.inf) -> Any:
    """Every float the math needs finite: in (0, high], never inf or NaN."""
    return _parsed(name, float, lambda n, v: _rules.check_positive(n, v, high))


def _open_unit(name: str) -> Any:
    """A probability: in (0, 1)."""
    return _parsed(
        name, float, lambda n, v: _rules.check_range(n, v, 0.0, 1.0, low_open=True, high_open=True)
    )


def _seed(name: str = "seed") -> Any:
    return _parsed(name, int, _rules.check_seed)


def _threads(name: str) -> Any:
    return _parsed(name, int, lambda n, v: _rules.check_int(n, v, 1, os.cpu_count() or 1))


def _out_dir(name: str) -> Any:
    """Every output directory: not empty, not an existing file, creatable."""

    parse = _parsed(name, str, _rules.check_output_path)
    return lambda text: Path(parse(text)) if isinstance(text, str) else text


DatasetSize = Annotated[
    int,
    typer.Option("--dataset-size", "-n", help="Number of examples N.",
                 parser=_count("dataset_size")),
]
BatchSize = Annotated[
    int,
    typer.Option("--batch-size", "-b", help="Expected batch size B (Poisson: q = B/N).",
                 parser=_count("batch_size")),
]
Epochs = Annotated[
    float | None, typer.Option("--epochs", help="Passes over the data.",
                               parser=_positive("epochs", _rules.MAX_COUNT))
]
Steps = Annotated[
    int | None, typer.Option("--steps", help="Number of training steps.", parser=_count("steps"))
]
Delta = Annotated[
    float, typer.Option("--delta", help="Target delta, in (0, 1).", parser=_open_unit("delta"))
]
TargetEpsilon = _positive("target_epsilon", _rules.MAX_EPSILON)
Sampler = Annotated[
    SamplerName, typer.Option("--sampler", help="The batch sampler that actually runs.")
]
Method = Annotated[
    str,
    typer.Option("--method", help="Accounting method.", click_type=_RegistryChoice(_method_names)),
]
MaxBatch = Annotated[
    int | None,
    typer.Option("--max-batch-size", help="Truncate batches to this size (costs extra delta).",
                 parser=_count("max_batch_size")),
]
Samples = Annotated[
    int | None,
    typer.Option("--samples", help="Monte Carlo samples (Balls-and-Bins).",
                 parser=_count("samples")),
]
ErrorProb = Annotated[
    float,
    typer.Option("--error-probability", help="Monte Carlo: probability the bound fails.",
                 parser=_open_unit("error_probability")),
]
Seed = Annotated[
    int | None, typer.Option("--seed", help="Seed for Monte Carlo accounting.", parser=_seed())
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
CompareMechanisms = Annotated[
    bool,
    typer.Option("--compare-mechanisms", help="Also calibrate DP-SGD (Poisson, shuffle) and "
                 "the correlated-noise mechanisms (BandMF, BLT, tree, efficient tree; cyclic "
                 "order) side by side at the same epsilon."),
]


class MechanismName(StrEnum):
    dpsgd = "dpsgd"
    bandmf = "bandmf"
    blt = "blt"
    tree = "tree"
    tree_efficient = "tree-efficient"
    dp_sgd = "dp-sgd"  # alias of dpsgd
    dp_ftrl_tree = "dp-ftrl-tree"  # alias of tree-efficient (Kairouz et al. 2021)


#: The spellings that name another mechanism.
_MECHANISM_ALIASES = {"dp-sgd": "dpsgd", "dp-ftrl-tree": "tree-efficient"}


def _print_mechanisms(rows: list[dict[str, Any]], title: str) -> None:
    print(title)
    print(f"{'mechanism':<16}{'sampler':<10}{'method':<10}{'z':>9}{'epsilon':>9}"
          f"{'prefix rmse / C':>17}")
    for r in rows:
        print(f"{r['mechanism']:<16}{r['sampler']:<10}{r['method']:<10}"
              f"{r['noise_multiplier']:>9.4f}{r['epsilon']:>9.4f}{r['prefix_rmse']:>17.4g}")


def _num(value: Any) -> Any:
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


def _result_fields(res: Any) -> dict[str, Any]:
    """The printed fields of a :class:`dpfy.accounting.PrivacyResult`."""
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
        float,
        typer.Option("--noise-multiplier", "-z", help="Noise std / clip norm.",
                     parser=_positive("noise_multiplier")),
    ],
    delta: Delta,
    epochs: Epochs = None,
    steps: Steps = None,
    sampler: Sampler = SamplerName.poisson,
    method: Method = "auto",
    max_batch_size: MaxBatch = None,
    samples: Samples = None,
    error_probability: ErrorProb = 1e-3,
    seed: Seed = None,
    as_json: AsJson = False,
) -> None:
    """Epsilon spent by a training run, accounted for the sampler that actually runs."""
    from dpfy import runs

    run = runs.account_run(
        dataset_size,
        batch_size,
        noise_multiplier,
        delta,
        epochs=epochs,
        steps=steps,
        sampler=sampler.value,
        method=method,
        max_batch_size=max_batch_size,
        samples=samples,
        error_probability=error_probability,
        seed=seed,
    )
    payload = _run_fields(sampler, run)
    payload["noise_multiplier"] = noise_multiplier
    payload.update(_result_fields(run.result))
    if run.attack_risk is not None:
        tpr = run.attack_risk.to_dict()["tpr_at_fpr"]
        payload["tpr_at_fpr"] = (
            tpr if as_json else "; ".join(f"FPR {k}: TPR <= {v:.4g}" for k, v in tpr.items())
        )
        payload["tpr_method"] = run.attack_risk.method
    if run.comparison is not None:
        payload["results"] = {
            k: (v if isinstance(v, str) else _result_fields(v)) for k, v in run.comparison.items()
        }
    _emit(payload, as_json, "dpfy epsilon")


def _run_fields(sampler: SamplerName, run: Any) -> dict[str, Any]:
    """The run's description shared by ``epsilon`` and ``calibrate`` output."""
    return {
        "sampler": sampler.value,
        "dataset_size": run.dataset_size,
        "batch_size": run.batch_size,
        "sampling_rate": run.sampling_rate,
        "steps": run.steps,
        "epochs": run.epochs,
    }


@app.command()
def calibrate(
    target_epsilon: Annotated[
        float,
        typer.Option("--target-epsilon", help="Epsilon the run must not exceed.",
                     parser=TargetEpsilon),
    ],
    dataset_size: DatasetSize,
    batch_size: BatchSize,
    delta: Delta,
    epochs: Epochs = None,
    steps: Steps = None,
    sampler: Sampler = SamplerName.poisson,
    method: Method = "auto",
    max_batch_size: MaxBatch = None,
    samples: Samples = None,
    error_probability: ErrorProb = 1e-3,
    seed: Seed = None,
    compare_mechanisms: CompareMechanisms = False,
    as_json: AsJson = False,
) -> None:
    """Smallest noise multiplier whose epsilon stays at or below the target (safe side)."""
    from dpfy import runs

    if method == "all":
        raise UsageProblem("--method all is for `dpfy epsilon`; calibrate with one method")
    run = runs.calibrate_run(
        target_epsilon,
        dataset_size,
        batch_size,
        delta,
        epochs=epochs,
        steps=steps,
        sampler=sampler.value,
        method=method,
        max_batch_size=max_batch_size,
        samples=samples,
        error_probability=error_probability,
        seed=seed,
        compare_mechanisms=compare_mechanisms,
    )
    payload = _run_fields(sampler, run)
    payload.update(target_epsilon=target_epsilon, noise_multiplier=run.noise_multiplier)
    payload.update(_result_fields(run.result))
    rows = None if run.mechanisms is None else [dataclasses.asdict(r) for r in run.mechanisms]
    if rows is not None and as_json:
        payload["mechanisms"] = rows
    _emit(payload, as_json, "dpfy calibrate")
    if rows is not None and not as_json:
        _print_mechanisms(rows, f"mechanisms at epsilon {target_epsilon:g} (whole epochs of "
                          f"{dataset_size // batch_size} steps):")


@app.command()
def report(
    ledger_path: Annotated[Path, typer.Argument(help="A ledger file (JSON lines).")],
    delta: Annotated[
        float | None,
        typer.Option("--delta", help="Delta of the statement (default: the run's delta).",
                     parser=_open_unit("delta")),
    ] = None,
    method: Method = "auto",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory for report.md/json and figures.",
                     parser=_out_dir("out")),
    ] = None,
    figures: Annotated[bool, typer.Option("--figures/--no-figures")] = True,
    as_json: AsJson = False,
) -> None:
    """Re-account a ledger with every applicable method and write the privacy report."""
    from dpfy import runs

    if method == "all":
        raise UsageProblem("--method all is for `dpfy epsilon`; reports list every method anyway")
    run = runs.report_ledger(
        ledger_path, delta=delta, method=method, out=out, figures=figures
    )
    rep = run.report
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
    console.print(f"report: {run.report_path}")


class AuditMethodName(StrEnum):
    canary = "canary"
    one_run = "one-run"


@app.command()
def audit(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (ledger.jsonl, report.json).")],
    method: Annotated[
        AuditMethodName, typer.Option("--method", help="White-box canaries or one-run.")
    ] = AuditMethodName.canary,
    trials: Annotated[
        int | None,
        typer.Option("--trials", help="Canary trials (canary) or canaries (one-run).",
                     parser=_count("trials", 4)),
    ] = None,
    confidence: Annotated[
        float, typer.Option("--confidence", help="Confidence of the lower bound, in (0, 1).",
                            parser=_open_unit("confidence"))
    ] = 0.95,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the audit's canaries and noise.", parser=_seed())
    ] = 0,
    as_json: AsJson = False,
) -> None:
    """Measure an empirical epsilon lower bound for a run's release; add it to its report."""
    from dpfy import runs

    section = runs.audit_and_report(
        run_dir, method=method.value, trials=trials, confidence=confidence, seed=seed,
        progress=not as_json,
    )
    if as_json:
        print(json.dumps({k: _num(v) for k, v in section.items()}, default=str))
        return
    from rich.console import Console

    console = Console()
    console.print(
        f"[bold]{section['verdict']}[/bold]: lower bound {section['epsilon_lower']:.4g} vs "
        f"audited claim {section['audited_claim']:.4g} ({section['audited_release']}); "
        f"{section['method']}, {100 * confidence:g} % confidence, {section['trials']} trials, "
        f"ceiling {section['ceiling']:.4g}"
    )
    console.print(section["meaning"], highlight=False)
    console.print(f"report: {run_dir / 'report.md'}")


@app.command()
def plan(
    dataset_size: DatasetSize,
    target_epsilon: Annotated[
        float,
        typer.Option("--target-epsilon", help="Epsilon budget of the final run.",
                     parser=TargetEpsilon),
    ],
    delta: Delta,
    max_steps: Annotated[
        int | None,
        typer.Option("--max-steps", help="Most DP-SGD steps you will run.",
                     parser=_count("max_steps")),
    ] = None,
    max_examples_processed: Annotated[
        int | None,
        typer.Option("--max-examples-processed", help="Compute budget: batch size x steps.",
                     parser=_count("max_examples_processed")),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write the options and privacy-wall figures to this folder.",
                     parser=_out_dir("plot")),
    ] = None,
    sampler: Sampler = SamplerName.poisson,
    compare_mechanisms: CompareMechanisms = False,
    as_json: AsJson = False,
) -> None:
    """Recommend (batch size, noise multiplier, steps) that meet the budget for the sampler."""
    from dpfy import runs

    result, figures, compared = runs.plan_and_compare(
        dataset_size,
        target_epsilon,
        delta,
        compare_mechanisms=compare_mechanisms,
        max_steps=max_steps,
        max_examples_processed=max_examples_processed,
        plot_dir=plot,
        sampler=sampler.value,
    )
    rows = None if compared is None else [dataclasses.asdict(r) for r in compared]
    if as_json:
        payload = result.to_dict()
        if figures:
            payload["figures"] = [str(p) for p in figures]
        if rows is not None:
            payload["mechanisms"] = rows
        print(json.dumps(payload, default=str))
        return
    print(result.summary())
    for path in figures:
        print(f"figure: {path}")
    if rows is not None:
        _print_mechanisms(rows, "mechanisms at the recommended batch size "
                          f"{result.recommendation.batch_size} (whole epochs):")


#: ``--seed`` of ``dpfy train`` / ``dpfy features``: without it a run is secure (a DP release).
SEEDED_HELP = (
    "Run a reproducible seeded experiment with this seed instead of a DP release (default: no "
    "seed; sampling and noise from the secure generator). A seeded model is NOT private "
    "against anyone who knows the seed; its report says so."
)


class DatasetName(StrEnum):
    mnist = "mnist"
    fashion_mnist = "fashion-mnist"
    rotten_tomatoes = "rotten-tomatoes"


if not TYPE_CHECKING:
    #: Samplers of ``dpfy train`` (rows of dpfy.sampling.kinds with ``cli_train``).
    TrainSampler = _sampler_enum("TrainSampler", train=True)


#: ``--max-length`` of ``dpfy train``: tokens per text example, as BERT's positions allow.
_max_length = _parsed("max_length", int, lambda n, v: _rules.check_int(n, v, 2, 512))


class UserReduction(StrEnum):
    sum = "sum"
    mean = "mean"


class TrainPrecision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


#: Where an option's value came from when it counts as given (the command line, or the
#: environment).
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _config_value(name: str, value: Any) -> Any:
    """A CLI option's value as the RunConfig field takes it (enum members -> their names)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, StrEnum):
        value = value.value
        return _MECHANISM_ALIASES.get(value, value) if name == "mechanism" else value
    return value


def _run_config(
    ctx: typer.Context, dataset: DatasetName | None, config: Path | None, given: dict[str, Any]
) -> RunConfig:
    """The RunConfig of ``dpfy train``: the --config file (if any), then the options given on
    the command line (an option left at its default does not override the file)."""
    from dpfy.config import RunConfig

    values = {
        name: _config_value(name, value)
        for name, value in given.items()
        if ctx.get_parameter_source(name) in _GIVEN
    }
    if dataset is not None:
        values["dataset"] = dataset.value
    if config is not None:
        return RunConfig.from_file(config, **values)
    if dataset is None:
        raise ValueError("dataset is missing: name one (mnist, fashion-mnist, "
                         "rotten-tomatoes) or give --config FILE")
    return RunConfig.from_mapping(values, source="dpfy train")


def _command_with_options(
    fn: Callable[..., None], options: dict[str, tuple[Any, Any]]
) -> Callable[..., None]:
    """``fn(ctx, dataset, config, **given)`` with one keyword parameter per entry of
    ``options`` in its signature (what typer reads to build the command's options)."""

    @functools.wraps(fn)
    def command(**kwargs: Any) -> None:
        fn(**kwargs)

    own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    hints = {
        "ctx": typer.Context,
        "dataset": Annotated[
            DatasetName | None,
            typer.Argument(help="Training data (offline packages); optional with --config."),
        ],
        "config": Annotated[
            Path | None,
            typer.Option("--config", help="A TOML file of the run's options (a run "
                         "directory's run.toml); options given here override it."),
        ],
    }
    params = [p.replace(annotation=hints[p.name]) for p in own]
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                          annotation=annotation)
        for name, (annotation, default) in options.items()
    ]
    command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return command


def _with_options(
    options: dict[str, tuple[Any, Any]],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: ``fn(ctx, dataset, config, **given)`` with one keyword parameter per entry of
    ``options`` in its signature (what typer reads to build the command's options)."""
    return functools.partial(_command_with_options, options=options)


#: ``dpfy train``'s options, one per field of :class:`dpfy.config.RunConfig` (the shown
#: defaults are the RunConfig's; only options given on the command line override --config).
_TRAIN_OPTIONS: dict[str, tuple[Any, Any]] = {
    "target_epsilon": (
        Annotated[
        float,
        typer.Option("--target-epsilon", help="Privacy budget of the run.", parser=TargetEpsilon),
    ],
        3.0,
    ),
    "delta": (
        Delta,
        1e-5,
    ),
    "sampler": (
        Annotated[
        TrainSampler | None,
        typer.Option("--sampler", help="Batch sampler (decides the accounting; default "
                     "poisson, cyclic with a correlated --mechanism)."),
    ],
        None,
    ),
    "epochs": (
        Annotated[
        int | None,
        typer.Option("--epochs", help="Passes over the data (default: images 10; text 2, "
                     "LoRA 3).", parser=_count("epochs")),
    ],
        None,
    ),
    "batch_size": (
        Annotated[
        int | None,
        typer.Option("--batch-size", help="Expected batch size (default: images 1024; "
                     "text 256).", parser=_count("batch_size")),
    ],
        None,
    ),
    "learning_rate": (
        Annotated[
        float | None,
        typer.Option("--learning-rate", help="Step size (default: images SGD 2.0; text Adam "
                     "1e-4, LoRA 5e-4).", parser=_positive("learning_rate", _rules.MAX_SCALE)),
    ],
        None,
    ),
    "clip_norm": (
        Annotated[
        float | None,
        typer.Option("--clip-norm", help="Per-example clip norm (default: images 0.1; "
                     "text 1.0).", parser=_positive("clip_norm", _rules.MAX_SCALE)),
    ],
        None,
    ),
    "seed": (
        Annotated[
        int | None, typer.Option("--seed", help=SEEDED_HELP, parser=_seed())
    ],
        None,
    ),
    "out": (
        Annotated[
        Path | None, typer.Option("--out", help="Run directory.", parser=_out_dir("out"))
    ],
        None,
    ),
    "train_limit": (
        Annotated[
        int | None,
        typer.Option("--train-limit", help="Use only this many training examples.",
                     parser=_count("train_limit")),
    ],
        None,
    ),
    "model": (
        Annotated[
        str | None,
        typer.Option("--model", help="Text datasets only: the pretrained model {minilm} "
                     "(default minilm)."),
    ],
        None,
    ),
    "lora": (
        Annotated[
        bool,
        typer.Option("--lora", help="Text datasets only: LoRA (r=8 on query/value; the "
                     "head trained in full) instead of full fine-tuning."),
    ],
        False,
    ),
    "max_length": (
        Annotated[
        int | None,
        typer.Option("--max-length", help="Text datasets only: tokens per example, in "
                     "[2, 512] (default 64).", parser=_max_length),
    ],
        None,
    ),
    "test_limit": (
        Annotated[
        int | None,
        typer.Option("--test-limit", help="Evaluate on the first this many test examples "
                     "(quick runs).", parser=_count("test_limit")),
    ],
        None,
    ),
    "threads": (
        Annotated[
        int | None,
        typer.Option("--threads", help="Torch threads, in [1, cpu count].",
                     parser=_threads("threads")),
    ],
        None,
    ),
    "precision": (
        Annotated[
        TrainPrecision,
        typer.Option("--precision", help="Forward/backward autocast dtype; clipping and "
                     "noise stay fp32."),
    ],
        TrainPrecision.fp32,
    ),
    "unit": (
        Annotated[
        str,
        typer.Option("--unit", help="Unit of privacy: example (default); user (images, with "
                     "--users) or movie (rotten-tomatoes): user-level DP-SGD."),
    ],
        "example",
    ),
    "users": (
        Annotated[
        int | None,
        typer.Option("--users", help="Images with --unit user: number of synthetic users "
                     "(image i belongs to user i mod N).", parser=_count("users")),
    ],
        None,
    ),
    "cap": (
        Annotated[
        int | None,
        typer.Option("--cap", help="User-level: at most this many examples per user (a "
                     "random subset, recorded in the ledger).", parser=_count("cap")),
    ],
        None,
    ),
    "user_reduction": (
        Annotated[
        UserReduction,
        typer.Option("--user-reduction", help="User-level: clip the sum or the mean of a "
                     "user's gradients."),
    ],
        UserReduction.sum,
    ),
    "workers": (
        Annotated[
        int,
        typer.Option("--workers", help="Images only: data-parallel processes on this machine "
                     "(gloo; a divisor of the physical batch 1024). Same privacy and ledger.",
                     parser=_count("workers")),
    ],
        1,
    ),
    "shard": (
        Annotated[
        bool,
        typer.Option("--shard", help="With --workers N: shard the model over the processes "
                     "(FSDP2 fully_shard; each process noises its own shard)."),
    ],
        False,
    ),
    "mechanism": (
        Annotated[
        MechanismName,
        typer.Option("--mechanism", help="Noise: dpsgd (alias dp-sgd; independent per step) "
                     "or correlated DP-FTRL noise bandmf, blt, tree, tree-efficient (alias "
                     "dp-ftrl-tree: the full tree with the Honaker estimator; default sampler "
                     "then: cyclic)."),
    ],
        MechanismName.dpsgd,
    ),
    "audit_canaries": (
        Annotated[
        int | None,
        typer.Option("--audit-canaries", help="Images: train with M canaries, each in the "
                     "training set by a secret coin, and add a one-run audit (Steinke et al.; "
                     "f-DP) to the report. M in [2, training set size].",
                     parser=_count("audit_canaries", 2)),
    ],
        None,
    ),
    "audit_guesses": (
        Annotated[
        int | None,
        typer.Option("--audit-guesses", help="Guesses of the one-run audit, in [2, M] "
                     "(default M/5); it abstains on the rest.",
                     parser=_count("audit_guesses", 2)),
    ],
        None,
    ),
    "audit_confidence": (
        Annotated[
        float, typer.Option("--audit-confidence", help="Confidence of the one-run audit's "
                            "bounds, in (0, 1).", parser=_open_unit("audit_confidence"))
    ],
        0.95,
    ),
}


@app.command("train")
@_with_options(_TRAIN_OPTIONS)
def train(
    ctx: typer.Context,
    dataset: DatasetName | None = None,
    config: Path | None = None,
    **given: Any,
) -> None:
    """Train a CNN with DP-SGD (images) or DP fine-tune MiniLM (rotten-tomatoes), then write
    the model, ledger and privacy report to --out. With --unit user / movie, one user (movie)
    is the unit of privacy. --config FILE reads the options from a TOML file (a run's
    run.toml); options given on the command line override it."""
    from dpfy import runs

    run_config = _run_config(ctx, dataset, config, given)
    run = runs.train_and_report(run_config, progress=True)
    from rich.console import Console

    console = Console()
    console.print(run.report.release, highlight=False)
    console.print(f"[bold]{run.statement}[/bold]")
    console.print(
        f"test accuracy {100 * run.test_accuracy:.2f} %, training took {run.seconds:.0f} s"
    )
    audit_ = run.report.audit
    if audit_:
        console.print(
            f"one-run audit ({audit_['trials']} canaries, {audit_['guesses']} guesses, "
            f"{audit_['correct']} correct, {100 * run_config.audit_confidence:g} %): epsilon >= "
            f"{audit_['epsilon_lower']:.3g} (ceiling {audit_['ceiling']:.3g}); f-DP: epsilon >= "
            f"{audit_['fdp_epsilon_lower']:.3g} (ceiling {audit_['fdp_ceiling']:.3g}); "
            f"{audit_['verdict']}",
            highlight=False,
        )
    console.print(f"run directory: {run.out_dir}   report: {run.report_path}")





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
        float, typer.Option("--target-epsilon", help="Privacy budget.", parser=TargetEpsilon)
    ] = 1.0,
    delta: Delta = 1e-5,
    seed: Annotated[
        int | None, typer.Option("--seed", help=SEEDED_HELP, parser=_seed())
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", help="Use only this many training examples.",
                     parser=_count("limit", 2)),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory.", parser=_out_dir("out"))
    ] = None,
) -> None:
    """Learn a linear classifier with DP on pretrained features; write ledger and report.

    Features (EfficientNet-Lite0 for images, all-MiniLM-L6-v2 for the rotten-tomatoes
    snippets) are extracted once and cached; the first run takes a while.
    """
    from dpfy import runs

    run = runs.features_and_report(
        dataset.value,
        method=method.value,
        target_epsilon=target_epsilon,
        delta=delta,
        seed=seed,
        limit=limit,
        out=out,
    )
    from rich.console import Console

    console = Console()
    console.print(run.report.release, highlight=False)
    console.print(f"[bold]{run.statement}[/bold]")
    estimator = run.model
    rho = run.zcdp_rho
    console.print(
        f"{type(estimator).__name__}: test accuracy {100 * run.test_accuracy:.2f} % "
        f"(fit {run.seconds:.1f} s); the paper's zCDP view of the same run: rho = {rho:.4g}"
    )
    console.print(f"report: {run.report_path}")


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
        print(f"dpfy: error: {_one_line(_click_message(exc))}", file=sys.stderr)
        return 2
    except _ClickException as exc:
        print(f"dpfy: error: {_one_line(_click_message(exc))}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))
    except (UsageProblem, ValueError, FileNotFoundError) as exc:
        print(f"dpfy: error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        hint = "; install it (`make` installs every extra)" if exc.name else ""
        print(f"dpfy: error: {_one_line(str(exc))}{hint}", file=sys.stderr)
        return 2
    except (typer.Exit, typer.Abort) as exc:
        return int(getattr(exc, "exit_code", 130))
    except Exception as exc:  # noqa: BLE001 - click's Exit/Abort from either click copy
        if type(exc).__name__ == "Exit":
            return int(getattr(exc, "exit_code", 0))
        if type(exc).__name__ == "Abort":
            print("dpfy: aborted", file=sys.stderr)
            return 130
        if type(exc).__name__ == "DistributedError":  # a --workers run lost a process
            print(f"dpfy: error: {_one_line(str(exc))}", file=sys.stderr)
            return 1
        raise
    return int(result) if isinstance(result, int) else 0


def _click_message(exc: Exception) -> str:
    """The message click would print for one of its exceptions."""
    return str(getattr(exc, "format_message", exc.__str__)())


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

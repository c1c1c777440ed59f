"""The ``dpfy`` command: parse options, call :mod:`dpfy.runs`, print, map errors to exit codes.

The pipelines themselves (train, fit, account, report, plan) live in :mod:`dpfy.runs`, which
checks every argument. On bad input a command exits with code 2 and a one-line message (never
a traceback). Every epsilon printed names its accounting method and adjacency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import warnings
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from dpfy import _validate

# The option parsers (dpfy.cli_options) apply the argument rules every pipeline applies
# (dpfy._validate): a bad value is refused with the same rule before a command runs.
from dpfy.cli_options import (
    MONTE_CARLO_OPTIONS,
    SEEDED_HELP,
    TRAIN_OPTIONS,
    AsJson,
    BatchSize,
    CompareMechanisms,
    DatasetName,
    DatasetSize,
    Delta,
    Epochs,
    MaxBatch,
    Method,
    Sampler,
    SamplerName,
    Steps,
    TargetEpsilon,
    TrialDistribution,
    UsageProblem,
    count_option,
    open_unit_option,
    out_dir_option,
    positive_option,
    run_config,
    seed_option,
    with_options,
)

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


PublicKeyOption = Annotated[
    str | None,
    typer.Option("--public-key", help="An Ed25519 public key (64 hex digits) you hold apart "
                 "from the run: the run's own key (its released report or model card names it) "
                 "or a long-lived key that endorsed it. A ledger signed by a key that is "
                 "neither is refused (exit 2)."),
]
TrustOption = Annotated[
    Path | None,
    typer.Option("--trust", help="A file holding the public key you trust (KEY.pub of "
                 "`dpfy keys new`, or PEM): as --public-key."),
]

keys_app = typer.Typer(help="Long-lived signing keys, kept outside runs.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("new")
def keys_new(
    path: Annotated[Path, typer.Argument(help="Where to write the private key (mode 0600); "
                                        "its public key goes to PATH.pub.")],
) -> None:
    """Draw a long-lived Ed25519 key that signs the keys of your runs (`dpfy train
    --signing-key PATH`); give readers PATH.pub (`dpfy report --trust PATH.pub`)."""
    from dpfy import runs

    public = runs.new_signing_key(path)
    print(f"private key: {path} (keep it outside every run directory; back it up)")
    print(f"public key:  {path}.pub  {public}")


def _warn_unless_trusted(trust: Any) -> None:
    """One warning line on standard error unless the ledger's key was checked against the key
    the reader trusts (``trust``: :meth:`dpfy.ledger.trust.KeyTrust.to_dict`)."""
    if isinstance(trust, dict) and not trust.get("verified"):
        print(f"dpfy: warning: ledger key: {trust.get('summary')}", file=sys.stderr)


def _print_mechanisms(rows: list[dict[str, Any]], title: str) -> None:
    print(title)
    print(f"{'mechanism':<16}{'sampler':<10}{'method':<10}{'z':>9}{'epsilon':>9}"
          f"{'prefix rmse / C':>17}")
    for r in rows:
        print(f"{r['mechanism']:<16}{r['sampler']:<10}{r['method']:<10}"
              f"{r['noise_multiplier']:>9.4f}{r['epsilon']:>9.4f}{r['prefix_rmse']:>17.4g}")
    print("method: the tightest accountant each mechanism supports (every applicable one "
          "calibrated, the smallest z kept)")


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
@with_options(MONTE_CARLO_OPTIONS)
def epsilon(
    dataset_size: DatasetSize,
    batch_size: BatchSize,
    noise_multiplier: Annotated[
        float,
        typer.Option("--noise-multiplier", "-z", help="Noise std / clip norm.",
                     parser=positive_option("noise_multiplier")),
    ],
    delta: Delta,
    epochs: Epochs = None,
    steps: Steps = None,
    sampler: Sampler = SamplerName.poisson,
    method: Method = "auto",
    max_batch_size: MaxBatch = None,
    as_json: AsJson = False,
    **monte_carlo: Any,
) -> None:
    """Epsilon spent by a training run, accounted for the sampler that actually runs."""
    from dpfy import run_accounting

    run = run_accounting.account_run(
        dataset_size,
        batch_size,
        noise_multiplier,
        delta,
        epochs=epochs,
        steps=steps,
        sampler=sampler.value,
        method=method,
        max_batch_size=max_batch_size,
        monte_carlo=run_accounting.MonteCarloOptions(**monte_carlo),
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
@with_options(MONTE_CARLO_OPTIONS)
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
    compare_mechanisms: CompareMechanisms = False,
    as_json: AsJson = False,
    **monte_carlo: Any,
) -> None:
    """Smallest noise multiplier whose epsilon stays at or below the target (safe side)."""
    from dpfy import run_accounting

    if method == "all":
        raise UsageProblem("--method all is for `dpfy epsilon`; calibrate with one method")
    run = run_accounting.calibrate_run(
        target_epsilon,
        dataset_size,
        batch_size,
        delta,
        epochs=epochs,
        steps=steps,
        sampler=sampler.value,
        method=method,
        max_batch_size=max_batch_size,
        monte_carlo=run_accounting.MonteCarloOptions(**monte_carlo),
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
                     parser=open_unit_option("delta")),
    ] = None,
    method: Method = "auto",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory for report.md/json and figures.",
                     parser=out_dir_option("out")),
    ] = None,
    figures: Annotated[bool, typer.Option("--figures/--no-figures")] = True,
    public_key: PublicKeyOption = None,
    trust: TrustOption = None,
    as_json: AsJson = False,
) -> None:
    """Re-account a ledger with every applicable method and write the privacy report.

    Exit code 0: the ledger is verified against the key you trust, or intact under a key
    nobody checked (one warning line on standard error); 2: broken or refused (one line)."""
    from dpfy import runs

    if method == "all":
        raise UsageProblem("--method all is for `dpfy epsilon`; reports list every method anyway")
    run = runs.report_ledger(
        ledger_path, delta=delta, method=method, out=out, figures=figures, public_key=public_key,
        trust=trust,
    )
    rep = run.report
    if run.diverted is not None:
        print(run.diverted, file=sys.stderr)
    _warn_unless_trusted(rep.ledger_integrity.get("trust"))
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
    console.print(f"{run.signature}\nreport: {run.report_path}", highlight=False)


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
                     parser=count_option("trials", 4)),
    ] = None,
    confidence: Annotated[
        float, typer.Option("--confidence", help="Confidence of the lower bound, in (0, 1).",
                            parser=open_unit_option("confidence"))
    ] = 0.95,
    seed: Annotated[
        int,
        typer.Option("--seed", help="Seed of the audit's canaries and noise.",
                     parser=seed_option()),
    ] = 0,
    public_key: PublicKeyOption = None,
    trust: TrustOption = None,
    as_json: AsJson = False,
    real_model: Annotated[
        bool,
        typer.Option("--real-model/--no-real-model",
                     help="Test the noise on every tensor of the run's own model (image runs)."),
    ] = True,
) -> None:
    """Measure an empirical epsilon lower bound for a run's release; add it to its report.

    Exit codes as `dpfy report`: 0 verified or intact (one warning line), 2 broken or
    refused."""
    from dpfy import runs

    section = runs.audit_and_report(
        run_dir, method=method.value, trials=trials, confidence=confidence, seed=seed,
        progress=not as_json, public_key=public_key, trust=trust, real_model=real_model,
    )
    _warn_unless_trusted(section.get("ledger_trust"))
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
                     parser=count_option("max_steps")),
    ] = None,
    max_examples_processed: Annotated[
        int | None,
        typer.Option("--max-examples-processed", help="Compute budget: batch size x steps.",
                     parser=count_option("max_examples_processed")),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write the options and privacy-wall figures to this folder.",
                     parser=out_dir_option("plot")),
    ] = None,
    sampler: Sampler = SamplerName.poisson,
    compare_mechanisms: CompareMechanisms = False,
    as_json: AsJson = False,
) -> None:
    """Recommend (batch size, noise multiplier, steps) that meet the budget for the sampler."""
    from dpfy import run_accounting

    result, figures, compared = run_accounting.plan_and_compare(
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


@app.command("train")
@with_options(TRAIN_OPTIONS)
def train(
    ctx: typer.Context,
    dataset: Annotated[
        DatasetName | None,
        typer.Argument(help="Training data (offline packages); optional with --config."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="A TOML file of the run's options (a run directory's "
                     "run.toml); options given here override it."),
    ] = None,
    signing_key: Annotated[
        Path | None,
        typer.Option("--signing-key", help="A long-lived Ed25519 private key kept outside "
                     "runs (`dpfy keys new`): it endorses the run's own key in the ledger, so "
                     "`dpfy report --trust KEY.pub` verifies the run. Never in run.toml."),
    ] = None,
    **given: Any,
) -> None:
    """Train a CNN with DP-SGD (images) or DP fine-tune MiniLM (rotten-tomatoes), then write
    the model, ledger and privacy report to --out. With --unit user / movie, one user (movie)
    is the unit of privacy. --config FILE reads the options from a TOML file (a run's
    run.toml); options given on the command line override it. Started by torchrun (one
    machine or several), every process trains its share and rank 0 writes the run."""
    from dpfy import runs

    chosen = run_config(ctx, dataset, config, given)
    run = runs.train_launched(chosen, progress=True, signing_key=signing_key)  # torchrun: a rank
    if isinstance(run, runs.HelperRank):
        print(f"rank {run.rank} of {run.world_size}: done; rank 0 wrote the ledger, model and "
              "report")
        return
    _print_run(run, chosen)


def _print_run(run: Any, chosen: Any) -> None:
    """What ``dpfy train`` prints when the run is written (rank 0)."""
    from rich.console import Console

    console = Console()
    console.print(run.report.release, highlight=False)
    console.print(f"[bold]{run.statement}[/bold]")
    measured = ("validation accuracy (held-out training units: private, not published)"
                if chosen.validation else "test accuracy")
    console.print(  # the wall time too is the operator's only (it depends on the data)
        f"{measured} {100 * run.test_accuracy:.2f} %, training took {run.seconds:.0f} s"
    )
    audit_ = run.report.audit
    if audit_:
        console.print(
            f"one-run audit ({audit_['trials']} canaries, {audit_['guesses']} guesses, "
            f"{audit_['correct']} correct, {100 * chosen.audit_confidence:g} %): epsilon >= "
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


class FeatureExtractor(StrEnum):
    pretrained = "pretrained"
    scatternet = "scatternet"


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
        int | None, typer.Option("--seed", help=SEEDED_HELP, parser=seed_option())
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", help="Use only this many training examples.",
                     parser=count_option("limit", 2)),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory.", parser=out_dir_option("out"))
    ] = None,
    extractor: Annotated[
        FeatureExtractor,
        typer.Option("--extractor", help="pretrained networks, or the fixed ScatterNet "
                     "transform (images; Tramer & Boneh 2021)."),
    ] = FeatureExtractor.pretrained,
) -> None:
    """Learn a linear classifier with DP on pretrained features; write ledger and report.

    Features (EfficientNet-Lite0 for images, all-MiniLM-L6-v2 for the rotten-tomatoes
    snippets, or ScatterNet for images) are extracted once and cached; the first run takes a
    while.
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
        extractor=extractor.value,
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


@app.command("tune")
@with_options(TRAIN_OPTIONS)
def tune(
    ctx: typer.Context,
    dataset: Annotated[
        DatasetName | None,
        typer.Argument(help="Training data (offline packages); optional with --config."),
    ] = None,
    space: Annotated[
        Path | None,
        typer.Option("--space", help="A TOML file: one table per searched field (e.g. a "
                     "table learning_rate holding log_uniform = [1e-4, 1e-2]); kinds: "
                     "choices, uniform, log_uniform, int_uniform."),
    ] = None,
    trials: Annotated[
        float, typer.Option("--trials", help="Mean number of trials (fixed: exactly this many).",
                            parser=positive_option("trials", 1000.0)),
    ] = 4.0,
    distribution: Annotated[
        TrialDistribution,
        typer.Option("--distribution", help="Number of trials K: poisson, geometric, "
                     "logarithmic (random K, Papernot & Steinke 2022; the search may not vary "
                     "epochs, batch size or the probe) or fixed (every trial composed)."),
    ] = TrialDistribution.geometric,
    score_noise: Annotated[
        float, typer.Option("--score-noise", help="Std of the Gaussian noise on each trial's "
                            "count of correct validation predictions.",
                            parser=positive_option("score_noise", 1e6)),
    ] = 10.0,
    total_epsilon: Annotated[
        float | None,
        typer.Option("--total-epsilon", help="Budget of the whole search (trials, scores, "
                     "choice, release) at --delta: every run is calibrated to the per-run "
                     "target that meets it. Not with --target-epsilon.",
                     parser=positive_option("total_epsilon", _validate.MAX_EPSILON)),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="A TOML file of the base run's options."),
    ] = None,
    **given: Any,
) -> None:
    """Random hyperparameter search on a validation split of the training units (never the
    test set); the best configuration is retrained and released. Reports the whole search's
    epsilon (the figure to quote) and the final run's alone, accounted from every ledger.
    --total-epsilon calibrates every run so the whole search meets it. A directory holding a
    search (--out) resumes it."""
    from dpfy import tuning_runs

    if space is None:
        raise ValueError("space is missing: give --space FILE (a TOML table per field)")
    if total_epsilon is not None:
        _one_budget(ctx, config)
    chosen = run_config(ctx, dataset, config, given)
    options = tuning_runs.TuneOptions(trials=trials, distribution=distribution.value,
                                      score_noise=score_noise, total_epsilon=total_epsilon)
    run = tuning_runs.tune_and_report(chosen, space, options, progress=True)
    from rich.console import Console

    Console().print((run.out_dir / "report.md").read_text(encoding="utf-8"), highlight=False)


def _one_budget(ctx: typer.Context, config: Path | None) -> None:
    """``dpfy tune --total-epsilon`` refuses a per-run target beside it (command line or the
    --config file): the total decides every run's target."""
    import tomllib

    from dpfy.cli_options import _given

    in_file = False
    if config is not None and config.is_file():
        with contextlib.suppress(OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            keys = tomllib.loads(config.read_text(encoding="utf-8"))
            in_file = bool({"target_epsilon", "target-epsilon"} & set(keys))
    if _given(ctx, "target_epsilon") or in_file:
        raise ValueError("give one of --total-epsilon (the whole search's budget) or "
                         "--target-epsilon (each run's alone), not both")


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
        with warnings.catch_warnings():  # restores the hook below when the command ends
            warnings.showwarning = _show_warning
            result = command.main(args=args, prog_name="dpfy", standalone_mode=False)
    except _UsageError as exc:
        print(f"dpfy: error: {_one_line(_click_message(exc))}", file=sys.stderr)
        return 2
    except _ClickException as exc:
        print(f"dpfy: error: {_one_line(_click_message(exc))}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 1))
    except (UsageProblem, ValueError, FileNotFoundError) as exc:
        print(f"dpfy: error: {_with_notes(exc, str(exc)) or type(exc).__name__}",
              file=sys.stderr)
        return 2
    except OSError as exc:  # a file it may not read or write: a full disk, a size limit, ...
        print(f"dpfy: error: {_with_notes(exc, _os_message(exc))}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if type(exc).__name__ not in ("LedgerKeyError", "LedgerLockedError", "RepeatedKeyError"):
            raise
        print(f"dpfy: error: {_with_notes(exc, str(exc))}", file=sys.stderr)
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
        if type(exc).__name__ == "DistributedError":  # a process of the run was lost
            print(f"dpfy: error: {_one_line(str(exc))}", file=sys.stderr)
            return 1
        raise
    return int(result) if isinstance(result, int) else 0


def _click_message(exc: Exception) -> str:
    """The message click would print for one of its exceptions."""
    return str(getattr(exc, "format_message", exc.__str__)())


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _show_warning(message: Warning | str, category: type[Warning], *args: Any,
                  **kwargs: Any) -> None:
    """A warning raised while a command runs (a ledger's cut last line, say), as one
    ``dpfy: warning:`` line on standard error: no source line, no file path of dpfy's."""
    print(f"dpfy: warning: {_one_line(str(message))}", file=sys.stderr)


def _os_message(exc: OSError) -> str:
    """An ``OSError`` in words that name its file: ``cannot use FILE: REASON``."""
    if exc.filename is None:  # e.g. the ledger's own write error, which names its file
        return str(exc.strerror or exc)
    return f"cannot use {exc.filename}: {exc.strerror or exc}"


def _with_notes(exc: BaseException, message: str) -> str:
    """``message`` and the notes a layer below added (what a fault left), as one line."""
    return _one_line("; ".join([message, *getattr(exc, "__notes__", ())]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

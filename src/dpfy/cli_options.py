"""How the ``dpfy`` commands parse their options: one rule per kind of value, checked at
parse time, and ``dpfy train``'s option table.

Every option of a kind is checked by the same rule of :mod:`dpfy._validate` when it is parsed,
so a bad value is refused in one line naming the option (exit 2) before anything runs or is
written. ``dpfy train`` has one option per field of :class:`dpfy.config.RunConfig`: the table
:data:`TRAIN_OPTIONS` gives each its typer annotation and shown default, and
:func:`with_options` puts them into the command's signature (docs/architecture.md, 4.5).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import typer

# The argument rules every pipeline applies (dpfy._validate).
from dpfy import _validate as _rules


def _typer_click(module: str) -> ModuleType:
    """A module (``types``, ``shell_completion``) of the click package typer builds its
    commands with: the installed ``click`` in older typer releases, typer's own copy
    (``typer._click``, whose classes are not click's) in newer ones. Classes a command hands to
    typer, or compares with what typer returns, must come from it."""
    package = typer.BadParameter.__module__.rpartition(".")[0]
    return importlib.import_module(f"{package}.{module}")


if TYPE_CHECKING:
    from click import ParamType as _ParamType

    from dpfy.config import RunConfig
else:
    _ParamType = _typer_click("types").ParamType


def _sampler_enum(name: str, *, train: bool) -> Any:
    """A StrEnum of the sampler kinds the table offers on the command line (dashed spelling)."""
    from dpfy.sampling import registered_kinds

    rows = [r for r in registered_kinds() if (r.cli_train if train else r.cli)]
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


class _RegistryChoice(_ParamType):  # type: ignore[type-arg]
    """A choice among names read from a registry whenever they are needed (help, parsing,
    completion), so an accountant registered after ``dpfy.cli`` was imported is offered and
    one never registered is refused with the usual one-line error. A parameter type of typer's
    own click, written out: newer typer copies of click have no ``Choice`` to subclass."""

    name = "choice"

    def __init__(self, names: Callable[[], tuple[str, ...]]) -> None:
        self._names = names

    @property
    def choices(self) -> tuple[str, ...]:
        return self._names()

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return f"[{'|'.join(self.choices)}]"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        choices = self.choices
        if value in choices:
            return str(value)
        self.fail(f"{value!r} is not one of {', '.join(map(repr, choices))}.", param, ctx)

    def shell_complete(self, ctx: Any, param: Any, incomplete: str) -> list[Any]:
        item = _typer_click("shell_completion").CompletionItem
        return [item(name) for name in self.choices if name.startswith(incomplete)]


class UsageProblem(Exception):
    """Bad input found by a command: reported in one line with exit code 2."""


# ---------------------------------------------------------------------------------------------
# option parsers: every option of a kind is checked by the same rule of dpfy._validate, at parse
# time, so a bad value is refused (one line naming the option) before anything runs or is written
# ---------------------------------------------------------------------------------------------
def parsed_option(
    name: str, convert: Callable[[str], Any], check: Callable[[str, Any], None]
) -> Any:
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

    # --help shows a parser's name as the value type: INTEGER, FLOAT, TEXT (not PARSE)
    parse.__name__ = {int: "integer", float: "float"}.get(convert, "text")  # type: ignore[call-overload]
    return parse


def count_option(name: str, low: int = 1) -> Any:
    """Every integer option: an integer in [low, MAX_COUNT]."""
    return parsed_option(name, int, lambda n, v: _rules.check_int(n, v, low))


def positive_option(name: str, high: float = math.inf) -> Any:
    """Every float the math needs finite: in (0, high], never inf or NaN."""
    return parsed_option(name, float, lambda n, v: _rules.check_positive(n, v, high))


def open_unit_option(name: str) -> Any:
    """A probability: in (0, 1)."""
    return parsed_option(
        name, float, lambda n, v: _rules.check_range(n, v, 0.0, 1.0, low_open=True, high_open=True)
    )


def seed_option(name: str = "seed") -> Any:
    return parsed_option(name, int, _rules.check_seed)


def threads_option(name: str) -> Any:
    return parsed_option(name, int, lambda n, v: _rules.check_int(n, v, 1, os.cpu_count() or 1))


def out_dir_option(name: str) -> Any:
    """Every output directory: not empty, not an existing file, creatable."""

    parse = parsed_option(name, str, _rules.check_output_path)

    def path(text: Any) -> Any:
        return Path(parse(text)) if isinstance(text, str) else text

    return path  # --help: PATH


DatasetSize = Annotated[
    int,
    typer.Option("--dataset-size", "-n", help="Number of examples N.",
                 parser=count_option("dataset_size")),
]
BatchSize = Annotated[
    int,
    typer.Option("--batch-size", "-b", help="Expected batch size B (Poisson: q = B/N).",
                 parser=count_option("batch_size")),
]
Epochs = Annotated[
    float | None, typer.Option("--epochs", help="Passes over the data.",
                               parser=positive_option("epochs", _rules.MAX_COUNT))
]
Steps = Annotated[
    int | None,
    typer.Option("--steps", help="Number of training steps.", parser=count_option("steps")),
]
Delta = Annotated[
    float,
    typer.Option("--delta", help="Target delta, in (0, 1).", parser=open_unit_option("delta")),
]
TargetEpsilon = positive_option("target_epsilon", _rules.MAX_EPSILON)
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
                 parser=count_option("max_batch_size")),
]
Samples = Annotated[
    int | None,
    typer.Option("--samples", help="Monte Carlo samples (Balls-and-Bins).",
                 parser=count_option("samples")),
]
ErrorProb = Annotated[
    float,
    typer.Option("--error-probability", help="Monte Carlo: probability the bound fails.",
                 parser=open_unit_option("error_probability")),
]
Seed = Annotated[
    int | None,
    typer.Option("--seed", help="Seed for Monte Carlo accounting.", parser=seed_option()),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
CompareMechanisms = Annotated[
    bool,
    typer.Option("--compare-mechanisms", help="Also calibrate DP-SGD (Poisson, shuffle) and "
                 "the correlated-noise mechanisms (BandMF, BLT, tree, efficient tree; cyclic "
                 "order) side by side at the same epsilon, each with the tightest accountant "
                 "it supports (named in the method column)."),
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
_max_length = parsed_option("max_length", int, lambda n, v: _rules.check_int(n, v, 2, 512))


class TrialDistribution(StrEnum):
    """The number of trials of ``dpfy tune`` (dpfy.tuning_runs.TRIAL_DISTRIBUTIONS)."""

    poisson = "poisson"
    geometric = "geometric"
    logarithmic = "logarithmic"
    fixed = "fixed"


class UserReduction(StrEnum):
    sum = "sum"
    mean = "mean"


class TrainPrecision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Clipping(StrEnum):
    flat = "flat"
    automatic = "automatic"


#: Where an option's value came from when it counts as given (the command line, or the
#: environment): names of click's ``ParameterSource`` members, compared by name because typer's
#: copy of click has its own ``ParameterSource`` enum, never equal to the installed click's.
_GIVEN = frozenset({"COMMANDLINE", "ENVIRONMENT"})


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given (command line or environment), not left at its
    default."""
    return getattr(ctx.get_parameter_source(name), "name", None) in _GIVEN


def _config_value(name: str, value: Any) -> Any:
    """A CLI option's value as the RunConfig field takes it (enum members -> their names)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, StrEnum):
        value = value.value
        return _MECHANISM_ALIASES.get(value, value) if name == "mechanism" else value
    return value


def run_config(
    ctx: typer.Context, dataset: DatasetName | None, config: Path | None, given: dict[str, Any]
) -> RunConfig:
    """The RunConfig of ``dpfy train``: the --config file (if any), then the options given on
    the command line (an option left at its default does not override the file)."""
    from dpfy.config import RunConfig

    values = {
        name: _config_value(name, value)
        for name, value in given.items()
        if _given(ctx, name)
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
    """``fn(..., **given)`` with one keyword parameter per entry of ``options`` in its
    signature (what typer reads to build the command's options); ``fn``'s own parameters keep
    their annotations."""

    @functools.wraps(fn)
    def command(**kwargs: Any) -> None:
        fn(**kwargs)

    own = inspect.signature(fn, eval_str=True).parameters.values()
    params = [p for p in own if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                          annotation=annotation)
        for name, (annotation, default) in options.items()
    ]
    signature = inspect.Signature(params, return_annotation=None)
    command.__signature__ = signature  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return command


def with_options(
    options: dict[str, tuple[Any, Any]],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: ``fn(ctx, dataset, config, **given)`` with one keyword parameter per entry of
    ``options`` in its signature (what typer reads to build the command's options)."""
    return functools.partial(_command_with_options, options=options)


#: The Monte Carlo accounting options of ``dpfy epsilon`` and ``dpfy calibrate``, one per field
#: of :class:`dpfy.run_accounting.MonteCarloOptions`.
MONTE_CARLO_OPTIONS: dict[str, tuple[Any, Any]] = {
    "samples": (Samples, None),
    "error_probability": (ErrorProb, 1e-3),
    "seed": (Seed, None),
}


#: ``dpfy train``'s options, one per field of :class:`dpfy.config.RunConfig` (the shown
#: defaults are the RunConfig's; only options given on the command line override --config).
TRAIN_OPTIONS: dict[str, tuple[Any, Any]] = {
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
                     "LoRA 3).", parser=count_option("epochs")),
    ],
        None,
    ),
    "batch_size": (
        Annotated[
        int | None,
        typer.Option("--batch-size", help="Expected batch size, in units of privacy "
                     "(default: images 1024, text 256; with --unit user or movie at most "
                     "N/8 of the N users or movies, so an epoch has at least 8 steps).",
                     parser=count_option("batch_size")),
    ],
        None,
    ),
    "learning_rate": (
        Annotated[
        float | None,
        typer.Option("--learning-rate", help="Step size (default: images SGD 2.0; text Adam "
                     "1e-4, LoRA 5e-4).",
                     parser=positive_option("learning_rate", _rules.MAX_SCALE)),
    ],
        None,
    ),
    "clip_norm": (
        Annotated[
        float | None,
        typer.Option("--clip-norm", help="Per-example clip norm (default: images 0.1; "
                     "text 1.0).", parser=positive_option("clip_norm", _rules.MAX_SCALE)),
    ],
        None,
    ),
    "seed": (
        Annotated[
        int | None, typer.Option("--seed", help=SEEDED_HELP, parser=seed_option())
    ],
        None,
    ),
    "out": (
        Annotated[
        Path | None, typer.Option("--out", help="Run directory.", parser=out_dir_option("out"))
    ],
        None,
    ),
    "train_limit": (
        Annotated[
        int | None,
        typer.Option("--train-limit", help="Use only this many training examples.",
                     parser=count_option("train_limit")),
    ],
        None,
    ),
    "model": (
        Annotated[
        str | None,
        typer.Option("--model", help="Images: {tanh-cnn, gn-cnn, scatternet-linear, "
                     "scatternet-cnn} (default tanh-cnn; scatternet-*: a linear model or small "
                     "CNN on ScatterNet features, Tramer & Boneh 2021). Text: the pretrained "
                     "model {minilm} (default minilm)."),
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
                     "(quick runs).", parser=count_option("test_limit")),
    ],
        None,
    ),
    "threads": (
        Annotated[
        int | None,
        typer.Option("--threads", help="Torch threads, in [1, cpu count].",
                     parser=threads_option("threads")),
    ],
        None,
    ),
    "device": (
        Annotated[
        str | None,
        typer.Option("--device", help="Where to train: cpu (default), cuda or cuda:<index> "
                     "(one process)."),
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
                     "(image i belongs to user i mod N).", parser=count_option("users")),
    ],
        None,
    ),
    "cap": (
        Annotated[
        int | None,
        typer.Option("--cap", help="User-level: at most this many examples per user (a "
                     "random subset, recorded in the ledger).", parser=count_option("cap")),
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
                     "(gloo; a divisor of the physical batch 1024). Same privacy and ledger. "
                     "Leave it out under torchrun: its processes are the workers "
                     "(docs/distributed.md).",
                     parser=count_option("workers")),
    ],
        1,
    ),
    "shard": (
        Annotated[
        bool,
        typer.Option("--shard", help="With --workers N or under torchrun: shard the model "
                     "over the processes (FSDP2 fully_shard; each process noises its own "
                     "shard)."),
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
                     parser=count_option("audit_canaries", 2)),
    ],
        None,
    ),
    "audit_guesses": (
        Annotated[
        int | None,
        typer.Option("--audit-guesses", help="Guesses of the one-run audit, in [2, M] "
                     "(default M/5); it abstains on the rest.",
                     parser=count_option("audit_guesses", 2)),
    ],
        None,
    ),
    "audit_confidence": (
        Annotated[
        float, typer.Option("--audit-confidence", help="Confidence of the one-run audit's "
                            "bounds, in (0, 1).", parser=open_unit_option("audit_confidence"))
    ],
        0.95,
    ),
    "bias_only": (
        Annotated[
        bool,
        typer.Option("--bias-only", help="Text datasets only: train only the encoder's biases "
                     "and the head (DP-BiTFiT, Bu et al. 2022; default lr 5e-3, 3 epochs)."),
    ],
        False,
    ),
    "lora_rank": (
        Annotated[
        int | None,
        typer.Option("--lora-rank", help="With --lora: the rank r in [1, 384] (default 8; "
                     "alpha 2r).", parser=parsed_option(
                         "lora_rank", int, lambda n, v: _rules.check_int(n, v, 1, 384))),
    ],
        None,
    ),
    "lora_targets": (
        Annotated[
        str,
        typer.Option("--lora-targets", help="With --lora: attention (query and value, the "
                     "default) or all-linear (every linear layer of the encoder)."),
    ],
        "attention",
    ),
    "warmup": (
        Annotated[
        float,
        typer.Option("--warmup", help="Text datasets only: linear warm-up of Adam's rates "
                     "over this fraction of the steps, in [0, 1) (default 0).",
                     parser=parsed_option("warmup", float, lambda n, v: _rules.check_range(
                         n, v, 0.0, 1.0, high_open=True))),
    ],
        0.0,
    ),
    "adam_eps": (
        Annotated[
        float | None,
        typer.Option("--adam-eps", help="Text datasets only: Adam's epsilon, in (0, 1] "
                     "(default 1e-8).", parser=parsed_option(
                         "adam_eps", float,
                         lambda n, v: _rules.check_range(n, v, 0.0, 1.0, low_open=True))),
    ],
        None,
    ),
    "linear_probe": (
        Annotated[
        float | None,
        typer.Option("--linear-probe", help="Text datasets only: LP-FT. A DP-FC linear probe "
                     "on the frozen embeddings spends this share of --target-epsilon (in (0, "
                     "1), calibrated alone), then DP fine-tuning starts from its head with "
                     "noise calibrated so that the ledger of both meets the target.",
                     parser=open_unit_option("linear_probe")),
    ],
        None,
    ),
    "tan_steps": (
        Annotated[
        int | None,
        typer.Option("--tan-steps", help="A TAN-scaled run of about this many steps (Sander et "
                     "al. 2023): batch size and epochs from `dpfy plan` (the smallest batch "
                     "whose noise multiplier reaches 2); not with --batch-size or --epochs.",
                     parser=count_option("tan_steps")),
    ],
        None,
    ),
    "validation": (
        Annotated[
        bool,
        typer.Option("--validation", help="Train on the training units outside the validation "
                     "split (rotten-tomatoes: held-out movies; images: held-out images) and "
                     "measure accuracy there, never on the test split."),
    ],
        False,
    ),
    "private_diagnostics": (
        Annotated[
        Path | None,
        typer.Option("--private-diagnostics", help="Keep the per-step diagnostics (realised "
                     "batch sizes, training-batch losses and accuracies) in this directory, "
                     "outside --out. Computed from the private data without noise: not "
                     "covered by the guarantee, never to be published. Off by default.",
                     parser=out_dir_option("private_diagnostics")),
    ],
        None,
    ),
    "attribution_check": (
        Annotated[
        int,
        typer.Option("--attribution-check", help="Check every n-th physical batch that one "
                     "random example's gradient, computed alone, is the one its per-example "
                     "rules recorded (1: every batch within 5 % of the engine's time, the "
                     "first always; 0: off). A mismatch refuses the step before its release.",
                     parser=count_option("attribution_check", low=0)),
    ],
        1,
    ),
    "clipping": (
        Annotated[
        Clipping,
        typer.Option("--clipping", help="Images, DP-SGD: the clip function. flat: "
                     "min(1, C/||g||); automatic: C/(||g|| + 0.01) (Bu et al. 2023), every "
                     "gradient normalised, so --clip-norm only scales the step (same privacy)."),
    ],
        Clipping.flat,
    ),
}



"""One run's configuration: a frozen record, validated once, that every layer takes.

``dpfy train`` parses its options into a :class:`RunConfig`, or reads one from a TOML file
(``dpfy train --config run.toml``; options given on the command line override the file), and
hands it to :func:`dpfy.runs.train_and_report`. The run writes it beside the model
(``run.toml``) and into the ledger's metadata, so the report can print the file that re-trains
the run. Validation happens here, in the constructor, with the one-line messages of
:mod:`dpfy._validate`: a bad value is refused before anything is written.

Units: ``target_epsilon`` and ``delta`` are the (epsilon, delta) budget the noise is
calibrated to; ``batch_size`` is the *expected* batch size (units of privacy per step);
``learning_rate`` and ``clip_norm`` are in the model's parameter units. ``None`` takes the
recipe's default (images: ``dpfy.training.recipes``; text: ``dpfy.training.text``).

Adding an option: one field here (with its check in :meth:`RunConfig.__post_init__`), its entry
in ``dpfy.cli_options.TRAIN_OPTIONS`` and its one use in a recipe (``docs/architecture.md``,
section 4.5, a worked example). The names the checks need live here too, so that this module
imports no recipe and no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dpfy._validate import (
    MAX_EPSILON,
    MAX_SCALE,
    _short_repr,
    check_int,
    check_output_path,
    check_positive,
    check_range,
    check_seed,
)

__all__ = [
    "RunConfig",
]

# The names a run's options take. They live here, with the record that checks them, so that
# building a RunConfig imports no recipe (and no torch); the recipes import them from here and
# tests/test_run_config.py holds each recipe's own tables equal to them.

#: Noise mechanisms of a run: DP-SGD, or correlated DP-FTRL noise (image datasets).
MECHANISMS = ("dpsgd", "bandmf", "blt", "tree", "tree-efficient")
#: Units of privacy of ``dpfy train`` on the image datasets.
IMAGE_UNITS = ("example", "user")
#: Image models as ``--model`` names them (``dpfy.training.recipes.MODELS``, dashed).
IMAGE_MODELS = ("tanh-cnn", "gn-cnn", "scatternet-linear", "scatternet-cnn")
#: Text datasets (:func:`dpfy.training.text.train_text_classifier`).
TEXT_DATASETS = ("rotten-tomatoes",)
#: Units of privacy on the text datasets: one snippet, or one movie.
TEXT_UNITS = ("example", "movie")
#: Pretrained text models by name.
TEXT_MODELS = ("minilm",)
#: The modules that get LoRA factors (BERT module names), by ``lora_targets``: the attention
#: query and value projections, or every linear layer of the encoder (query, key, value, the
#: attention output and both feed-forward layers: the BERT modules named ``dense``).
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("query", "value"),
    "all-linear": ("query", "key", "value", "dense"),
}
#: Precisions of the forward and backward pass (the DP arithmetic is fp32 in all three).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
#: Clip functions (``dpfy.queries.clipping.CLIPPING_MODES``): flat ``min(1, C / norm)`` or
#: automatic ``C / (norm + 0.01)`` (Bu et al. 2023; the clip norm then only scales the step).
CLIPPINGS: tuple[str, ...] = ("flat", "automatic")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Everything that decides one ``dpfy train`` run (``None``: the recipe's default).

    Attributes:
      dataset: ``"mnist"``, ``"fashion-mnist"`` or ``"rotten-tomatoes"`` (text).
      out: a new run directory (default ``runs/<dataset>-<date>-<time>``).
      target_epsilon, delta: the budget the noise is calibrated to; delta in (0, 1).
      sampler: the batch sampler that runs (default ``"poisson"``; ``"cyclic"`` with a
        correlated ``mechanism``).
      epochs, batch_size, learning_rate, clip_norm: the optimisation (expected batch size).
      seed: ``None``: sampling and noise from the secure generator, a DP release. An int runs
        a reproducible seeded experiment, which is NOT a DP release.
      train_limit, test_limit: use only the first this many training / test examples.
      threads: torch threads, in [1, cpu count].
      device: where one process trains: ``"cpu"`` (``None``, the default), ``"cuda"`` or
        ``"cuda:<index>"`` (checked to be visible). The model, the batches and the noise go
        there (docs/devices.md); data loading, sampling and the ledger stay on the host.
        One-process runs only (not with ``workers``, ``shard`` or a torchrun launch).
      precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` autocast of the forward pass.
      model: the model: text datasets, the pretrained model (``"minilm"``); images, one of
        :data:`IMAGE_MODELS` (``"tanh-cnn"`` by default; ``"scatternet-linear"``
        and ``"scatternet-cnn"`` train on ScatterNet features, Tramer & Boneh 2021).
      lora, max_length: text datasets only: LoRA instead of full fine-tuning, tokens per
        example in [2, 512].
      unit: the unit of privacy: ``"example"``; ``"user"`` (images, with ``users`` synthetic
        users) or ``"movie"`` (rotten-tomatoes); ``cap`` bounds the examples used per user and
        ``user_reduction`` (``"sum"`` or ``"mean"``) how a user's gradients are combined.
      workers, shard: image datasets only: data-parallel processes on this machine, and FSDP2
        sharding over them (``workers >= 2``, or the processes of a ``torchrun`` launch, which
        ``dpfy train`` detects: :func:`dpfy.runs.torchrun_rank`; ``workers`` is then 1).
      mechanism: one of :data:`MECHANISMS` (correlated noise: image datasets).
      audit_canaries, audit_guesses, audit_confidence: the one-run audit (image datasets, one
        process, example level, DP-SGD).
      bias_only, lora_rank, lora_targets, warmup, adam_eps, linear_probe: text datasets only
        (:mod:`dpfy.training.text`): bias-only fine-tuning (DP-BiTFiT, Bu et al. 2022); the
        LoRA rank in [1, 384] (default 8) and its targets (``"attention"``: query and value;
        ``"all-linear"``: every linear layer of the encoder); a linear warm-up of Adam's
        rates over this fraction of the steps, in [0, 1); Adam's epsilon in (0, 1] (default
        1e-8); LP-FT (:mod:`dpfy.training.lpft`): a DP-FC linear probe on the frozen
        encoder's embeddings spending this share of ``target_epsilon`` (in (0, 1), its noise
        calibrated to ``share x target_epsilon`` alone), then DP fine-tuning from the probe's
        head with its noise calibrated so that the ledger of both stages meets
        ``target_epsilon``.
      tan_steps: a TAN-scaled run (Sander et al. 2023) of about this many steps: the batch size
        and the epochs come from :func:`dpfy.planning.tan_scaled` on the training units (the
        smallest expected batch whose noise multiplier reaches 2 at the target); not with
        ``batch_size`` or ``epochs``; Poisson sampling, one example as the unit, DP-SGD.
      validation: train on the training units outside the validation split and measure
        accuracy on that split instead of the test split (hyperparameter search; the test
        split is never read): :func:`dpfy.datasets.split_rotten_tomatoes` (by movie),
        :func:`dpfy.datasets.validation_images`.
      private_diagnostics: a directory outside ``out`` for what the run computed from the
        private training data without noise (per-step realised batch sizes, training-batch
        losses and accuracies; :mod:`dpfy.publication`). Not covered by the guarantee and
        never to be published; ``None`` (the default): nothing of the kind is kept.
      attribution_check: check every n-th physical batch that one random example's gradient
        computed alone is the one its per-example rules recorded (1, the default: every batch
        within 5 % of the engine's time, the first always; 0: off;
        :mod:`dpfy.training.norms.attribution`).
      clipping: the clip function of DP-SGD on the image datasets, one of :data:`CLIPPINGS`
        (``"automatic"``: every gradient normalised, so ``clip_norm`` only scales the step
        and the learning rate absorbs it; the privacy is the same).
    """

    dataset: str = "mnist"
    out: str | os.PathLike[str] | None = None
    target_epsilon: float = 3.0
    delta: float = 1e-5
    sampler: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    clip_norm: float | None = None
    seed: int | None = None
    train_limit: int | None = None
    test_limit: int | None = None
    threads: int | None = None
    device: str | None = None
    precision: str = "fp32"
    model: str | None = None
    lora: bool = False
    max_length: int | None = None
    unit: str = "example"
    users: int | None = None
    cap: int | None = None
    user_reduction: str = "sum"
    workers: int = 1
    shard: bool = False
    mechanism: str = "dpsgd"
    audit_canaries: int | None = None
    audit_guesses: int | None = None
    audit_confidence: float = 0.95
    bias_only: bool = False
    lora_rank: int | None = None
    lora_targets: str = "attention"
    warmup: float = 0.0
    adam_eps: float | None = None
    linear_probe: float | None = None
    tan_steps: int | None = None
    validation: bool = False
    private_diagnostics: str | os.PathLike[str] | None = None
    attribution_check: int = 1
    clipping: str = "flat"

    def __post_init__(self) -> None:
        for name in ("out", "private_diagnostics"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):  # a path: kept as text
                if not isinstance(value, os.PathLike):
                    raise TypeError(f"{name} must be a path or None, got {name}={value!r}")
                object.__setattr__(self, name, os.fspath(value))
        if self.private_diagnostics is not None:
            check_output_path("private_diagnostics", self.private_diagnostics)
        from dpfy.datasets import DATASETS

        if self.dataset not in (*DATASETS, *TEXT_DATASETS):
            allowed = ", ".join((*DATASETS, *TEXT_DATASETS))
            raise ValueError(f"dataset must be one of {{{allowed}}}, got dataset={self.dataset!r}")
        text = self.text
        models, kind = (TEXT_MODELS, "a text dataset's") if text else (IMAGE_MODELS, "an image")
        if self.model is not None and self.model not in models:
            raise ValueError(
                f"model must be one of {{{', '.join(models)}}} ({kind} model), "
                f"got model={self.model!r}"
            )
        for name, given in (("lora", self.lora), ("max_length", self.max_length is not None)):
            if given and not text:
                raise ValueError(
                    f"{name} applies only to the text datasets "
                    f"{{{', '.join(TEXT_DATASETS)}}}, got dataset={self.dataset!r}"
                )
        self._check_unit()
        self._check_execution()
        self._check_text_recipe()
        check_budget(self.target_epsilon, self.delta)
        check_int("attribution_check", self.attribution_check, 0)
        for name, count in (("epochs", self.epochs), ("batch_size", self.batch_size),
                            ("train_limit", self.train_limit)):
            if count is not None:
                check_int(name, count)
        if self.audit_canaries is not None:
            self.audit_guess_count()
        elif self.audit_guesses is not None:
            raise ValueError("audit_guesses needs audit_canaries (the one-run audit), got none")
        for name, scale in (("learning_rate", self.learning_rate),
                            ("clip_norm", self.clip_norm)):
            if scale is not None:
                check_positive(name, scale, MAX_SCALE)
        if self.seed is not None:  # None: a secure run
            check_seed("seed", self.seed)
        if self.tan_steps is not None:
            self._check_tan()
        self._check_clipping()
        if self.sampler is not None and not isinstance(self.sampler, str):
            raise ValueError(f"sampler must be a sampler kind's name, got sampler={self.sampler!r}")

    def _check_clipping(self) -> None:
        if self.clipping not in CLIPPINGS:
            raise ValueError(f"clipping must be one of {{{', '.join(CLIPPINGS)}}}, got "
                             f"clipping={self.clipping!r}")
        if self.clipping != "flat" and (self.text or self.mechanism != "dpsgd"):
            raise ValueError(f"clipping={self.clipping!r} applies only to DP-SGD on the image "
                             f"datasets, got dataset={self.dataset!r}, "
                             f"mechanism={self.mechanism!r}")

    def _check_tan(self) -> None:
        check_int("tan_steps", self.tan_steps)
        for name in ("batch_size", "epochs"):
            if getattr(self, name) is not None:
                raise ValueError(f"tan_steps chooses batch_size and epochs: give one or the "
                                 f"other, got tan_steps={self.tan_steps!r} and "
                                 f"{name}={getattr(self, name)!r}")
        if self.workers > 1:
            raise ValueError(f"tan_steps plans a one-process run, got workers={self.workers!r}")
        if (self.sampler_kind, self.unit, self.mechanism) != ("poisson", "example", "dpsgd"):
            raise ValueError(f"tan_steps plans Poisson DP-SGD with one example as the unit, got "
                             f"sampler={self.sampler_kind!r}, unit={self.unit!r}, "
                             f"mechanism={self.mechanism!r}")

    @property
    def text(self) -> bool:
        """Whether the dataset is a text dataset (fine-tuning a pretrained model)."""
        return self.dataset in TEXT_DATASETS

    @property
    def sampler_kind(self) -> str:
        """The sampler that runs: ``sampler``, else poisson (cyclic with correlated noise)."""
        if self.sampler is not None:
            return self.sampler.replace("-", "_")
        return "poisson" if self.mechanism == "dpsgd" else "cyclic"

    def _check_unit(self) -> None:
        text, unit, users, cap = self.text, self.unit, self.users, self.cap
        reduction = self.user_reduction
        allowed = TEXT_UNITS if text else IMAGE_UNITS
        if unit not in allowed:
            raise ValueError(
                f"unit must be one of {{{', '.join(allowed)}}} for dataset={self.dataset!r}, "
                f"got unit={unit!r}"
            )
        if unit == "example":
            for name, given in (("users", users is not None), ("cap", cap is not None),
                                ("user_reduction", reduction != "sum")):
                if given:
                    raise ValueError(f"{name} applies only to a user-level unit "
                                     f"({', '.join(u for u in allowed if u != 'example')}), "
                                     "got unit='example'")
            return
        if reduction not in ("sum", "mean"):
            raise ValueError(
                f"user_reduction must be one of {{sum, mean}}, got user_reduction={reduction!r}"
            )
        if cap is not None:
            check_int("cap", cap)
        if text:
            if users is not None:
                raise ValueError(
                    f"users applies only to the image datasets (synthetic users); "
                    f"{self.dataset} groups snippets by their {unit}"
                )
            return
        if users is None:
            raise ValueError(
                "users is missing: unit='user' on an image dataset needs the number of "
                "synthetic user ids (--users N; image i belongs to user i mod N)"
            )
        check_int("users", users)
        if isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool):
            from dpfy.sampling.factory import check_batch_size

            check_batch_size(self.batch_size, users, unit)  # users per step, named as such

    def _check_execution(self) -> None:
        text, mechanism, workers = self.text, self.mechanism, self.workers
        if mechanism not in MECHANISMS:
            raise ValueError(
                f"mechanism must be one of {{{', '.join(MECHANISMS)}}}, got "
                f"mechanism={mechanism!r}"
            )
        if text and mechanism != "dpsgd":
            raise ValueError(f"mechanism={mechanism!r} applies only to the image datasets, "
                             f"got dataset={self.dataset!r}")
        if self.unit != "example" and mechanism != "dpsgd":
            raise ValueError(f"mechanism={mechanism!r} applies only to example-level runs, "
                             f"got unit={self.unit!r}")
        if self.max_length is not None:
            check_int("max_length", self.max_length, 2, 512)
        if self.test_limit is not None:
            check_int("test_limit", self.test_limit)
        check_int("workers", workers, 1, 1024)
        if self.shard and workers < 2 and _launched_world_size() < 2:
            raise ValueError(f"shard needs workers >= 2 (processes to shard over), or a "
                             f"torchrun launch of WORLD_SIZE >= 2, got workers={workers!r}")
        if workers > 1 and text:
            raise ValueError(f"workers applies only to the image datasets, got "
                             f"dataset={self.dataset!r} with workers={workers!r}")
        if self.threads is not None:
            check_int("threads", self.threads, 1, os.cpu_count() or 1)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {{{', '.join(PRECISIONS)}}}, got "
                             f"precision={self.precision!r}")
        if self.device is not None:
            check_device("device", self.device)
            if self.device != "cpu" and (workers > 1 or self.shard
                                         or _launched_world_size() > 1):
                raise ValueError(f"device={self.device!r} applies only to one-process runs, "
                                 f"got workers={workers!r}, shard={self.shard!r}")

    def _check_text_recipe(self) -> None:
        text_only = (("bias_only", self.bias_only), ("lora_rank", self.lora_rank is not None),
                     ("lora_targets", self.lora_targets != "attention"),
                     ("warmup", self.warmup != 0.0), ("adam_eps", self.adam_eps is not None),
                     ("linear_probe", self.linear_probe is not None))
        for name, given in text_only:
            if given and not self.text:
                raise ValueError(f"{name} applies only to the text datasets, got "
                                 f"dataset={self.dataset!r}")
        if self.bias_only and self.lora:
            raise ValueError("bias_only and lora are two fine-tuning modes: choose one, got "
                             "bias_only=True with lora=True")
        for name, given in (("lora_rank", self.lora_rank is not None),
                            ("lora_targets", self.lora_targets != "attention")):
            if given and not self.lora:
                raise ValueError(f"{name} applies only with lora=True, got lora=False")
        if self.lora_rank is not None:
            check_int("lora_rank", self.lora_rank, 1, 384)
        if self.lora_targets not in LORA_TARGETS:
            raise ValueError(f"lora_targets must be one of {{{', '.join(LORA_TARGETS)}}}, got "
                             f"lora_targets={self.lora_targets!r}")
        check_range("warmup", self.warmup, 0.0, 1.0, high_open=True)
        if self.adam_eps is not None:
            check_range("adam_eps", self.adam_eps, 0.0, 1.0, low_open=True)
        if self.linear_probe is not None:
            check_range("linear_probe", self.linear_probe, 0.0, 1.0,
                        low_open=True, high_open=True)
            if self.unit != "example":
                raise ValueError(f"linear_probe (LP-FT) needs unit='example' (the probe "
                                 f"releases per-snippet statistics), got unit={self.unit!r}")

    def recipe_options(self) -> dict[str, Any]:
        """The fine-tuning recipe's options as ``dpfy train`` flags take them (None: not
        given; ``""``: a flag without a value), for the command line a report prints."""
        return {
            "bias_only": "" if self.bias_only else None, "lora_rank": self.lora_rank,
            "lora_targets": None if self.lora_targets == "attention" else self.lora_targets,
            "warmup": self.warmup or None, "adam_eps": self.adam_eps,
            "linear_probe": self.linear_probe, "validation": "" if self.validation else None,
            "clipping": None if self.clipping == "flat" else self.clipping,
        }

    def audit_guess_count(self) -> int:
        """The one-run audit's guesses (default a fifth of the canaries), checked.

        Raises:
          ValueError: the audit's options do not fit this run.
        """
        from dpfy.datasets import TRAIN_SIZES

        if self.audit_canaries is None:
            raise ValueError("the run has no one-run audit (audit_canaries is None)")
        for ok, what in ((not self.text, f"the image datasets, got dataset={self.dataset!r}"),
                         (self.unit == "example", f"unit='example', got unit={self.unit!r}"),
                         (self.workers == 1, f"workers=1, got workers={self.workers}"),
                         (self.mechanism == "dpsgd",
                          f"mechanism='dpsgd', got mechanism={self.mechanism!r}")):
            if not ok:
                raise ValueError(f"audit_canaries (the one-run audit) needs {what}")
        check_range("audit_confidence", self.audit_confidence, 0.0, 1.0,
                    low_open=True, high_open=True)
        size = TRAIN_SIZES[self.dataset]
        if self.train_limit is not None:
            size = min(size, self.train_limit)
        return check_canary_counts(self.audit_canaries, self.audit_guesses, size)

    # ---------------------------------------------------------------------------------------
    # files and records

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults (JSON- and TOML-ready)."""
        defaults = RunConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name == "dataset" or getattr(self, f.name) != getattr(defaults, f.name)
        }

    def to_toml(self) -> str:
        """The configuration as a TOML document that :meth:`from_file` reads back."""
        lines = ["# dpfy run configuration: `dpfy train --config run.toml`"]
        for key, value in self.to_dict().items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> RunConfig:
        """A configuration from ``{field: value}`` (dashes in keys read as underscores).

        Raises:
          ValueError: an unknown key (the valid ones are listed) or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        given = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(
                f"{source}: unknown option(s) {', '.join(unknown)}; valid: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**given)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> RunConfig:
        """A configuration from a TOML file (a table of the fields; see :meth:`to_toml`),
        with ``overrides`` (field values) taking precedence; validated once.

        Raises:
          ValueError: the file cannot be read or parsed, or holds a bad option (one line).
        """
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"config: cannot read {p}: {err.strerror or err}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"config: {p} is not valid TOML: {err}") from None
        given = {str(k).replace("-", "_"): v for k, v in data.items()} | overrides
        return cls.from_mapping(given, source=f"config {p}")

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def check_budget(target_epsilon: float, delta: float) -> None:
    """A target epsilon in (0, MAX_EPSILON] (finite) and a delta in (0, 1)."""
    check_positive("target_epsilon", target_epsilon, MAX_EPSILON)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)


def check_canary_counts(canaries: int, guesses: int | None, dataset_size: int) -> int:
    """Checks ``canaries`` (in [2, dataset_size]) and ``guesses`` (in [2, canaries]); returns
    the guesses to use (default :func:`default_guesses`)."""
    check_int("dataset_size", dataset_size)
    check_int("audit_canaries", canaries, 2, max(2, dataset_size))
    if canaries > dataset_size:
        raise ValueError(
            f"audit_canaries must be in [2, {dataset_size}] (at most the training set), got "
            f"audit_canaries={canaries}"
        )
    if guesses is None:
        return default_guesses(canaries)
    check_int("audit_guesses", guesses, 2, canaries)
    return guesses


def default_guesses(canaries: int) -> int:
    """A fifth of the canaries (even, at least 2): a weak attack is surer on its extremes."""
    return max(2, 2 * (canaries // 10))


def check_device(name: str, value: Any) -> None:
    """A torch device for one process's training: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``,
    and, for CUDA, one this process can see (torch is imported only then)."""
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", value):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:<index>', "
                         f"got {name}={_short_repr(value)}")
    if value == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(value.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"{name}={value!r} needs CUDA device {index}, but this process sees "
                         f"{count} (torch.cuda.is_available() is {torch.cuda.is_available()})")


#: The world size configurations are validated under instead of this process's launch, while
#: :func:`as_launched` holds it.
_AS_LAUNCHED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dpfy_as_launched", default=None
)


@contextlib.contextmanager
def as_launched(world_size: int) -> Iterator[None]:
    """Validate configurations as in a launch of ``world_size`` processes (1: no launch), not
    in this process's environment: a run's published configuration read back (the report's
    and the audit's cross-check, :mod:`dpfy.report.crosscheck`) is checked against the launch
    that ran it, which its ledger records, wherever it is read (a torchrun run's ``shard``
    outside torchrun, or a one-process run's inside a launch)."""
    token = _AS_LAUNCHED.set(world_size)
    try:
        yield
    finally:
        _AS_LAUNCHED.reset(token)


def _launched_world_size() -> int:
    """``WORLD_SIZE`` of the ``torchrun`` launch this process belongs to (1 outside a launch),
    or the one :func:`as_launched` holds.

    Read as it is: the launch as a whole (every variable, their ranges) is checked where a run
    joins it (:func:`dpfy.training.torchrun.torchrun_env`, through
    :func:`dpfy.runs.torchrun_rank`), before anything is written.
    """
    held = _AS_LAUNCHED.get()
    if held is not None:
        return held
    text = os.environ.get("WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() else 1

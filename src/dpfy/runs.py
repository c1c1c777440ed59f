"""Library pipelines: run (or plan) something private, account the ledger, report.

These are what the ``dpfy`` command runs, callable from Python without it:

* :func:`train_and_report` — DP-SGD on MNIST / Fashion-MNIST with the recipe of
  :mod:`dpfy.training.recipes`, then the privacy report of its ledger (``dpfy train``);
* :func:`features_and_report` — a DP linear classifier on pretrained features (Mehta et al.
  2023), then its report (``dpfy features``);
* :func:`report_ledger` — re-account any ledger file and write its report (``dpfy report``);
* the privacy of a run before it runs (``dpfy plan`` / ``epsilon`` / ``calibrate``) is
  :mod:`dpfy.run_accounting`'s.

Every statement is accounted from the ledger, never from numbers the training code computed.
Arguments are checked here, once, before anything is computed or written: bad input raises
``ValueError`` with a one-line message naming the parameter. Torch and matplotlib are imported
only by the pipelines that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfy._validate import (
    check_input_file,
    check_int,
    check_output_path,
    check_range,
    check_seed,
)

if TYPE_CHECKING:
    import numpy as np

    from dpfy.ledger import Ledger
    from dpfy.report import PrivacyReport
    from dpfy.training.distributed import Distributed
    from dpfy.training.recipes import ImageRecipe
    from dpfy.training.torchrun import TorchrunEnv


#: Feature extractors of :func:`features_and_report` (``scatternet``: images only).
FEATURE_EXTRACTORS = ("pretrained", "scatternet")
#: Datasets whose pretrained features :func:`features_and_report` extracts itself.
FEATURE_DATASETS = ("fashion-mnist", "mnist", "rotten-tomatoes")
#: DP learners of Mehta et al. 2023, by name, as class names in :mod:`dpfy.features`.
FEATURE_METHODS = {
    "dp-fc": "DPFeatureCovarianceClassifier",
    "dp-ls": "DPLeastSquaresClassifier",
    "dp-newton": "DPNewtonClassifier",
    "dp-adam": "DPAdamClassifier",
}

FeatureData = tuple["np.ndarray", "np.ndarray", "np.ndarray", "np.ndarray"]

from dpfy.config import RunConfig, check_budget  # noqa: E402

__all__ = [
    "train_and_report",
    "report_ledger",
]


@dataclasses.dataclass(frozen=True)
class ReportedRun:
    """A ledger and the report written from it (what :func:`report_ledger` returns).

    Attributes:
      out_dir: the directory of ``report.md``, ``report.json`` and ``figures/``.
      ledger_path: the ledger the report was accounted from.
      report: the privacy report, with its figure paths (relative to ``out_dir``).
    """

    out_dir: Path
    ledger_path: Path
    report: PrivacyReport
    #: The report's file name without suffix: ``report``, or ``report-<head>`` beside a
    #: ``report.json`` of another chain head (``diverted`` says why).
    report_name: str = dataclasses.field(default="report", kw_only=True)
    diverted: str | None = dataclasses.field(default=None, kw_only=True)

    @property
    def report_path(self) -> Path:
        """``report.md`` (or the name it was written under) in the run directory."""
        return self.out_dir / f"{self.report_name}.md"

    @property
    def signature(self) -> str:
        """One line: the run's public key and the ledger head it signed, or "unsigned"."""
        from dpfy.report.consistency import signature_line

        return signature_line(self.report.ledger_integrity)

    @property
    def statement(self) -> str:
        """The formal (epsilon, delta) statement of the report."""
        return self.report.formal_statement


@dataclasses.dataclass(frozen=True)
class TrainedRun(ReportedRun):
    """A private model, its ledger and its report (what the train / fit pipelines return).

    Attributes (beyond :class:`ReportedRun`):
      test_accuracy: accuracy of the released model on the test split, in [0, 1].
      seconds: wall time of training or fitting, in seconds (data loading excluded).
      model: the released model: the recipe's ``TrainResultSummary`` (its ``model`` is the
        ``nn.Module``) for :func:`train_and_report`, the fitted estimator for
        :func:`features_and_report`.
      zcdp_rho: for :func:`features_and_report`, the same run as rho-zCDP (the view Mehta et
        al. 2023 state their guarantees in); ``None`` for sampled training.
    """

    test_accuracy: float
    seconds: float
    model: Any
    zcdp_rho: float | None = None


# ---------------------------------------------------------------------------------------------
# train or fit, then report
# ---------------------------------------------------------------------------------------------


def train_and_report(
    config: RunConfig,
    *,
    progress: bool = False,
    distributed: Distributed | None = None,
    signing_key: str | os.PathLike[str] | None = None,
) -> TrainedRun:
    """Train with :func:`dpfy.training.recipes.train_image_classifier` (images) or
    :func:`dpfy.training.text.train_text_classifier` (text), then account the ledger and write
    ``report.md``, ``report.json``, ``run.toml`` and figures beside the model.

    Args:
      config: the run (:class:`dpfy.config.RunConfig`, validated when it was built).
      progress: a progress bar (terminal) or progress lines.
      distributed: rank 0 of a ``torchrun`` launch (:func:`torchrun_rank`): it writes the run
        directory while the other ranks run :func:`train_rank`; ``None``: this process alone
        (or with its ``config.workers`` local helpers).
      signing_key: a long-lived Ed25519 key file kept outside runs: it endorses the run key in
        the ledger (:mod:`dpfy.ledger.trust`); read first, never in ``run.toml``.

    Raises:
      ValueError: ``config.out`` already holds a ledger (nothing is written then), or
        ``distributed`` is not rank 0.
    """
    if distributed is not None and not distributed.releases:
        raise ValueError(
            f"distributed must be rank 0 (the rank that writes the run directory), got rank "
            f"{distributed.rank}: the other ranks of a launch call train_rank"
        )
    c = config
    endorser = None
    if signing_key is not None:
        from dpfy.ledger.trust import load_long_lived_key

        endorser = load_long_lived_key(signing_key)
    out_dir = _new_run_dir(c.out, c.dataset)
    from dpfy.publication import check_diagnostics_dir, claimed_run_dir
    from dpfy.training.allocator import keep_freed_memory

    diagnostics = check_diagnostics_dir(c.private_diagnostics, out_dir)
    with claimed_run_dir(out_dir), keep_freed_memory():  # one run per directory at a time
        return _train_into(c, out_dir, diagnostics, progress, distributed, endorser)


def _train_into(
    c: RunConfig,
    out_dir: Path,
    diagnostics: Path | None,
    progress: bool,
    distributed: Distributed | None,
    endorser: Any = None,
) -> TrainedRun:
    """:func:`train_and_report` in the run directory ``out_dir`` it holds; ``endorser``: the
    long-lived key that endorses the run key (None: none)."""
    dataset, target_epsilon, delta, seed = c.dataset, c.target_epsilon, c.delta, c.seed
    sampler, precision, lora, unit = c.sampler_kind, c.precision, c.lora, c.unit
    workers, shard, mechanism = c.workers, c.shard, c.mechanism
    audit_canaries = c.audit_canaries
    audit_guesses = c.audit_guess_count() if audit_canaries is not None else None
    text = c.text
    ran = c.replace(out=str(out_dir))  # the configuration that runs, as recorded

    text_options = {"model": c.model or "minilm", "lora": lora,
                    "max_length": c.max_length} if text else {"model": c.model}
    canaries = tracker = None
    if audit_canaries is not None:
        canaries, tracker = _audit_setup(dataset, audit_canaries, seed, 0.9)
    if text:
        summary = _train_text(ran, progress)
    else:
        from dpfy.training import recipes
        from dpfy.training.skeleton import RunHooks

        summary = recipes.train_image_classifier(
            ran,
            _image_recipe(c),
            RunHooks(
                progress=progress,
                distributed=distributed,
                extra_train=None if canaries is None else canaries.training_rows(),
                step_observer=tracker,
                batch_plan=batch_plan(c),
            ),
        )
    # accuracies on validation units (--validation) are private: never recorded or reported
    evaluated = [] if summary.private_evaluation else summary.history.epochs
    accuracy_by_step = [
        (int(e.steps), float(e.test_accuracy)) for e in evaluated if e.test_accuracy is not None
    ]
    command = _train_command(  # --seed only for a seeded run: the line repeats the mode that ran
        "train", dataset, out_dir, target_epsilon, delta,
        {"sampler": sampler, "epochs": summary.epochs, "batch_size": summary.batch_size,
         "learning_rate": summary.learning_rate, "clip_norm": summary.clip_norm, "seed": seed,
         "train_limit": c.train_limit, "test_limit": c.test_limit,
         "precision": None if precision == "fp32" else precision,
         "workers": workers if workers > 1 else None, "shard": "" if shard else None,
         **{k: v for k, v in text_options.items() if k != "lora"},
         "lora": "" if lora else None,
         **c.recipe_options(),
         "mechanism": None if mechanism == "dpsgd" else mechanism,
         "audit_canaries": audit_canaries,
         "audit_guesses": audit_guesses if audit_canaries is not None else None,
         **({"unit": unit, "users": c.users, "cap": c.cap,
             "user_reduction": None if c.user_reduction == "sum" else c.user_reduction}
            if unit != "example" else {})},
    )
    # the configuration that ran, beside the model and in the ledger: `dpfy train --config`
    from dpfy._files import write_atomic
    from dpfy.training.skeleton import closed_on_fault

    with closed_on_fault(summary.ledger):  # a fault before the close: closed, saying so
        write_atomic(out_dir / "run.toml", ran.to_toml())
        summary.ledger.record_metadata(
            delta=delta,
            target_epsilon=target_epsilon,
            accuracy_by_step=[list(x) for x in accuracy_by_step],
            # the raw model's (before an EMA), as summary.json publishes it: checked against it
            model_accuracy_by_step=[
                [int(e.steps), float(e.model_test_accuracy)] for e in evaluated
                if e.model_test_accuracy is not None
            ],
            train_command=command,
            config=ran.to_dict(),
            **({"audit_canaries": audit_canaries} if audit_canaries is not None else {}),
            **({"launcher": "torchrun"} if distributed is not None else {}),
        )
        trusted_key = None
        if endorser is not None:  # the long-lived key signs the run key, inside the signed chain
            from dpfy.ledger.trust import endorse

            trusted_key = endorse(summary.ledger, endorser)["key"]
        from dpfy.report.crosscheck import file_sha256

        model = Path(summary.model_path or out_dir / "model.pt")  # its SHA-256: in the signed end
        summary.ledger.close(files={model.name: file_sha256(model)} if model.is_file() else None)
    from dpfy.ledger import Ledger
    from dpfy.publication import publishing_section, write_private_diagnostics

    if diagnostics is not None:  # asked for: outside the run directory, named as private
        write_private_diagnostics(diagnostics, summary.to_dict(private=True), out_dir)
    ledger_path = out_dir / "ledger.jsonl"
    report = _report_files(
        Ledger.load(ledger_path),
        out_dir,
        delta=delta,
        method=summary.accounting,
        train_command=command,
        target_epsilon=target_epsilon,
        accuracy_by_step=accuracy_by_step,
        publishing=publishing_section(out_dir, diagnostics),
        trusted_key=trusted_key,
    )
    if canaries is not None and tracker is not None and audit_guesses is not None:
        report = _one_run_audit(
            out_dir, report, summary.model, canaries, tracker.observer, audit_guesses,
            delta, c.audit_confidence,
        )
    return TrainedRun(
        out_dir, ledger_path, report, summary.test_accuracy, summary.seconds, summary
    )


def _train_text(c: RunConfig, progress: bool) -> Any:
    """The text recipe's run for ``c`` (None fields take the recipe's defaults)."""
    from dpfy.training import text as text_recipe
    from dpfy.training.skeleton import RunHooks

    hooks = RunHooks(progress=progress, batch_plan=batch_plan(c))
    return text_recipe.train_text_classifier(c, None, hooks)


def batch_plan(c: RunConfig) -> Any:
    """The recipes' ``batch_plan`` of a ``tan_steps`` run (None without one): the planner's
    batch and epochs for the training units (:func:`dpfy.planning.tan_scaled`)."""
    if c.tan_steps is None:
        return None
    from dpfy.planning import tan_scaled

    steps = c.tan_steps
    return lambda units: tan_scaled(units, c.target_epsilon, c.delta, steps)


def _image_recipe(c: RunConfig) -> ImageRecipe | None:
    """The image recipe of a run (``None``: the recipe's own default for ``c.model``)."""
    from dpfy.training import recipes

    # the final weights are released: an FSDP2 model cannot be copied for an EMA
    return dataclasses.replace(recipes.default_recipe(c.model), ema_decay=None) if c.shard else None


# ---------------------------------------------------------------------------------------------
# a run launched by torchrun: every machine runs `dpfy train`, rank 0 writes the run directory
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torchrun_rank(config: RunConfig) -> Iterator[Distributed | None]:
    """This process's rank of a ``dpfy train`` run launched by ``torchrun``, for the block.

    ``torchrun`` (on one machine or several) starts ``dpfy train`` in every process; the
    environment tells each one its rank (:func:`dpfy.training.torchrun.torchrun_env`). Outside
    a launch, or in a launch of one process, this yields ``None`` and the run is the ordinary
    one. Otherwise it checks, before joining anything, what would refuse the run (the same
    configuration refuses alike on every rank, so no rank is left waiting for one that
    stopped), checks rank 0's run directory, joins the process group (gloo: the image recipes
    train on CPU; collective timeout :data:`dpfy.training.distributed.DEFAULT_TIMEOUT` s),
    yields this rank's :class:`~dpfy.training.distributed.Distributed` and leaves the group
    when the block ends. Rank 0 then runs :func:`train_and_report` with it, the other ranks
    :func:`train_rank`: one sampler, one ledger (rank 0's), the epsilon of the 1-process run.

    Unless ``config.threads`` is given, each process uses ``cpu count / LOCAL_WORLD_SIZE``
    torch threads (its share of its machine).

    Raises:
      ValueError: an inconsistent setup, before joining: ``--workers N`` under torchrun, a
        world size that does not divide the recipe's physical batch, a text dataset, or an
        option that runs in one process only (correlated noise, user-level DP, the one-run
        audit); on rank 0, a run directory that already holds a ledger.
      DistributedError: the process group could not be joined.
    """
    from dpfy.training.torchrun import torchrun_env

    launch = torchrun_env()
    if launch is None:
        yield None
        return
    _check_launch(config, launch)
    if launch.world_size == 1:
        yield None
        return
    if launch.rank == 0:
        _new_run_dir(config.out, config.dataset)  # refused here, before any rank joins
    import torch
    import torch.distributed as dist

    from dpfy.training.distributed import from_env

    if config.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size))
    distributed = from_env(backend="gloo")
    try:
        yield distributed
    except BaseException:
        if dist.is_initialized():  # no barrier: the other ranks may never reach it
            dist.destroy_process_group()
        raise
    dist.barrier(group=distributed.group)  # every rank is done before any leaves the group
    dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class HelperRank:
    """A rank other than 0 of a ``torchrun`` launch: it trained its share and wrote nothing."""

    rank: int
    world_size: int


def train_launched(config: RunConfig, *, progress: bool = False,
                   signing_key: str | os.PathLike[str] | None = None) -> TrainedRun | HelperRank:
    """``dpfy train``: :func:`train_and_report`, or this process's rank of a ``torchrun`` launch.

    Outside a launch this is :func:`train_and_report`. Under ``torchrun``
    (:func:`torchrun_rank`) rank 0 runs :func:`train_and_report` with the launch's process
    group and returns its run; every other rank runs :func:`train_rank` and returns a
    :class:`HelperRank`.
    """
    with torchrun_rank(config) as rank:
        if rank is not None and not rank.releases:
            train_rank(config, rank)
            return HelperRank(rank.rank, rank.world_size)
        return train_and_report(config, progress=progress, distributed=rank,
                                signing_key=signing_key)


def train_rank(config: RunConfig, distributed: Distributed) -> None:
    """The part of a rank other than 0 in a launched ``dpfy train`` run: it trains its share
    of every step with rank 0 (:func:`torchrun_rank`) and writes nothing (rank 0 writes the
    ledger, model and report; this rank keeps an in-memory mirror of the ledger).

    Raises:
      ValueError: ``distributed`` is rank 0 (it runs :func:`train_and_report`).
    """
    if distributed.releases:
        raise ValueError("distributed must be a rank other than 0 (rank 0 runs "
                         "train_and_report and writes the run directory), got rank 0")
    from dpfy.training import recipes
    from dpfy.training.skeleton import RunHooks

    recipes.train_image_classifier(
        config.replace(out=None), _image_recipe(config),
        RunHooks(distributed=distributed, batch_plan=batch_plan(config)),
    )


def _check_launch(config: RunConfig, launch: TorchrunEnv) -> None:
    """Refuse a configuration that cannot run on the ``launch``'s processes (before joining)."""
    from dpfy.training.distributed import per_process_batch

    world = launch.world_size
    under = f"under torchrun (WORLD_SIZE={world})"
    if config.workers != 1:
        raise ValueError(
            f"workers must be 1 {under}: the launch's processes are the run's workers "
            f"(--workers N starts processes on this machine), got workers={config.workers}"
        )
    if world == 1:
        return
    for ok, what in ((not config.text, f"an image dataset, got dataset={config.dataset!r}"),
                     (config.mechanism == "dpsgd",
                      f"mechanism='dpsgd', got mechanism={config.mechanism!r}"),
                     (config.unit == "example", f"unit='example', got unit={config.unit!r}"),
                     (config.audit_canaries is None,
                      f"no one-run audit, got audit_canaries={config.audit_canaries}")):
        if not ok:
            raise ValueError(f"a run {under} needs {what} (that option runs in one process)")
    recipe = _image_recipe(config)
    if recipe is None:
        from dpfy.training.recipes import default_recipe

        recipe = default_recipe(config.model)
    try:
        per_process_batch(recipe.max_physical_batch_size, world)
    except ValueError as e:
        raise ValueError(f"{e} ({under}: start a number of processes that divides "
                         f"{recipe.max_physical_batch_size})") from None


@dataclasses.dataclass
class _Tracker:
    """Builds the white-box score callback from the recipe's model and keeps it."""

    canaries: Any
    momentum: float
    observer: Any = None

    def __call__(self, model: Any) -> Any:
        from dpfy.audit.onerun import WhiteBoxScores

        self.observer = WhiteBoxScores(model, self.canaries, momentum=self.momentum)
        return self.observer


def _audit_setup(
    dataset: str, count: int, seed: int | None, momentum: float
) -> tuple[Any, _Tracker]:
    """The canaries (coins from the secure generator, or from the run's seed for a seeded
    experiment) and the white-box tracker of a one-run audit."""
    from dpfy.audit.onerun import make_canaries
    from dpfy.datasets import pixel_stats
    from dpfy.randomness import Randomness

    rng = Randomness.secure_mode() if seed is None else Randomness((int(seed) + 1) % 2**63)
    canaries = make_canaries(count, rng, pixel_stats=pixel_stats(dataset))
    return canaries, _Tracker(canaries, momentum)


def _one_run_audit(
    out_dir: Path, report: PrivacyReport, model: Any, canaries: Any, white: Any,
    guesses: int, delta: float, confidence: float,
) -> PrivacyReport:
    """Score the canaries, write the Audit section into report.json / report.md."""
    import json

    from dpfy.audit.onerun import black_box_scores, center_by_label, one_run_section
    from dpfy.audit.run import write_section

    start = time.perf_counter()
    section = one_run_section(
        {"black-box": center_by_label(black_box_scores(model, canaries), canaries.labels),
         "white-box": center_by_label(white.scores, canaries.labels)},
        canaries.included, guesses=guesses, delta=delta, confidence=confidence,
        run_epsilon=float(report.epsilon),
    )
    section["steps_scored"] = white.steps
    section["seconds"] = time.perf_counter() - start
    data = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    write_section(out_dir, data, section)
    return dataclasses.replace(report, audit=section)


#: Units of privacy of ``dpfy train`` per kind of dataset (beyond ``"example"``).
def features_and_report(
    dataset: str = "fashion-mnist",
    *,
    method: str = "dp-fc",
    target_epsilon: float = 1.0,
    delta: float = 1e-5,
    seed: int | None = None,
    limit: int | None = None,
    out: str | os.PathLike[str] | None = None,
    data: FeatureData | None = None,
    extractor: str = "pretrained",
    classes: Sequence[int] | None = None,
) -> TrainedRun:
    """Fit a DP linear classifier on pretrained features, then write its ledger and report.

    Features (EfficientNet-Lite0 for images, all-MiniLM-L6-v2 for the rotten-tomatoes
    snippets; or, with ``extractor="scatternet"``, the fixed ScatterNet transform of the
    images, Tramer & Boneh 2021) are extracted once and cached by :mod:`dpfy.features.extract`
    / :mod:`dpfy.features.scatternet`; the first run takes a while. The unit of privacy is one
    training example (a row with its label).

    Args:
      dataset: one of :data:`FEATURE_DATASETS`, or any name when ``data`` is given.
      method: one of :data:`FEATURE_METHODS` (Mehta et al. 2023).
      target_epsilon, delta: the budget of the fit; delta in (0, 1).
      seed: None (default): noise from the secure generator, a DP release; an int runs a
        reproducible seeded experiment, NOT a DP release (its report says so).
      limit: use only the first ``limit`` (>= 2) training examples.
      out: a new run directory (default ``runs/features-<dataset>-<date>-<time>``).
      data: precomputed ``(x_train, y_train, x_test, y_test)`` instead of extraction.
      extractor: one of :data:`FEATURE_EXTRACTORS`: ``"pretrained"`` (the networks above) or
        ``"scatternet"`` (images only; rows normalised per example by
        :func:`dpfy.features.scatternet.flat_normalised`).
      classes: the public class labels; default: the dataset's definition
        (:data:`dpfy.datasets.CLASSES`), never the training labels. Required with ``data`` for a
        dataset not listed there.

    Raises:
      ValueError: a bad argument, or ``out`` already holds a ledger (nothing is written then).
    """
    check_budget(target_epsilon, delta)
    if seed is not None:  # None: a secure run
        check_seed("seed", seed)
    if limit is not None:
        check_int("limit", limit, 2)
    if method not in FEATURE_METHODS:
        allowed = ", ".join(FEATURE_METHODS)
        raise ValueError(f"method must be one of {{{allowed}}}, got method={method!r}")
    if data is None and dataset not in FEATURE_DATASETS:
        allowed = ", ".join(FEATURE_DATASETS)
        raise ValueError(f"dataset must be one of {{{allowed}}}, got dataset={dataset!r}")
    if extractor not in FEATURE_EXTRACTORS:
        allowed = ", ".join(FEATURE_EXTRACTORS)
        raise ValueError(f"extractor must be one of {{{allowed}}}, got extractor={extractor!r}")
    if extractor == "scatternet" and dataset == "rotten-tomatoes":
        raise ValueError("extractor='scatternet' is for images; rotten-tomatoes has text "
                         "features only (extractor='pretrained')")
    from dpfy.datasets import CLASSES

    if classes is None:
        if dataset not in CLASSES:
            raise ValueError(
                f"classes must be the public class labels of dataset={dataset!r} (it is not in "
                "dpfy.datasets.CLASSES; they are never read from the training labels), got "
                "classes=None"
            )
        classes = CLASSES[dataset]
    out_dir = _new_run_dir(out, f"features-{dataset}")

    import numpy as np

    from dpfy import features as feats

    x_train, y_train, x_test, y_test = (
        _feature_data(dataset, extractor) if data is None else data
    )
    if limit is not None:
        x_train, y_train = x_train[:limit], y_train[:limit]
    estimator = getattr(feats, FEATURE_METHODS[method])(
        epsilon=target_epsilon, delta=delta, classes=list(classes), random_state=seed
    )
    start = time.perf_counter()
    estimator.fit(x_train, y_train)
    seconds = time.perf_counter() - start
    accuracy = float(np.mean(estimator.predict(x_test) == np.asarray(y_test)))
    out_dir.mkdir(parents=True, exist_ok=True)
    command = None if data is not None else _train_command(
        "features", dataset, out_dir, target_epsilon, delta,
        {"method": method, "limit": limit, "seed": seed,
         "extractor": None if extractor == "pretrained" else extractor},
    )
    ledger = estimator.ledger_.prefix(path=out_dir / "ledger.jsonl")
    ledger.record_metadata(
        dataset=dataset,
        estimator=type(estimator).__name__,
        features=extractor,
        delta=delta,
        target_epsilon=target_epsilon,
        test_accuracy=accuracy,  # the wall time stays private (it depends on the data)
        released_output="the linear classifier's weights",
        **({"train_command": command} if command else {}),  # the report's, checked against it
    )
    ledger.close()
    from dpfy.ledger import Ledger

    ledger_path = out_dir / "ledger.jsonl"
    ledger = Ledger.load(ledger_path)
    report = _report_files(
        ledger, out_dir, delta=delta, figures=False, train_command=command
    )
    rho = feats.gdp_figures(ledger).zcdp_rho
    return TrainedRun(out_dir, ledger_path, report, accuracy, seconds, estimator, rho)


def report_ledger(
    ledger_path: str | os.PathLike[str],
    *,
    delta: float | None = None,
    method: str = "auto",
    out: str | os.PathLike[str] | None = None,
    figures: bool = True,
    public_key: str | None = None,
    trust: str | os.PathLike[str] | None = None,
) -> ReportedRun:
    """Re-account a ledger file with every applicable method and write its report.

    Args:
      ledger_path: a ledger (JSON lines) written by any run.
      delta: delta of the statement. Default: the delta the run recorded; else its recorded
        target delta; else (a run cut short before recording either) 1/(10 N) with N the
        largest dataset size of the ledger's sample specs. The report names the default used.
      method: accounting method of the statement (``auto``: the tightest valid one).
      out: directory for ``report.md``, ``report.json`` and figures (default: the ledger's).
      figures: draw the figures (their data comes from the ledger; utility and the target
        epsilon from its metadata).
      public_key: an Ed25519 public key (64 hex digits) you hold apart from the ledger: the
        run's own key (the released report or model card names it) or a long-lived key that
        endorsed it (:mod:`dpfy.ledger.trust`). A ledger whose key is neither it nor endorsed
        by it is refused, as a rewritten and re-signed one. Without it (or ``trust``) the
        header's own key is used, which shows the file self-consistent, not who signed it:
        the report says "key not checked".
      trust: a file holding the public key you trust (``dpfy keys new`` writes ``KEY.pub``);
        as ``public_key``, of which at most one is given.

    Raises:
      ValueError: no such ledger file, a malformed ledger or metadata field (named), a
        ledger signed by a key other than ``public_key``, an
        output directory that cannot be created, or no delta given and none derivable. Nothing
        is written then.
    """
    check_input_file("ledger_path", ledger_path)
    path = Path(ledger_path)
    if delta is not None:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    out_dir = Path(out) if out is not None else path.parent
    check_output_path("out", out_dir)
    from dpfy.ledger import Ledger, LedgerFormatError
    from dpfy.ledger.trust import reader_key
    from dpfy.report.inputs import default_delta, kept_publishing, recorded_facts

    trusted_key = reader_key(public_key, trust)
    try:
        ledger = Ledger.load(path)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"ledger_path must be a UTF-8 dpfy ledger, got {str(path)!r}: {err}"
        ) from None
    except LedgerFormatError as err:
        raise ValueError(f"ledger_path holds a malformed ledger: {err}") from None
    from dpfy.report.crosscheck import check_run_dir, refusal

    found = check_run_dir(path.parent, ledger, other_heads=False)
    if found:  # an edited figure beside the ledger: refused, no report written or replaced
        raise refusal(path.parent, found)
    facts = recorded_facts(ledger.metadata, need_delta=delta is None)
    note = None
    if delta is None:
        delta, note = default_delta(ledger, facts)
    from dpfy.report.write import report_name

    name, diverted = report_name(out_dir, ledger.head)  # _report_files writes under this name
    audit = _kept_audit(out_dir, ledger.head) if diverted is None else None
    report = _report_files(
        ledger,
        out_dir,
        delta=delta,
        method=method,
        utility=facts["utility"],
        figures=figures,
        target_epsilon=facts["target_epsilon"],
        accuracy_by_step=facts["accuracy_by_step"],
        note=note,
        trusted_key=trusted_key,
        # what a report of this head already published and the ledger cannot re-derive
        train_command=command if isinstance(command := ledger.metadata.get("train_command"),
                                            str) else None,
        publishing=kept_publishing(out_dir, ledger.head) if diverted is None else None,
    )
    if audit is not None:  # `dpfy audit` wrote it and the ledger cannot re-derive it, so
        import json  # the report of the same chain head keeps it

        from dpfy.audit.run import write_section

        data = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
        write_section(out_dir, data, audit)
        report = dataclasses.replace(report, audit=audit)
    return ReportedRun(out_dir, path, report, report_name=name, diverted=diverted)


def _kept_audit(out_dir: Path, head: str | None) -> dict[str, Any] | None:
    """The non-empty Audit section of the ``report.json`` of chain head ``head`` in
    ``out_dir`` (what ``dpfy audit`` added to it), or None."""
    import json

    try:
        kept = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict):
        return None
    integrity, section = kept.get("ledger_integrity"), kept.get("audit")
    if not isinstance(integrity, dict) or integrity.get("head") != head:
        return None
    return section if isinstance(section, dict) and section else None


def _report_files(
    ledger: Ledger,
    out_dir: Path,
    *,
    delta: float,
    method: str = "auto",
    utility: Mapping[str, Any] | None = None,
    figures: bool = True,
    train_command: str | None = None,
    target_epsilon: float | None = None,
    accuracy_by_step: list[tuple[int, float]] | None = None,
    note: str | None = None,
    publishing: dict[str, Any] | None = None,
    trusted_key: str | None = None,
) -> PrivacyReport:
    """Account the closed ``ledger`` (read from its file) and write the report files
    into ``out_dir`` (beside, never over, a ``report.json`` of another chain head:
    :func:`dpfy.report.write.report_name`, no figures then); the report written. ``note`` (how
    a default was chosen) is added to the report's assumptions; ``publishing``
    (:func:`dpfy.publication.publishing_section`) is its list of the files safe to publish."""
    from dpfy.report import build_report, write_report
    from dpfy.report.write import report_name

    name, diverted = report_name(out_dir, ledger.head)
    report = build_report(
        ledger, delta=delta, method=method, utility=utility, ledger_path=ledger.path,
        trusted_key=trusted_key,
    )
    if publishing is not None:
        report = dataclasses.replace(report, publishing=publishing)
    if note is not None:
        report = dataclasses.replace(report, assumptions=(*report.assumptions, note))
    if train_command is not None:
        report = dataclasses.replace(
            report, reproduce={**report.reproduce, "train_command": train_command}
        )
    try:
        return write_report(
            report,
            ledger,
            out_dir,
            figures=figures and diverted is None,
            target_epsilon=target_epsilon,
            accuracy_by_step=accuracy_by_step or None,
            name=name,
        )
    except OSError as err:  # e.g. a full disk: the atomic write left no partial report
        raise ValueError(
            f"out: could not write the report into {str(out_dir)!r} ({err.strerror or err}); "
            f"nothing was written there, the ledger {ledger.path!r} is intact"
        ) from None


def new_signing_key(path: str | os.PathLike[str]) -> str:
    """``dpfy keys new``: :func:`dpfy.ledger.trust.new_long_lived_key`."""
    from dpfy.ledger.trust import new_long_lived_key

    return new_long_lived_key(path)


def _new_run_dir(out: str | os.PathLike[str] | None, default_name: str) -> Path:
    """``out``, or ``runs/<default_name>-<date>-<time>``; refused (nothing created) if it is not
    a creatable directory or already holds a ledger (ledgers are append-only records of one
    run)."""
    if out is not None:
        check_output_path("out", out)
    out_dir = Path(out) if out is not None else (
        Path("runs") / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    if (out_dir / "ledger.jsonl").exists():
        raise ValueError(f"out must be a new run directory, {out_dir}/ledger.jsonl exists")
    return out_dir


def _train_command(
    command: str,
    dataset: str,
    out_dir: Path,
    target_epsilon: float,
    delta: float,
    options: dict[str, Any],
) -> str:
    """The ``dpfy train`` / ``dpfy features`` command line that repeats the run in the mode
    that ran (recorded in ledger and report): options that are None are left out, so a secure
    run's line has no ``--seed`` and a seeded run's line has its seed."""
    argv = ["dpfy", command, dataset, "--target-epsilon", f"{target_epsilon:g}", "--delta",
            f"{delta:g}", "--out", str(out_dir)]
    for key, value in options.items():
        if value == "":  # a flag
            argv.append(f"--{key.replace('_', '-')}")
        elif value is not None:
            text = str(value).replace("_", "-") if key == "sampler" else str(value)
            argv += [f"--{key.replace('_', '-')}", text]
    return shlex.join(argv)


def _feature_data(dataset: str, extractor: str = "pretrained") -> FeatureData:
    """(x_train, y_train, x_test, y_test) features of ``dataset`` by ``extractor``, cached."""
    from dpfy.features import extract

    if extractor == "scatternet":
        from dpfy import datasets
        from dpfy.features.scatternet import dataset_features, flat_normalised

        splits: list[Any] = []
        for split in ("train", "test"):
            images, labels = datasets.load(dataset, split)
            features = dataset_features(dataset, split, images, progress=True)
            splits += [flat_normalised(features), labels.numpy()]
        return splits[0], splits[1], splits[2], splits[3]
    if dataset == "rotten-tomatoes":
        x, y, is_test = extract.text_features()
        return x[~is_test], y[~is_test], x[is_test], y[is_test]
    x_train, y_train = extract.image_features(dataset, "train")
    x_test, y_test = extract.image_features(dataset, "test")
    return x_train, y_train, x_test, y_test


def audit_and_report(
    run_dir: str | os.PathLike[str],
    *,
    method: str = "canary",
    trials: int | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    progress: bool = False,
    public_key: str | None = None,
    trust: str | os.PathLike[str] | None = None, real_model: bool = True,
) -> dict[str, Any]:
    """``dpfy audit``: audit a run directory and add the Audit section to its report.

    See :func:`dpfy.audit.run.audit_run` (the method, what is audited, what a result means);
    ``progress`` shows a rich progress bar over the audit's releases. ``public_key`` /
    ``trust``: the key you trust, as in :func:`report_ledger`; ``real_model``: as audit_run's.
    """
    from dpfy.audit.run import METHODS, audit_run

    if method not in METHODS:
        raise ValueError(f"method must be one of {set(METHODS)}, got method={method!r}")
    from dpfy.ledger.trust import reader_key

    trusted_key = reader_key(public_key, trust)
    if not progress:
        return audit_run(
            run_dir, method=method, trials=trials, confidence=confidence, seed=seed,  # type: ignore[arg-type]
            trusted_key=trusted_key, real_model=real_model,
        )
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("auditing"), BarColumn(), TextColumn("{task.completed}/{task.total} releases"),
        TimeRemainingColumn(), transient=True,
    ) as bar:
        task = bar.add_task("audit", total=None)

        def step(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return audit_run(
            run_dir, method=method, trials=trials, confidence=confidence, seed=seed,  # type: ignore[arg-type]
            progress=step, trusted_key=trusted_key, real_model=real_model,
        )

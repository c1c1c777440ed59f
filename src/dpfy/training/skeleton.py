"""One run of a ready-made recipe: data, model, sampler, private steps, evaluation, ledger.

:func:`run_recipe` is written once; a recipe (:class:`Recipe`) fills in what differs between
the image runs (:mod:`dpfy.training.recipes`) and the text runs (:mod:`dpfy.training.text`,
LP-FT's probe included): its data, model, loss, optimizer, trainer, evaluation, the ledger's
metadata and the files it keeps. The skeleton owns the order every run follows, which is also
what makes a run safe to repeat:

1. the randomness (secure, or one seed for an experiment: :func:`run_randomness`);
2. the data, and the units of privacy (rows, or the users that own them);
3. the expected batch, checked against the units before anything heavy loads
   (``tan_steps``: the planner's batch and epochs, :attr:`RunHooks.batch_plan`);
4. the model, the sampler, the accountant, the optimizer, the trainer;
5. the noise calibrated before anything is written, so an unreachable target leaves ``out``
   empty; then the ledger, its metadata, the training, the evaluation, the final metadata;
6. the model, the ledger and ``summary.json`` in ``out``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dpfy._files import write_atomic
from dpfy.config import RunConfig
from dpfy.ledger import Ledger
from dpfy.queries.clipping import DEFAULT_STABILITY, check_clipping
from dpfy.randomness import Randomness
from dpfy.sampling import make_sampler
from dpfy.sampling.kinds import kind as sampler_kind
from dpfy.training import users
from dpfy.training.distributed import Distributed
from dpfy.training.history import History, ProgressInfo
from dpfy.training.keys import key_facts
from dpfy.training.precision import check_precision
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

if TYPE_CHECKING:
    from dpfy.correlated.plan import CorrelatedPlan
    from dpfy.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class TrainResultSummary:
    """What a recipe run returns (and writes as ``summary.json``).

    Attributes:
      dataset, sampler, model_name: what ran.
      test_accuracy: final accuracy of the released model on the test split (or on the
        validation split of a search).
      epsilon, delta, accounting: the final statement, from the ledger.
      noise_multiplier, clip_norm, batch_size, epochs, steps, learning_rate: hyperparameters.
      seconds: wall time of the training loop (data loading excluded).
      stopped: ``completed`` or ``budget``.
      history: per-step loss and per-epoch test accuracy / epsilon spent.
      model_path, ledger_path: files in ``out_dir`` (None without ``out_dir``).
      model: the released ``nn.Module``; ledger: the run's :class:`~dpfy.ledger.Ledger`.
      diagnostics: facts the recipe computed from the private training data without noise
        (e.g. the share of truncated snippets); never in ``summary.json`` or the ledger, only
        in the run's private diagnostics (``dpfy train --private-diagnostics DIR``).

    ``summary.json`` holds :meth:`to_dict` (the public view: the wall time, the history's
    per-step records, training losses and epoch timings are left out,
    :meth:`History.public_dict`).
    """

    dataset: str
    sampler: str
    model_name: str
    test_accuracy: float
    epsilon: float
    delta: float
    accounting: str
    noise_multiplier: float
    clip_norm: float
    batch_size: int
    epochs: int
    steps: int
    learning_rate: float
    seconds: float
    stopped: str
    history: History
    model_path: str | None
    ledger_path: str | None
    model: nn.Module
    ledger: Ledger
    diagnostics: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The accuracies were measured on held-out training units (a search's validation
    #: split), not on public test data: private, so the public view leaves them out.
    private_evaluation: bool = False

    def to_dict(self, *, include_history: bool = True, private: bool = False) -> dict[str, Any]:
        """The summary as JSON-ready values.

        Args:
          include_history: add the run's history.
          private: add the whole history and :attr:`diagnostics` (computed from the private
            training data, not covered by the guarantee: for benchmarks and private
            diagnostics, never beside the model); default: the public view only.
        """
        left_out = ("history", "model", "ledger", "diagnostics", "private_evaluation") + (
            () if private else ("seconds",))
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in left_out}  # the wall time depends on the realised batches
        if include_history:
            out["history"] = self.history.to_dict() if private else self.history.public_dict()
        if self.private_evaluation and not private:  # computed from private units, no noise
            out["test_accuracy"] = None
            for epoch in out.get("history", {}).get("epochs", []):
                epoch["test_accuracy"] = epoch["model_test_accuracy"] = None
        if private:
            out["diagnostics"] = dict(self.diagnostics)
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunHooks:
    """What a caller plugs into a recipe run (not part of its configuration).

    Attributes:
      progress: show progress (loss, accuracy, epsilon spent).
      callbacks: extra progress callbacks (see :class:`~dpfy.training.trainer.ProgressInfo`).
      distributed: this process's place in a run started elsewhere (``torchrun``, or a helper
        rank of ``RunConfig.workers``; the RunConfig then names the world size as ``workers``
        when it shards); only rank 0 writes ``out``. Image recipe only.
      extra_train: ``(images, labels)`` appended to the training set (one process, example
        level; the one-run audit's included canaries, :mod:`dpfy.audit.onerun`): ordinary
        training examples, sampled, clipped and counted in N like the rest. Image recipe only.
      step_observer: ``step_observer(model)`` is called once with the freshly initialised
        model and returns a callback added to ``callbacks`` (the white-box audit's view).
      batch_plan: with ``RunConfig.tan_steps``, ``batch_plan(units)`` gives the expected batch
        size and the epochs for the run's number of training units (``dpfy.runs`` passes
        :func:`dpfy.planning.tan_scaled` for the run's budget and steps).
    """

    progress: bool = False
    callbacks: Sequence[Callable[[ProgressInfo], None]] = ()
    distributed: Distributed | None = None
    extra_train: tuple[torch.Tensor, torch.Tensor] | None = None
    step_observer: Callable[[nn.Module], Callable[[ProgressInfo], None]] | None = None
    batch_plan: Callable[[int], tuple[int, int]] | None = None

    def planned_batch(self, config: RunConfig, units: int) -> tuple[int, int]:
        """``(batch_size, epochs)`` of a ``tan_steps`` run over ``units`` training units."""
        if self.batch_plan is None:
            raise ValueError(f"tan_steps={config.tan_steps!r} needs hooks.batch_plan (dpfy.runs "
                             "gives the planner's; `dpfy train --tan-steps` goes through it)")
        return self.batch_plan(units)


def run_randomness(seed: int | None) -> tuple[Randomness, Randomness, dict[str, Any]]:
    """(sampling stream, noise stream, their ledger description) of a recipe run.

    ``seed=None``: two secure generators (docs/randomness.md), a DP release; their keys are
    drawn now, and their commitments recorded and registered (:mod:`dpfy.training.keys`: a
    key another run drew refuses this one). An int: both streams derive from the one seed a
    user would pass again, and ``torch.manual_seed(seed)`` fixes the initialisation: a
    reproducible experiment, not a DP release.
    """
    if seed is None:
        sample_rng, noise_rng = Randomness.secure_mode(), Randomness.secure_mode()
        return sample_rng, noise_rng, {"sampling_randomness": sample_rng.describe(),
                                       "noise_randomness": noise_rng.describe(),
                                       **key_facts(noise_rng, sample_rng)}
    base = Randomness(int(seed))
    sample_rng = Randomness(int(base.uniform(1)[0] * 2**62))
    noise_rng = Randomness(int(base.uniform(1)[0] * 2**62))
    torch.manual_seed(int(seed))
    return sample_rng, noise_rng, {
        **dict.fromkeys(("sampling_randomness", "noise_randomness"), base.describe()),
        **key_facts(noise_rng, sample_rng),
    }


@dataclasses.dataclass(kw_only=True)
class RecipeData:
    """A recipe's data for one run.

    Attributes:
      train, targets: the training rows as the trainer takes them (tensors, or a map-style
        dataset with ``targets`` None).
      test: what :meth:`Recipe.trainer` evaluates on.
      size: training rows.
      unit_ids: the unit of privacy of every training row (a user, a movie) for a user-level
        run; None at the example level.
      diagnostics: facts computed from the private training data without noise (never
        written beside the model).
    """

    train: Any
    targets: Any
    test: Any
    size: int
    unit_ids: np.ndarray | None = None
    diagnostics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def units(self) -> int:
        """Units of privacy: training rows, or the distinct owners of the rows."""
        return self.size if self.unit_ids is None else int(len(np.unique(self.unit_ids)))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Optimisation:
    """The numbers of a run once the recipe's defaults fill the RunConfig's ``None`` fields.

    Attributes:
      epochs, learning_rate, clip_norm: as the run uses them.
      batch_size: the given expected batch (None: :func:`dpfy.training.users.recipe_batch_size`
        of ``default_batch_size``).
      max_physical_batch_size: rows per forward/backward pass.
      accounting: the accountant (None: the sampler kind's, ``"gaussian"`` with correlated
        noise).
      example: what one training row is, for the ledger's unit of privacy.
    """

    epochs: int
    learning_rate: float
    clip_norm: float
    batch_size: int | None
    default_batch_size: int
    max_physical_batch_size: int
    accounting: str | None
    example: str


class Recipe(abc.ABC):
    """What a recipe run fills into :func:`run_recipe`. A subclass implements :meth:`load`,
    :meth:`model`, :meth:`optimizer`, :meth:`trainer`, :meth:`metadata` and
    :meth:`model_state`; the others have the defaults of a plain run."""

    config: RunConfig
    hooks: RunHooks
    optimisation: Optimisation

    @abc.abstractmethod
    def load(self) -> RecipeData:
        """The training and evaluation data (cheap enough to come before the batch check)."""
        raise NotImplementedError

    def prepare(self, data: RecipeData) -> RecipeData:
        """The data as the trainer takes it, once the batch is known to fit (default: as is)."""
        return data

    @abc.abstractmethod
    def model(self, device: torch.device) -> nn.Module:
        """A fresh model on ``device``."""
        raise NotImplementedError

    def noise_plan(self, batches: Sampler, epochs: int) -> CorrelatedPlan | None:
        """Correlated noise for the run (default: None, DP-SGD)."""
        return None

    @abc.abstractmethod
    def optimizer(self, net: nn.Module) -> torch.optim.Optimizer:
        """The optimizer that post-processes the released gradients."""
        raise NotImplementedError

    def before_training(self, net: nn.Module, data: RecipeData, batches: Sampler,
                        accounting: str, randomness: Randomness) -> float | None:
        """Anything released before DP-SGD (LP-FT's probe), and the noise multiplier DP-SGD
        must then use (None: calibrated to the target)."""
        return None

    def leading_callbacks(self, optimizer: torch.optim.Optimizer,
                          batches: Sampler) -> tuple[Callable[[ProgressInfo], None], ...]:
        """Callbacks that run before the caller's (learning-rate schedules)."""
        return ()

    @abc.abstractmethod
    def trainer(self, net: nn.Module, optimizer: torch.optim.Optimizer, data: RecipeData,
                batches: Sampler, user_args: dict[str, Any],
                options: TrainerOptions) -> PrivateTrainer:
        """The trainer; ``user_args`` is empty at the example level."""
        raise NotImplementedError

    @abc.abstractmethod
    def metadata(self, ledger: Ledger, net: nn.Module, batch_size: int) -> str:
        """Record the run's metadata before training; returns the model's name."""
        raise NotImplementedError

    def progress(self, trainer: PrivateTrainer, accounting: str, steps: int) -> Any:
        """A progress display over ``steps`` steps with a ``close()``, added to the trainer's
        callbacks (None: the trainer's own, or none)."""
        return None

    @abc.abstractmethod
    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The tensors ``model.pt`` keeps, on the host."""
        raise NotImplementedError

    def diagnostics(self, data: RecipeData) -> dict[str, Any]:
        """Private diagnostics of the run (default: the data's)."""
        return dict(data.diagnostics)


def run_recipe(recipe: Recipe) -> TrainResultSummary:
    """One run of ``recipe`` (its ``config`` and ``hooks``): train, record, write ``out``.

    Raises:
      FileExistsError: ``out`` already holds a ledger.
      ValueError: an option the data refuses (a batch larger than the units, a target the
        budget cannot reach), before anything is written.
    """
    config, hooks, opt = recipe.config, recipe.hooks, recipe.optimisation
    if config.threads is not None:
        torch.set_num_threads(int(config.threads))
    sample_rng, noise_rng, randomness = run_randomness(config.seed)
    data = recipe.load()
    units, epochs, batch_size = _units_and_batch(config, hooks, opt, data)
    data = recipe.prepare(data)
    device = torch.device(config.device or "cpu")  # RunConfig: one process when not the CPU
    net = recipe.model(device)
    callbacks = tuple(hooks.callbacks)
    if hooks.step_observer is not None:
        callbacks = (*callbacks, hooks.step_observer(net))
    user_args: dict[str, Any] = {}
    if config.unit != "example":
        units, user_args = users.user_level_options(
            config.unit, data.unit_ids, max_examples_per_user=config.cap,
            reduction=config.user_reduction, randomness=sample_rng,
        )
    batches = make_sampler(config.sampler_kind, units, batch_size, randomness=sample_rng,
                           unit=config.unit)
    plan = recipe.noise_plan(batches, epochs)
    accounting = opt.accounting or ("gaussian" if plan is not None else
                                    sampler_kind(batches.kind).default_accountant)
    optimizer = recipe.optimizer(net)
    noise_multiplier = recipe.before_training(net, data, batches, accounting, noise_rng)
    callbacks = (*recipe.leading_callbacks(optimizer, batches), *callbacks)
    ledger_path, model_path = _run_files(config.out)
    trainer = recipe.trainer(net, optimizer, data, batches, user_args, TrainerOptions(
        clip_norm=opt.clip_norm, epochs=epochs, delta=config.delta,
        target_epsilon=config.target_epsilon, noise_multiplier=noise_multiplier,
        max_physical_batch_size=opt.max_physical_batch_size, accounting=accounting,
        ledger=Ledger(), randomness=noise_rng, callbacks=callbacks,
        precision=check_precision(config.precision),
        correlated=plan, device=None if device.type == "cpu" else device,
        attribution_check=config.attribution_check,
        clipping=check_clipping(config.clipping, DEFAULT_STABILITY),
    ))
    # Calibrate before anything is written: an unreachable target is refused while out_dir
    # is still empty, so the corrected command is not refused for an existing ledger.
    trainer.calibrate()
    if config.out is not None:
        Path(config.out).mkdir(parents=True, exist_ok=True)
    ledger = trainer.ledger = Ledger(ledger_path)
    with closed_on_fault(ledger):  # a fault from here on: the ledger is closed, saying so
        model_name = recipe.metadata(ledger, net, batch_size)
        display = recipe.progress(trainer, accounting, epochs * int(batches.steps_per_epoch)) if (
            hooks.progress) else None
        start = time.perf_counter()
        try:
            result = trainer.fit()
        finally:
            if display is not None:
                display.close()
        seconds = time.perf_counter() - start
        accuracy = trainer.evaluate()
        assert accuracy is not None  # every recipe's trainer evaluates
        ledger.record_metadata(  # wall time, and an accuracy on validation units: private
            **({} if config.validation else {"test_accuracy": accuracy}),
            epsilon=result.privacy.epsilon, accounting=result.privacy.method,
            stopped=result.stopped, **randomness,
        )
        summary = TrainResultSummary(
            dataset=config.dataset, sampler=batches.kind, model_name=model_name,
            test_accuracy=float(accuracy), epsilon=float(result.privacy.epsilon),
            delta=float(config.delta), accounting=result.privacy.method,
            noise_multiplier=result.noise_multiplier, clip_norm=float(opt.clip_norm),
            batch_size=int(batch_size), epochs=int(epochs), steps=result.steps,
            learning_rate=float(opt.learning_rate), seconds=seconds, stopped=result.stopped,
            history=result.history, model=result.model, ledger=ledger,
            model_path=None if model_path is None else str(model_path),
            ledger_path=None if ledger_path is None else str(ledger_path),
            diagnostics={**recipe.diagnostics(data), **users.private_facts(trainer)},
            private_evaluation=bool(config.validation),
        )
        state = recipe.model_state(result.model)
        if model_path is not None:  # set exactly when out is; each file whole or absent
            write_atomic(model_path, lambda f: torch.save(state, f))
            write_atomic(model_path.parent / "summary.json",
                         json.dumps(summary.to_dict(), indent=2, default=str))
        return summary


@contextlib.contextmanager
def closed_on_fault(ledger: Ledger) -> Iterator[None]:
    """Close a file ledger when its run fails (a full disk while the model is saved, say):
    the end record says the run ended early and how many releases it made, so the file is
    complete for what was released and a report never reads it as the plan."""
    try:
        yield
    except BaseException as err:
        if ledger.path is not None and not ledger.read_only:
            released = len(ledger.noise_multipliers())
            with contextlib.suppress(OSError):  # a ledger whose own write failed stays cut
                ledger.close(ended=f"early (the run failed: {type(err).__name__}): "
                             f"{released} releases before the fault")
        raise


def _units_and_batch(
    config: RunConfig, hooks: RunHooks, opt: Optimisation, data: RecipeData
) -> tuple[int, int, int]:
    """(units of privacy, epochs, expected batch) of a run, the batch checked against the
    units (the message naming the unit) before the model loads."""
    units, epochs, batch_size = data.units(), opt.epochs, opt.batch_size
    if config.tan_steps is not None:  # RunConfig: Poisson, one example as the unit
        batch_size, epochs = hooks.planned_batch(config, units)
    batch_size = users.recipe_batch_size(batch_size, opt.default_batch_size, units, config.unit)
    return units, int(epochs), batch_size


def _run_files(out: str | os.PathLike[str] | None) -> tuple[Path | None, Path | None]:
    """(ledger, model) paths in ``out``; refused when ``out`` already holds a ledger."""
    if out is None:
        return None, None
    ledger_path = Path(out) / "ledger.jsonl"
    if ledger_path.exists():
        raise FileExistsError(
            f"{ledger_path} exists: a new run needs a new out_dir (the ledger is append-only)"
        )
    return ledger_path, Path(out) / "model.pt"

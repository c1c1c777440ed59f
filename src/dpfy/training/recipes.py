"""Ready-made DP-SGD runs on the real image datasets (what ``dpfy train`` calls).

:func:`train_image_classifier` trains a small CNN on MNIST or Fashion-MNIST with a sampler
from :mod:`dpfy.sampling`, calibrates the noise to a target (epsilon, delta) from the sampler's
event, and writes the released model, the ledger and a JSON summary into ``out_dir``.

Models (both private by construction: no layer mixes examples):

* ``"tanh_cnn"`` (default): the end-to-end CNN of Tramer & Boneh (2021) / Papernot et al.
  (2021): conv16 8x8/2 - tanh - maxpool 2/1 - conv32 4x4/2 - tanh - maxpool 2/1 - fc32 - tanh -
  fc10 (26k parameters). Bounded activations keep per-example gradients small, which suits
  clipping.
* ``"gn_cnn"``: conv16 3x3 - GroupNorm - ReLU - pool - conv32 3x3 - GroupNorm - ReLU - pool -
  linear (the CNN of ``benchmarks/dpsgd_step.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from dpfy import datasets
from dpfy.config import IMAGE_MODELS, RunConfig
from dpfy.correlated import Cyclic, SingleEpoch
from dpfy.correlated.plan import CorrelatedPlan, make_plan
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import make_sampler
from dpfy.sampling.kinds import kind as sampler_kind
from dpfy.sampling.kinds import kind_names
from dpfy.sampling.spec import SampleSpec
from dpfy.training import users
from dpfy.training.devices import host_copy
from dpfy.training.distributed import Distributed, per_process_batch
from dpfy.training.history import History, ProgressInfo
from dpfy.training.launch import run_local
from dpfy.training.precision import check_precision
from dpfy.training.sharded import full_state_dict, shard_model
from dpfy.training.trainer import PrivateTrainer, TrainerOptions


def _tanh_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.Tanh(),
        nn.Linear(32, 10),
    )


def _gn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


def _scatternet_linear() -> nn.Module:
    # Tramer & Boneh (2021): a linear model on ScatterNet features normalised per example
    # (GroupNorm without parameters: no statistics of the private data, nothing to account).
    from dpfy.features.scatternet import GROUPS, scattering_channels

    channels, side = scattering_channels(), 7
    return nn.Sequential(
        nn.GroupNorm(GROUPS, channels, affine=False),
        nn.Flatten(),
        nn.Linear(channels * side * side, 10),
    )


def _scatternet_cnn() -> nn.Module:
    # A small CNN on the 81 x 7 x 7 ScatterNet features (Tramer & Boneh 2021, section 3.1).
    from dpfy.features.scatternet import GROUPS, scattering_channels

    channels = scattering_channels()
    return nn.Sequential(
        nn.GroupNorm(GROUPS, channels, affine=False),
        nn.Conv2d(channels, 64, 3, padding=1),
        nn.GroupNorm(8, 64),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.GroupNorm(8, 64),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(64 * 3 * 3, 10),
    )


MODELS = {
    "tanh_cnn": _tanh_cnn,
    "gn_cnn": _gn_cnn,
    "scatternet_linear": _scatternet_linear,
    "scatternet_cnn": _scatternet_cnn,
}
#: Models trained on ScatterNet features of the images (:mod:`dpfy.features.scatternet`).
SCATTERNET_MODELS = ("scatternet_linear", "scatternet_cnn")


def make_model(name: str = "tanh_cnn") -> nn.Module:
    """A fresh model by name (one of :data:`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {{{', '.join(MODELS)}}}, got name={name!r}")
    return MODELS[name]()


@dataclasses.dataclass(frozen=True)
class TrainResultSummary:
    """What :func:`train_image_classifier` returns (and writes as ``summary.json``).

    Attributes:
      dataset, sampler, model_name: what ran.
      test_accuracy: final accuracy of the released model on the 10k test images.
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

    ``summary.json`` holds :meth:`to_dict` (the public view: the history's per-step records,
    training losses and epoch timings are left out, :meth:`History.public_dict`).
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

    def to_dict(self, *, include_history: bool = True, private: bool = False) -> dict[str, Any]:
        """The summary as JSON-ready values.

        Args:
          include_history: add the run's history.
          private: add the whole history and :attr:`diagnostics` (computed from the private
            training data, not covered by the guarantee: for benchmarks and private
            diagnostics, never beside the model); default: the public view only.
        """
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("history", "model", "ledger", "diagnostics")
        }
        if include_history:
            out["history"] = self.history.to_dict() if private else self.history.public_dict()
        if private:
            out["diagnostics"] = dict(self.diagnostics)
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ImageRecipe:
    """The image recipe's own knobs, and its defaults for the RunConfig fields left ``None``.

    Attributes:
      epochs, batch_size, learning_rate, clip_norm: used where the RunConfig leaves them None
        (expected batch size; SGD step size; per-example clip norm C).
      momentum: SGD momentum (post-processing of the noisy gradient).
      model: a key of :data:`MODELS` (``"tanh_cnn"``, ``"gn_cnn"``; ``"scatternet_linear"``
        and ``"scatternet_cnn"`` train on ScatterNet features: see :func:`default_recipe`).
      ema_decay: EMA of the weights (the EMA model is released), or None.
      max_physical_batch_size: rows per forward/backward pass.
      noise_multiplier: fixed z instead of calibration (the guard still uses the target).
      accounting: accountant for calibration, the guard and the final statement; default: the
        sampler kind's ``default_accountant`` (``"gaussian"`` with correlated noise).
      band, buffers: BandMF diagonals and BLT buffers of a correlated ``mechanism``.
    """

    epochs: int = 10
    batch_size: int = 1024
    learning_rate: float = 2.0
    clip_norm: float = 0.1
    momentum: float = 0.9
    model: str = "tanh_cnn"
    ema_decay: float | None = 0.99
    max_physical_batch_size: int = 1024
    noise_multiplier: float | None = None
    accounting: str | None = None
    band: int = 16
    buffers: int = 4


def default_recipe(model: str | None = None) -> ImageRecipe:
    """The recipe's defaults for ``model`` (a key of :data:`MODELS` or its ``--model`` name).

    The ScatterNet models follow Tramer & Boneh (2021): large batches, few epochs, a large
    step size on the per-example-normalised features, and the final weights released (no EMA).
    """
    name = "tanh_cnn" if model is None else model.replace("-", "_")
    if name not in MODELS:
        raise ValueError(f"model must be one of {{{', '.join(IMAGE_MODELS)}}}, got model={model!r}")
    if name == "scatternet_linear":
        # chosen on a validation split at epsilon 3 (benchmarks/images.py)
        return ImageRecipe(model=name, epochs=80, batch_size=4096, learning_rate=4.0,
                           clip_norm=0.1, ema_decay=None, max_physical_batch_size=4096)
    if name == "scatternet_cnn":
        return ImageRecipe(model=name, epochs=20, batch_size=4096, learning_rate=4.0,
                           clip_norm=0.1, ema_decay=None, max_physical_batch_size=512)
    return ImageRecipe(model=name)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunHooks:
    """What a caller plugs into a recipe run (not part of its configuration).

    Attributes:
      progress: show a progress bar (loss, accuracy, epsilon spent).
      callbacks: extra progress callbacks (see :class:`~dpfy.training.trainer.ProgressInfo`).
      distributed: this process's place in a run started elsewhere (``torchrun``, or a helper
        rank of ``RunConfig.workers``; the RunConfig then names the world size as ``workers``
        when it shards); only rank 0 writes ``out``.
      extra_train: ``(images, labels)`` appended to the training set (one process, example
        level; the one-run audit's included canaries, :mod:`dpfy.audit.onerun`): ordinary
        training examples, sampled, clipped and counted in N like the rest.
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


def train_image_classifier(
    config: RunConfig,
    recipe: ImageRecipe | None = None,
    hooks: RunHooks | None = None,
) -> TrainResultSummary:
    """Train a small CNN with DP-SGD on MNIST / Fashion-MNIST; write model and ledger.

    Unit of privacy: one training image (default), or with ``unit="user"`` one synthetic user
    (image i belongs to user ``i % num_users``; :mod:`dpfy.training.users`); adjacency
    add-or-remove (Poisson, Balls-and-Bins).

    Args:
      config: the run (:class:`dpfy.config.RunConfig`): dataset (``"mnist"`` or
        ``"fashion-mnist"``), budget, sampler (any :func:`dpfy.sampling.make_sampler` kind;
        shuffle runs get their honest accounting), optimisation, ``seed`` (None: sampling and
        noise from the secure generator, a DP release; an int: a reproducible experiment that
        is NOT differentially private against anyone who knows the seed), limits, precision,
        unit of privacy (``"user"``: ``users`` synthetic users, ``batch_size`` users per
        batch), ``workers`` (data-parallel processes on this machine; this one is rank 0 and
        writes ``out``), ``shard`` (FSDP2) and ``mechanism`` (correlated noise needs the
        ``cyclic`` or ``deterministic`` sampler, or one epoch of ``shuffle``; accounted as one
        ``MatrixMechanism``). ``out`` receives ``model.pt``, ``ledger.jsonl`` and
        ``summary.json``.
      recipe: the recipe's own knobs and defaults (:class:`ImageRecipe`).
      hooks: progress, callbacks, a distributed context, the one-run audit's extra training
        rows and observer (:class:`RunHooks`).

    Returns:
      :class:`TrainResultSummary` (rank 0's).
    """
    if recipe is None:
        recipe = default_recipe(config.model)
    elif config.model is not None:
        recipe = dataclasses.replace(recipe, model=config.model.replace("-", "_"))
    hooks = RunHooks() if hooks is None else hooks
    dataset, target_epsilon, delta, seed = (
        config.dataset, config.target_epsilon, config.delta, config.seed
    )
    sampler, mechanism, unit, precision = (
        config.sampler_kind, config.mechanism, config.unit, config.precision
    )
    epochs = recipe.epochs if config.epochs is None else config.epochs
    batch_size = config.batch_size  # None: the recipe's (users: recipe_batch_size's rule)
    learning_rate = (
        recipe.learning_rate if config.learning_rate is None else config.learning_rate
    )
    clip_norm = recipe.clip_norm if config.clip_norm is None else config.clip_norm
    momentum, model, ema_decay = recipe.momentum, recipe.model, recipe.ema_decay
    max_physical_batch_size, accounting = recipe.max_physical_batch_size, recipe.accounting
    noise_multiplier, band, buffers = recipe.noise_multiplier, recipe.band, recipe.buffers
    out_dir, threads, train_limit, test_limit = (
        config.out, config.threads, config.train_limit, config.test_limit
    )
    num_users, max_examples_per_user, user_reduction = (
        config.users, config.cap, config.user_reduction
    )
    workers, shard = config.workers, config.shard
    progress, callbacks, distributed = hooks.progress, hooks.callbacks, hooks.distributed
    extra_train, step_observer = hooks.extra_train, hooks.step_observer
    if distributed is not None:
        workers = 1  # a rank of a run: the processes are already there
    # RunConfig checked the mechanism, the unit, the workers' range and the precision
    checked_precision = check_precision(precision)
    if mechanism != "dpsgd" and (workers > 1 or distributed is not None):
        raise ValueError(
            f"mechanism={mechanism!r} (correlated noise) runs in one process: use workers=1, "
            f"got workers={workers}" + ("" if distributed is None else " and a distributed run")
        )
    if unit != "example" and (workers > 1 or distributed is not None):
        raise ValueError(
            f"unit={unit!r} (user-level DP) runs in one process: use workers=1, got "
            f"workers={workers}" + ("" if distributed is None else " and a distributed run")
        )
    if shard and ((workers == 1 and distributed is None) or ema_decay is not None):
        raise ValueError(
            "shard=True needs workers > 1 (or a distributed run) and ema_decay=None (an FSDP2 "
            f"model cannot be copied for the EMA), got workers={workers}, "
            f"ema_decay={ema_decay!r}"
        )
    if (extra_train is not None or step_observer is not None) and (
        workers > 1 or distributed is not None or unit != "example"
    ):
        raise ValueError(
            "extra_train and step_observer (the one-run audit) need one process and "
            f"unit='example', got workers={workers}, unit={unit!r}"
        )
    if workers > 1:
        per_process_batch(max_physical_batch_size, workers)  # refused before anything starts
        if out_dir is not None and (Path(out_dir) / "ledger.jsonl").exists():
            raise FileExistsError(f"{Path(out_dir) / 'ledger.jsonl'} exists: use a new out_dir")
        config = config.replace(threads=threads or max(1, (os.cpu_count() or 1) // workers))
        helper = config.replace(out=None)
        return cast(TrainResultSummary, run_local(
            _worker, workers, (helper, recipe),
            rank0_args=(config, recipe, RunHooks(progress=progress, callbacks=callbacks)),
        ))
    if threads is not None:
        torch.set_num_threads(int(threads))
    if unit != "example" and num_users is None:
        raise ValueError(
            f"num_users is missing: unit={unit!r} needs the number of synthetic users"
        )
    x_train, y_train = datasets.load(dataset, "train", limit=train_limit)
    if config.validation:  # a search: held-out training images, never the test split
        held = torch.as_tensor(datasets.validation_images(x_train))
        x_test, y_test = x_train[held][:test_limit], y_train[held][:test_limit]
        x_train, y_train = x_train[~held], y_train[~held]
    else:
        x_test, y_test = datasets.load(dataset, "test", limit=test_limit)
    if extra_train is not None:
        x_train = torch.cat([x_train, extra_train[0].to(x_train.dtype)])
        y_train = torch.cat([y_train, extra_train[1].to(y_train.dtype)])
    if model in SCATTERNET_MODELS:  # a fixed feature map: no privacy spent, nothing to record
        from dpfy.features.scatternet import dataset_features

        x_train = dataset_features(dataset, "train", x_train, progress=progress)
        x_test = dataset_features(dataset, "test", x_test, progress=progress)
    sample_rng, noise_rng, randomness = run_randomness(seed)
    units = len(x_train)
    trainer_cls: type[PrivateTrainer] = PrivateTrainer
    user_args: dict[str, Any] = {}
    if unit != "example":
        assert num_users is not None
        units, user_args = users.user_level_options(
            unit, users.synthetic_user_ids(len(x_train), num_users),
            max_examples_per_user=max_examples_per_user, reduction=user_reduction,
            randomness=sample_rng,
        )
        trainer_cls = users.UserLevelTrainer
    if config.tan_steps is not None:  # RunConfig: Poisson, one image as the unit
        batch_size, epochs = hooks.planned_batch(config, units)
    batch_size = users.recipe_batch_size(batch_size, recipe.batch_size, units, unit)
    device = torch.device(config.device or "cpu")  # RunConfig: one process when not the CPU
    net = make_model(model).to(device)
    if shard and distributed is not None:
        shard_model(net, distributed)
    if step_observer is not None:
        callbacks = (*callbacks, step_observer(net))
    batches = make_sampler(sampler, units, batch_size, randomness=sample_rng, unit=unit)
    plan = None
    if mechanism != "dpsgd":
        plan = correlated_plan(mechanism, batches.sample_spec(), epochs, band, buffers)
        accounting = accounting or "gaussian"
    if accounting is None:
        accounting = sampler_kind(batches.kind).default_accountant
    optimizer = torch.optim.SGD(net.parameters(), lr=learning_rate, momentum=momentum)
    ledger_path = model_path = None
    if out_dir is not None:
        ledger_path = Path(out_dir) / "ledger.jsonl"
        if ledger_path.exists():
            raise FileExistsError(
                f"{ledger_path} exists: a new run needs a new out_dir (the ledger is append-only)"
            )
        model_path = Path(out_dir) / "model.pt"
    trainer = trainer_cls(
        net,
        optimizer,
        nn.CrossEntropyLoss(reduction="none"),
        x_train,
        y_train,
        batches,
        **user_args,
        options=TrainerOptions(
            clip_norm=clip_norm,
            epochs=epochs,
            delta=delta,
            target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier,
            max_physical_batch_size=max_physical_batch_size,
            accounting=accounting,
            ledger=Ledger(),
            randomness=noise_rng,
            ema_decay=ema_decay,
            test_data=(x_test, y_test),
            progress=progress,
            callbacks=callbacks,
            precision=checked_precision,
            distributed=distributed,
            correlated=plan,
            device=None if device.type == "cpu" else device,
        ),
    )
    # Calibrate before anything is written: an unreachable target is refused while out_dir
    # is still empty, so the corrected command is not refused for an existing ledger.
    trainer.calibrate()
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    ledger = trainer.ledger = Ledger(ledger_path)
    ledger.record_metadata(
        dataset=dataset,
        model=model,
        learning_rate=learning_rate,
        momentum=momentum,
        batch_size=batch_size,
        unit_of_privacy=users.unit_description(unit, max_examples_per_user, "training image"),
        mechanism=mechanism,
        tan_steps=config.tan_steps,
        released_output="final model" + (" (EMA of the weights)" if ema_decay else ""),
        data_accesses="final training run only (hyperparameter tuning not accounted)",
    )
    start = time.perf_counter()
    result = trainer.fit()
    seconds = time.perf_counter() - start
    accuracy = trainer.evaluate()
    assert accuracy is not None  # the trainer has test_data
    ledger.record_metadata(
        test_accuracy=accuracy,
        wall_time_seconds=seconds,
        epsilon=result.privacy.epsilon,
        accounting=result.privacy.method,
        stopped=result.stopped,
        **randomness,
    )
    summary = TrainResultSummary(
        dataset=dataset,
        sampler=batches.kind,
        model_name=model,
        test_accuracy=float(accuracy),
        epsilon=float(result.privacy.epsilon),
        delta=float(delta),
        accounting=result.privacy.method,
        noise_multiplier=result.noise_multiplier,
        clip_norm=float(clip_norm),
        batch_size=int(batch_size),
        epochs=int(epochs),
        steps=result.steps,
        learning_rate=float(learning_rate),
        seconds=seconds,
        stopped=result.stopped,
        history=result.history,
        model_path=None if model_path is None else str(model_path),
        ledger_path=None if ledger_path is None else str(ledger_path),
        model=result.model,
        ledger=ledger,
    )
    state = full_state_dict(result.model) if shard else host_copy(
        result.model.state_dict().items())
    if model_path is not None:  # set exactly when out_dir is
        torch.save(state, model_path)
        with open(model_path.parent / "summary.json", "w", encoding="utf-8") as f:
            json.dump(summary.to_dict(), f, indent=2, default=str)
    return summary


def _worker(
    distributed: Distributed,
    config: RunConfig,
    recipe: ImageRecipe,
    hooks: RunHooks | None = None,
) -> TrainResultSummary:
    """One rank of a ``RunConfig.workers`` run of :func:`train_image_classifier`."""
    hooks = RunHooks() if hooks is None else hooks
    ranked = dataclasses.replace(hooks, distributed=distributed)
    return train_image_classifier(config, recipe, ranked)


def correlated_plan(
    mechanism: str, spec: SampleSpec, epochs: int, band: int = 16, buffers: int = 4
) -> CorrelatedPlan:
    """The plan of a correlated-noise image run: the cyclic schema for a sampler kind that
    repeats one order (its row is ``cyclic``: ``cyclic``, ``deterministic``), a single epoch
    for a kind that uses each example once per epoch (``once_per_epoch``: also ``shuffle``,
    ``balls_and_bins``) with ``epochs=1``; anything else is refused (``ValueError``)."""
    per_epoch = spec.required_int("steps_per_epoch") if spec.steps_per_epoch else 0
    row = sampler_kind(spec.sampler)
    schema: Cyclic | SingleEpoch
    if row.cyclic:
        schema = Cyclic(per_epoch)
    elif row.once_per_epoch and epochs == 1:
        schema = SingleEpoch()
    else:
        once = [n for n in kind_names("once_per_epoch") if n not in kind_names("cyclic")]
        raise ValueError(
            f"sampler must be one of {{{', '.join(kind_names('cyclic'))}}} for "
            f"mechanism={mechanism!r} (or {' / '.join(once)} with epochs=1): its correlated "
            f"noise needs every example in one fixed step per epoch, got "
            f"sampler={spec.sampler!r}"
        )
    return make_plan(mechanism, per_epoch * epochs, schema, band=min(band, per_epoch),
                     buffers=buffers)


def run_randomness(seed: int | None) -> tuple[Randomness, Randomness, dict[str, str]]:
    """(sampling stream, noise stream, their ledger description) of a recipe run.

    ``seed=None``: two secure generators (docs/randomness.md), a DP release. An int: both
    streams derive from the one seed a user would pass again, and ``torch.manual_seed(seed)``
    fixes the initialisation: a reproducible experiment, not a DP release.
    """
    if seed is None:
        sample_rng, noise_rng = Randomness.secure_mode(), Randomness.secure_mode()
        return sample_rng, noise_rng, {"sampling_randomness": sample_rng.describe(),
                                       "noise_randomness": noise_rng.describe()}
    base = Randomness(int(seed))
    sample_rng = Randomness(int(base.uniform(1)[0] * 2**62))
    noise_rng = Randomness(int(base.uniform(1)[0] * 2**62))
    torch.manual_seed(int(seed))
    return sample_rng, noise_rng, dict.fromkeys(("sampling_randomness", "noise_randomness"),
                                                base.describe())


def _print_epoch(info: ProgressInfo) -> None:  # pragma: no cover - console helper
    if info.kind == "epoch":
        print(
            f"epoch {info.epoch}: step {info.step}/{info.total_steps} loss {info.loss:.4f} "
            f"test {info.test_accuracy} eps {info.epsilon}",
            flush=True,
        )

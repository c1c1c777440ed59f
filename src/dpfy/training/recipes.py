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
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from dpfy import datasets
from dpfy.config import IMAGE_MODELS, RunConfig
from dpfy.correlated import Cyclic, SingleEpoch
from dpfy.correlated.plan import CorrelatedPlan, make_plan
from dpfy.ledger import Ledger
from dpfy.sampling.kinds import kind as sampler_kind
from dpfy.sampling.kinds import kind_names
from dpfy.sampling.spec import SampleSpec
from dpfy.training import users
from dpfy.training.devices import host_copy
from dpfy.training.distributed import Distributed, per_process_batch
from dpfy.training.launch import run_local
from dpfy.training.sharded import full_state_dict, shard_model
from dpfy.training.skeleton import (
    Optimisation,
    Recipe,
    RecipeData,
    RunHooks,
    TrainResultSummary,
    run_recipe,
)
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

if TYPE_CHECKING:
    from dpfy.randomness import Randomness
    from dpfy.sampling import Sampler


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
        rows and observer (:class:`~dpfy.training.skeleton.RunHooks`).

    Returns:
      :class:`~dpfy.training.skeleton.TrainResultSummary` (rank 0's).
    """
    if recipe is None:
        recipe = default_recipe(config.model)
    elif config.model is not None:
        recipe = dataclasses.replace(recipe, model=config.model.replace("-", "_"))
    hooks = RunHooks() if hooks is None else hooks
    workers = 1 if hooks.distributed is not None else config.workers  # a rank: already there
    _check_processes(config, recipe, hooks, workers)
    if workers > 1:
        per_process_batch(recipe.max_physical_batch_size, workers)  # refused before it starts
        if config.out is not None and (Path(config.out) / "ledger.jsonl").exists():
            raise FileExistsError(
                f"{Path(config.out) / 'ledger.jsonl'} exists: use a new out_dir")
        config = config.replace(
            threads=config.threads or max(1, (os.cpu_count() or 1) // workers))
        helper = config.replace(out=None)
        return cast(TrainResultSummary, run_local(
            _worker, workers, (helper, recipe),
            rank0_args=(config, recipe, RunHooks(progress=hooks.progress,
                                                  callbacks=hooks.callbacks)),
        ))
    return run_recipe(_ImageRun(config, recipe, hooks))


def train_recipe(config: RunConfig, hooks: RunHooks | None = None) -> TrainResultSummary:
    """The run of ``config`` by its dataset's recipe with the recipe's defaults: the text
    recipe (:func:`dpfy.training.text.train_text_classifier`) for a text dataset, else
    :func:`train_image_classifier` (a tuning trial, a run a caller starts by its config)."""
    if config.text:
        from dpfy.training.text import train_text_classifier

        return train_text_classifier(config, None, hooks)
    return train_image_classifier(config, None, hooks)


def _check_processes(
    config: RunConfig, recipe: ImageRecipe, hooks: RunHooks, workers: int
) -> None:
    """What a run of several processes cannot do (RunConfig checked the rest)."""
    distributed, unit, mechanism = hooks.distributed, config.unit, config.mechanism
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
    if config.shard and ((workers == 1 and distributed is None) or recipe.ema_decay is not None):
        raise ValueError(
            "shard=True needs workers > 1 (or a distributed run) and ema_decay=None (an FSDP2 "
            f"model cannot be copied for the EMA), got workers={workers}, "
            f"ema_decay={recipe.ema_decay!r}"
        )
    if (hooks.extra_train is not None or hooks.step_observer is not None) and (
        workers > 1 or distributed is not None or unit != "example"
    ):
        raise ValueError(
            "extra_train and step_observer (the one-run audit) need one process and "
            f"unit='example', got workers={workers}, unit={unit!r}"
        )


class _ImageRun(Recipe):
    """What the image recipe fills into the run skeleton: the images (ScatterNet features
    for those models), a CNN, cross-entropy, SGD with momentum, the weights' EMA, correlated
    noise for a correlated ``mechanism``."""

    def __init__(self, config: RunConfig, recipe: ImageRecipe, hooks: RunHooks) -> None:
        self.config, self.recipe, self.hooks = config, recipe, hooks
        self.optimisation = Optimisation(
            epochs=recipe.epochs if config.epochs is None else config.epochs,
            learning_rate=(recipe.learning_rate if config.learning_rate is None
                           else config.learning_rate),
            clip_norm=recipe.clip_norm if config.clip_norm is None else config.clip_norm,
            batch_size=config.batch_size, default_batch_size=recipe.batch_size,
            max_physical_batch_size=recipe.max_physical_batch_size,
            accounting=recipe.accounting, example="training image",
        )

    def load(self) -> RecipeData:
        c, extra = self.config, self.hooks.extra_train
        features = self.recipe.model in SCATTERNET_MODELS  # a fixed map, image by image
        x_train, y_train = datasets.load(c.dataset, "train", limit=c.train_limit)
        pixels = x_train.dtype
        held = torch.as_tensor(datasets.validation_images(x_train)) if c.validation else None
        if features:  # every training image's (one cached file), before any split
            x_train = self._features("train", x_train)
        if held is not None:  # a search: held-out training images, never the test split
            x_test, y_test = x_train[held][:c.test_limit], y_train[held][:c.test_limit]
            x_train, y_train = x_train[~held], y_train[~held]
        else:
            x_test, y_test = datasets.load(c.dataset, "test", limit=c.test_limit)
            if features:
                x_test = self._features("test", x_test)
        if extra is not None:
            added = extra[0].to(pixels)
            if features:
                added = self._features("train", added)
            x_train = torch.cat([x_train, added.to(x_train.dtype)])
            y_train = torch.cat([y_train, extra[1].to(y_train.dtype)])
        ids = None
        if c.unit != "example":
            if c.users is None:
                raise ValueError(
                    f"num_users is missing: unit={c.unit!r} needs the number of synthetic users")
            ids = users.synthetic_user_ids(len(x_train), c.users)
        return RecipeData(train=x_train, targets=y_train, test=(x_test, y_test),
                          size=len(x_train), unit_ids=ids)

    def _features(self, split: str, images: torch.Tensor) -> torch.Tensor:
        """ScatterNet features of ``images``: nothing to record (no statistic of other images);
        cached by the images' content, so a limit or added images get their own file."""
        from dpfy.features.scatternet import dataset_features

        return dataset_features(self.config.dataset, split, images, progress=self.hooks.progress)

    def model(self, device: torch.device) -> nn.Module:
        net = make_model(self.recipe.model).to(device)
        if self.config.shard and self.hooks.distributed is not None:
            shard_model(net, self.hooks.distributed)
        return net

    def noise_plan(self, batches: Sampler, epochs: int) -> CorrelatedPlan | None:
        if self.config.mechanism == "dpsgd":
            return None
        return correlated_plan(self.config.mechanism, batches.sample_spec(), epochs,
                               self.recipe.band, self.recipe.buffers)

    def optimizer(self, net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(net.parameters(), lr=self.optimisation.learning_rate,
                               momentum=self.recipe.momentum)

    def before_training(self, net: nn.Module, data: RecipeData, batches: Sampler,
                        accounting: str, randomness: Randomness) -> float | None:
        return self.recipe.noise_multiplier  # fixed z, or None: calibrated

    def trainer(self, net: nn.Module, optimizer: torch.optim.Optimizer, data: RecipeData,
                batches: Sampler, user_args: dict[str, Any],
                options: TrainerOptions) -> PrivateTrainer:
        cls = users.UserLevelTrainer if user_args else PrivateTrainer
        options = dataclasses.replace(
            options, ema_decay=self.recipe.ema_decay, test_data=data.test,
            progress=self.hooks.progress, distributed=self.hooks.distributed)
        return cls(net, optimizer, nn.CrossEntropyLoss(reduction="none"), data.train,
                   data.targets, batches, **user_args, options=options)

    def metadata(self, ledger: Ledger, net: nn.Module, batch_size: int) -> str:
        c, r = self.config, self.recipe
        ledger.record_metadata(
            dataset=c.dataset, model=r.model, learning_rate=self.optimisation.learning_rate,
            momentum=r.momentum, batch_size=batch_size,
            unit_of_privacy=users.unit_description(c.unit, c.cap, self.optimisation.example),
            mechanism=c.mechanism, tan_steps=c.tan_steps,
            released_output="final model" + (" (EMA of the weights)" if r.ema_decay else ""),
            data_accesses="final training run only (hyperparameter tuning not accounted)",
        )
        return r.model

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.config.shard:  # every rank takes part in gathering the shards
            return full_state_dict(model)
        return host_copy(model.state_dict().items())


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

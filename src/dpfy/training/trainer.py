"""The high-level DP-SGD trainer: calibrate, train, record, guard the budget, checkpoint.

:class:`PrivateTrainer` runs DP-SGD (Abadi et al. 2016; Ponomareva et al. 2023, Alg. 1) on
tensors with any sampler from :mod:`dpfy.sampling` and any ``torch.optim`` optimizer:

1. validate the model (:mod:`dpfy.training.validate`: every layer that mixes examples is an
   error with its fix);
2. calibrate the noise multiplier from the *sampler's* privacy event
   (``sampler.privacy_event(z, epochs=epochs)``) to the target epsilon with the chosen
   accountant, unless a noise multiplier is given;
3. per logical step: record the sampler's :class:`~dpfy.sampling.SampleSpec` in the ledger, cut
   the batch into fixed-shape physical chunks with weight-0 padding
   (:mod:`dpfy.training.data`), accumulate clipped per-example gradients, release the noisy
   sum once (the query writes its ledger entry first), step the optimizer, update the EMA;
4. before every epoch the :class:`BudgetGuard` asks the accountant how many of the epoch's
   steps the ledger can still afford under the target; a refused step is never taken (the run
   stops cleanly, or raises :class:`BudgetExceededError` with ``on_budget="raise"``);
5. after every epoch: test accuracy, epsilon spent so far (read from the ledger with
   ``monitor_accounting``, by default the final method), optional checkpoint.

The trainer never computes epsilon itself: every figure is the ledger accounted,
``dpfy.accounting.epsilon(ledger, delta, method)``; the final one with the chosen ``accounting``
method (PLD by default).

Unit of privacy and adjacency: one row of the training tensors, add-or-remove (the sampler's
spec records both). Monitoring figures in :class:`History` (training loss and accuracy) are
computed on private batches without noise: they are for the operator and are not covered by the
guarantee. Test accuracy is computed on the test data you pass, which is not protected either.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from dpfy._validate import check_int, check_range
from dpfy.ledger import Ledger
from dpfy.models.modes import evaluating
from dpfy.queries.clipping import (
    DEFAULT_STABILITY,
    ClippingMode,
    check_clipping,
    describe_clipping,
)
from dpfy.randomness import Randomness
from dpfy.training import checkpoint as ckpt
from dpfy.training.budget import (
    BudgetExceededError,
    BudgetGuard,
    spent,
    statement,
)
from dpfy.training.data import Batcher, PhysicalBatcher, accumulate_logical_batch
from dpfy.training.distributed import (
    Distributed,
    ShardBatcher,
    SharedSampler,
    check_mirror_ledger,
    per_process_batch,
    unwrap,
)
from dpfy.training.history import EpochRecord, History, ProgressInfo, StepRecord, TrainResult
from dpfy.training.loader import DatasetBatcher, check_dataset, check_sampler
from dpfy.training.norms.attribution import DEFAULT_EVERY
from dpfy.training.norms.registry import layer_type_names
from dpfy.training.precision import Precision, check_loss_scale, check_precision
from dpfy.training.resume import check_resume, run_hyperparameters
from dpfy.training.sharded import is_sharded
from dpfy.training.step import PrivateGradient
from dpfy.training.user_inputs import (
    check_learning_rates,
    check_randomness,
    check_tensor_labels,
    warn_eval_mode,
)
from dpfy.training.validate import validate_module

if TYPE_CHECKING:
    from dpfy import events as ev
    from dpfy.correlated import CorrelatedPlan
    from dpfy.queries import Query
    from dpfy.sampling import Sampler


OnBudget = Literal["stop", "raise"]
_T = TypeVar("_T")

_NEED_TARGET_OR_Z = (
    "give target_epsilon (the noise multiplier is calibrated to it) or noise_multiplier, "
    "got neither"
)


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainerOptions:
    """How a :class:`PrivateTrainer` runs: everything but the model, optimizer, loss, data and
    sampler (see :class:`PrivateTrainer` for each field's meaning, units and range; checked
    when the trainer is built or calibrated)."""

    clip_norm: float
    epochs: int
    delta: float
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    max_physical_batch_size: int = 256
    accounting: str = "pld"
    monitor_accounting: str | None = None
    ledger: Ledger | None = None
    randomness: Randomness | None = None
    ema_decay: float | None = None
    test_data: tuple[torch.Tensor, torch.Tensor] | None = None
    on_budget: OnBudget = "stop"
    callbacks: Sequence[Callable[[ProgressInfo], None]] = ()
    progress: bool = False
    checkpoint_path: str | Path | None = None
    checkpoint_every: int = 1
    microbatch_size: int | None = None
    validate: bool = True
    device: torch.device | str | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    target_key: str = "labels"
    forward: Callable[[nn.Module, Any], Any] | None = None
    precision: Precision = "fp32"
    loss_scale: float | None = None
    distributed: Distributed | None = None
    correlated: CorrelatedPlan | None = None
    clip_groups: Sequence[str] = ()
    attribution_check: int = DEFAULT_EVERY
    clipping: ClippingMode = "flat"
    clip_stability: float = DEFAULT_STABILITY


class PrivateTrainer:
    """DP-SGD on in-memory tensors with ledger accounting (see the module docstring).

    Args:
      model: the network (validated; use ``fix_module`` for BatchNorm models).
      optimizer: any ``torch.optim`` optimizer over ``model``'s parameters.
      loss_fn: per-example loss ``loss_fn(outputs, targets) -> Tensor[B]``
        (e.g. ``nn.CrossEntropyLoss(reduction="none")``).
      inputs, targets: the training set, leading dimension = number of examples; one row is
        the unit of privacy. Or ``inputs`` a map-style ``torch.utils.data.Dataset`` (items:
        tensors, tuples or dicts; one item is the unit) and ``targets=None``: physical batches
        are read by index and collated (:mod:`dpfy.training.loader`), split into (inputs,
        targets) by :func:`dpfy.training.loader.split_batch`; a dict batch calls
        ``model(**inputs)`` with its ``target_key`` entry as the targets. In-memory tensors
        stay the fast path.
      sampler: a :mod:`dpfy.sampling` sampler over ``len(inputs)`` examples.
      options: a :class:`TrainerOptions`, one record of everything else; its fields:

      clip_norm: L2 clip norm C of each example's gradient.
      epochs: number of epochs (``sampler.steps_per_epoch`` steps each).
      delta: target delta.
      target_epsilon: budget; calibrates z when ``noise_multiplier`` is None and arms the
        budget guard in any case.
      noise_multiplier: z (noise std / C); give this or ``target_epsilon`` (or both).
      max_physical_batch_size: rows per forward/backward pass (memory bound).
      accounting: accountant (name or configured instance) for calibration, the guard and the
        final statement; must apply to the sampler (``"pld"`` or ``"rdp"`` for Poisson,
        ``"random_allocation"`` or ``"monte_carlo"`` for Balls-and-Bins, ``"auto"`` picks the
        tightest that applies).
      monitor_accounting: accountant for the per-epoch "epsilon so far" read from the ledger
        (default: ``accounting``, so the curve ends at the final statement; ``"rdp"`` is
        cheaper but looser). Falls back to ``accounting`` when it does not apply.
      ledger: where releases are recorded (default: a new in-memory ledger).
      randomness: noise source (default: the secure generator, ``Randomness.secure_mode()``;
        pass ``Randomness(seed)`` only for a reproducible experiment, which is not a DP release:
        docs/randomness.md). The ledger records it and the sampler's as ``noise_randomness``
        and ``sampling_randomness``.
      ema_decay: EMA of the weights with this decay (post-processing; warm-up
        ``min(decay, (1 + t) / (10 + t))``); the EMA model is the released one.
      test_data: ``(inputs, targets)`` to report test accuracy after every epoch.
      on_budget: ``"stop"`` (finish cleanly before the refused step) or ``"raise"``.
      callbacks: called with a :class:`ProgressInfo` after each step and epoch.
      progress: show a rich progress bar (loss, accuracy, epsilon spent).
      checkpoint_path: write a checkpoint here after every ``checkpoint_every`` epochs.
      microbatch_size: split physical chunks into passes of this many rows (Ponomareva
        et al. 2023, Alg. 3 option 1: same privacy, less memory).
      validate: run :func:`dpfy.training.validate.validate_module` first.
      device: device of the physical batches (default: the inputs' device).
      collate_fn: collates a list of Dataset items (default ``default_collate``).
      target_key: the targets of a dict batch (default ``"labels"``).
      forward: ``forward(model, inputs) -> outputs`` for inputs the convention of
        :class:`PrivateGradient` does not fit.
      precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` autocast of the forward; clipping, sums
        and noise stay fp32 on fp32 master weights. ``loss_scale``: fixed fp16 loss scale
        (default 2**8). See :mod:`dpfy.training.precision`.
      distributed: this process of a data-parallel run
        (:mod:`dpfy.training.distributed`): rank 0 samples and broadcasts each batch, every
        rank clips its share of each physical chunk (``max_physical_batch_size`` is the
        global chunk, a multiple of the world size), rank 0 records and noises the summed
        release, every rank applies it. Only rank 0's ``ledger`` may be a file; the others
        keep an in-memory mirror. A ``DistributedDataParallel`` model is unwrapped.
      correlated: a :class:`dpfy.correlated.CorrelatedPlan`: DP-FTRL / matrix-factorization
        noise instead of independent noise (:class:`dpfy.queries.correlated.CorrelatedNoiseQuery`;
        the sampler must implement its schema, the whole run is one ``MatrixMechanism``;
        account it with ``"gaussian"`` or ``"auto"``).
      clip_groups: parameter-name prefixes clipped separately (each prefix one group, the
        other trainable parameters one more), at the privacy cost of joint clipping to
        ``clip_norm`` (:func:`dpfy.queries.nested.separate_clipping`); empty: joint clipping. Not
        with ``correlated`` or ``distributed``.
      attribution_check: the attribution check's frequency (``PrivateGradient``'s
        ``attribution.every``: 1, the default, every chunk within its time budget; 0 off).
      clipping: the clip function, ``"flat"`` (``min(1, C / norm)``) or ``"automatic"``
        (``C / (norm + clip_stability)``, Bu et al. 2023: C then only scales the step;
        :mod:`dpfy.queries.clipping`). Automatic only with joint clipping and independent
        noise. ``clip_stability``: its gamma > 0 (default 0.01).

    Example:
        >>> trainer = PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr=1.0),
        ...     nn.CrossEntropyLoss(reduction="none"), x, y,
        ...     PoissonSampler(len(x), 256 / len(x), randomness=Randomness(0)),
        ...     TrainerOptions(clip_norm=1.0, epochs=3, delta=1e-5, target_epsilon=3.0),
        ... )  # doctest: +SKIP
        >>> result = trainer.fit()  # doctest: +SKIP
        >>> result.privacy.epsilon <= 3.0  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        inputs: torch.Tensor | Dataset[Any],
        targets: torch.Tensor | None,
        sampler: Sampler,
        options: TrainerOptions,
    ) -> None:
        o = self.options = options
        distributed, correlated = o.distributed, o.correlated
        self.distributed = distributed
        if distributed is not None:
            model, sampler = unwrap(model), cast("Sampler", SharedSampler(sampler, distributed))
        self.model = model
        self.correlated = correlated
        self.clip_groups = tuple(o.clip_groups)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.inputs = inputs
        self.targets = targets
        self.sampler = sampler
        self.clip_norm = o.clip_norm
        self.epochs = o.epochs
        self.delta = o.delta
        self.target_epsilon = o.target_epsilon
        self.noise_multiplier = o.noise_multiplier
        self.max_physical_batch_size = o.max_physical_batch_size
        self.accounting = o.accounting
        self.monitor_accounting = o.monitor_accounting
        self.ledger = o.ledger if o.ledger is not None else Ledger()
        self.randomness = o.randomness if o.randomness is not None else Randomness.secure_mode()
        self.ema_decay = o.ema_decay
        self.test_data = o.test_data
        self.on_budget = o.on_budget
        self.callbacks = tuple(o.callbacks)
        self.progress = o.progress
        self.checkpoint_path = None if o.checkpoint_path is None else Path(o.checkpoint_path)
        self.checkpoint_every = o.checkpoint_every
        self.microbatch_size = o.microbatch_size
        self.validate = o.validate
        self.device = o.device
        self.collate_fn = o.collate_fn
        self.target_key = o.target_key
        self.forward = o.forward
        self.precision, self.loss_scale = o.precision, o.loss_scale
        # run state (fitted attributes end in "_")
        self.noise_multiplier_: float | None = None
        self.history_ = History()
        self.global_step_ = 0
        self.epoch_ = 0
        self.ema_model_: nn.Module | None = None
        self._ema_updates = 0
        self._ready = False

    # -- setup ------------------------------------------------------------------------------
    def _check_args(self) -> None:
        check_range("clip_norm", self.clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_randomness(self.randomness)
        check_learning_rates(self.optimizer)
        check_int("epochs", self.epochs)
        check_range("delta", self.delta, 0.0, 1.0, low_open=True, high_open=True)
        check_range(
            "max_physical_batch_size", self.max_physical_batch_size, 1, None, integer=True
        )
        check_int("checkpoint_every", self.checkpoint_every)
        check_precision(self.precision)
        if self.loss_scale is not None:
            check_loss_scale(self.loss_scale)
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ValueError(_NEED_TARGET_OR_Z)
        if self.target_epsilon is not None:
            check_range("target_epsilon", self.target_epsilon, 0.0, None, low_open=True)
        if self.noise_multiplier is not None:
            check_range(
                "noise_multiplier", self.noise_multiplier, 0.0, math.inf, low_open=True,
                high_open=True,
            )
        if self.ema_decay is not None:
            check_range("ema_decay", self.ema_decay, 0.0, 1.0, high_open=True)
        if self.on_budget not in ("stop", "raise"):
            raise ValueError(
                f"on_budget must be one of {{stop, raise}}, got on_budget={self.on_budget!r}"
            )
        check_sampler(self.sampler, self.sampler_size(), "sampler")
        check_clipping(self.options.clipping, self.options.clip_stability)
        if self.options.clipping != "flat" and (self.clip_groups or self.correlated is not None):
            raise ValueError(
                f"clipping must be 'flat' with clip_groups or correlated noise (their queries "
                f"clip flat), got clipping={self.options.clipping!r}"
            )
        if self.clip_groups and (self.correlated is not None or self.distributed is not None):
            raise ValueError(
                f"clip_groups must be empty with correlated noise or several processes "
                f"(separate clipping is single-process, independent noise), got "
                f"clip_groups={list(self.clip_groups)}"
            )
        if self.distributed is not None:
            per_process_batch(self.max_physical_batch_size, self.distributed.world_size)
            if not self.distributed.releases:
                check_mirror_ledger(self.ledger, self.distributed.rank)
        if self.ema_decay is not None and is_sharded(self.model):
            raise ValueError(
                f"ema_decay must be None for a model sharded with fully_shard (FSDP2 modules "
                f"cannot be copied for the EMA), got ema_decay={self.ema_decay!r}"
            )

    def sampler_size(self) -> int:
        """Examples in the training data (checked against the sampler's ``dataset_size``)."""
        if isinstance(self.inputs, torch.Tensor):
            if not isinstance(self.targets, torch.Tensor):
                raise TypeError(
                    "targets must be a tensor with tensor inputs (a Dataset carries its own "
                    f"targets), got {type(self.targets).__name__}"
                )
            if len(self.targets) != len(self.inputs):
                raise ValueError(
                    f"inputs and targets must have the same length, got {len(self.inputs)} and "
                    f"{len(self.targets)}"
                )
        else:
            check_dataset(self.inputs, "inputs")
            if self.targets is not None:
                raise ValueError(
                    "targets must be None when inputs is a Dataset (its items carry the "
                    f"targets), got {type(self.targets).__name__}"
                )
        n = len(self.inputs)  # type: ignore[arg-type]
        if n != self.sampler.dataset_size:
            raise ValueError(
                f"the sampler draws from {self.sampler.dataset_size} examples but inputs has "
                f"{n} rows"
            )
        return n

    def calibrate(self) -> float:
        """The noise multiplier of the run: given, or calibrated from the sampler's event."""
        if self.noise_multiplier_ is not None:
            return self.noise_multiplier_
        if self.noise_multiplier is not None:
            self.noise_multiplier_ = float(self.noise_multiplier)
        elif self.target_epsilon is None:
            raise ValueError(_NEED_TARGET_OR_Z)
        else:
            from dpfy.accounting.calibrate import calibrate_noise_multiplier

            epochs = int(self.epochs)
            self.noise_multiplier_ = float(
                calibrate_noise_multiplier(
                    lambda z: self._privacy_event(z, epochs=epochs),
                    float(self.target_epsilon),
                    float(self.delta),
                    self.accounting,
                )
            )
        return self.noise_multiplier_

    def _setup(self) -> None:
        if self._ready:
            return
        self._check_args()
        if self.validate:
            validate_module(self.model)
        dist = self.distributed
        if dist is not None:  # rank 0's initial weights everywhere
            dist.sync_module_(self.model)
        z = self.calibrate()
        from dpfy.queries import GaussianSumQuery
        from dpfy.queries.correlated import correlated_query
        from dpfy.queries.nested import separate_clipping

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.query_: Query = (
            separate_clipping(names, self.clip_groups, self.clip_norm, z) if self.clip_groups
            else GaussianSumQuery(self.clip_norm, z, name="gradient",
                                  clipping=self.options.clipping,
                                  stability=self.options.clip_stability)
            if self.correlated is None
            else correlated_query(self.correlated, self.clip_norm, z, self.sampler.sample_spec(),
                                  self.total_steps, parameters=sum(p.numel() for p in trainable),
                                  device=trainable[0].device if trainable else None)
        )
        self.private_gradient_ = PrivateGradient(
            self.model,
            self.query_,
            expected_batch_size=self.sampler.expected_batch_size,
            microbatch_size=self.microbatch_size,
            forward=self.forward,
            precision=self.precision,
            loss_scale=self.loss_scale,
            reducer=dist,
        )
        self.private_gradient_.attribution.every = self.options.attribution_check
        rows, max_batch = self.max_physical_batch_size, self.sampler.max_batch_size
        if dist is not None:  # this rank's share of every chunk; the wrapper pads the count
            rows, max_batch = per_process_batch(rows, dist.world_size), None
        self.batcher_: Batcher
        if isinstance(self.inputs, torch.Tensor):
            assert isinstance(self.targets, torch.Tensor)  # _check_args
            self.batcher_ = PhysicalBatcher(
                self.inputs,
                self.targets,
                max_physical_batch_size=rows,
                max_batch_size=max_batch,
                device=self.device,
            )
        else:
            self.batcher_ = DatasetBatcher(
                self.inputs,
                max_physical_batch_size=rows,
                max_batch_size=max_batch,
                collate_fn=self.collate_fn,
                device=self.device,
                target_key=self.target_key,
            )
        if dist is not None:
            self.batcher_ = ShardBatcher(
                self.batcher_,
                dist,
                max_physical_batch_size=self.max_physical_batch_size,
                max_batch_size=self.sampler.max_batch_size,
            )
        self.spec_ = self.sampler.sample_spec()
        self.guard_ = (
            BudgetGuard(self.target_epsilon, self.delta, method=self.accounting)
            if self.target_epsilon is not None
            else None
        )
        if self.ema_decay is not None and self.ema_model_ is None:
            self.ema_model_ = copy.deepcopy(self.model).requires_grad_(False)
        self._ready = True

    @property
    def total_steps(self) -> int:
        """Planned logical steps: ``epochs x sampler.steps_per_epoch``."""
        return int(self.epochs) * int(self.sampler.steps_per_epoch)

    def _privacy_event(self, z: float, **count: int | None) -> ev.Event:
        """The sampler's event of ``epochs=`` / ``steps=``, or what a correlated run costs."""
        if self.correlated is None:
            return self.sampler.privacy_event(z, **count)
        from dpfy.queries.correlated import correlated_event

        spec = self.sampler.sample_spec()
        return correlated_event(self.correlated, self.ledger, z, spec, steps=count.get("steps"))

    # -- one step ---------------------------------------------------------------------------
    def _step(self, indices: np.ndarray, epoch: int) -> StepRecord:
        sid = self.ledger.record_sample(self.spec_, epoch=epoch, step=self.global_step_)
        hits: list[torch.Tensor] = []
        correct = 0

        def loss_fn(outputs: Any, targets: Any) -> torch.Tensor:
            if (
                isinstance(outputs, torch.Tensor)
                and outputs.dim() == 2
                and isinstance(targets, torch.Tensor)
                and targets.dim() == 1
                and not targets.is_floating_point()
            ):
                hits.append(outputs.detach().argmax(1) == targets)
            return self.loss_fn(outputs, targets)

        def on_chunk(chunk: Any, stats: Any) -> None:
            nonlocal correct
            if hits:  # the chunk's own loss comes first (the attribution check's follows)
                correct += int((hits[0] & (chunk.weights > 0)).sum())
                hits.clear()

        accumulate_logical_batch(
            self.private_gradient_, self.batcher_, indices, loss_fn, on_chunk=on_chunk
        )
        step = self.private_gradient_.release(
            ledger=self.ledger, sample_id=sid, randomness=self.randomness
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._update_ema()
        if self.distributed is not None:  # the step's totals, as one process would count them
            correct = int(self.distributed.sum_numbers([correct])[0])
        n = step.num_examples
        record = StepRecord(
            step=self.global_step_,
            epoch=epoch,
            batch_size=n,
            loss=step.loss_sum / n if n else math.nan,
            accuracy=correct / n if n else math.nan,
            num_nonfinite=step.num_nonfinite,
        )
        self.global_step_ += 1
        return record

    def _update_ema(self) -> None:
        # _setup makes the EMA model only when ema_decay is set
        if self.ema_model_ is None or self.ema_decay is None:
            return
        t = self._ema_updates
        decay = min(float(self.ema_decay), (1.0 + t) / (10.0 + t))
        with torch.no_grad():
            ema: list[torch.Tensor] = [p for p in self.ema_model_.parameters()]
            cur = [p.detach() for p in self.model.parameters()]
            torch._foreach_lerp_(ema, cur, 1.0 - decay)
            for b_ema, b in zip(self.ema_model_.buffers(), self.model.buffers(), strict=True):
                b_ema.copy_(b)
        self._ema_updates += 1

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: nn.Module | None = None, batch_size: int = 1000) -> float | None:
        """Test accuracy of ``model`` (default: the released model) on ``test_data``."""
        if self.test_data is None:
            return None
        model = model if model is not None else self.released_model
        x, y = self.test_data
        correct = 0
        with evaluating(model):
            for i in range(0, len(x), batch_size):
                xb = x[i : i + batch_size]
                if self.device is not None:
                    xb = xb.to(self.device)
                out = model(xb)
                correct += int((out.argmax(1).cpu() == y[i : i + batch_size]).sum())
        return correct / len(x)

    @property
    def released_model(self) -> nn.Module:
        """The EMA model when EMA is on, else the trained model."""
        return self.ema_model_ if self.ema_model_ is not None else self.model

    def epsilon_spent(self, method: str | None = None) -> float:
        """Ledger epsilon at ``delta`` so far (default: the cheap monitor method)."""
        method = method or self.monitor_accounting or self.accounting
        return spent(self.ledger, self.delta, method, fallback=self.accounting)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self, *, max_steps: int | None = None) -> TrainResult:
        """Train until ``epochs`` are done, the budget guard refuses a step, or ``max_steps``.

        Args:
          max_steps: stop after this many global steps in total (e.g. to interrupt a run and
            resume it from its checkpoint later).

        Returns:
          :class:`TrainResult` with the final privacy statement from the ledger.

        Raises:
          BudgetExceededError: with ``on_budget="raise"``, before a refused step.
          dpfy.training.validate.UnsupportedModuleError: the model has non-private layers.
        """
        self._setup()
        start = time.perf_counter()
        z = self.calibrate()  # set by _setup: a float from here on
        spe = int(self.sampler.steps_per_epoch)
        stopped = "completed"
        if self.global_step_ == 0:  # also after earlier records (LP-FT's probe): its own facts
            warn_eval_mode(self.model)  # then the labels, before the first line is written
            if self.distributed is None:  # a lone forward would stall a sharded model
                check_tensor_labels(
                    self.model, self.loss_fn, self.inputs, self.targets, self.device
                )
            self.ledger.record_metadata(**self._run_facts())
        bar = _ProgressBar(self.total_steps, self.global_step_) if self.progress else None
        try:
            while self.epoch_ < int(self.epochs):
                epoch = self.epoch_
                done = self.global_step_ - epoch * spe
                todo = spe - done
                if max_steps is not None:
                    todo = min(todo, max_steps - self.global_step_)
                    if todo <= 0:
                        stopped = "max_steps"
                        break
                allowed = todo
                guard = self.guard_
                if guard is not None:
                    allowed = guard.allowed_steps(
                        self.ledger, lambda k: self._privacy_event(z, steps=k), todo
                    )
                losses = []
                for indices in _take(self.sampler.batches(epoch), allowed):
                    rec = self._step(indices, epoch)
                    self.history_.steps.append(rec)
                    losses.append(rec.loss)
                    self._notify(rec, None, bar)
                if guard is not None and allowed < todo:  # only the guard refuses steps
                    stopped = "budget"
                    message = guard._message(
                        self.ledger,
                        guard.epsilon_after(
                            self.ledger, self._privacy_event(z, steps=1)
                        ),
                    )
                    self._end_epoch(epoch, losses, start, bar, partial=True)
                    if self.on_budget == "raise":
                        raise BudgetExceededError(message)
                    warnings.warn(message, stacklevel=2)
                    break
                if self.global_step_ - epoch * spe < spe:  # max_steps inside the epoch
                    stopped = "max_steps"
                    break
                self.epoch_ += 1
                self._end_epoch(epoch, losses, start, bar, partial=False)
        finally:
            if bar is not None:
                bar.close()
        if stopped == "max_steps" and self.checkpoint_path is not None:
            self.save_checkpoint(self.checkpoint_path)
        privacy = statement(self.ledger, self.delta, self.accounting)
        return TrainResult(
            model=self.released_model,
            ledger=self.ledger,
            privacy=privacy,
            history=self.history_,
            noise_multiplier=float(z),
            steps=self.global_step_,
            stopped=stopped,
            seconds=time.perf_counter() - start,
            trained_model=self.model,
        )

    def _end_epoch(
        self,
        epoch: int,
        losses: list[float],
        start: float,
        bar: _ProgressBar | None,
        *,
        partial: bool,
    ) -> None:
        finite = [v for v in losses if not math.isnan(v)]
        test_acc = self.evaluate()
        model_acc = self.evaluate(self.model) if self.ema_model_ is not None else None
        record = EpochRecord(
            epoch=epoch,
            steps=self.global_step_,
            train_loss=float(np.mean(finite)) if finite else math.nan,
            test_accuracy=test_acc,
            model_test_accuracy=model_acc,
            epsilon=self.epsilon_spent(),
            seconds=time.perf_counter() - start,
        )
        self.history_.epochs.append(record)
        self._notify(record, test_acc, bar)
        if (
            not partial
            and self.checkpoint_path is not None
            and (self.epoch_ % int(self.checkpoint_every) == 0 or self.epoch_ == int(self.epochs))
        ):
            self.save_checkpoint(self.checkpoint_path)

    def _notify(
        self,
        record: StepRecord | EpochRecord,
        test_acc: float | None,
        bar: _ProgressBar | None,
    ) -> None:
        last_epoch = self.history_.epochs[-1] if self.history_.epochs else None
        kind: Literal["step", "epoch"]
        if isinstance(record, StepRecord):
            kind, loss, accuracy = "step", record.loss, record.accuracy
        else:
            kind, loss, accuracy = "epoch", record.train_loss, math.nan
        info = ProgressInfo(
            kind=kind,
            epoch=record.epoch,
            step=self.global_step_,
            total_steps=self.total_steps,
            loss=loss,
            accuracy=accuracy,
            epsilon=last_epoch.epsilon if last_epoch is not None else None,
            test_accuracy=last_epoch.test_accuracy if last_epoch is not None else test_acc,
        )
        if bar is not None:
            bar.update(info)
        for cb in self.callbacks:
            cb(info)

    def _run_facts(self) -> dict[str, Any]:
        return {
            "trainer": "dpfy.training.PrivateTrainer",
            "noise_multiplier": self.calibrate(),  # already calibrated: the cached value
            "clip_norm": float(self.clip_norm),
            "clip_function": describe_clipping(self.options.clipping, self.options.clip_stability),
            "epochs": int(self.epochs),
            "steps_per_epoch": int(self.sampler.steps_per_epoch),
            "expected_batch_size": float(self.sampler.expected_batch_size),
            "max_physical_batch_size": int(self.max_physical_batch_size),
            "sampler": repr(self.sampler),
            "target_epsilon": self.target_epsilon,
            "target_delta": float(self.delta),
            "accounting": getattr(self.accounting, "name", self.accounting),
            "optimizer": type(self.optimizer).__name__,
            "ema_decay": self.ema_decay,
            "secure_randomness": bool(self.randomness.secure),
            "sampling_randomness": _describe(getattr(self.sampler, "randomness", None)),
            "noise_randomness": self.randomness.describe(),
            "calibrated": self.noise_multiplier is None,
            "precision": self.precision,
            "mechanism": "dpsgd" if self.correlated is None else self.correlated.strategy,
            "layer_types": list(layer_type_names(p.module for p in self.private_gradient_.plans_)),
        } | ({} if self.distributed is None else {"workers": self.distributed.world_size}) | (
            {"sharded": True} if self.distributed is not None and is_sharded(self.model) else {}
        )

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (see :mod:`dpfy.training.checkpoint`)."""
        self._setup()
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "randomness": None if self.randomness.secure else self.randomness.state_dict(),
            "randomness_mode": self._randomness_modes(),
            "torch_rng": torch.get_rng_state(),
            "ledger": ckpt.ledger_state(self.ledger),
            "noise_multiplier": self.noise_multiplier_,
            "global_step": self.global_step_,
            "epoch": self.epoch_,
            "history": self.history_.to_dict(),
            "ema": None if self.ema_model_ is None else self.ema_model_.state_dict(),
            "ema_updates": self._ema_updates,
            "query": self.query_.state_dict() if hasattr(self.query_, "state_dict") else None,
            "hyperparameters": self._resume_facts(),
        }
        return state

    def _resume_facts(self) -> dict[str, Any]:
        """What a resumed run must keep (or, the budget, change explicitly): resume.py."""
        return run_hyperparameters(
            target_epsilon=self.target_epsilon, clip_norm=self.clip_norm, delta=self.delta,
            epochs=self.epochs, expected_batch_size=self.sampler.expected_batch_size,
            microbatch_size=self.microbatch_size, accounting=self.accounting,
        )

    def _randomness_modes(self) -> dict[str, str]:
        return {
            "noise": ckpt.randomness_mode(self.randomness),
            "sampling": ckpt.randomness_mode(getattr(self.sampler, "randomness", None)),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, ledger_moved: bool = False, raise_budget: bool = False
    ) -> None:
        """Restore :meth:`state_dict` into a trainer built with the same arguments.

        Another clip norm, delta, epochs, batch size, microbatch size or accountant is refused;
        another target epsilon only without ``raise_budget`` (with it, the ledger records the
        raised budget: :mod:`dpfy.training.resume`).

        The ledger must be the same file (``Ledger(path)``: same run identifier and path, not
        behind the checkpoint nor forked from it; ``ledger_moved=True`` accepts it under
        another path) or, for an in-memory ledger, a new empty one (the checkpoint replays its
        entries). A run that used secure randomness is not resumed with seeded randomness.
        See :mod:`dpfy.training.checkpoint`.
        """
        if self.global_step_ or (self.ledger.iteration and self.ledger.path is None):
            raise ckpt.CheckpointMismatchError("load a checkpoint into a fresh trainer")
        raised = check_resume(state.get("hyperparameters"), self._resume_facts(),
                              raise_budget=raise_budget, step=int(state["global_step"]))
        ckpt.check_randomness_modes(state.get("randomness_mode"), self._randomness_modes())
        ckpt.restore_ledger(self.ledger, state["ledger"], allow_moved=ledger_moved)
        if raised is not None:
            self.ledger.record_metadata(**raised)
        self.noise_multiplier_ = float(state["noise_multiplier"])
        if self.noise_multiplier is not None and not math.isclose(
            self.noise_multiplier_, float(self.noise_multiplier), rel_tol=1e-12
        ):
            raise ckpt.CheckpointMismatchError(
                f"the checkpoint used noise_multiplier={self.noise_multiplier_!r}, this trainer "
                f"noise_multiplier={self.noise_multiplier!r}"
            )
        self._setup()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        if state["randomness"] is not None and not self.randomness.secure:
            self.randomness.load_state_dict(state["randomness"])
        torch.set_rng_state(state["torch_rng"])
        self.global_step_ = int(state["global_step"])
        self.epoch_ = int(state["epoch"])
        self.history_ = History.from_dict(state["history"])
        if state["ema"] is not None:
            if self.ema_model_ is None:
                raise ckpt.CheckpointMismatchError("the checkpoint has EMA weights; set ema_decay")
            self.ema_model_.load_state_dict(state["ema"])
        self._ema_updates = int(state["ema_updates"])
        if state.get("query") is not None and hasattr(self.query_, "load_state_dict"):
            self.query_.load_state_dict(state["query"])

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` atomically to ``path``."""
        return ckpt.save_checkpoint(path, self.state_dict())

    def resume(
        self, path: str | Path, *, ledger_moved: bool = False, raise_budget: bool = False
    ) -> PrivateTrainer:
        """Load the checkpoint at ``path`` (see :meth:`load_state_dict`); returns ``self``."""
        self.load_state_dict(
            ckpt.load_checkpoint(path), ledger_moved=ledger_moved, raise_budget=raise_budget
        )
        return self


def _describe(randomness: Any) -> str:
    """``Randomness.describe()`` of a sampler's source, or why there is none to describe."""
    if isinstance(randomness, Randomness):
        return randomness.describe()
    return "not recorded (the sampler holds no dpfy Randomness)"


def _take(iterator: Iterable[_T], n: int) -> Iterator[_T]:
    """The first ``n`` items, without drawing the (n+1)-th from the sampler."""
    if n <= 0:
        return
    for i, item in enumerate(iterator):
        yield item
        if i + 1 >= n:
            return


class _ProgressBar:
    """The run's progress: a rich bar on a terminal, else a plain line about every 30 s
    (:mod:`dpfy.training.progress`); loss, batch accuracy, test accuracy, epsilon spent."""

    def __init__(self, total: int, completed: int) -> None:
        from dpfy.training.progress import progress_display

        self._display = progress_display(
            "DP-SGD", total, completed, fields=("loss", "acc", "test", "eps")
        )

    def update(self, info: ProgressInfo) -> None:
        fields: dict[str, str] = {}
        if not math.isnan(info.loss):
            fields["loss"] = f"{info.loss:.3f}"
        if not math.isnan(info.accuracy):
            fields["acc"] = f"{info.accuracy:.3f}"
        if info.test_accuracy is not None:
            fields["test"] = f"{info.test_accuracy:.4f}"
        if info.epsilon is not None:
            fields["eps"] = f"{info.epsilon:.3f}"
        self._display.update(info.step, info.epoch, **fields)

    def close(self) -> None:
        self._display.close()

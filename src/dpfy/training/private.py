"""``make_private``: DP-SGD in the user's own loop, for people coming from Opacus.

:func:`make_private` (compare Opacus 1.6, ``PrivacyEngine.make_private_with_epsilon`` with
ghost clipping) checks everything, calibrates the noise multiplier from the *sampler's* event
and arms the budget guard, then returns ``(model, optimizer, criterion, loader)``:

* ``model`` is the user's model, untouched: same class, ``state_dict`` keys, ``generate()``,
  ``save_pretrained()``. Forward hooks exist only between the loader handing out a physical
  batch and ``loss.backward()`` of that batch (``PrivateGradient.open_chunk``).
* ``loader`` yields fixed-shape physical batches (the collated items, a tensor, tuple or dict)
  of the dpfy sampler's logical batches, padded with weight-0 rows
  (:mod:`dpfy.training.loader`); one ``for`` over it is one epoch, and at most ``epochs``
  epochs run (the noise was calibrated to them): starting one more raises
  :class:`~dpfy.training.budget.BudgetExceededError`, never an empty epoch. The sample record
  of a logical batch is written to the ledger at its first ``loss.backward()``, so a batch
  looked at and dropped (``next(iter(loader))``) leaves no trace and uses up no epoch.
* ``criterion(outputs, targets)`` computes the per-example losses with ``loss_fn`` and
  returns a :class:`PrivateLoss`; its ``backward()`` adds the clipped per-example gradients
  of the real rows to the accumulator (padding rows have weight 0). It does not write
  ``p.grad``.
* ``optimizer.step()`` after the *last* physical batch of a logical batch releases: the
  Gaussian query writes its ledger entry first, noise goes on every trainable parameter, the
  sum is divided by the expected batch size (``docs/architecture.md``, 5.11), then the user's
  optimizer steps. After any other physical batch it does nothing (gradient accumulation over
  virtual batches: one release per logical batch, as Opacus' ``BatchMemoryManager``).

``optimizer.epsilon()`` (and ``.ledger``) read the ledger at any time; the guard ends an
epoch before a step that would pass ``target_epsilon`` (``on_budget="stop"``: the epoch ends
there with a warning, a clean stop, and the next epoch raises; ``"raise"``:
:class:`~dpfy.training.budget.BudgetExceededError` in place of the refused step).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpfy._validate import check_int, check_range
from dpfy.ledger import Ledger
from dpfy.queries.clipping import (
    DEFAULT_STABILITY,
    ClippingMode,
    check_clipping,
    describe_clipping,
)
from dpfy.randomness import Randomness
from dpfy.training.budget import BudgetExceededError, BudgetGuard, spent
from dpfy.training.chunk import OpenChunk
from dpfy.training.closing import LedgerCloser
from dpfy.training.distributed import (
    Distributed,
    SharedSampler,
    check_mirror_ledger,
    per_process_batch,
)
from dpfy.training.keys import key_facts
from dpfy.training.loader import (
    ChunkInfo,
    PrivateBatchSampler,
    RowsDataset,
    _to,
    check_dataset,
    check_sampler,
    collated,
)
from dpfy.training.norms.attribution import DEFAULT_BUDGET, DEFAULT_EVERY
from dpfy.training.norms.registry import layer_type_names
from dpfy.training.precision import (
    Precision,
    check_loss_scale,
    check_master_weights,
    check_precision,
)
from dpfy.training.private_loss import PrivateLoss
from dpfy.training.step import PrivateGradient, StepStats
from dpfy.training.user_inputs import (
    check_class_labels,
    check_learning_rates,
    check_randomness,
    warn_eval_mode,
)
from dpfy.training.validate import validate_module

OnBudget = Literal["stop", "raise"]


class Private(NamedTuple):
    """What :func:`make_private` returns; unpacks as ``model, optimizer, criterion, loader``."""

    model: nn.Module
    optimizer: PrivateOptimizer
    criterion: PrivateCriterion
    loader: PrivateLoader

    @property
    def ledger(self) -> Ledger:
        return self.optimizer.ledger

    @property
    def noise_multiplier(self) -> float:
        return self.optimizer.noise_multiplier

    def epsilon(self, delta: float | None = None, method: str | None = None) -> float:
        """Epsilon spent so far, read from the ledger (see :meth:`PrivateOptimizer.epsilon`)."""
        return self.optimizer.epsilon(delta, method)

    def autocast(self) -> Any:
        """The forward's ``torch.autocast`` context for ``precision`` (see the optimizer's)."""
        return self.optimizer.autocast()


class _Engine:
    """State shared by the loader, the criterion and the optimizer of one private run."""

    def __init__(
        self,
        *,
        private_gradient: PrivateGradient,
        sampler: Any,
        ledger: Ledger,
        randomness: Randomness,
        noise_multiplier: float,
        guard: BudgetGuard | None,
        epochs: int | None,
        delta: float | None,
        accounting: str,
        on_budget: OnBudget,
        facts: dict[str, Any],
    ) -> None:
        self.pg = private_gradient
        self.sampler = sampler
        self.spec = sampler.sample_spec()
        self.ledger = ledger
        self.randomness = randomness
        self.z = noise_multiplier
        self.guard = guard
        self.epochs = epochs
        self.delta = delta
        self.accounting = accounting
        self.on_budget = on_budget
        self.facts = facts
        planned = None if epochs is None else int(epochs) * int(sampler.steps_per_epoch)
        # at the plan's end, on request, at exit; recording the epsilon this process accounts
        self.closer = LedgerCloser(ledger, planned, delta=delta, method=accounting)
        self.closer.watch(self)  # and when the run's objects are released
        self.epoch = 0
        self.steps = 0
        self.info: ChunkInfo | None = None
        self.weights: torch.Tensor | None = None
        self.chunk: OpenChunk | None = None
        self.sample_id: int | None = None
        self.backwards = 0
        self.released = False
        self.last_stats: StepStats | None = None
        self._epoch_start: dict[str, Any] | None = None

    # -- loader side ------------------------------------------------------------------------
    def allowed_steps(self) -> int:
        spe = int(self.sampler.steps_per_epoch)
        if self.guard is None:
            return spe
        return self.guard.allowed_steps(
            self.ledger, lambda k: self.sampler.privacy_event(self.z, steps=k), spe
        )

    def begin_epoch(self) -> tuple[int, int]:
        """(epoch, logical batches it may run); past the plan or the budget: an error."""
        if self.epochs is not None and self.epoch >= self.epochs:
            raise BudgetExceededError(
                f"the private loader was planned for epochs={self.epochs} (the noise multiplier "
                f"{self.z:.4g} was calibrated to them) and all of them have run; epoch "
                f"{self.epoch + 1} would release more than planned. Stop the loop after "
                f"{self.epochs} epochs, or plan more epochs in make_private"
            )
        allowed = self.allowed_steps()
        if allowed == 0:  # the budget is spent: an error, never an empty epoch
            raise BudgetExceededError(self.budget_message())
        epoch = self.epoch
        self.epoch += 1
        self._epoch_start = self.sampler.state_dict()  # where the sampler stands: see abandon
        return epoch, allowed

    def abandon(self, epoch: int, steps_before: int) -> None:
        """An iteration ended early (``break``, or a batch looked at with ``next(iter(...))``).

        The logical batch in hand is dropped when nothing of it was backpropagated (nothing
        of it is in the ledger); an iteration that released nothing gives its epoch back, and
        the sampler returns to the start of that epoch (a seeded one draws the same batches
        again; nothing drawn and dropped was released).
        """
        self.close_chunk()
        if self.sample_id is None:
            self.info = None
            if self.steps == steps_before and self.epoch == epoch + 1:
                self.epoch = epoch
                if self._epoch_start is not None:
                    self.sampler.load_state_dict(self._epoch_start)

    def start_chunk(self, info: ChunkInfo, device: torch.device | None) -> None:
        self.close_chunk()
        if info.chunk == 0:
            if self.sample_id is not None:
                raise RuntimeError(
                    "the previous logical batch was never released: call optimizer.step() "
                    "after loss.backward() of every physical batch"
                )
            self.backwards = 0
            self.released = False
        self.info = info
        self.weights = info.weights(device)
        # the physical batch's row count (padding rows included): a layer called once on a
        # batch-1 input broadcast over the batch (position ids [1, T]) is then recorded per row
        self.chunk = self.pg.open_chunk(batch_size=len(self.weights))

    def close_chunk(self) -> None:
        if self.chunk is not None:
            self.chunk.close()
            self.chunk = None

    def budget_message(self) -> str:
        assert self.guard is not None
        eps = self.guard.epsilon_after(self.ledger, self.sampler.privacy_event(self.z, steps=1))
        return self.guard._message(self.ledger, eps)

    # -- criterion and optimizer side -------------------------------------------------------
    def backward(self, losses: torch.Tensor) -> None:
        if self.chunk is None or not self.chunk.open:
            raise RuntimeError(
                "loss.backward() needs a physical batch from the private loader that has not "
                "been backpropagated yet (one backward per batch)"
            )
        chunk, self.chunk = self.chunk, None
        if self.sample_id is None:  # the batch is used: its sample record goes first
            info = self.info
            assert info is not None
            if self.ledger.iteration == 0 and self.steps == 0:
                self.ledger.record_metadata(**self.facts)
            self.sample_id = self.ledger.record_sample(self.spec, epoch=info.epoch, step=self.steps)
        chunk.accumulate(losses, self.weights)
        self.backwards += 1

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        info = self.info
        if info is None:
            raise RuntimeError("optimizer.step() before the first batch of the private loader")
        if not info.last:
            return False  # inside a logical batch: keep accumulating
        if self.released:
            raise RuntimeError("optimizer.step() was already called for this logical batch")
        if self.backwards != info.num_chunks or self.sample_id is None:
            raise RuntimeError(
                f"optimizer.step() after loss.backward() of {self.backwards} of the "
                f"{info.num_chunks} physical batches of this logical batch: call the private "
                "criterion and backward() on every batch the loader yields"
            )
        self.close_chunk()
        self.last_stats = self.pg.release(
            ledger=self.ledger, sample_id=self.sample_id, randomness=self.randomness
        )
        self.sample_id = None
        self.released = True
        optimizer.step()
        self.steps += 1
        return True


class PrivateLoader:
    """Physical batches of the dpfy sampler's logical batches (see the module docstring).

    Built by :func:`make_private`; each ``for`` over it is the next epoch, up to the planned
    ``epochs`` (one more raises :class:`~dpfy.training.budget.BudgetExceededError`). ``len()``
    is the number of logical batches per epoch. ``num_workers > 0`` reads rows in worker
    processes (the sampler and its randomness stay in this process).

    An iteration left early costs nothing it did not use: ``next(iter(loader))`` hands out a
    batch (for a look at its shapes) whose hooks and ledger record vanish with the iterator,
    and the epoch is not used up; a new ``iter()`` first ends any earlier iteration still
    suspended.
    """

    def __init__(
        self,
        engine: _Engine,
        dataset: Any,
        *,
        collate_fn: Callable[[list[Any]], Any] | None,
        max_physical_batch_size: int | None,
        num_workers: int,
        device: torch.device | None,
        loader_kwargs: dict[str, Any],
    ) -> None:
        self._engine = engine
        self.dataset = dataset
        self.batch_sampler = PrivateBatchSampler(
            engine.sampler, max_physical_batch_size=max_physical_batch_size
        )
        self.device = device
        self._loader = DataLoader(
            RowsDataset(dataset, collate_fn),
            batch_sampler=self.batch_sampler,
            collate_fn=collated,
            num_workers=num_workers,
            **loader_kwargs,
        )
        self._live: weakref.ref[Generator[Any, None, None]] | None = None

    @property
    def sampler(self) -> Any:
        return self._engine.sampler

    @property
    def max_physical_batch_size(self) -> int | None:
        """Rows per physical batch (None: one physical batch per logical batch)."""
        return self.batch_sampler.max_physical_batch_size

    @max_physical_batch_size.setter
    def max_physical_batch_size(self, value: int | None) -> None:
        """Change the physical batch size between epochs (privacy is unchanged: one release
        per logical batch whatever its cut)."""
        if value is not None:
            check_range("max_physical_batch_size", value, 1, None, integer=True)
        live = self._live() if self._live is not None else None
        started = (inspect.GEN_SUSPENDED, inspect.GEN_RUNNING)
        if live is not None and inspect.getgeneratorstate(live) in started:
            raise RuntimeError(
                "max_physical_batch_size can change between epochs only, got a change while "
                "an iteration over the loader is under way"
            )
        self.batch_sampler.max_physical_batch_size = None if value is None else int(value)
        self._engine.facts["max_physical_batch_size"] = self.batch_sampler.max_physical_batch_size

    def __len__(self) -> int:
        return int(self._engine.sampler.steps_per_epoch)

    def __iter__(self) -> Iterator[Any]:
        live = self._live() if self._live is not None else None
        if live is not None:
            live.close()  # an earlier iteration left suspended
        batches = self._epoch()
        self._live = weakref.ref(batches)
        return batches

    def _epoch(self) -> Generator[Any, None, None]:
        engine = self._engine
        epoch, allowed = engine.begin_epoch()
        self.batch_sampler.begin(epoch, allowed)
        steps_before, finished = engine.steps, False
        try:
            for batch in self._loader:
                engine.start_chunk(self.batch_sampler.infos.popleft(), self.device)
                yield _to(batch, self.device)
            finished = True
        finally:
            engine.close_chunk()
            if not finished:
                engine.abandon(epoch, steps_before)
        if engine.sample_id is None and engine.closer.done():
            engine.closer.close("planned epochs done")  # a later release resumes the file
        if allowed < int(engine.sampler.steps_per_epoch):
            message = engine.budget_message()
            if engine.on_budget == "raise":
                raise BudgetExceededError(message)
            warnings.warn(message, stacklevel=2)


class PrivateCriterion:
    """``criterion(outputs, targets) -> PrivateLoss`` for the current physical batch."""

    def __init__(self, engine: _Engine, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self._engine = engine
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, targets: Any) -> PrivateLoss:
        engine = self._engine
        if engine.chunk is None or engine.weights is None:
            raise RuntimeError(
                "the private criterion works on the outputs of a batch from the private "
                "loader (its hooks record the forward pass); iterate over the loader that "
                "make_private returned"
            )
        if engine.steps == 0 and engine.sample_id is None:  # the first batch, nothing written
            check_class_labels(self.loss_fn, outputs, targets)
        losses = self.loss_fn(outputs, targets)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError(
                "loss_fn must return per-example losses of shape [B] (reduction='none'), got "
                f"{getattr(losses, 'shape', type(losses))}"
            )
        return PrivateLoss(engine, losses, engine.weights, (self.loss_fn, targets))


class PrivateOptimizer(torch.optim.Optimizer):
    """The user's optimizer whose ``step()`` releases privately (see the module docstring).

    Shares ``param_groups``, ``state`` and ``defaults`` with the wrapped optimizer (learning
    rate schedulers work on either); ``zero_grad``, ``state_dict`` and ``load_state_dict``
    delegate to it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: _Engine) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.original_optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._engine = engine

    @property
    def ledger(self) -> Ledger:
        """The run's ledger (every sample and noisy release, written before it happens)."""
        return self._engine.ledger

    @property
    def noise_multiplier(self) -> float:
        return self._engine.z

    @property
    def steps(self) -> int:
        """Logical batches released so far (this session)."""
        return self._engine.steps

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the latest release (not private: monitoring)."""
        return self._engine.last_stats

    def epsilon(self, delta: float | None = None, method: str | None = None) -> float:
        """Epsilon the ledger has spent so far at ``delta`` (default: the target delta)."""
        engine = self._engine
        d = engine.delta if delta is None else delta
        if d is None:
            raise ValueError(
                "delta must be given: make_private had no target delta, got delta=None"
            )
        return spent(engine.ledger, d, method or engine.accounting)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Release at the end of a logical batch (then the wrapped optimizer steps)."""
        if closure is not None:
            raise ValueError(
                "closure must be None: the private loss is computed from the loader's batches"
            )
        self._engine.step(self.original_optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def close_ledger(self, how: str = "closed by the script", *,
                     delta: float | None = None) -> None:
        """Close the run's ledger now: its end record says whether every planned release was
        made (:mod:`dpfy.training.closing`; it closes itself when the planned epochs are done
        and at interpreter exit). A later release reopens it with a resume marker. The
        epsilon this process accounts is recorded first, at the run's delta (or ``delta``)."""
        self._engine.closer.close(how, delta=delta)

    def autocast(self) -> Any:
        """``with optimizer.autocast(): loss = criterion(model(x), y)``: the forward in the
        ``precision`` given to :func:`make_private` (``torch.autocast``; fp32: a no-op). The
        fp16 loss scale is applied inside ``loss.backward()`` and divided out before clipping.
        """
        return self._engine.pg.autocast()

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"PrivateOptimizer({type(self.original_optimizer).__name__}, "
            f"noise_multiplier={self._engine.z:.4g})"
        )


def _per_example(loss_fn: Any) -> Callable[[Any, Any], torch.Tensor]:
    """A loss with ``reduction="none"`` (a copy of an ``nn`` loss; a function as given)."""
    if loss_fn is None:
        return nn.CrossEntropyLoss(reduction="none")
    if isinstance(loss_fn, nn.Module) and hasattr(loss_fn, "reduction"):
        per_example = copy.copy(loss_fn)
        per_example.reduction = "none"  # type: ignore[assignment]
        return per_example
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable (outputs, targets) -> Tensor[B], got {loss_fn!r}"
        )
    return loss_fn  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrivateOptions:
    """The less common options of :func:`make_private` (one record; all have defaults).

    Attributes:
      max_physical_batch_size: rows per physical batch (virtual batches: one release per
        logical batch). Default: one physical batch per logical batch.
      max_batch_size: truncate logical batches to this size (fixed work per step; the extra
        delta enters every epsilon, ``docs/architecture.md`` 5.10).
      collate_fn: collates a list of items (default ``default_collate``).
      ledger: where samples and releases are recorded (default: a new in-memory ledger).
      accounting: accountant for calibration, the guard and ``epsilon()`` (default: the
        sampler kind's ``default_accountant``).
      num_workers: DataLoader worker processes reading rows.
      device: where batches go (default: as collated).
      on_budget: ``"stop"`` (end the epoch with a warning) or ``"raise"``.
      validate: check the model's layers first.
      loader_kwargs: extra ``DataLoader`` arguments (``pin_memory``, ``prefetch_factor``...).
      precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: run the forward inside
        ``optimizer.autocast()``; norms, clipping, the clipped sum and the noise stay fp32 and
        the parameters must be fp32 master weights (:mod:`dpfy.training.precision`).
      loss_scale: fixed fp16 loss scale (default 2**8; a dynamic ``GradScaler`` would adapt
        to a data-dependent overflow bit the noise does not cover, so none is used).
      noise_multiplier: use this noise multiplier z >= 0 instead of calibrating one; then
        ``target_epsilon`` only arms the budget guard and may be None (no guard), and
        ``epochs`` may be None (no planned end). z = 0 releases without noise and the ledger
        says epsilon = infinity (debugging only).
      attribution_check: check every n-th physical batch that one random example's gradient
        computed alone matches what the per-example rules recorded for it (1, the default:
        every batch within ``attribution_budget``; 0: never;
        :mod:`dpfy.training.norms.attribution`).
      attribution_budget: the share of the engine's time (backward, norms, clipping) the
        attribution check may take (default 0.05: a batch is skipped while the checks so far
        took more; the first is always checked); ``None``: every n-th batch whatever it costs.
      clipping: the clip function, ``"flat"`` (``min(1, C / norm)``, the default) or
        ``"automatic"`` (``C / (norm + clip_stability)``, Bu et al. 2023): every example's
        gradient normalised, so ``clip_norm`` only scales the step (set it to 1 and tune the
        learning rate); the privacy is the same (:mod:`dpfy.queries.clipping`).
      clip_stability: gamma > 0 of automatic clipping, in gradient-norm units (default 0.01).
      distributed: this process of a data-parallel run (:mod:`dpfy.training.distributed`,
        docs/architecture.md 5.18): rank 0 draws each logical batch and broadcasts it, each
        rank takes its part of every physical batch (``PrivateBatchSampler.shard``), the
        clipped sums are all-reduced, and rank 0 alone writes the ledger and draws the noise;
        the other ranks keep an in-memory mirror ledger (``ledger`` must be None or in
        memory there). Rank 0's weights are broadcast to every rank here.
    """

    max_physical_batch_size: int | None = None
    max_batch_size: int | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    ledger: Ledger | None = None
    accounting: str | None = None
    num_workers: int = 0
    device: torch.device | str | None = None
    on_budget: OnBudget = "stop"
    validate: bool = True
    loader_kwargs: dict[str, Any] | None = None
    precision: Precision = "fp32"
    loss_scale: float | None = None
    noise_multiplier: float | None = None
    attribution_check: int = DEFAULT_EVERY
    attribution_budget: float | None = DEFAULT_BUDGET
    clipping: ClippingMode = "flat"
    clip_stability: float = DEFAULT_STABILITY
    distributed: Distributed | None = None


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    target_epsilon: float | None,
    delta: float | None,
    epochs: int | None,
    clip_norm: float,
    expected_batch_size: int | None = None,
    sampler: Any = "poisson",
    loss_fn: Any = None,
    randomness: Randomness | None = None,
    options: PrivateOptions | None = None,
) -> Private:
    """Make ``model``/``optimizer`` private on ``data``: ``(model, optimizer, criterion, loader)``.

    Everything is checked, and the noise multiplier calibrated, before anything is written:
    a refused argument leaves the ledger untouched.

    Args:
      model: the model; validated (layers that mix examples are refused), never wrapped.
      optimizer: a ``torch.optim`` optimizer over trainable parameters of ``model``.
      data: a map-style ``torch.utils.data.Dataset`` (items: tensors, tuples, dicts); one
        item is the unit of privacy. Not a ``DataLoader`` nor an ``IterableDataset``.
      target_epsilon: budget; the noise multiplier is calibrated to it over ``epochs`` and the
        budget guard refuses any step past it. None only with
        ``options.noise_multiplier`` (then no guard).
      delta: target delta in (0, 1); None only without ``target_epsilon``.
      epochs: planned epochs (passes over the loader); one more is an error. None only with
        ``options.noise_multiplier`` (then no planned end).
      clip_norm: L2 clip norm C of each example's gradient (Opacus' ``max_grad_norm``).
      expected_batch_size: (expected) logical batch size B (Poisson: q = B / N); needed when
        ``sampler`` is a kind name.
      sampler: a kind name (``"poisson"``, ``"balls_and_bins"``, ``"shuffle"``, ...) or a
        :mod:`dpfy.sampling` sampler over ``len(data)`` examples.
      loss_fn: per-example loss ``loss_fn(outputs, targets) -> Tensor[B]``; an ``nn`` loss
        with a ``reduction`` is used with ``reduction="none"``. Default: cross-entropy.
      randomness: noise randomness, and the seed of the sampler's own stream when ``sampler``
        is a kind name. Default: ``Randomness.secure_mode()``; pass ``Randomness(seed)`` for a
        reproducible experiment.
      options: the rest (:class:`PrivateOptions`: physical batch size, truncation, collate,
        ledger, accountant, loader workers and arguments, device, budget behaviour, layer
        validation, precision and loss scale).

    Raises:
      TypeError, ValueError: a bad argument, named in the message.
      dpfy.training.validate.UnsupportedModuleError: layers that are not private.
    """
    from dpfy.sampling.kinds import kind as sampler_kind

    o = PrivateOptions() if options is None else options
    _check_numbers(target_epsilon, delta, epochs, clip_norm, o)
    max_physical_batch_size = o.max_physical_batch_size
    collate_fn, ledger, accounting = o.collate_fn, o.ledger, o.accounting
    num_workers, device, on_budget, validate = o.num_workers, o.device, o.on_budget, o.validate
    loader_kwargs, precision, loss_scale = o.loader_kwargs, o.precision, o.loss_scale
    given_z = o.noise_multiplier
    _check_model_and_optimizer(model, optimizer)
    check_dataset(data, "data")
    check_randomness(randomness)
    rng = randomness if randomness is not None else Randomness.secure_mode()
    sampler = _the_sampler(sampler, data, expected_batch_size, o.max_batch_size, rng)
    d = _check_distributed(o.distributed, ledger, max_physical_batch_size)
    per_example = _per_example(loss_fn)
    if validate:
        validate_module(model)
    warn_eval_mode(model)
    method = accounting or sampler_kind(sampler.sample_spec().sampler).default_accountant
    if given_z is None:
        assert target_epsilon is not None and delta is not None and epochs is not None
        z = calibrate_to_budget(
            sampler, float(target_epsilon), float(delta), method, epochs=int(epochs)
        )
    else:
        z = float(given_z)
    guard = (
        BudgetGuard(target_epsilon, delta, method=method)
        if target_epsilon is not None and delta is not None and z > 0
        else None
    )
    from dpfy.queries import GaussianSumQuery
    from dpfy.queries.sum import NoPrivacyQuery

    mode, gamma = o.clipping, o.clip_stability
    pg = PrivateGradient(
        model,
        NoPrivacyQuery(clip_norm, clipping=mode, stability=gamma) if z == 0
        else GaussianSumQuery(clip_norm, z, name="gradient", clipping=mode, stability=gamma),
        expected_batch_size=sampler.expected_batch_size,
        precision=precision,
        loss_scale=loss_scale,
        reducer=d,
    )
    pg.attribution.every, pg.attribution.budget = o.attribution_check, o.attribution_budget
    facts = {
        "trainer": "dpfy.make_private",
        "noise_multiplier": z,
        "clip_norm": float(clip_norm),
        "clip_function": describe_clipping(o.clipping, o.clip_stability),
        "epochs": None if epochs is None else int(epochs),
        "steps_per_epoch": int(sampler.steps_per_epoch),
        "expected_batch_size": float(sampler.expected_batch_size),
        "max_physical_batch_size": max_physical_batch_size,
        "sampler": repr(sampler),
        "target_epsilon": None if target_epsilon is None else float(target_epsilon),
        "target_delta": None if delta is None else float(delta),
        "accounting": method,
        "optimizer": type(optimizer).__name__,
        "secure_randomness": bool(rng.secure),
        # what the report's headline reads: a DP release, or a seeded experiment
        "sampling_randomness": _describe(getattr(sampler, "randomness", None)),
        "noise_randomness": rng.describe(),
        # the keys' commitments, registered now: a key another run drew refuses this one
        **key_facts(rng, getattr(sampler, "randomness", None)),
        "calibrated": given_z is None,
        "precision": pg.precision,
        "loss_scale": pg.loss_scale,
        "layer_types": list(layer_type_names(p.module for p in pg.plans_)),
    } | ({} if d is None else {"workers": d.world_size})
    if d is not None:  # every rank starts from rank 0's weights and gets rank 0's draws
        d.sync_module_(model)
        sampler = SharedSampler(sampler, d)
    engine = _Engine(
        private_gradient=pg,
        sampler=sampler,
        ledger=ledger if ledger is not None else Ledger(),
        randomness=rng,
        noise_multiplier=z,
        guard=guard,
        epochs=None if epochs is None else int(epochs),
        delta=None if delta is None else float(delta),
        accounting=method,
        on_budget=on_budget,
        facts=facts,
    )
    loader = PrivateLoader(
        engine,
        data,
        collate_fn=collate_fn,
        max_physical_batch_size=max_physical_batch_size,
        num_workers=int(num_workers),
        device=None if device is None else torch.device(device),
        loader_kwargs=dict(loader_kwargs or {}),
    )
    loader.batch_sampler.shard = None if d is None else (d.rank, d.world_size)
    criterion = PrivateCriterion(engine, per_example)
    return Private(model, PrivateOptimizer(optimizer, engine), criterion, loader)


def _check_numbers(
    target_epsilon: float | None, delta: float | None, epochs: int | None, clip_norm: float,
    o: PrivateOptions,
) -> None:
    """:func:`make_private`'s budget, clip norm and options, each in its range."""
    check_int("attribution_check", o.attribution_check, 0, 2**31)
    if o.attribution_budget is not None:
        check_range("attribution_budget", o.attribution_budget, 0.0, 1.0, low_open=True)
    given_z, num_workers, on_budget = o.noise_multiplier, o.num_workers, o.on_budget
    max_physical_batch_size, precision, loss_scale = (
        o.max_physical_batch_size, o.precision, o.loss_scale)
    if given_z is None:
        for name, value in (("target_epsilon", target_epsilon), ("epochs", epochs)):
            if value is None:
                raise ValueError(
                    f"{name} must be given to calibrate the noise multiplier, got {name}=None "
                    "(or pass options=PrivateOptions(noise_multiplier=...))"
                )
    else:
        check_range("noise_multiplier", given_z, 0.0, math.inf, high_open=True)
    if target_epsilon is not None:
        check_range(
            "target_epsilon", target_epsilon, 0.0, math.inf, low_open=True, high_open=True
        )
        if delta is None:
            raise ValueError("delta must be given with target_epsilon, got delta=None")
    if delta is not None:
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if epochs is not None:
        check_range("epochs", epochs, 1, None, integer=True)
    check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
    check_clipping(o.clipping, o.clip_stability)
    check_range("num_workers", num_workers, 0, None, integer=True)
    check_precision(precision)
    if loss_scale is not None:
        check_loss_scale(loss_scale)
    if max_physical_batch_size is not None:
        check_range("max_physical_batch_size", max_physical_batch_size, 1, None, integer=True)
    if on_budget not in ("stop", "raise"):
        raise ValueError(f"on_budget must be one of {{stop, raise}}, got on_budget={on_budget!r}")


def _check_distributed(
    d: Distributed | None, ledger: Ledger | None, physical: int | None
) -> Distributed | None:
    """``d``, checked: a rank other than 0 keeps an in-memory mirror ledger, and W divides
    the physical batch size."""
    if d is None:
        return None
    if not d.releases and ledger is not None:
        check_mirror_ledger(ledger, d.rank)  # only rank 0 writes the ledger file
    if physical is not None:
        per_process_batch(physical, d.world_size)
    return d


def _check_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A module, and a plain optimizer over its trainable parameters (fp32 master weights,
    finite rates, no stale gradient on a frozen parameter)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, PrivateOptimizer) or not isinstance(
        optimizer, torch.optim.Optimizer
    ):
        raise TypeError(
            f"optimizer must be a plain torch.optim optimizer, got {type(optimizer).__name__}"
        )
    check_learning_rates(optimizer)
    check_master_weights((n, p) for n, p in model.named_parameters() if p.requires_grad)
    # Frozen parameters of the model may sit in the optimizer (it skips them: no release
    # gives them a gradient), unless they hold a gradient from before, which every step
    # would apply again.
    own = {id(p): p.requires_grad for p in model.parameters()}
    updated = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in updated if id(p) not in own]
    if foreign:
        raise ValueError(
            f"optimizer must update parameters of model only, got {len(foreign)} other "
            "parameter(s) (their gradients would not be private)"
        )
    stale = [p for p in updated if not own[id(p)] and p.grad is not None]
    if stale:
        raise ValueError(
            f"optimizer must hold no gradient on frozen parameters, got {len(stale)} frozen "
            "parameter(s) with a gradient from before (every step would apply it again); call "
            "optimizer.zero_grad(set_to_none=True) first"
        )


def _the_sampler(
    sampler: Any, data: Any, expected_batch_size: int | None, max_batch_size: int | None,
    rng: Randomness,
) -> Any:
    """The sampler of a :func:`make_private` run: built from a kind name (its own stream
    seeded from ``rng``), or a given one checked against the data and the batch size."""
    from dpfy.sampling import make_sampler

    n = len(data)
    if isinstance(sampler, str):
        if expected_batch_size is None:
            raise ValueError(
                "expected_batch_size must be given with a sampler kind, got "
                "expected_batch_size=None"
            )
        check_range("expected_batch_size", expected_batch_size, 1, n, integer=True)
        sampler = make_sampler(
            sampler,
            n,
            int(expected_batch_size),
            max_batch_size=max_batch_size,
            randomness=_sampling_stream(rng),
        )
    else:
        check_sampler(sampler, n, "sampler")
        if expected_batch_size is not None and not math.isclose(
            float(expected_batch_size), float(sampler.expected_batch_size), rel_tol=1e-9
        ):
            raise ValueError(
                f"expected_batch_size must match the sampler's "
                f"{sampler.expected_batch_size!r}, got expected_batch_size={expected_batch_size!r}"
            )
    return sampler


def _describe(randomness: Any) -> str:
    describe = getattr(randomness, "describe", None)
    return str(describe()) if callable(describe) else "not recorded (a sampler without one)"


def _sampling_stream(rng: Randomness) -> Randomness:
    """A stream for the sampler, independent of the noise stream of ``rng``.

    Separate streams keep a seeded run reproducible whatever the order of sampling and noise
    draws (a ``DataLoader`` with workers draws batches ahead of the releases).
    """
    if rng.secure:
        return Randomness.secure_mode()
    assert rng.seed is not None
    state = np.random.SeedSequence([int(rng.seed), 0x5A4D]).generate_state(2, np.uint64)
    return Randomness(int(state[0]))


def calibrate_to_budget(
    sampler: Any,
    target_epsilon: float,
    delta: float,
    method: str,
    *,
    epochs: int | None = None,
    steps: int | None = None,
) -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``delta`` over ``epochs`` (or
    ``steps``) of ``sampler``'s event; a target no noise can meet is a ``ValueError`` naming
    ``target_epsilon``."""
    from dpfy.accounting.calibrate import CalibrationError, calibrate_noise_multiplier

    span = f"epochs={epochs!r}" if steps is None else f"{steps} steps"
    try:
        return float(
            calibrate_noise_multiplier(
                lambda z: sampler.privacy_event(z, epochs=epochs, steps=steps),
                target_epsilon,
                delta,
                method,
            )
        )
    except CalibrationError as err:
        raise ValueError(
            f"target_epsilon={target_epsilon!r} cannot be met at delta={delta!r} over "
            f"{span} with this sampler (even the largest noise multiplier does not "
            f"reach it): raise target_epsilon, or train fewer steps or smaller batches ({err})"
        ) from err

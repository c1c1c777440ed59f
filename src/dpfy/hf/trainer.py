"""``DPTrainer``: ``transformers.Trainer`` with DP-SGD, a ledger and a privacy report.

Same arguments as ``Trainer`` plus the privacy ones; ``train()`` then runs DP-SGD
(Abadi et al. 2016, "Deep Learning with Differential Privacy") with dpfy's own pieces:

* **Batches.** dpfy's sampler (Poisson by default) draws each *logical* batch; the accounting
  uses its *expected* size ``B = per_device_train_batch_size * gradient_accumulation_steps``
  (or ``expected_batch_size``). A logical batch is cut into *physical* batches of at most
  ``per_device_train_batch_size`` rows (or ``max_physical_batch_size``), the last one padded
  with weight-0 rows (:mod:`dpfy.training.loader`). A Poisson batch has a random number of
  physical batches, so the accumulation is dpfy's, not the Trainer's: the Trainer's loop sees
  one item (a :class:`LogicalBatch`) per optimizer step and runs with
  ``gradient_accumulation_steps=1`` (a copy of ``args``; the user's value only sets ``B``).
* **Release.** ``training_step`` runs forward on every physical batch, computes per-example
  losses from the logits and labels (the model's ``outputs.loss`` is a batch mean and cannot
  be clipped per example: :func:`dpfy.training.losses.causal_lm_loss` for ``...ForCausalLM`` /
  ``...LMHeadModel``, ``token_classification_loss`` for token-level heads,
  ``sequence_classification_loss`` for one label per sequence, or the user's
  ``per_example_loss(outputs, labels) -> Tensor[B]``), clips each example's gradient and
  accumulates; after the last physical batch the Gaussian query writes its ledger entry, then
  noise goes on every trainable parameter and the sum is divided by ``B``
  (``docs/architecture.md``, sections 1 and 3). Only then does the Trainer's optimizer step.
  With ``peft``, only the adapter parameters are trainable, so only they get per-example work
  and noise.
* **Post-processing.** ``args.max_grad_norm`` (Trainer default 1.0) clips the *noisy averaged*
  gradient: post-processing, it changes no privacy number (set it to 0 to disable). The
  optimizer, the learning-rate schedule, logging and evaluation are the Trainer's.
* **Budget.** The noise multiplier is calibrated so the planned steps (``max_steps``, else
  ``ceil(num_train_epochs * steps_per_epoch)``) meet ``target_epsilon`` at ``delta``;
  the budget guard ends training before a step past the target (a warning).
* **Outputs.** ``output_dir/ledger.jsonl`` (written ahead of every sample and release), and at
  the end of ``train()`` ``output_dir/privacy_report.md`` and ``.json``; ``save_model()`` adds a
  ``## Privacy`` section to the saved model's ``README.md`` (:mod:`dpfy.hf.model_card`).
  ``trainer.epsilon()`` and ``trainer.ledger`` read the ledger.

Refused at construction, before any ledger exists (each breaks or would silently change the
guarantee): an ``IterableDataset`` or no ``train_dataset``; a ``train_sampling_strategy``
other than ``"random"`` (``"group_by_length"``, ...) or an overridden ``_get_train_sampler``
(dpfy's sampler decides the batches, so only it can state their privacy event); several
processes or GPUs (``world_size > 1``, ``n_gpu > 1``, DeepSpeed, FSDP: not implemented);
``fp16=True`` (the Trainer's dynamic GradScaler would unscale the released gradient and skip
steps on a non-private overflow bit; ``precision="fp16"`` uses dpfy's fixed loss scale instead;
``bf16=True`` is honoured: bf16 autocast, fp32 clipping and noise,
:mod:`dpfy.training.precision`); *reentrant* gradient checkpointing (its segments run without
autograd in the forward, so their per-example gradients cannot be recorded; the
non-reentrant variant, ``gradient_checkpointing_kwargs={"use_reentrant": False}`` and
transformers' default, is exact: the hooks record the first forward only, not the re-run
inside backward; dpfy still holds each recorded layer's input until the backward, so it saves
less memory than without DP); ``torch_compile``; ``auto_find_batch_size``; label smoothing
(the per-example loss would differ from the Trainer's); ``model_init``; ``compute_loss_func``
(use ``per_example_loss``). ``train()`` refuses
``resume_from_checkpoint`` (the ledger is not resumed yet) and a second call.

Other ``Trainer`` subclasses (TRL's ``SFTTrainer``, for one): :class:`DPTrainingMixin` holds
all of the above and overrides only ``__init__``, ``get_train_dataloader``, ``training_step``,
``train`` and ``save_model``, so ``class DPSFTTrainer(DPTrainingMixin, SFTTrainer)`` carries it
over, provided that subclass computes its loss through ``training_step``/``compute_loss`` from
model outputs and labels (packing, which joins several examples in one row, changes the unit
of privacy and must stay off). :class:`dpfy.hf.sft.DPSFTTrainer` is that class for TRL.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments

from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.training.budget import BudgetGuard, spent
from dpfy.training.closing import LedgerCloser
from dpfy.training.keys import key_facts
from dpfy.training.loader import (
    PrivateBatchSampler,
    RowsDataset,
    check_dataset,
    check_sampler,
    collated,
)
from dpfy.training.losses import (
    causal_lm_loss,
    sequence_classification_loss,
    token_classification_loss,
)
from dpfy.training.norms.registry import layer_type_names
from dpfy.training.precision import Precision, check_precision
from dpfy.training.step import PrivateGradient, StepStats
from dpfy.training.validate import validate_module

PerExampleLoss = Callable[[Any, torch.Tensor], torch.Tensor]


class LogicalBatch:
    """One logical batch: its physical batches (collated dicts) and their 0/1 row weights.

    The Trainer's loop treats it as one opaque batch (``"labels" in batch`` is False, so it
    computes no token count; the loss is per example anyway).
    """

    def __init__(
        self, epoch: int, step: int, chunks: list[tuple[Any, torch.Tensor]], num_rows: int
    ) -> None:
        self.epoch = epoch
        self.step = step
        self.chunks = chunks
        self.num_rows = num_rows  #: real rows of the logical batch (padding excluded)

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return f"LogicalBatch(epoch={self.epoch}, step={self.step}, rows={self.num_rows})"


class _LogicalLoader:
    """Logical batches of dpfy's sampler (one ``for`` = the next epoch), read by a DataLoader."""

    def __init__(self, owner: DPTrainingMixin, dataset: Any, collate_fn: Any) -> None:
        self._owner = owner
        self.dataset = dataset
        args = owner.args
        self.batch_sampler = PrivateBatchSampler(
            owner._dp_sampler, max_physical_batch_size=owner._dp_physical
        )
        kwargs: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
            kwargs["persistent_workers"] = args.dataloader_persistent_workers
        self._loader = DataLoader(
            RowsDataset(dataset, collate_fn),
            batch_sampler=self.batch_sampler,
            collate_fn=collated,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            **kwargs,
        )

    def __len__(self) -> int:
        return int(self._owner._dp_sampler.steps_per_epoch)

    def __iter__(self) -> Iterator[LogicalBatch]:
        owner = self._owner
        epoch = owner._dp_epoch
        owner._dp_epoch += 1
        allowed = owner._dp_allowed_steps()
        self.batch_sampler.begin(epoch, allowed)
        chunks: list[tuple[Any, torch.Tensor]] = []
        rows = 0
        for batch in self._loader:
            info = self.batch_sampler.infos.popleft()
            if not isinstance(batch, dict):
                raise TypeError(
                    "DPTrainer needs batches that are dicts of model inputs and labels (the "
                    f"data collator's output), got {type(batch).__name__}"
                )
            chunks.append((batch, info.weights()))
            rows += info.count
            if info.last:
                yield LogicalBatch(info.epoch, info.step, chunks, rows)
                chunks, rows = [], 0
        if allowed < len(self):
            warnings.warn(owner._dp_budget_message(), stacklevel=2)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrivacyArguments:
    """The privacy arguments of a :class:`DPTrainingMixin` trainer (``privacy=``), one record
    beside the Trainer's own ``TrainingArguments`` (see :class:`DPTrainingMixin` for each)."""

    target_epsilon: float | None = None
    delta: float = 1e-5
    clip_norm: float = 1.0
    sampler: Any = "poisson"
    expected_batch_size: int | None = None
    max_physical_batch_size: int | None = None
    per_example_loss: PerExampleLoss | None = None
    randomness: Randomness | None = None
    accounting: str | None = None
    noise_multiplier: float | None = None
    precision: Precision | None = None


_PRIVACY_FIELDS = frozenset(f.name for f in dataclasses.fields(PrivacyArguments))
#: What the Trainer would log about training that is computed from the private batches
#: without noise: the mean loss of each batch (``loss``, ``train_loss``) and the run's wall
#: time and speed (they follow the realised Poisson batch sizes). Never logged: not in
#: ``trainer_state.json`` (output_dir and every checkpoint), ``train_results.json``,
#: ``all_results.json``, stdout or a logging integration; ``last_step`` keeps the loss.
_PRIVATE_LOGS = frozenset({
    "loss", "train_loss", "train_runtime", "train_samples_per_second",
    "train_steps_per_second", "train_tokens_per_second",
})


class DPTrainingMixin:
    """DP-SGD for a ``transformers.Trainer`` subclass (see the module docstring).

    Privacy arguments (``privacy=PrivacyArguments(...)``; every other argument goes to the
    Trainer):
      target_epsilon, delta: the budget; the noise multiplier is calibrated to it (``delta``
        is spelt as in :func:`dpfy.make_private` and the accounting functions).
      clip_norm: L2 clip norm C of each example's gradient.
      sampler: a sampler kind (``"poisson"``, ``"balls_and_bins"``, ``"shuffle"``, ...) or a
        :mod:`dpfy.sampling` sampler over the training set.
      expected_batch_size: logical batch size B the accounting uses (default:
        ``per_device_train_batch_size * gradient_accumulation_steps``).
      max_physical_batch_size: rows per forward pass (default ``per_device_train_batch_size``).
      per_example_loss: ``(outputs, labels) -> Tensor[B]``; default chosen from the model.
      randomness: noise (and sampling) randomness; default ``Randomness.secure_mode()``. A
        seeded ``Randomness(seed)`` makes a reproducible experiment, not a DP release.
      accounting: accountant (default: the sampler kind's).
      noise_multiplier: skip calibration and use this z (``target_epsilon`` then only arms
        the guard); ``0`` releases without noise and the ledger says epsilon = infinity
        (debugging and tests only).
      precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` autocast of the forward (default:
        ``"bf16"`` with ``args.bf16``, else ``"fp32"``); norms, clipping and noise stay fp32.
    """

    args: TrainingArguments
    model: Any
    train_dataset: Any
    data_collator: Any

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        privacy: PrivacyArguments | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        from dpfy._validate import check_range
        from dpfy.sampling import make_sampler
        from dpfy.sampling.kinds import kind as sampler_kind
        from dpfy.training.private import _sampling_stream, calibrate_to_budget

        misplaced = sorted(set(trainer_kwargs) & _PRIVACY_FIELDS)
        if misplaced:
            raise TypeError(
                f"{', '.join(misplaced)}: privacy arguments go in one record, "
                f"privacy=PrivacyArguments({misplaced[0]}=...)"
            )
        p = PrivacyArguments() if privacy is None else privacy
        target_epsilon, delta, clip_norm = p.target_epsilon, p.delta, p.clip_norm
        sampler, expected_batch_size = p.sampler, p.expected_batch_size
        max_physical_batch_size, per_example_loss = p.max_physical_batch_size, p.per_example_loss
        randomness, accounting, noise_multiplier = p.randomness, p.accounting, p.noise_multiplier
        precision = p.precision
        if args is None:
            args = TrainingArguments()
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be TrainingArguments, got {type(args).__name__}")
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError("target_epsilon must be given (the budget the noise is calibrated to)")
        if target_epsilon is not None:
            check_range("target_epsilon", target_epsilon, 0.0, math.inf, low_open=True,
                        high_open=True)
        check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        if noise_multiplier is not None:
            check_range("noise_multiplier", noise_multiplier, 0.0, math.inf, high_open=True)
        if randomness is not None and not isinstance(randomness, Randomness):
            raise TypeError(
                f"randomness must be a dpfy Randomness, got {type(randomness).__name__}"
            )
        accumulation = int(args.gradient_accumulation_steps)
        _refuse_arguments(args, type(self), trainer_kwargs)
        if trainer_kwargs.get("train_dataset") is not None:
            check_dataset(trainer_kwargs["train_dataset"], "train_dataset")
        private_args = copy.copy(args)  # the Trainer's loop steps once per logical batch
        private_args.gradient_accumulation_steps = 1
        super().__init__(model, private_args, *trainer_args, **trainer_kwargs)  # type: ignore[call-arg]
        if self.model is None or not isinstance(self.model, nn.Module):
            raise TypeError("DPTrainer needs a model (torch.nn.Module), not model_init")
        if self.args.world_size > 1 or self.args.n_gpu > 1:
            raise ValueError(
                f"DPTrainer runs in one process on one device for now, got world_size="
                f"{self.args.world_size}, n_gpu={self.args.n_gpu}"
            )
        if self.train_dataset is None:
            raise ValueError("train_dataset must be given (its size sets the sampling rate)")
        check_dataset(self.train_dataset, "train_dataset")
        n = len(self.train_dataset)
        rng = randomness if randomness is not None else Randomness.secure_mode()
        batch = expected_batch_size or args.per_device_train_batch_size * accumulation
        if isinstance(sampler, str):
            check_range("expected_batch_size", batch, 1, n, integer=True)
            sampler = make_sampler(sampler, n, int(batch), randomness=_sampling_stream(rng))
        else:
            check_sampler(sampler, n, "sampler")
        physical = max_physical_batch_size or args.per_device_train_batch_size
        check_range("max_physical_batch_size", physical, 1, None, integer=True)
        validate_module(self.model)
        spe = int(sampler.steps_per_epoch)
        steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * spe)
        method = accounting or sampler_kind(sampler.sample_spec().sampler).default_accountant
        calibrated = noise_multiplier is None
        if noise_multiplier is None:
            assert target_epsilon is not None
            span = (
                {"epochs": steps // spe} if steps % spe == 0 else {"steps": steps}
            )
            z = calibrate_to_budget(
                sampler, float(target_epsilon), float(delta), method, **span
            )
        else:
            z = float(noise_multiplier)
        from dpfy.queries import GaussianSumQuery
        from dpfy.queries.sum import NoPrivacyQuery

        query = NoPrivacyQuery(clip_norm) if z == 0 else GaussianSumQuery(clip_norm, z)
        self._dp_gradient = PrivateGradient(
            self.model, query, expected_batch_size=sampler.expected_batch_size,
            precision=_precision(args, precision),
        )
        self._dp_sampler = sampler
        self._dp_spec = sampler.sample_spec()
        self._dp_physical = int(physical)
        self._dp_z = z
        self._dp_delta = float(delta)
        self._dp_method = method
        self._dp_guard = (
            BudgetGuard(target_epsilon, delta, method=method)
            if target_epsilon is not None and z > 0
            else None
        )
        self._dp_randomness = rng
        self._dp_loss = per_example_loss
        self._dp_epoch = 0
        self._dp_steps = 0
        self._dp_ledger: Ledger | None = None
        self._dp_trained = False
        self.last_step: StepStats | None = None
        self._dp_planned = int(steps)
        self._dp_facts = {
            "trainer": f"dpfy.hf.{type(self).__name__}",
            "noise_multiplier": z,
            "clip_norm": float(clip_norm),
            "planned_steps": int(steps),
            "steps_per_epoch": spe,
            "expected_batch_size": float(sampler.expected_batch_size),
            "max_physical_batch_size": int(physical),
            "sampler": repr(sampler),
            "target_epsilon": None if target_epsilon is None else float(target_epsilon),
            "target_delta": float(delta),
            "accounting": method,
            "optimizer": args.optim if isinstance(args.optim, str) else str(args.optim),
            "learning_rate": float(args.learning_rate),
            "max_grad_norm_post_processing": float(args.max_grad_norm),
            "secure_randomness": bool(rng.secure),
            "sampling_randomness": _describe(getattr(sampler, "randomness", None)),
            "noise_randomness": rng.describe(),
            # the keys' commitments, registered now: a key another run drew refuses this one
            **key_facts(rng, getattr(sampler, "randomness", None)),
            "layer_types": list(layer_type_names(p.module for p in self._dp_gradient.plans_)),
            "calibrated": calibrated,
            "model": type(self.model).__name__,
            "precision": self._dp_gradient.precision,
        }

    # -- reading the ledger -----------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """The run's ledger (``output_dir/ledger.jsonl`` once ``train()`` has started)."""
        if self._dp_ledger is None:
            raise RuntimeError("the ledger exists once train() has started")
        return self._dp_ledger

    @property
    def noise_multiplier(self) -> float:
        return self._dp_z

    @property
    def ledger_path(self) -> Path:
        return Path(self.args.output_dir or ".") / "ledger.jsonl"

    def epsilon(self, delta: float | None = None, method: str | None = None) -> float:
        """Epsilon the ledger has spent at ``delta`` (default: the ``delta`` of the budget)."""
        return spent(self.ledger, self._dp_delta if delta is None else delta,
                     method or self._dp_method)

    # -- the overrides ----------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """dpfy's sampler decides the batches: logical batches of padded physical ones."""
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")  # type: ignore[attr-defined]
            else:
                collator = self._get_collator_with_removed_columns(collator, "training")  # type: ignore[attr-defined]
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, "training")  # type: ignore[attr-defined]
        return _LogicalLoader(self, dataset, collator)

    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Per-example clipped gradients of every physical batch, then one noisy release."""
        if not isinstance(inputs, LogicalBatch):
            raise TypeError(
                "DPTrainer.training_step takes the LogicalBatch of its own loader, got "
                f"{type(inputs).__name__}"
            )
        ledger = self.ledger
        if ledger.iteration == 0 and self._dp_steps == 0:
            ledger.record_metadata(**self._dp_facts)
        sample_id = ledger.record_sample(self._dp_spec, epoch=inputs.epoch, step=self._dp_steps)
        model.train()
        pg = self._dp_gradient
        label_key = _label_key(self.args)
        for batch, weights in inputs.chunks:
            batch = self._prepare_inputs(dict(batch))  # type: ignore[attr-defined]
            labels = batch.pop(label_key, None)
            if labels is None:
                raise ValueError(f"every batch needs {label_key!r} for the per-example loss")
            chunk = pg.open_chunk(batch_size=len(weights))
            try:
                with self.compute_loss_context_manager(), pg.autocast():  # type: ignore[attr-defined]
                    outputs = model(**batch)
                    losses = self._per_example_loss(outputs, labels)
                chunk.accumulate(losses, weights.to(losses.device))
            finally:
                chunk.close()
        self.last_step = pg.release(
            ledger=ledger, sample_id=sample_id, randomness=self._dp_randomness
        )
        self._dp_steps += 1
        stats = self.last_step
        mean = stats.loss_sum / stats.num_examples if stats.num_examples else 0.0
        return torch.tensor(mean, device=self.args.device)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Train privately, then write ``privacy_report.md``/``.json`` next to the ledger."""
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "resume_from_checkpoint is not supported by DPTrainer yet (the ledger of the "
                "first run would have to be resumed with it)"
            )
        if self._dp_trained:
            raise RuntimeError("DPTrainer.train() runs once; build a new trainer for a new run")
        path = self.ledger_path
        if path.exists():
            raise FileExistsError(
                f"{str(path)!r} already holds a ledger: choose a new output_dir (a run's "
                "ledger is never overwritten)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        self._dp_trained = True
        self._dp_ledger = Ledger(path)
        # the end record says whether the planned steps all ran (dpfy.training.closing)
        closer = LedgerCloser(self._dp_ledger, self._dp_planned, delta=self._dp_delta,
                              method=self._dp_method)  # records the epsilon it accounts
        how = ""
        try:
            output = super().train(None, *args, **kwargs)  # type: ignore[misc]
        except BaseException as err:
            how = f"an uncaught {type(err).__name__} in train()"
            raise
        finally:
            self._dp_gradient.reset()
            closer.close(how or "train() returned")
        self.write_privacy_report()
        metrics = {k: v for k, v in output.metrics.items() if k not in _PRIVATE_LOGS}
        return output._replace(training_loss=math.nan, metrics=metrics)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log without what it computed from the private batches without noise
        (:data:`_PRIVATE_LOGS`); evaluation on the user's data is the user's to judge."""
        # no start_time: the Trainer would add speed metrics (wall time per private batch)
        kwargs.pop("start_time", None)
        super().log({k: v for k, v in logs.items() if k not in _PRIVATE_LOGS},  # type: ignore[misc]
                    *args[:0], **kwargs)

    def write_privacy_report(self, out_dir: str | os.PathLike[str] | None = None) -> Any:
        """Write ``privacy_report.md`` and ``.json`` (default: into ``output_dir``)."""
        from dpfy.report import build_report

        report = build_report(
            self.ledger, delta=self._dp_delta, method=self._dp_method,
            ledger_path=str(self.ledger_path),
        )
        out = Path(out_dir or self.args.output_dir or ".")
        out.mkdir(parents=True, exist_ok=True)
        for name, text in (("privacy_report.json", report.to_json()),
                           ("privacy_report.md", report.to_markdown())):
            tmp = out / (name + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out / name)
        return report

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as the Trainer does, then add the privacy section to the model card."""
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        if self._dp_ledger is not None and self._dp_ledger.iteration > 0:
            from dpfy.hf.model_card import write_model_card

            target = output_dir or self.args.output_dir or "."
            write_model_card(
                target, self._dp_ledger, delta=self._dp_delta, method=self._dp_method,
                ledger_ref=os.path.relpath(self.ledger_path, target),
            )

    def floating_point_ops(self, inputs: Any) -> int:
        """0: the Trainer's count (6 x tokens x parameters of each batch) would follow the
        realised Poisson batch sizes, a statistic of the private data without noise, into
        ``total_flos`` of ``trainer_state.json``."""
        return 0

    # -- helpers ----------------------------------------------------------------------------
    def _per_example_loss(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if self._dp_loss is not None:
            losses = self._dp_loss(outputs, labels)
        else:
            losses = _default_loss(self.model, outputs, labels)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError(
                "per_example_loss must return per-example losses of shape [B], got "
                f"{getattr(losses, 'shape', type(losses))}"
            )
        return losses

    def _dp_allowed_steps(self) -> int:
        spe = int(self._dp_sampler.steps_per_epoch)
        if self._dp_guard is None:
            return spe
        return self._dp_guard.allowed_steps(
            self.ledger, lambda k: self._dp_sampler.privacy_event(self._dp_z, steps=k), spe
        )

    def _dp_budget_message(self) -> str:
        assert self._dp_guard is not None
        event = self._dp_sampler.privacy_event(self._dp_z, steps=1)
        guard = self._dp_guard
        return guard._message(self.ledger, guard.epsilon_after(self.ledger, event))


class DPTrainer(DPTrainingMixin, Trainer):
    """``transformers.Trainer`` with DP-SGD, a ledger and a privacy report (module docstring).

    Example (``docs/examples/hf_trainer_lora.py``)::

        trainer = DPTrainer(model=model, args=TrainingArguments(output_dir=out, ...),
                            train_dataset=data,
                            privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5,
                                                     clip_norm=1.0))
        trainer.train()          # out/ledger.jsonl, out/privacy_report.md
        trainer.save_model()     # out/README.md gets a "Privacy" section
    """


def _refuse_arguments(args: TrainingArguments, cls: type, kwargs: dict[str, Any]) -> None:
    """Refuse settings that break or silently change the guarantee (module docstring)."""
    checks = [
        (getattr(args, "train_sampling_strategy", "random") not in ("random",),
         f"train_sampling_strategy={getattr(args, 'train_sampling_strategy', None)!r}"),
        (cls._get_train_sampler is not Trainer._get_train_sampler,  # type: ignore[attr-defined]
         "a custom train sampler (_get_train_sampler is overridden)"),
        (args.fp16, "fp16=True (the Trainer's dynamic GradScaler would divide the released "
         "gradient by its scale and skip steps on an overflow bit the noise does not cover; "
         "pass precision='fp16' to DPTrainer for dpfy's fixed loss scale)"),
        (_reentrant_checkpointing(args), "reentrant gradient checkpointing (its segments run "
         "without autograd in the forward, so per-example gradients cannot be recorded; pass "
         "gradient_checkpointing_kwargs={'use_reentrant': False})"),
        (args.torch_compile, "torch_compile"),
        (args.auto_find_batch_size, "auto_find_batch_size"),
        (bool(args.deepspeed) or bool(args.fsdp), "DeepSpeed/FSDP (several processes)"),
        (args.label_smoothing_factor != 0, "label_smoothing_factor != 0"),
        (args.include_num_input_tokens_seen not in (False, "no", None),
         "include_num_input_tokens_seen (a count of the private batches' tokens, and a "
         "tokens-per-second rate, logged without noise)"),
        (kwargs.get("model_init") is not None, "model_init"),
        (kwargs.get("compute_loss_func") is not None, "compute_loss_func (it reduces a batch "
         "to one loss; pass per_example_loss=(outputs, labels) -> Tensor[B] instead)"),
    ]
    bad = [what for refused, what in checks if refused]
    if bad:
        raise ValueError(
            f"DPTrainer refuses {', '.join(bad)}: dpfy's sampler and per-example clipping "
            "must decide every batch and gradient for the privacy statement to hold"
        )


def _reentrant_checkpointing(args: TrainingArguments) -> bool:
    """Whether the Trainer will enable *reentrant* activation checkpointing.

    ``transformers`` passes ``gradient_checkpointing_kwargs`` (less ``every_n_layers`` and
    ``offload``) to ``torch.utils.checkpoint``; with none left it uses ``use_reentrant=False``,
    with some but no ``use_reentrant`` torch's default (reentrant) applies.
    """
    on = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    if not on:
        return False
    kwargs = (
        getattr(args, "activation_checkpointing_kwargs", None)
        or args.gradient_checkpointing_kwargs
        or {}
    )
    if isinstance(kwargs, str):
        import json

        kwargs = json.loads(kwargs)
    rest = {k: v for k, v in dict(kwargs).items() if k not in ("every_n_layers", "offload")}
    return bool(rest) and rest.get("use_reentrant", True) is not False


def _precision(args: TrainingArguments, precision: Any) -> Precision:
    """``precision`` of the step: the argument, else ``"bf16"`` with ``args.bf16``."""
    if precision is None:
        return "bf16" if args.bf16 else "fp32"
    checked = check_precision(precision)
    if args.bf16 and checked != "bf16":
        raise ValueError(
            f"precision must be 'bf16' (or None) with TrainingArguments(bf16=True), got "
            f"precision={precision!r}"
        )
    return checked


def _describe(randomness: Any) -> str:
    describe = getattr(randomness, "describe", None)
    return str(describe()) if callable(describe) else "not recorded (a sampler without one)"


def _label_key(args: TrainingArguments) -> str:
    names = getattr(args, "label_names", None)
    return names[0] if names and len(names) == 1 else "labels"


def _default_loss(model: nn.Module, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-example loss chosen from the model's class name and the labels' shape."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    name = type(base).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return causal_lm_loss(outputs, labels)
    if labels.dim() >= 2 and not labels.is_floating_point():
        return token_classification_loss(outputs, labels)
    return sequence_classification_loss(outputs, labels)

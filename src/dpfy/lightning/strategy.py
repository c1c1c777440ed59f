"""``DPStrategy``: DP-SGD inside a ``lightning.Trainer``, one argument added to the script.

``Trainer(..., strategy=DPStrategy(target_epsilon=3, delta=1e-5, clip_norm=1.0,
run_dir="runs/mnist"))`` trains the user's ``LightningModule`` unchanged with dpfy's machinery:
the strategy hands the module, its optimizer and the training ``DataLoader`` to
:class:`dpfy.opacus.PrivacyEngine` (``make_private_with_epsilon``, which runs
:func:`dpfy.training.make_private`), so that

* the batches are Poisson draws of dpfy's sampler at rate ``q = 1 / len(train_dataloader)``,
  ``len(train_dataloader)`` logical batches an epoch: the strategy gives Lightning the private
  loader in place of the user's (Lightning's ``use_distributed_sampler`` never reaches it, and
  only the dataset and the length of the user's loader are read);
* the noise multiplier is calibrated to ``trainer.max_epochs`` epochs within
  ``(target_epsilon, delta)``, on the safe side, and a budget guard refuses any step past it;
* each example's gradient is read off the ``loss.backward()`` that Lightning runs inside its
  closure (:mod:`dpfy.opacus.outputs`: the loss must be a mean over rows of per-row terms, as
  ``F.cross_entropy`` is), then clipped to ``clip_norm``, summed, noised and written to the
  ledger before the user's optimizer steps;
* the ledger (``run_dir/ledger.jsonl``) is closed, signed, when ``fit`` ends, and its report
  (``report.md``, ``report.json``) written beside it.

Lightning's ``optimizer.step(closure)`` is owned here: :meth:`DPStrategy.optimizer_step` runs
the closure (``training_step``, ``zero_grad``, ``backward``), then the private step. What would
change the gradients outside dpfy is refused at ``fit`` before anything is written:
``accumulate_grad_batches > 1``, ``gradient_clip_val``, a precision other than ``"32-true"``,
manual optimization, more than one optimizer, ``max_epochs=-1``, a resumed ``fit``
(``ckpt_path``) and more than one process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader

from dpfy.ledger import Ledger
from dpfy.opacus import PrivacyEngine
from dpfy.opacus.optimizer import DPOptimizer


class DPStrategy(SingleDeviceStrategy):
    """A single-device Lightning strategy that trains with DP-SGD (module docstring).

    Args:
      target_epsilon: the run's epsilon budget at ``delta``; the noise is calibrated to it
        over ``trainer.max_epochs`` epochs.
      delta: the target delta.
      clip_norm: L2 bound C on each example's gradient.
      run_dir: folder of the ledger (``ledger.jsonl``) and report; it must not hold a ledger
        yet. None: an in-memory ledger and no files (tests, experiments).
      accountant: ``"prv"`` (the PLD upper bound, default) or ``"rdp"`` (names as in
        :class:`dpfy.opacus.PrivacyEngine`).
      seed: a seeded experiment instead of a DP release (recorded so in the ledger and the
        report); None: the secure generator.
      device: the device to train on (default: ``"cuda:0"`` when available, else ``"cpu"``).

    Attributes:
      engine: the :class:`dpfy.opacus.PrivacyEngine` of the run (after ``fit`` started).
    """

    def __init__(
        self,
        *,
        target_epsilon: float,
        delta: float,
        clip_norm: float,
        run_dir: str | os.PathLike[str] | None,
        accountant: str = "prv",
        seed: int | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device)
        self.target_epsilon = float(target_epsilon)
        self.delta = float(delta)
        self.clip_norm = float(clip_norm)
        self.run_dir = run_dir
        self.accountant_name = accountant
        self.seed = seed
        self.engine: PrivacyEngine | None = None
        self._private: DPOptimizer | None = None

    # -- reading the run --------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """The run's ledger (it exists once ``fit`` has started)."""
        return self._engine().ledger

    @property
    def noise_multiplier(self) -> float:
        """The calibrated noise multiplier z (noise standard deviation / ``clip_norm``)."""
        if self._private is None:
            raise RuntimeError("the noise multiplier exists once fit has started")
        return self._private.noise_multiplier

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon the ledger has spent so far at ``delta`` (default: the target delta)."""
        return self._engine().get_epsilon(self.delta if delta is None else float(delta))

    def _engine(self) -> PrivacyEngine:
        if self.engine is None:
            raise RuntimeError("the private run exists once Trainer.fit has started")
        return self.engine

    # -- Lightning's hooks ------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validate/test/predict run as usual
            _refuse_options(trainer, self.precision_plugin)
        super().setup(trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes the private one (validation loaders pass through)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._private is not None:
            raise RuntimeError(
                "a DPStrategy trains one run (its ledger belongs to it), got a second train "
                "dataloader (a second fit, or reload_dataloaders_every_n_epochs > 0): pass a "
                "new DPStrategy to a new Trainer"
            )
        return self._make_private(trainer, dataloader)

    def _make_private(self, trainer: Trainer, dataloader: object) -> object:
        module = self.lightning_module
        assert isinstance(module, LightningModule)
        if len(self.optimizers) != 1:
            raise ValueError(
                "configure_optimizers must return one optimizer with DPStrategy, got "
                f"{len(self.optimizers)}: each release steps one optimizer"
            )
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                "train_dataloader must return a torch DataLoader with DPStrategy, got "
                f"{type(dataloader).__name__}: dpfy draws the batches from its dataset"
            )
        self.engine = PrivacyEngine(
            accountant=self.accountant_name, run_dir=self.run_dir, seed=self.seed
        )
        _, optimizer, loader = self.engine.make_private_with_epsilon(
            module=module, optimizer=self.optimizers[0], data_loader=dataloader,
            target_epsilon=self.target_epsilon, target_delta=self.delta,
            epochs=int(trainer.max_epochs or 0), max_grad_norm=self.clip_norm,
        )
        assert isinstance(optimizer, DPOptimizer)
        self._private = optimizer
        self.optimizers = [optimizer]  # schedulers keep working: the param_groups are shared
        return loader

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Any,
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run Lightning's closure (``training_step``, ``zero_grad``, ``backward``), then the
        private step: per-example gradients, clipping, the ledger entry, noise, the step."""
        result = closure()
        if self._private is None:
            raise RuntimeError("optimizer_step before DPStrategy made the run private")
        self._private.step()
        return result

    def teardown(self) -> None:
        """Close the ledger (its end record says whether every planned release was made) and
        write the report beside it."""
        try:
            if self.engine is not None and self._private is not None:
                trainer = getattr(self.lightning_module, "_trainer", None)
                interrupted = trainer is not None and trainer.interrupted
                self._private.private.close_ledger(
                    "fit interrupted" if interrupted else "fit ended"
                )
                if self.engine.run_dir is not None:
                    self.engine.write_report(self.delta)
        finally:
            super().teardown()


def _refuse_options(trainer: Trainer, precision: Precision) -> None:
    """One-line errors for the Trainer options that touch gradients outside dpfy."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "accumulate_grad_batches must be 1 with DPStrategy, got accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches!r}: a logical batch is one Poisson draw; raise "
            "the train DataLoader's batch_size instead"
        )
    if trainer.gradient_clip_val:
        raise ValueError(
            f"gradient_clip_val must be None with DPStrategy, got gradient_clip_val="
            f"{trainer.gradient_clip_val!r}: each example's gradient is clipped to "
            "DPStrategy(clip_norm=...) instead"
        )
    if type(precision) is not Precision:
        name = getattr(precision, "precision", type(precision).__name__)
        raise ValueError(
            f"precision must be '32-true' with DPStrategy, got precision={name!r}: its plugin "
            "scales or casts gradients outside dpfy's clipping; train in fp32"
        )
    module = trainer.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            "automatic_optimization must be True with DPStrategy, got False: the strategy "
            "owns optimizer.step(closure)"
        )
    if trainer.max_epochs is None or trainer.max_epochs < 1:
        raise ValueError(
            f"max_epochs must be in [1, inf) with DPStrategy, got max_epochs="
            f"{trainer.max_epochs!r}: the noise is calibrated to the planned epochs"
        )
    if trainer.ckpt_path is not None:
        raise ValueError(
            f"ckpt_path must be None with DPStrategy, got ckpt_path={trainer.ckpt_path!r}: "
            "resuming a private run from a Lightning checkpoint is not supported yet (its "
            "ledger position would not be carried over)"
        )

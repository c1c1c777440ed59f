"""``DPStrategy`` and ``DistributedDPStrategy``: DP-SGD inside a ``lightning.Trainer``.

``Trainer(..., strategy=DPStrategy(target_epsilon=3, delta=1e-5, clip_norm=1.0,
run_dir="runs/mnist"))`` trains the user's ``LightningModule`` unchanged with dpfy's machinery
(:class:`dpfy.lightning.run.PrivateRun`, the assembly of ``dpfy.opacus``' ``PrivacyEngine``):

* the batches are Poisson draws of dpfy's sampler at rate ``q = 1 / len(train_dataloader)``,
  ``len(train_dataloader)`` logical batches an epoch: the strategy gives Lightning the private
  loader in place of the user's (Lightning's ``use_distributed_sampler`` never reaches it, and
  only the dataset, the length and the loading options of the user's loader are read);
* the noise multiplier is calibrated to ``trainer.max_epochs`` epochs within
  ``(target_epsilon, delta)``, on the safe side, and a budget guard stops any step past it;
* each example's gradient is read off the ``loss.backward()`` that Lightning runs inside its
  closure (:mod:`dpfy.opacus.outputs`: the loss must be a mean over rows of per-row terms, as
  ``F.cross_entropy`` is), then clipped to ``clip_norm``, summed, noised and written to the
  ledger before the user's optimizer steps;
* the ledger (``run_dir/ledger.jsonl``) is closed, signed, when ``fit`` ends, and its report
  (``report.md``, ``report.json``) written beside it.

:class:`DistributedDPStrategy` is the same on several processes (Lightning's DDP launch,
``Trainer(accelerator="cpu", devices=2, strategy=DistributedDPStrategy(...))``, or
``torchrun``): dpfy's data-parallel step (docs/architecture.md, 5.18) in place of DDP's
all-reduce of unclipped gradients, which is never built (the module is not wrapped). Rank 0
draws each Poisson batch and broadcasts it, every rank clips its part of the rows, the clipped
sums are all-reduced, rank 0 writes the one ledger and draws the noise once.

Lightning checkpoints carry the run's ledger position and generator states
(:meth:`save_checkpoint`), and ``fit(ckpt_path=...)`` resumes them on the same ledger file
(:mod:`dpfy.lightning.run`: every release stays counted, also those a killed process made after
the checkpoint).

Lightning's ``optimizer.step(closure)`` is owned here: :meth:`optimizer_step` runs the closure
(``training_step``, ``zero_grad``, ``backward``), then the private step. What would change the
gradients outside dpfy is refused at ``fit`` before anything is written:
``accumulate_grad_batches > 1``, ``gradient_clip_val``, a precision other than ``"32-true"``,
manual optimization, more than one optimizer, ``max_epochs=-1``, and (``DPStrategy``) more than
one process.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader

from dpfy.ledger import Ledger
from dpfy.lightning.run import CHECKPOINT_KEY, PrivateRun, Settings, check_settings
from dpfy.training.checkpoint import CheckpointMismatchError
from dpfy.training.distributed import DEFAULT_TIMEOUT, Distributed
from dpfy.training.torchrun import torchrun_env


class _PrivateFit(Strategy):
    """What both strategies add to Lightning's (not instantiated on its own)."""

    _settings: Settings
    _run: PrivateRun | None
    _resume: dict[str, Any] | None

    def _init_private(self, settings: Settings) -> None:
        check_settings(settings)
        self._settings, self._run, self._resume = settings, None, None

    # -- reading the run --------------------------------------------------------------------
    target_epsilon = property(lambda self: self._settings.target_epsilon)
    delta = property(lambda self: self._settings.delta)
    clip_norm = property(lambda self: self._settings.clip_norm)
    run_dir = property(lambda self: self._settings.run_dir)
    seed = property(lambda self: self._settings.seed)

    @property
    def ledger(self) -> Ledger:
        """The run's ledger (it exists once ``fit`` has started; on a rank other than 0 the
        in-memory mirror of rank 0's)."""
        return self._private_run().ledger

    @property
    def noise_multiplier(self) -> float:
        """The calibrated noise multiplier z (noise standard deviation / ``clip_norm``)."""
        return self._private_run().optimizer.noise_multiplier

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon the ledger has spent so far at ``delta`` (default: the target delta)."""
        return self._private_run().epsilon(self.delta if delta is None else float(delta))

    def _private_run(self) -> PrivateRun:
        if self._run is None:
            raise RuntimeError("the private run exists once Trainer.fit has started")
        return self._run

    def _distributed(self) -> Distributed | None:
        return None

    # -- Lightning's hooks ------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validate/test/predict run as usual
            _refuse_options(trainer, self.precision_plugin)
            if trainer.ckpt_path is not None and self._resume is None:
                raise CheckpointMismatchError(
                    f"ckpt_path must be a checkpoint saved by a DPStrategy fit (it carries the "
                    f"ledger position), got ckpt_path={trainer.ckpt_path!r} without one"
                )
        super().setup(trainer)

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes the private one (validation loaders pass through)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._run is not None:
            raise RuntimeError(
                "a DPStrategy trains one run (its ledger belongs to it), got a second train "
                "dataloader (a second fit, or reload_dataloaders_every_n_epochs > 0): pass a "
                "new DPStrategy to a new Trainer"
            )
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
        self._run = PrivateRun(
            self._settings, module, self.optimizers[0], dataloader,
            epochs=int(trainer.max_epochs or 0), distributed=self._distributed(),
            resume=self._resume,
        )
        self.optimizers = [self._run.optimizer]  # schedulers keep working: shared param_groups
        return self._run.loader

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None,
                       **kwargs: Any) -> Any:
        """Run Lightning's closure (``training_step``, ``zero_grad``, ``backward``), then the
        private step: per-example gradients, clipping, the ledger entry, noise, the step."""
        result = closure()
        self._private_run().optimizer.step()
        return result

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Lightning's checkpoint, with the private run's state under ``"dpfy"`` (rank 0)."""
        if self._run is not None and self.is_global_zero:
            checkpoint[CHECKPOINT_KEY] = self._run.state()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Lightning's checkpoint; a fit keeps its ``"dpfy"`` state to resume the run."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        self._resume = saved if isinstance(saved, dict) and saved else None
        return checkpoint

    def teardown(self) -> None:
        """Close the ledger (its end record says whether every planned release was made) and
        write the report beside it."""
        try:
            if self._run is not None:
                trainer = getattr(self.lightning_module, "_trainer", None)
                interrupted = trainer is not None and trainer.interrupted
                self._run.close("fit interrupted" if interrupted else "fit ended")
        finally:
            super().teardown()


class DPStrategy(_PrivateFit, SingleDeviceStrategy):
    """A single-device Lightning strategy that trains with DP-SGD (module docstring).

    Args:
      target_epsilon: the run's epsilon budget at ``delta``; the noise is calibrated to it
        over ``trainer.max_epochs`` epochs.
      delta: the target delta.
      clip_norm: L2 bound C on each example's gradient.
      run_dir: folder of the ledger (``ledger.jsonl``) and report; it must not hold a ledger
        yet, unless ``fit(ckpt_path=...)`` resumes that ledger's run. None: an in-memory
        ledger and no files (tests, experiments).
      accountant: ``"prv"`` (the PLD upper bound, default) or ``"rdp"`` (names as in
        :class:`dpfy.opacus.PrivacyEngine`).
      seed: a seeded experiment instead of a DP release (recorded so in the ledger and the
        report); None: the secure generator.
      device: the device to train on (default: ``"cuda:0"`` when available, else ``"cpu"``).
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
        self._init_private(Settings(float(target_epsilon), float(delta), float(clip_norm),
                                    run_dir, accountant, seed))

    def setup(self, trainer: Trainer) -> None:
        launch = torchrun_env()
        if trainer.state.fn == TrainerFn.FITTING and launch is not None and launch.world_size > 1:
            raise ValueError(
                f"DPStrategy trains in one process, got one of {launch.world_size} launched "
                "processes (each would release its own run): use DistributedDPStrategy"
            )
        super().setup(trainer)


class DistributedDPStrategy(_PrivateFit, DDPStrategy):
    """DP-SGD on several processes: dpfy's data-parallel step in a Lightning DDP launch
    (module docstring).

    ``Trainer(accelerator="cpu", devices=2, strategy=DistributedDPStrategy(...))`` starts the
    second process as Lightning's ``"ddp"`` strategy does (the script again, with its rank in
    the environment), or joins the processes ``torchrun`` started. The module is never wrapped
    in ``DistributedDataParallel``: the gradient all-reduce is dpfy's, of clipped sums.

    Args:
      target_epsilon, delta, clip_norm, run_dir, accountant, seed: as :class:`DPStrategy`;
        ``run_dir`` is written by rank 0 only.
      timeout: seconds a collective of the private step (the batch broadcast, the all-reduce
        of the clipped sums, the broadcast of the noisy sum) waits for a rank that died or hung.
      start_method: Lightning's launch (``"popen"``: the script again; ``"spawn"``).
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
        timeout: float = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(start_method=start_method)  # type: ignore[arg-type]
        self._init_private(Settings(float(target_epsilon), float(delta), float(clip_norm),
                                    run_dir, accountant, seed))
        if not 0 < float(timeout) <= 86400:
            raise ValueError(f"timeout must be in (0, 86400] seconds, got timeout={timeout!r}")
        self._collective_timeout = float(timeout)
        self._dp: Distributed | None = None

    def setup_distributed(self) -> None:
        """Lightning joins the process group; then the private step's own group, with its
        collective timeout (every rank creates it, in the same order)."""
        super().setup_distributed()
        group = dist.new_group(
            list(range(self.world_size)),
            timeout=datetime.timedelta(seconds=self._collective_timeout),
        )
        device = self.root_device if self.root_device.type == "cuda" else torch.device("cpu")
        self._dp = Distributed(self.global_rank, self.world_size, self._collective_timeout,
                               device, group)

    def _distributed(self) -> Distributed | None:
        return self._dp

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel`` wrapper: its all-reduce of unclipped gradients
        would bypass clipping; dpfy all-reduces the clipped sums instead."""


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

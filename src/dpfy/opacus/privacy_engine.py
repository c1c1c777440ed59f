"""``PrivacyEngine``: Opacus 1.6's entry point, run by dpfy's machinery.

A script written for Opacus is ported by one import: ``from opacus import PrivacyEngine``
becomes ``from dpfy.opacus import PrivacyEngine``. ``make_private`` and
``make_private_with_epsilon`` take Opacus' keywords and return what Opacus returns
(``(module, optimizer, data_loader)``, or with ``grad_sample_mode="ghost"``
``(module, optimizer, criterion, data_loader)``), and the loop does not change. Underneath is
:func:`dpfy.training.make_private`:

* the batches are drawn by a dpfy sampler that states its privacy event: with
  ``poisson_sampling=True`` a :class:`~dpfy.sampling.poisson.PoissonSampler` with Opacus'
  sampling rate ``q = 1 / len(data_loader)`` and ``len(data_loader)`` steps per epoch;
* every release is written to a ledger (``run_dir/ledger.jsonl``) before its noise exists, and
  ``get_epsilon`` and ``accountant.get_epsilon`` read that ledger
  (:mod:`dpfy.opacus.accountant` says which dpfy accountant answers for each Opacus name);
* sampling and noise come from the secure generator unless a seed is given;
* the model is never wrapped: ``module`` comes back as the same object, and Opacus'
  ``model._module`` is that object too (``torch.save(model._module.state_dict(), ...)`` saves
  the user's model as in Opacus);
* the ledger closes itself when the planned epochs are done, at :meth:`write_report` and at
  interpreter exit, its end record saying whether the plan ran (:mod:`dpfy.training.closing`);
* a second ``make_private`` (a script's next run, Opacus' ``--n-runs``) may take the loader the
  first one returned: its batches are drawn afresh from the original ``DataLoader``'s data.

What Opacus allows and would break the stated guarantee is refused, with the reason, before
anything is written: an accountant stepped by hand, a seeded ``noise_generator`` passed off as
a private run, more epochs than the noise was calibrated for (the data loader raises
:class:`dpfy.training.BudgetExceededError` rather than going on). ``poisson_sampling=False``
is honoured honestly: the loader's shuffled (or fixed-order) batches are drawn by dpfy's shuffle
(or deterministic) sampler and accounted with the bound their event admits, which is much
larger than the Poisson epsilon Opacus would print for the same run.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, default_collate

from dpfy.ledger import Ledger
from dpfy.opacus._compat import DISTRIBUTED, refuse
from dpfy.opacus.accountant import LedgerAccountant
from dpfy.opacus.data_loader import DPDataLoader
from dpfy.opacus.optimizer import DPOptimizer
from dpfy.opacus.outputs import OutputGradients, Reduction
from dpfy.opacus.validators.module_validator import ModuleValidator
from dpfy.randomness import Randomness
from dpfy.sampling.deterministic import DeterministicSampler
from dpfy.sampling.poisson import PoissonSampler
from dpfy.sampling.shuffle import ShuffleSampler
from dpfy.training import PrivateOptions, make_private
from dpfy.training.loader import check_dataset
from dpfy.training.torchrun import torchrun_env

#: Where a run's ledger and report go unless ``run_dir`` says otherwise (``{time}``: the local
#: time of the first ``make_private``, ``YYYYmmdd-HHMMSS``; relative to the working directory).
DEFAULT_RUN_DIR = "runs/opacus-{time}"
#: Opacus' per-example gradient implementations: all of them are dpfy's one exact path here.
_MODES = ("hooks", "functorch", "ew", "ghost")
#: Opacus' rarer keywords of make_private, accepted by name (``_opacus_options``).
_OPTIONS = ("loss_reduction", "batch_first", "noise_generator", "wrap_model", "rand_on_empty",
            "epsilon_tolerance")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    """One ``make_private`` call, its arguments checked."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    data_loader: DataLoader[Any]
    max_grad_norm: float
    criterion: Any
    poisson_sampling: bool
    grad_sample_mode: str
    loss_reduction: Reduction
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float | None = None
    epochs: int | None = None


class PrivacyEngine:
    """Opacus' ``PrivacyEngine`` over dpfy (module docstring).

    Args:
      accountant: Opacus' accountant name, ``"prv"`` (the default, as in Opacus), ``"rdp"`` or
        ``"gdp"``, or dpfy's ``"pld"``; which dpfy accountant answers for each is in
        :mod:`dpfy.opacus.accountant` (``prv`` and ``gdp``: the PLD upper bound; ``rdp``: RDP).
      secure_mode: accepted for compatibility and changes nothing: dpfy's sampling and noise
        come from the secure generator (an AES-256-CTR keystream keyed from the operating
        system) whether it is True or False. In Opacus, False (its default) means PyTorch's
        seedable generator, so the released model is reproducible by anyone who learns the
        seed; that is an experiment, not a DP release, and dpfy never makes it one silently
        (the secure generator costs 1.0-1.12x of a seeded step, ``benchmarks/secure_noise.py``).
        No ``torchcsprng`` is needed.
      run_dir: folder of the run's ledger (``ledger.jsonl``) and report (:meth:`write_report`),
        made at the first ``make_private``; default ``runs/opacus-{time}``. A folder that
        already holds a ledger is refused (a ledger belongs to one run). None: an in-memory
        ledger and no files.
      seed: a seeded experiment instead of a DP release: sampling and noise reproducible from
        ``seed``, recorded so in the ledger and the report ("not a DP release"). Not with
        ``secure_mode=True``.

    Attributes:
      accountant: a :class:`~dpfy.opacus.accountant.LedgerAccountant` (``get_epsilon``,
        ``mechanism``, ``len``) reading this engine's ledger.
      run_dir: the resolved folder (None before the first ``make_private`` or without files).
    """

    def __init__(
        self,
        *,
        accountant: str = "prv",
        secure_mode: bool = False,
        run_dir: str | os.PathLike[str] | None = DEFAULT_RUN_DIR,
        seed: int | None = None,
    ) -> None:
        self.accountant = LedgerAccountant(accountant)
        if seed is not None:
            if secure_mode:
                raise ValueError(
                    "seed must be None with secure_mode=True (a seeded run is reproducible by "
                    f"anyone who knows the seed), got seed={seed!r}"
                )
            if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
                raise ValueError(f"seed must be an integer in [0, inf), got seed={seed!r}")
        if accountant == "gdp":
            warnings.warn(
                "accountant='gdp' is Opacus' central-limit approximation, not an upper bound "
                "(about 30% below the true epsilon on runs of tens of steps); dpfy accounts the "
                "run with its PLD upper bound instead (accountant.mechanism() == 'pld')",
                stacklevel=2,
            )
        self.secure_mode = bool(secure_mode)
        self.seed = None if seed is None else int(seed)
        self.run_dir: Path | None = None
        self.dataset: Any = None
        self._run_dir = run_dir
        self._ledger: Ledger | None = None
        self._delta: float | None = None
        self._made_folder = False
        self._close_ledger: Any = None  # the latest run's PrivateOptimizer.close_ledger

    # -- reading the ledger -----------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """The run's ledger (it exists once ``make_private`` has run)."""
        if self._ledger is None:
            raise RuntimeError("the ledger exists once make_private has run")
        return self._ledger

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta``: ``accountant.get_epsilon(delta)``, the ledger's."""
        return self.accountant.get_epsilon(delta)

    def write_report(self, delta: float | None = None) -> Path:
        """Close the ledger, then write ``report.md`` and ``report.json`` beside it; returns
        the folder.

        The end record says whether every planned release was made (an engine without planned
        epochs: how many were made), so the report is complete but never reads a run stopped
        early as its plan; training on afterwards reopens the ledger with a resume marker
        (:mod:`dpfy.training.closing`; the ledger also closes itself when the planned epochs
        are done and at interpreter exit). ``delta`` defaults to ``target_delta`` of
        ``make_private_with_epsilon``.
        """
        from dpfy.report.statement import build_report

        if self.run_dir is None:
            raise RuntimeError("write_report needs a run_dir (this engine keeps no files)")
        d = self._delta if delta is None else delta
        if d is None:
            raise ValueError("delta must be given: no target_delta was set, got delta=None")
        if self._close_ledger is not None:
            self._close_ledger("write_report", delta=d)
        report = build_report(
            self.ledger, delta=d, method=self.accountant.method,
            ledger_path=str(self.run_dir / "ledger.jsonl"),
        )
        for name, text in (("report.json", report.to_json()), ("report.md", report.to_markdown())):
            (self.run_dir / name).write_text(text, encoding="utf-8")
        return self.run_dir

    # -- making a run private ---------------------------------------------------------------
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        noise_multiplier: float,
        max_grad_norm: float,
        criterion: Any = None,
        poisson_sampling: bool = True,
        clipping: str = "flat",
        grad_sample_mode: str = "hooks",
        **opacus_options: Any,
    ) -> tuple[Any, ...]:
        """Opacus' ``make_private`` with a given noise multiplier (no budget, no planned end).

        Args:
          module, optimizer, data_loader: the model, its optimizer and a ``DataLoader`` over a
            map-style dataset (one item = one example, the unit of privacy).
          noise_multiplier: z >= 0 (noise standard deviation / ``max_grad_norm``); 0 releases
            without noise and the ledger says epsilon = infinity (debugging only).
          max_grad_norm: L2 clip norm C of each example's gradient (one float: flat clipping).
          criterion: the loss of ``grad_sample_mode="ghost"`` (default cross-entropy); dpfy
            evaluates it per example.
          poisson_sampling: True (Poisson, ``q = 1 / len(data_loader)``); False keeps the
            loader's batches (shuffled or in order) and accounts them honestly (module
            docstring).
          clipping: ``"flat"`` only; ``"per_layer"`` and ``"adaptive"`` are refused.
          grad_sample_mode: ``"hooks"`` (default), ``"functorch"`` or ``"ew"`` return
            ``(module, optimizer, data_loader)`` and read each example's gradient off the
            loop's own ``loss.backward()`` (:mod:`dpfy.opacus.outputs`, with its assumption
            on the loss); ``"ghost"`` returns ``(module, optimizer, criterion, data_loader)``
            and computes per-example losses with ``criterion``.
          **opacus_options: Opacus' rarer keywords: ``loss_reduction`` (``"mean"``, default,
            or ``"sum"``: how the loop's loss reduces over rows), ``batch_first`` (True only:
            dpfy reads dimension 0 as the example), ``noise_generator`` (None only: pass
            ``PrivacyEngine(seed=...)`` for a seeded experiment), ``wrap_model`` and
            ``rand_on_empty`` (accepted: the model is never wrapped, a batch is never empty:
            an empty Poisson draw is one weight-0 row), ``epsilon_tolerance`` (accepted:
            calibration is always to the safe side of the target).

        Raises:
          TypeError, ValueError: an argument dpfy cannot honour, with the reason.
          dpfy.training.UnsupportedModuleError: layers that are not private (BatchNorm, ...).
        """
        return self._make(
            _Request(
                module=module, optimizer=optimizer, data_loader=data_loader,
                max_grad_norm=_clip_norm(max_grad_norm, clipping), criterion=criterion,
                poisson_sampling=poisson_sampling,
                grad_sample_mode=_mode(grad_sample_mode),
                loss_reduction=_opacus_options(opacus_options),
                noise_multiplier=float(noise_multiplier),
            )
        )

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float,
        criterion: Any = None,
        poisson_sampling: bool = True,
        clipping: str = "flat",
        grad_sample_mode: str = "hooks",
        **opacus_options: Any,
    ) -> tuple[Any, ...]:
        """Opacus' ``make_private_with_epsilon``: the noise calibrated to a budget.

        The noise multiplier is the smallest that keeps ``epochs`` epochs within
        ``(target_epsilon, target_delta)`` for the sampler's event and this engine's accountant
        (on the safe side of the target, not within Opacus' ``epsilon_tolerance`` of it), and a
        budget guard refuses any step past the target: an epoch beyond ``epochs`` raises
        :class:`dpfy.training.BudgetExceededError` instead of running. Other arguments as
        :meth:`make_private`.
        """
        made = self._make(
            _Request(
                module=module, optimizer=optimizer, data_loader=data_loader,
                max_grad_norm=_clip_norm(max_grad_norm, clipping), criterion=criterion,
                poisson_sampling=poisson_sampling,
                grad_sample_mode=_mode(grad_sample_mode),
                loss_reduction=_opacus_options(opacus_options),
                target_epsilon=float(target_epsilon), target_delta=float(target_delta),
                epochs=int(epochs),
            )
        )
        self._delta = float(target_delta)  # the report's default delta
        return made

    def _make(self, r: _Request) -> tuple[Any, ...]:
        launch = torchrun_env()
        if launch is not None and launch.world_size > 1:
            refuse(RuntimeError(f"make_private in {launch.world_size} processes: {DISTRIBUTED}"))
        loader = r.data_loader
        if isinstance(loader, DPDataLoader):  # a script's next run (Opacus' --n-runs)
            loader = loader.original  # its batches are drawn afresh by this run's sampler
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"data_loader must be a torch DataLoader, got {type(loader).__name__}"
            )
        check_dataset(loader.dataset, "data_loader.dataset")  # map-style: dpfy draws by index
        optimizer = r.optimizer
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        stream = self._sampling_stream()
        sampler = _sampler(loader, r.poisson_sampling, stream)
        # shuffled and fixed-order batches: the no-amplification bound ("shuffle" accounts both)
        method = self.accountant.method if r.poisson_sampling else "shuffle"
        if self._ledger is not None and method != self.accountant.method:
            raise ValueError(
                f"one engine accounts one ledger with one accountant: this run needs "
                f"{method!r}, the engine's earlier run {self.accountant.method!r}; use a new "
                "PrivacyEngine"
            )
        outputs = None
        if r.grad_sample_mode != "ghost":
            outputs = OutputGradients(r.module, r.loss_reduction)
            loss_fn: Any = outputs  # its per_example_losses, marked not recomputable
        else:
            loss_fn = nn.CrossEntropyLoss() if r.criterion is None else r.criterion
        workers = int(loader.num_workers)
        loader_kwargs: dict[str, Any] = {"pin_memory": bool(loader.pin_memory)}
        if workers > 0:
            loader_kwargs.update(
                prefetch_factor=loader.prefetch_factor,
                persistent_workers=loader.persistent_workers,
                worker_init_fn=loader.worker_init_fn,
            )
        ledger = self._open_ledger()
        try:
            private = make_private(
                r.module, optimizer, loader.dataset,
                target_epsilon=r.target_epsilon, delta=r.target_delta, epochs=r.epochs,
                clip_norm=r.max_grad_norm, sampler=sampler, loss_fn=loss_fn,
                randomness=self._noise(),
                options=PrivateOptions(
                    ledger=ledger, accounting=method, on_budget="raise",
                    collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
                    num_workers=workers, loader_kwargs=loader_kwargs,
                    noise_multiplier=r.noise_multiplier,
                ),
            )
        except BaseException:
            if ledger is not self._ledger:
                self._forget(ledger)
            raise
        self._ledger = ledger
        self.accountant.method = method
        self.accountant.ledger = ledger
        self.dataset = loader.dataset
        self._close_ledger = private.optimizer.close_ledger
        private.loader.batch_sampler.pad = False  # the loop sees real rows only (as Opacus)
        _set_module(r.module)
        dp_loader = DPDataLoader(private.loader, outputs, loader)
        dp_optimizer = DPOptimizer(
            private.optimizer, private.criterion, outputs, r.max_grad_norm,
            sampler.expected_batch_size,
        )
        if r.grad_sample_mode == "ghost":
            return r.module, dp_optimizer, private.criterion, dp_loader
        return r.module, dp_optimizer, dp_loader

    # -- Opacus' checks ---------------------------------------------------------------------
    def is_compatible(self, *, module: nn.Module, optimizer: Any = None,
                      data_loader: Any = None) -> bool:
        """Whether ``module`` trains privately as is (``ModuleValidator.is_valid``)."""
        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer: Any = None,
                 data_loader: Any = None) -> None:
        """Raise :class:`dpfy.training.UnsupportedModuleError` listing every problem."""
        ModuleValidator.validate(module, strict=True)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """A fixed copy of ``module`` (``ModuleValidator.fix``), validated."""
        fixed = ModuleValidator.fix(module)
        ModuleValidator.validate(fixed, strict=True)
        return fixed

    def save_checkpoint(self, **_: Any) -> None:
        """Refused: the ledger is the privacy state and it is on disk already."""
        raise NotImplementedError(
            "save_checkpoint is not part of dpfy.opacus: the run's privacy state is its ledger "
            "(run_dir/ledger.jsonl, written before every release); save the model and "
            "optimizer with torch.save, or use dpfy.training.PrivateTrainer's checkpoints"
        )

    def load_checkpoint(self, **_: Any) -> None:
        """Refused: a restored accountant state could understate what the ledger holds."""
        raise NotImplementedError(
            "load_checkpoint is not part of dpfy.opacus: an accountant state loaded from a "
            "checkpoint could describe fewer releases than happened; resume with "
            "dpfy.training.PrivateTrainer, whose checkpoints carry the ledger"
        )

    # -- where things go --------------------------------------------------------------------
    def _noise(self) -> Randomness:
        return Randomness.secure_mode() if self.seed is None else Randomness(self.seed)

    def _sampling_stream(self) -> Randomness:
        """The sampler's stream: secure, or seeded apart from the noise stream."""
        if self.seed is None:
            return Randomness.secure_mode()
        state = np.random.SeedSequence([self.seed, 0x4F50]).generate_state(1, np.uint64)
        return Randomness(int(state[0]))

    def _open_ledger(self) -> Ledger:
        if self._ledger is not None:
            return self._ledger
        if self._run_dir is None:
            return Ledger()
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = Path(os.fspath(self._run_dir).format(time=stamp))
        if self._run_dir == DEFAULT_RUN_DIR:  # a fresh folder, never another run's
            base, n = folder, 1
            while (folder / "ledger.jsonl").exists():
                n += 1
                folder = base.with_name(f"{base.name}-{n}")
        elif (folder / "ledger.jsonl").exists():
            raise FileExistsError(
                f"run_dir must be a folder without a ledger (a ledger belongs to one run), got "
                f"run_dir={os.fspath(folder)!r} holding ledger.jsonl"
            )
        self._made_folder = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        self.run_dir = folder
        return Ledger(folder / "ledger.jsonl")

    def _forget(self, ledger: Ledger) -> None:
        """A refused first make_private leaves no ledger file (nor a folder it made) behind."""
        ledger.close()
        folder, self.run_dir = self.run_dir, None
        if ledger.path is not None and folder is not None:
            Path(ledger.path).unlink(missing_ok=True)
            if self._made_folder and not any(folder.iterdir()):
                folder.rmdir()

    def __repr__(self) -> str:
        return f"PrivacyEngine(accountant={self.accountant!r}, run_dir={self.run_dir})"


def _set_module(module: nn.Module) -> None:
    """Opacus' ``model._module`` (the user's model inside its wrapper) is the model itself
    here: written into the instance's ``__dict__``, not registered as a submodule, so the
    model's ``state_dict``, ``modules()`` and ``parameters()`` do not change. A model with an
    ``_module`` of its own keeps it."""
    if not hasattr(module, "_module"):
        object.__setattr__(module, "_module", module)


def _sampler(loader: DataLoader[Any], poisson: bool, stream: Randomness) -> Any:
    """The dpfy sampler that draws the run's batches (Opacus' sampling rate for Poisson)."""
    n = len(loader.dataset)  # type: ignore[arg-type]
    if poisson:
        steps = len(loader)
        return PoissonSampler(n, 1.0 / steps, steps_per_epoch=steps, randomness=stream)
    inner, size = loader.sampler, loader.batch_size
    if size is None:
        raise ValueError(
            "poisson_sampling=False needs a DataLoader with a batch_size (a custom batch_sampler "
            "has no privacy event dpfy can state); use poisson_sampling=True"
        )
    if isinstance(inner, RandomSampler) and not inner.replacement and len(inner) == n:
        return ShuffleSampler(n, int(size), drop_last=loader.drop_last, randomness=stream)
    if isinstance(inner, SequentialSampler):
        return DeterministicSampler(n, int(size), drop_last=loader.drop_last, randomness=stream)
    raise ValueError(
        f"poisson_sampling=False keeps the loader's batches only when they are shuffled or in "
        f"order (shuffle=True or False), got a {type(inner).__name__}, whose privacy event dpfy "
        "cannot state; use poisson_sampling=True"
    )


def _mode(grad_sample_mode: str) -> str:
    if grad_sample_mode == "ghost_fsdp":
        raise ValueError(
            "grad_sample_mode='ghost_fsdp' is not part of dpfy.opacus (one process); FSDP2 "
            "sharding is dpfy's own: PrivateGradient with a Distributed (docs/architecture.md, "
            "5.18)"
        )
    if grad_sample_mode not in _MODES:
        allowed = ", ".join(_MODES)
        raise ValueError(
            f"grad_sample_mode must be one of {{{allowed}}}, got "
            f"grad_sample_mode={grad_sample_mode!r}"
        )
    return grad_sample_mode


def _clip_norm(max_grad_norm: Any, clipping: str) -> float:
    if clipping != "flat":
        raise ValueError(
            f"clipping must be 'flat' in dpfy.opacus (one norm per example), got "
            f"clipping={clipping!r}; per-layer clip norms are dpfy's NestedQuery with "
            "PrivateGradient, adaptive clipping its AdaptiveClipQuery"
        )
    if isinstance(max_grad_norm, list | tuple):
        raise ValueError(
            "max_grad_norm must be one float with clipping='flat', got a list (per-layer norms)"
        )
    return float(max_grad_norm)


def _opacus_options(options: dict[str, Any]) -> Reduction:
    """Check Opacus' rarer keywords (see ``make_private``); returns ``loss_reduction``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"make_private() got an unexpected keyword argument {unknown[0]!r}")
    if options.get("batch_first", True) is not True:
        raise ValueError(
            "batch_first must be True: dpfy's per-example rules read dimension 0 of every "
            "layer's input as the example, got batch_first=False"
        )
    if options.get("noise_generator") is not None:
        raise ValueError(
            "noise_generator must be None: noise from a generator the script seeds is "
            "reproducible by anyone with the seed, so the model is not a DP release; pass "
            "PrivacyEngine(seed=...) for a seeded experiment (recorded as one)"
        )
    reduction = options.get("loss_reduction", "mean")
    if reduction == "sum":
        return "sum"
    if reduction != "mean":
        raise ValueError(
            f"loss_reduction must be one of {{mean, sum}}, got loss_reduction={reduction!r}"
        )
    return "mean"

"""The private run a ``DPStrategy`` fit trains: built, reported, checkpointed and resumed.

:class:`PrivateRun` assembles what ``dpfy.opacus.PrivacyEngine.make_private_with_epsilon``
assembles (docs/architecture.md, 5.20): a Poisson sampler at Opacus' rate
``q = 1 / steps_per_epoch``, :func:`dpfy.training.make_private` with the per-example losses
read off the user's own ``loss.backward()`` (:class:`dpfy.opacus.outputs.OutputGradients`),
wrapped as the loader and optimizer Lightning drives. Two things the engine does not do are
done here:

* **Several processes.** With a :class:`dpfy.training.distributed.Distributed` the run is
  dpfy's data-parallel step (5.18): rank 0 draws every Poisson batch and broadcasts it, each
  rank takes its part of the rows, the clipped sums are all-reduced, rank 0 alone writes the
  ledger and draws the noise once, and the other ranks keep an in-memory mirror ledger.
* **Checkpoints.** :meth:`state` is what a Lightning checkpoint carries of the run: the
  ledger's position (file, run id, line count and chain head, signed:
  :func:`dpfy.training.checkpoint.ledger_state`), the releases it held, the sampler's position
  (and its generator state when seeded), the noise generator's state when seeded, the
  hyperparameters that shape the privacy and the noise multiplier. A run built with that state
  (``resume=``) appends to the same ledger file, never rewinding it: releases made after the
  checkpoint by a process that then died stay in the ledger and are counted, the planned
  releases count from the ledger's start (so they include those lost ones), and the budget
  guard stops the resumed run once the ledger has spent the target. A seeded run restores both
  generators; a secure run cannot continue its operating-system-keyed stream and draws a fresh
  key. The ledger records the resume (its resume marker, and a ``resumed_from_checkpoint``
  metadata record saying how many releases the checkpoint and the ledger held).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from dpfy.ledger import Ledger
from dpfy.ledger.records import record_from_dict
from dpfy.opacus.accountant import method_for
from dpfy.opacus.data_loader import DPDataLoader
from dpfy.opacus.optimizer import DPOptimizer
from dpfy.opacus.outputs import OutputGradients
from dpfy.randomness import Randomness
from dpfy.sampling.poisson import PoissonSampler
from dpfy.training import PrivateOptions, make_private
from dpfy.training.checkpoint import (
    CheckpointMismatchError,
    check_randomness_modes,
    ledger_state,
    randomness_mode,
    restore_ledger,
)
from dpfy.training.distributed import Distributed
from dpfy.training.loader import check_dataset
from dpfy.training.resume import check_resume, run_hyperparameters

#: The key of a Lightning checkpoint that holds :meth:`PrivateRun.state`.
CHECKPOINT_KEY = "dpfy"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """What the user gave ``DPStrategy`` (checked by :func:`check_settings`)."""

    target_epsilon: float
    delta: float
    clip_norm: float
    run_dir: str | os.PathLike[str] | None
    accountant: str
    seed: int | None


def check_settings(s: Settings) -> None:
    """One-line errors for arguments out of range, before Lightning starts anything."""
    for name, value in (("target_epsilon", s.target_epsilon), ("clip_norm", s.clip_norm)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be in (0, inf), got {name}={value!r}")
    if not 0 < s.delta < 1:
        raise ValueError(f"delta must be in (0, 1), got delta={s.delta!r}")
    method_for(s.accountant)  # names the accepted accountants
    if s.seed is not None and (isinstance(s.seed, bool) or not isinstance(s.seed, int)
                               or s.seed < 0):
        raise ValueError(f"seed must be an integer in [0, inf), got seed={s.seed!r}")


def steps_per_epoch(loader: DataLoader[Any]) -> int:
    """Logical batches an epoch: ``len(loader)`` of the user's loader, or of the whole dataset
    when Lightning gave it a ``DistributedSampler`` (each rank's share would be shorter)."""
    if isinstance(loader.sampler, DistributedSampler) and loader.batch_size:
        n, b = len(loader.dataset), int(loader.batch_size)  # type: ignore[arg-type]
        return n // b if loader.drop_last else math.ceil(n / b)
    return len(loader)


class PrivateRun:
    """One fit's private run (module docstring).

    Args:
      settings: the strategy's arguments.
      module, optimizer, loader: the ``LightningModule``, its one optimizer and the training
        ``DataLoader`` Lightning built (only its dataset, length and loading options are read).
      epochs: ``trainer.max_epochs``, the plan the noise is calibrated to.
      distributed: this process of a data-parallel run, or None (one process).
      resume: :meth:`state` of the checkpoint being resumed, or None (a fresh run).

    Attributes:
      loader: the private loader (a :class:`dpfy.opacus.data_loader.DPDataLoader`).
      optimizer: the private optimizer (a :class:`dpfy.opacus.optimizer.DPOptimizer`).
      ledger: the run's ledger (rank 0's file, or an in-memory mirror on another rank).
      run_dir: the folder of the ledger and report on rank 0 (None: in memory, or a mirror).
    """

    def __init__(
        self,
        settings: Settings,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: DataLoader[Any],
        *,
        epochs: int,
        distributed: Distributed | None,
        resume: dict[str, Any] | None,
    ) -> None:
        check_dataset(loader.dataset, "train_dataloader().dataset")
        self.settings, self.distributed = settings, distributed
        self.method = method_for(settings.accountant)
        self.releases = distributed is None or distributed.releases
        steps = steps_per_epoch(loader)
        n = len(loader.dataset)  # type: ignore[arg-type]
        sampling, noise = _streams(settings.seed)
        sampler = PoissonSampler(n, 1.0 / steps, steps_per_epoch=steps, randomness=sampling)
        self.run_dir = None if settings.run_dir is None or not self.releases else Path(
            settings.run_dir)
        self.hyperparameters = run_hyperparameters(
            target_epsilon=settings.target_epsilon, clip_norm=settings.clip_norm,
            delta=settings.delta, epochs=int(epochs),
            expected_batch_size=sampler.expected_batch_size, microbatch_size=None,
            accounting=self.method,
        )
        if resume is not None:  # refused before the ledger is opened (nothing written)
            check_resume(resume["hyperparameters"], self.hyperparameters, raise_budget=False,
                         step=int(resume["releases"]))
            check_randomness_modes(resume["randomness"], {
                "noise": randomness_mode(noise), "sampling": randomness_mode(sampling)})
        self.ledger = self._opened_on_every_rank(resume)
        outputs = OutputGradients(module, "mean")
        options = PrivateOptions(
            ledger=self.ledger, accounting=self.method, on_budget="stop",
            collate_fn=None if loader.collate_fn is default_collate else loader.collate_fn,
            num_workers=int(loader.num_workers), loader_kwargs=_loader_kwargs(loader),
            distributed=distributed,
        )
        try:
            private = make_private(
                module, optimizer, loader.dataset, target_epsilon=settings.target_epsilon,
                delta=settings.delta, epochs=int(epochs), clip_norm=settings.clip_norm,
                sampler=sampler, loss_fn=outputs, randomness=noise, options=options,
            )
        except BaseException:
            self._forget(fresh=resume is None)
            raise
        private.loader.batch_sampler.pad = False  # training_step sees real rows (as Opacus)
        self.loader = DPDataLoader(private.loader, outputs, loader)
        self.optimizer = DPOptimizer(
            private.optimizer, private.criterion, outputs, settings.clip_norm,
            sampler.expected_batch_size,
        )
        if resume is not None:
            self._resume(resume)

    # -- the ledger ------------------------------------------------------------------------
    def _open_ledger(self, resume: dict[str, Any] | None) -> Ledger:
        """Rank 0's file (fresh, or the checkpoint's, appended to), or an in-memory ledger:
        without a run_dir, or on another rank a mirror of rank 0's records."""
        if not self.releases:
            return Ledger.from_records(record_from_dict(r) for r in self._rank0_records())
        if self.run_dir is None:
            ledger = Ledger()
            if resume is not None:
                restore_ledger(ledger, resume["ledger"])
            return ledger
        path = self.run_dir / "ledger.jsonl"
        if resume is None and path.exists():
            raise FileExistsError(
                f"run_dir must be a folder without a ledger (a ledger belongs to one run; "
                f"resume it with fit(ckpt_path=...)), got run_dir={os.fspath(self.run_dir)!r} "
                "holding ledger.jsonl"
            )
        if resume is not None and not path.exists():
            raise CheckpointMismatchError(
                f"the checkpoint's ledger {resume['ledger'].get('path')!r} must be in run_dir "
                f"to resume (its releases must stay counted), got run_dir="
                f"{os.fspath(self.run_dir)!r} without ledger.jsonl"
            )
        if resume is not None:  # read-only first: another run's ledger is refused untouched
            restore_ledger(Ledger.load(path), resume["ledger"])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ledger = Ledger(path)
        if resume is not None:
            try:
                with warnings.catch_warnings():  # said once, above
                    warnings.simplefilter("ignore")
                    restore_ledger(ledger, resume["ledger"])
            except BaseException:
                ledger.close()
                raise
        return ledger

    def _forget(self, *, fresh: bool) -> None:
        """A run refused by ``make_private`` (a layer that is not private, ...) releases its
        ledger file; a fresh one, holding only its header, is removed with it (and run_dir
        if it is left empty), so that the corrected script can start in the same run_dir."""
        self.ledger.close()
        if fresh and self.ledger.path is not None and self.run_dir is not None:
            Path(self.ledger.path).unlink(missing_ok=True)
            if not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()

    def _opened_on_every_rank(self, resume: dict[str, Any] | None) -> Ledger:
        """:meth:`_open_ledger`; rank 0 then sends the other ranks its ledger's records (their
        mirrors start from them: a resumed run) or, when it refused, its error, which they
        raise at once instead of waiting for a collective that never comes."""
        d = self.distributed
        if d is None or d.world_size == 1 or not self.releases:
            return self._open_ledger(resume)
        try:
            ledger = self._open_ledger(resume)
        except BaseException as error:
            refusal = f"{type(error).__name__}: {error}"
            dist.broadcast_object_list([None, refusal], src=0, group=d.group)
            raise
        records = [r.to_dict() for r in ledger.entries]
        dist.broadcast_object_list([records, None], src=0, group=d.group)
        return ledger

    def _rank0_records(self) -> list[dict[str, Any]]:
        d = self.distributed
        assert d is not None
        box: list[Any] = [None, None]
        dist.broadcast_object_list(box, src=0, group=d.group)
        if box[1] is not None:
            raise RuntimeError(f"rank 0 refused the run ({box[1]}); rank {d.rank} stops too")
        return list(box[0])

    # -- checkpoints -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a Lightning checkpoint carries of the run (module docstring); on a rank other
        than 0 nothing (only rank 0 writes checkpoints)."""
        if not self.releases:
            return {}
        engine = self._engine()
        sampler = engine.sampler
        state: dict[str, Any] = {
            "ledger": ledger_state(self.ledger),
            "releases": len(self.ledger.noise_multipliers()),
            "sampler": _plain(sampler.state_dict()),
            "noise_multiplier": float(engine.z),
            "hyperparameters": dict(self.hyperparameters),
            "randomness": {
                "noise": randomness_mode(engine.randomness),
                "sampling": randomness_mode(sampler.randomness),
            },
        }
        if not engine.randomness.secure:
            state["noise"] = _plain(engine.randomness.state_dict())
        return state

    def _resume(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state` (module docstring)."""
        engine = self._engine()
        if not math.isclose(float(saved["noise_multiplier"]), engine.z, rel_tol=1e-12):
            raise CheckpointMismatchError(
                f"the noise multiplier must be {saved['noise_multiplier']!r} to resume this "
                f"checkpoint (its releases were calibrated with it), got {engine.z!r}"
            )
        engine.sampler.load_state_dict(saved["sampler"])  # a secure stream goes on with fresh bits
        if "noise" in saved and not engine.randomness.secure:  # seeded: the same stream
            engine.randomness.load_state_dict(saved["noise"])
        engine.epoch = int(saved["sampler"]["epoch"])  # the epoch in progress begins again
        in_ledger = len(self.ledger.noise_multipliers())
        engine.steps = in_ledger
        engine.closer._first = 0  # the plan counts every release of this ledger
        if self.releases:
            secure = engine.randomness.secure
            self.ledger.record_metadata(resumed_from_checkpoint={
                "releases_in_checkpoint": int(saved["releases"]),
                "releases_in_ledger": in_ledger,
                "releases_lost": in_ledger - int(saved["releases"]),
                "randomness": "a fresh secure key" if secure else "the checkpoint's seeded state",
                "key_commitments": engine.facts.get("key_commitments"),  # the fresh keys'
            })

    def _engine(self) -> Any:
        """The run's shared state (:func:`dpfy.training.make_private`'s engine)."""
        return self.optimizer.private._engine

    # -- reading and closing ---------------------------------------------------------------
    def epsilon(self, delta: float) -> float:
        return float(self.optimizer.private.epsilon(delta, self.method))

    def close(self, how: str) -> None:
        """Close the ledger (its end record says how the run ended) and, on rank 0 with a
        run_dir, write ``report.md`` and ``report.json`` beside it."""
        self.optimizer.private.close_ledger(how)
        if self.run_dir is None or not self.releases:
            return
        from dpfy.report.statement import build_report

        report = build_report(
            self.ledger, delta=self.settings.delta, method=self.method,
            ledger_path=str(self.run_dir / "ledger.jsonl"),
        )
        for name, text in (("report.json", report.to_json()), ("report.md", report.to_markdown())):
            (self.run_dir / name).write_text(text, encoding="utf-8")


def _streams(seed: int | None) -> tuple[Randomness, Randomness]:
    """(sampling, noise) streams: secure, or seeded apart as ``dpfy.opacus.PrivacyEngine``
    seeds them (the same seed draws the same batches and noise as that engine)."""
    if seed is None:
        return Randomness.secure_mode(), Randomness.secure_mode()
    state = np.random.SeedSequence([seed, 0x4F50]).generate_state(1, np.uint64)
    return Randomness(int(state[0])), Randomness(seed)


def _loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"pin_memory": bool(loader.pin_memory)}
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor,
                      persistent_workers=loader.persistent_workers,
                      worker_init_fn=loader.worker_init_fn)
    return kwargs


def _plain(obj: Any) -> Any:
    """A sampler or generator state as plain data (NumPy arrays as lists, scalars as numbers),
    which ``torch.load(weights_only=True)`` reads back."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj

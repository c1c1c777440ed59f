"""Checkpoint and resume: model, optimizer, sampler, randomness, ledger and trainer position.

A resumed run must account exactly as an uninterrupted one, and in seeded mode reproduce it.
That needs every piece of state that decides what happens next:

* model and optimizer ``state_dict`` (and the EMA copy of the weights, if any);
* the sampler's position and generator state (epoch samplers also save the epoch's layout, so
  "every example once per epoch" survives a mid-epoch restart even with secure randomness);
* the noise generator's state (seeded mode; secure randomness has no state and continues with
  fresh bits) and torch's global generator (dropout and other in-model randomness);
* the ledger. A ledger *file* is the source of truth and is never rewound: the checkpoint
  records how many samples it held, and on resume :func:`restore_ledger` checks that the file
  holds at least that many. Steps that ran after the checkpoint stay in the file (their noisy
  values existed), so a run restarted from an older checkpoint over-counts, never under-counts.
  An in-memory ledger is stored in the checkpoint (its records' ``to_dict``) and replayed into
  a fresh ledger through :meth:`dpfy.ledger.Ledger.replay`, the path a ledger file is read by.

Files are written atomically (temporary file + ``os.replace``): a crash while saving leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from dpfy.ledger import Ledger, record_from_dict

__all__ = [
    "CheckpointMismatchError",
    "ledger_state",
    "load_checkpoint",
    "restore_ledger",
    "save_checkpoint",
]

FORMAT = "dpfy-checkpoint"
VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the run it is loaded into (e.g. a ledger that lost steps)."""


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, numpy arrays, plain Python) to ``path`` atomically.

    Returns:
      The checkpoint path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **state}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
      CheckpointMismatchError: the file is not a dpfy checkpoint of a known version.
    """
    # weights_only=False: the state holds numpy arrays (sampler layouts, generator states).
    # Only load checkpoints you wrote yourself.
    payload = torch.load(Path(path), map_location="cpu", weights_only=False)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{path} is not a dpfy checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointMismatchError(
            f"checkpoint version must be {VERSION}, got version={payload.get('version')!r}"
        )
    return payload


def ledger_state(ledger: Ledger) -> dict[str, Any]:
    """What a checkpoint keeps of a ledger: its file and size, or (in memory) its entries."""
    state: dict[str, Any] = {"samples": ledger.iteration, "entries_count": len(ledger)}
    if ledger.path is not None:
        state["path"] = os.path.abspath(ledger.path)
    else:
        state["entries"] = [record.to_dict() for record in ledger.entries]
    return state


def restore_ledger(ledger: Ledger, state: dict[str, Any]) -> None:
    """Bring ``ledger`` to the checkpointed state (see the module docstring).

    Args:
      ledger: the resumed run's ledger: ``Ledger(path)`` on the same file (it re-reads the
        file and appends), or an empty in-memory ledger into which the saved entries are
        replayed (:meth:`dpfy.ledger.Ledger.replay`).
      state: ``ledger_state`` of the checkpoint.

    Raises:
      CheckpointMismatchError: the ledger holds fewer samples than the checkpoint (releases
        would be forgotten), or an in-memory ledger is not empty, or file/memory mismatch.
    """
    saved = int(state["samples"])
    if "path" in state:
        if ledger.path is None:
            raise CheckpointMismatchError(
                f"the checkpoint's ledger is the file {state['path']!r}; resume with "
                f"dpfy.ledger.Ledger({state['path']!r}) so the recorded releases stay counted"
            )
        if ledger.iteration < saved:
            raise CheckpointMismatchError(
                f"ledger {ledger.path!r} holds {ledger.iteration} samples but the checkpoint "
                f"was taken after {saved}: this ledger lost recorded releases and cannot "
                "account the resumed run"
            )
        if ledger.iteration > saved:
            warnings.warn(
                f"ledger {ledger.path!r} holds {ledger.iteration - saved} samples recorded after "
                "the checkpoint; they stay counted (their noisy values existed), so the resumed "
                "run over-counts them",
                stacklevel=2,
            )
        return
    if len(ledger) or ledger.path is not None:
        raise CheckpointMismatchError(
            "the checkpoint holds an in-memory ledger; resume into an empty in-memory Ledger()"
        )
    ledger.replay(record_from_dict(obj) for obj in state["entries"])

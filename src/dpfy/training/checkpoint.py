"""Checkpoint and resume: model, optimizer, sampler, randomness, ledger and trainer position.

A resumed run must account exactly as an uninterrupted one, and in seeded mode reproduce it.
That needs every piece of state that decides what happens next:

* model and optimizer ``state_dict`` (and the EMA copy of the weights, if any);
* the sampler's position and generator state (epoch samplers also save the epoch's layout, so
  "every example once per epoch" survives a mid-epoch restart even with secure randomness);
* the noise generator's state (seeded mode; secure randomness has no state and continues with
  fresh bits) and torch's global generator (dropout and other in-model randomness);
* the ledger. A ledger *file* is the source of truth and is never rewound: the checkpoint
  records its run identifier, its path, its line count and chain head (the SHA-256 of its last
  line, ``docs/ledger.md``). On resume :func:`restore_ledger` refuses a different ledger (run
  identifier or path), and a file that no longer holds the checkpoint's line as that line
  (behind the checkpoint, or forked from it). The file may be *ahead*: steps that ran after
  the checkpoint stay in it (their noisy values existed), so a run restarted from an older
  checkpoint over-counts, never under-counts. An in-memory ledger is stored in the checkpoint
  (its records' ``to_dict``) and replayed into a fresh ledger through
  :meth:`dpfy.ledger.Ledger.replay`, the path a ledger file is read by;
* the randomness mode of noise and sampling ("secure" or "seeded"): a run that used secure
  randomness is never resumed with seeded randomness (:func:`check_randomness_modes`).

Checkpoints hold plain data only (dicts, lists, tuples, strings, numbers, bytes, tensors;
NumPy arrays are stored as tensors and restored) and are read with
``torch.load(weights_only=True)``: a crafted file cannot run code when it is loaded. Files are
written atomically (temporary file + ``os.replace``): a crash while saving leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfy.ledger import Ledger
from dpfy.ledger.records import record_from_dict

FORMAT = "dpfy-checkpoint"
VERSION = 2
_NDARRAY = "__ndarray__"
_PLAIN = (str, int, float, bool, bytes, type(None), torch.Tensor, torch.Size, torch.dtype)


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the run it is loaded into (e.g. a ledger that lost steps)."""


def _to_plain(obj: Any, where: str) -> Any:
    """``obj`` with NumPy arrays as tagged tensors and NumPy scalars as Python numbers."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, _PLAIN):
        return obj
    raise ValueError(
        f"checkpoint state must be plain data (dicts, lists, strings, numbers, tensors, NumPy "
        f"arrays), got {type(obj).__name__} at state{where}"
    )


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY} and isinstance(obj[_NDARRAY], torch.Tensor):
            return obj[_NDARRAY].numpy()
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_from_plain(v) for v in obj)
    return obj


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, NumPy arrays, plain Python data) to ``path`` atomically.

    Returns:
      The checkpoint path.

    Raises:
      ValueError: ``state`` holds something other than plain data (nothing is written).
    """
    path = Path(path)
    payload = _to_plain({"format": FORMAT, "version": VERSION, **state}, "")
    path.parent.mkdir(parents=True, exist_ok=True)
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
    """Read a checkpoint written by :func:`save_checkpoint` (plain data only; no code runs).

    Raises:
      CheckpointMismatchError: the file is not a dpfy checkpoint of this version, or it holds
        objects a dpfy checkpoint never contains (they are refused, not constructed).
    """
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointMismatchError(
            f"{path} is not a dpfy checkpoint: it holds objects other than plain data, which "
            f"are refused rather than unpickled (torch.load weights_only=True: {first})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{path} is not a dpfy checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointMismatchError(
            f"checkpoint version must be {VERSION}, got version={payload.get('version')!r}"
        )
    out: dict[str, Any] = _from_plain(payload)
    return out


def randomness_mode(randomness: Any) -> str:
    """``"secure"`` or ``"seeded"``: the mode a :class:`dpfy.randomness.Randomness` draws in."""
    return "secure" if getattr(randomness, "secure", False) else "seeded"


def check_randomness_modes(saved: Mapping[str, str] | None, now: Mapping[str, str]) -> None:
    """Refuse to resume a run with weaker randomness than it used (secure, then seeded).

    Args:
      saved: the checkpoint's modes per stream (``{"noise": "secure", "sampling": ...}``).
      now: the resuming run's modes.

    Raises:
      CheckpointMismatchError: a stream was secure and would continue seeded, or the checkpoint
        records no modes.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointMismatchError(
            "the checkpoint records no randomness mode; it cannot show the resumed run keeps "
            "the randomness it used"
        )
    for stream, mode in saved.items():
        if mode == "secure" and now.get(stream) != "secure":
            raise CheckpointMismatchError(
                f"the checkpointed run drew its {stream} randomness in secure mode; resuming "
                f"it {now.get(stream)} would weaken every later step. Resume with "
                "Randomness.secure_mode()"
            )


def ledger_state(ledger: Ledger) -> dict[str, Any]:
    """What a checkpoint keeps of a ledger: its file, run id, size and chain head (after
    writing any queued entries and, for a signed ledger open for writing, a signature of the
    head: :meth:`dpfy.ledger.Ledger.sign`), or (in memory) its entries."""
    state: dict[str, Any] = {"samples": ledger.iteration, "entries_count": len(ledger)}
    if ledger.path is not None:
        ledger.sign()
        state.update(
            path=os.path.realpath(ledger.path),
            run_id=ledger.run_id,
            lines=ledger.line_count,
            head=ledger.head,
        )
    else:
        state["entries"] = [record.to_dict() for record in ledger.entries]
    return state


def restore_ledger(ledger: Ledger, state: dict[str, Any], *, allow_moved: bool = False) -> None:
    """Bring ``ledger`` to the checkpointed state (see the module docstring).

    Args:
      ledger: the resumed run's ledger: ``Ledger(path)`` on the same file (it re-reads the
        file and appends), or an empty in-memory ledger into which the saved entries are
        replayed (:meth:`dpfy.ledger.Ledger.replay`).
      state: ``ledger_state`` of the checkpoint.
      allow_moved: accept the checkpoint's ledger file under another path (same run
        identifier and chain). A copy may lack releases recorded after the checkpoint in the
        original, so this is refused unless asked for.

    Raises:
      CheckpointMismatchError: a different ledger (run identifier or path); a ledger behind
        the checkpoint (releases would be forgotten) or forked from it; an in-memory ledger
        that is not empty; or a file/memory mismatch.
    """
    saved = int(state["samples"])
    if "path" in state:
        _check_same_file(ledger, state, allow_moved)
        line = ledger.chain_hash_at(int(state["lines"]))
        if ledger.iteration < saved or line is None:
            raise CheckpointMismatchError(
                f"ledger {ledger.path!r} holds {ledger.iteration} samples but the checkpoint "
                f"was taken after {saved} (line {state['lines']}): this ledger lost recorded "
                "releases and cannot account the resumed run"
            )
        if line != state["head"]:
            raise CheckpointMismatchError(
                f"ledger {ledger.path!r} forked from the checkpoint: its line {state['lines']} "
                "is not the line the checkpoint recorded (the file was rewritten, or another "
                "copy of it was appended to)"
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


def _check_same_file(ledger: Ledger, state: dict[str, Any], allow_moved: bool) -> None:
    if ledger.path is None:
        raise CheckpointMismatchError(
            f"the checkpoint's ledger is the file {state['path']!r}; resume with "
            f"dpfy.ledger.Ledger({state['path']!r}) so the recorded releases stay counted"
        )
    if not state.get("run_id") or ledger.run_id != state["run_id"]:
        raise CheckpointMismatchError(
            f"ledger {ledger.path!r} belongs to run {ledger.run_id!r}, the checkpoint to run "
            f"{state.get('run_id')!r} (ledger {state['path']!r}): a different ledger cannot "
            "account the resumed run"
        )
    if os.path.realpath(ledger.path) != state["path"] and not allow_moved:
        raise CheckpointMismatchError(
            f"the checkpoint's ledger is {state['path']!r}, not {ledger.path!r}; a copy may "
            "lack releases recorded after the checkpoint. If the file was moved, pass "
            "ledger_moved=True (resume) or allow_moved=True (restore_ledger)"
        )

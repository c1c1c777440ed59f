"""What a resumed run may change: nothing that shapes its privacy, and its budget only when asked.

A checkpoint records the hyperparameters the run's releases and its calibration depend on
(:func:`run_hyperparameters`). A trainer that resumes it with another clip norm, delta, plan of
epochs, expected batch size, microbatch size or accountant would release steps that the first
part of the ledger and the calibrated noise multiplier were not made for: it is refused
(:func:`check_resume`). Another target epsilon is refused too unless the caller raises the budget
explicitly (``resume(..., raise_budget=True)``); the change is then written into the ledger's
metadata (``budget_raised_on_resume``: from, to, at which step), so the report shows it beside
the new target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dpfy.training.checkpoint import CheckpointMismatchError

#: Hyperparameters a resumed run must keep (the releases and the calibration depend on them).
FIXED = ("clip_norm", "delta", "epochs", "expected_batch_size", "microbatch_size", "accounting")


class ResumeMismatchError(CheckpointMismatchError):
    """A checkpoint resumed with another hyperparameter that shapes the run's privacy."""


def run_hyperparameters(
    *,
    target_epsilon: float | None,
    clip_norm: float,
    delta: float,
    epochs: int,
    expected_batch_size: float,
    microbatch_size: int | None,
    accounting: Any,
) -> dict[str, Any]:
    """The hyperparameters a checkpoint records (plain numbers and names; the accountant by
    its name)."""
    return {
        "target_epsilon": None if target_epsilon is None else float(target_epsilon),
        "clip_norm": float(clip_norm),
        "delta": float(delta),
        "epochs": int(epochs),
        "expected_batch_size": float(expected_batch_size),
        "microbatch_size": None if microbatch_size is None else int(microbatch_size),
        "accounting": None if accounting is None else str(getattr(accounting, "name", accounting)),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return bool(a == b)


def check_resume(
    saved: Mapping[str, Any] | None, now: Mapping[str, Any], *, raise_budget: bool, step: int
) -> dict[str, Any] | None:
    """Compare a checkpoint's hyperparameters (``saved``; ``None``: a checkpoint written before
    they were recorded, nothing to compare) with the resuming trainer's (``now``).

    Returns:
      ``None``, or with ``raise_budget`` and another target epsilon the metadata to record:
      ``{"target_epsilon": new, "budget_raised_on_resume": {"from", "to", "at_step"}}``.

    Raises:
      ResumeMismatchError: a hyperparameter of :data:`FIXED` differs, or the target epsilon
        differs without ``raise_budget`` (one line naming the parameter and the value the
        checkpoint needs).
    """
    if saved is None:
        return None
    for name in FIXED:
        if name in saved and not _same(saved[name], now.get(name)):
            raise ResumeMismatchError(
                f"{name} must be {saved[name]!r} to resume this checkpoint (the steps already "
                f"in the ledger and the calibrated noise depend on it), got "
                f"{name}={now.get(name)!r}"
            )
    before, after = saved.get("target_epsilon"), now.get("target_epsilon")
    if _same(before, after):
        return None
    if not raise_budget:
        raise ResumeMismatchError(
            f"target_epsilon must be {before!r} to resume this checkpoint, got "
            f"target_epsilon={after!r}; pass raise_budget=True to resume with another budget "
            "(the ledger records the change and the report shows it)"
        )
    return {
        "target_epsilon": after,
        "budget_raised_on_resume": {"from": before, "to": after, "at_step": int(step)},
    }

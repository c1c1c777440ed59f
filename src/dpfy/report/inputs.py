"""What ``dpfy report`` reads besides the ledger's records: its recorded facts, a default
delta, and the sections a report of the same chain head already published.

Files are input, never trusted: every field is type-checked and a wrong one raises
``ValueError`` naming it. This module imports no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpfy._validate import check_range
from dpfy.ledger import Ledger


def recorded_facts(meta: Mapping[str, Any], *, need_delta: bool) -> dict[str, Any]:
    """The report's inputs from a ledger's metadata, each type-checked: a field of the wrong
    type or range raises ``ValueError`` naming it (files are input, never trusted)."""

    def number(name: str, low: float, high: float) -> float | None:
        if name not in meta:
            return None
        value = meta[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"the ledger's metadata {name} must be a number in ({low}, {high}), got "
                f"{name}={value!r}" + (" (pass --delta to override)" if "delta" in name else "")
            )
        check_range(name, value, low, high, low_open=True, high_open=high == math.inf)
        return float(value)

    facts: dict[str, Any] = {
        "delta": number("delta", 0.0, 1.0) if need_delta else None,
        "target_delta": number("target_delta", 0.0, 1.0) if need_delta else None,
        "target_epsilon": number("target_epsilon", 0.0, math.inf),
    }
    pairs = meta.get("accuracy_by_step", [])
    ok = isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2
        and isinstance(p[0], int) and not isinstance(p[0], bool) and p[0] >= 0
        and isinstance(p[1], int | float) and not isinstance(p[1], bool) and 0.0 <= p[1] <= 1.0
        for p in pairs
    )
    if not ok:
        raise ValueError(
            "the ledger's metadata accuracy_by_step must be a list of [step >= 0, accuracy in "
            f"[0, 1]] pairs, got accuracy_by_step={str(pairs)[:60]!r}"
        )
    facts["accuracy_by_step"] = [(int(step), float(acc)) for step, acc in pairs]
    utility = meta.get("utility", {})
    if not isinstance(utility, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str | int | float | bool))
        for k, v in utility.items()
    ):
        raise ValueError(
            "the ledger's metadata utility must be an object of named numbers or strings, "
            f"got utility={str(utility)[:60]!r}"
        )
    facts["utility"] = dict(utility) or None
    return facts


def default_delta(ledger: Ledger, facts: Mapping[str, Any]) -> tuple[float, str | None]:
    """The statement's delta when none is given: the recorded delta; else the recorded target
    delta; else 1/(10 N) (a run cut short before recording either). (delta, note or None)."""
    if facts["delta"] is not None:
        return float(facts["delta"]), None
    if facts["target_delta"] is not None:
        return float(facts["target_delta"]), (
            "delta: the ledger records no final delta (the run ended before writing it); the "
            "statement uses the recorded target delta"
        )
    sizes = [r.spec.dataset_size for r in ledger.samples if r.spec.dataset_size is not None]
    if not sizes:
        raise ValueError(
            "delta: the ledger records no delta, no target delta and no dataset size: pass --delta"
        )
    n = max(sizes)
    return 1.0 / (10.0 * n), (
        f"delta: the ledger records no delta (the run ended before writing it); the statement "
        f"uses the default 1/(10 N) = {1.0 / (10.0 * n):.3g} with N = {n}, the dataset size of "
        "its sample records"
    )


def kept_publishing(out_dir: Path, head: str | None) -> dict[str, Any] | None:
    """The Publishing section of the ``report.json`` of chain head ``head`` in ``out_dir``
    (checked against the directory by :mod:`dpfy.report.crosscheck`), or None."""
    try:
        kept = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    integrity = kept.get("ledger_integrity") if isinstance(kept, dict) else None
    if not isinstance(integrity, dict) or integrity.get("head") != head:
        return None
    section = kept.get("publishing")
    return section if isinstance(section, dict) and section else None

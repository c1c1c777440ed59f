"""The DP hyperparameters a ledger recorded, read back for a report.

Everything here is read from the ledger's records (sample specs, sum queries, matrix runs,
metadata), never from the training code's intent. No accounting happens here, and this module
imports neither torch nor the accountants.
"""

from __future__ import annotations

from typing import Any

from dpfy.ledger.ledger import Ledger
from dpfy.ledger.records import MatrixRunRecord, SumQueryRecord


def ledger_hyperparameters(ledger: Ledger) -> dict[str, Any]:
    """DP hyperparameters as the ledger recorded them (never as the training code intended).

    Read from the first sample's spec (``sampler_changes`` counts distinct specs when there
    are several), the effective noise multipliers (one float, or ``{"min", "max"}``), the
    sensitivities of each named sum query, and known metadata keys (``clip_norm``,
    ``learning_rate``, ...). ``epochs``: expected epochs (steps x q) for ``poisson``, distinct
    epoch labels for epoch samplers. No accounting happens here.
    """
    samples = ledger.samples
    specs = list(dict.fromkeys(r.spec for r in samples))
    zs = [z for z in ledger.noise_multipliers().values() if z > 0]
    sens: dict[str, set[float]] = {}
    for r in ledger.entries:
        if isinstance(r, SumQueryRecord):
            sens.setdefault(r.name or "sum", set()).add(r.sensitivity)
    spec = specs[0].to_dict() if specs else {}
    out: dict[str, Any] = {"_spec": spec, "steps": len(samples)}
    if len(specs) > 1:
        out["sampler_changes"] = len(specs)
    if spec.get("sampling_rate") is not None:
        out["sampling_rate"] = spec["sampling_rate"]
        if spec.get("dataset_size"):
            out["expected_batch_size"] = spec["sampling_rate"] * spec["dataset_size"]
            out["epochs"] = len(samples) * spec["sampling_rate"]
    if spec.get("steps_per_epoch"):
        out["steps_per_epoch"] = spec["steps_per_epoch"]
        out["epochs"] = len({r.epoch for r in samples})
        if spec.get("dataset_size"):
            out["expected_batch_size"] = spec["dataset_size"] / spec["steps_per_epoch"]
    for key in ("batch_size", "max_batch_size", "dataset_size"):
        if spec.get(key) is not None:
            out[key] = spec[key]
    if zs:
        out["noise_multiplier"] = min(zs) if max(zs) - min(zs) < 1e-12 * max(zs) else {
            "min": min(zs),
            "max": max(zs),
        }
    out["l2_sensitivity_per_query"] = {k: sorted(v) for k, v in sens.items()}
    runs = [r for r in ledger.entries if isinstance(r, MatrixRunRecord)]
    if runs:  # a correlated-noise run: its z and the strategy (docs/architecture.md, 5.16)
        out["noise_multiplier"] = runs[0].noise_multiplier
        out["mechanism"] = "; ".join(
            f"{r.plan.strategy} (correlated noise), schema {r.plan.event(1.0).schema}, "
            f"{r.plan.steps} steps, sensitivity {r.sensitivity:.4g} x clip norm" for r in runs
        )
    meta = ledger.metadata
    keys = (
        "clip_norm", "clip_function", "optimizer", "learning_rate", "momentum", "model", "dataset",
        "microbatch_size", "max_physical_batch_size", "ema_decay", "secure_randomness",
        "target_epsilon", "budget_raised_on_resume",
    )
    for key in keys:
        if meta.get(key) is not None:
            out[key] = meta[key]
    return out

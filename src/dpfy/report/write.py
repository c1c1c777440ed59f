"""A privacy report written to a run directory: ``report.md``, ``report.json`` and figures.

The figures' numbers are re-derived from the ledger (never from training code); matplotlib is
imported only when figures are drawn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dpfy import accounting
from dpfy.accounting.risk import attack_curve
from dpfy.ledger import Ledger
from dpfy.report.statement import PrivacyReport, epsilon_history


def write_report(
    report: PrivacyReport,
    ledger: Ledger,
    out_dir: str | Path,
    *,
    accuracy_by_step: Sequence[tuple[int, float]] | None = None,
    target_epsilon: float | None = None,
    figures: bool = True,
    name: str = "report",
) -> PrivacyReport:
    """Write ``report.md``, ``report.json`` and figures into ``out_dir``; returns the report
    with the figure paths (relative to ``out_dir``) filled in. ``name`` replaces ``report`` in
    both file names (see :func:`report_name`).

    ``accuracy_by_step`` holds (step, test accuracy in [0, 1]) pairs and ``target_epsilon`` the
    run's budget, both drawn on the epsilon-over-training figure. Without ``figures``, or when
    epsilon is infinite, no figure is drawn (and matplotlib is not imported).

    Atomic: every file is first written into a temporary folder inside ``out_dir`` and renamed
    into place only when all of them were written (figures, then ``report.json``, then
    ``report.md``), so a failed write (a full disk) leaves no partial report and no
    ``figures/`` behind; the ``OSError`` propagates.
    """
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        report = _write_staged(
            report, ledger, staging, accuracy_by_step, target_epsilon, figures
        )
        if report.figures:
            (out / "figures").mkdir(exist_ok=True)
        for rel in report.figures.values():
            os.replace(staging / rel, out / rel)
        os.replace(staging / "report.json", out / f"{name}.json")
        os.replace(staging / "report.md", out / f"{name}.md")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return report


def report_name(out_dir: str | Path, head: str | None) -> tuple[str, str | None]:
    """The file name (without suffix) for a report of a ledger with chain head ``head``, and
    why it is not ``report`` (None when it is).

    ``report.json`` holds the chain head a run's owner keeps to detect a rewritten ledger, so
    it is never replaced by a report of another head: an existing ``report.json`` whose head
    differs (or that cannot be read) leaves the new report beside it as
    ``report-<first 12 hex digits of head>``.
    """
    existing = Path(out_dir) / "report.json"
    if not existing.exists():
        return "report", None
    try:
        kept = json.loads(existing.read_text(encoding="utf-8"))["ledger_integrity"]["head"]
    except (OSError, ValueError, KeyError, TypeError):
        kept = "unreadable"
    if kept == head:
        return "report", None
    name = f"report-{(head or 'nohead')[:12]}"
    return name, (
        f"{existing} records chain head {str(kept)[:12]}…, this ledger's head is "
        f"{(head or 'none')[:12]}…: the ledger changed since that report was written (or it "
        f"belongs to another run), so it is kept and this report is written beside it as "
        f"{name}.md / {name}.json"
    )


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``; the one place report text reaches the disk."""
    path.write_text(text, encoding="utf-8")


def _write_staged(
    report: PrivacyReport,
    ledger: Ledger,
    out: Path,
    accuracy_by_step: Sequence[tuple[int, float]] | None,
    target_epsilon: float | None,
    figures: bool,
) -> PrivacyReport:
    """Draw the figures and write both report files into the staging folder ``out``."""
    from dpfy.report import plots

    (out / "figures").mkdir()
    paths: dict[str, str] = {}
    if figures and math.isfinite(report.epsilon):
        steps, curves = epsilon_history(ledger, report.delta)
        if curves:
            p = plots.epsilon_over_training(
                steps,
                curves,
                out / "figures" / "epsilon_over_training.png",
                delta=report.delta,
                target_epsilon=target_epsilon,
                accuracy=accuracy_by_step,
            )
            paths["epsilon_over_training"] = str(p.relative_to(out))
        deltas, eps_by_method = _epsilon_vs_delta(ledger, report)
        if eps_by_method:
            p = plots.epsilon_vs_delta(
                deltas,
                eps_by_method,
                out / "figures" / "epsilon_vs_delta.png",
                dataset_size=report.sampler.get("dataset_size"),
                chosen_delta=report.delta,
            )
            paths["epsilon_vs_delta"] = str(p.relative_to(out))
        comparison: dict[str, tuple[float, float | None, float | None]] = {}
        for name, res in report.other_methods.items():
            if isinstance(res, dict):
                comparison[name] = (
                    res["epsilon"],
                    res.get("epsilon_lower"),
                    res.get("epsilon_estimate"),
                )
            elif isinstance(res, float):
                comparison[name] = (res, None, None)
        if comparison:
            p = plots.accountant_comparison(
                comparison, out / "figures" / "accountant_comparison.png", delta=report.delta
            )
            paths["accountant_comparison"] = str(p.relative_to(out))
        if report.attack_risk.get("method") in ("gaussian", "pld", "epsilon-delta"):
            curve = attack_curve(ledger)
            p = plots.attack_risk(
                curve.fpr,
                curve.tpr,
                out / "figures" / "attack_risk.png",
                marked=report.attack_risk["tpr_at_fpr"],
            )
            paths["attack_risk"] = str(p.relative_to(out))
    report = dataclasses.replace(report, figures=paths)
    _write_text(out / "report.md", report.to_markdown())
    _write_text(out / "report.json", report.to_json() + "\n")
    return report


def _epsilon_vs_delta(
    ledger: Ledger, report: PrivacyReport
) -> tuple[list[float], dict[str, list[float]]]:
    """Epsilon of each provable method at 17 deltas from 1e-10 to 1e-2 (log-spaced)."""
    import numpy as np

    deltas = [float(d) for d in np.logspace(-10, -2, 17)]
    event = ledger.to_event()
    out: dict[str, list[float]] = {}
    for name, res in report.other_methods.items():
        if not isinstance(res, dict) or not res.get("provable", True):
            continue
        try:
            out[name] = [accounting.epsilon(event, d, method=name).epsilon for d in deltas]
        except (ValueError, KeyError):
            continue
    return deltas, out

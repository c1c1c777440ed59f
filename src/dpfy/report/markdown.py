"""A privacy report rendered as Markdown (``report.md``), the page a person reads.

The checklist follows Ponomareva et al. 2023 ("How to DP-fy ML"), Sec. 5.3.3. Every table row
has exactly two cells: ``|`` inside a value is escaped.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfy.report.consistency import signature_line

if TYPE_CHECKING:
    from dpfy.report.statement import PrivacyReport


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isinf(value):
            return "infinity"
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_fmt(v) for v in value)
    return "-" if value is None else str(value)


def to_markdown(r: PrivacyReport) -> str:
    """The report as a Markdown page: whether it is a DP release, statement, checklist,
    assumptions, hyperparameters, epsilon per method, utility, figures and how to reproduce it."""
    lines = ["# Privacy report", ""]
    if r.release:
        lines += [f"> {r.release}", ""]
    lines += [f"**{r.formal_statement}**", ""]
    eps = "infinity" if math.isinf(r.epsilon) else f"{r.epsilon:.5g}"
    headline = f"- epsilon = **{eps}** at delta = {r.delta:g} ({r.accounting_method}"
    headline += f", {r.adjacency} adjacency, unit of privacy: {r.unit_of_privacy})"
    lines.append(headline)
    if r.epsilon_estimate is not None:
        lines.append(
            f"- Monte Carlo point estimate {_fmt(r.epsilon_estimate)}; the reported epsilon is "
            f"its upper confidence bound (error probability {r.error_probability:g})"
        )
    if r.epsilon_lower is not None:
        lines.append(f"- lower bound on the true epsilon: {_fmt(r.epsilon_lower)}")
    lines.append(f"- {r.privacy_tier}")
    if r.delta_times_n is not None:
        n = r.sampler.get("dataset_size")
        verdict = "below 1/N, as it should be" if r.delta_times_n < 1 else "NOT below 1/N"
        what = f" {r.unit_of_privacy}s" if r.unit_of_privacy != "example" else ""
        lines.append(f"- delta x N = {r.delta_times_n:.3g} (N = {n}{what}): delta is {verdict}")
    if r.mu is not None:
        lines.append(f"- exact Gaussian DP: mu = {r.mu:.4g}")
    checklist = "## Checklist (Ponomareva et al. 2023, Sec. 5.3.3)"
    lines += ["", checklist, "", "| item | value |", "|---|---|"]
    rows = [
        ("DP setting", r.dp_setting),
        ("Data accesses covered", r.data_accesses),
        ("Released output", r.released_output),
        ("Unit of privacy", r.unit_of_privacy),
        ("Adjacency", r.adjacency),
        ("Sampler actually used", _fmt(r.sampler)),
        ("Sampling randomness", r.sampling_randomness),
        ("Noise randomness", r.noise_randomness),
        ("Accounting method", r.accounting_method),
        ("Privacy tier", r.privacy_tier),
    ]
    lines += [f"| {k} | {_escape(str(v))} |" for k, v in rows]
    lines += ["", "## Assumptions", ""]
    lines += [f"- {_escape(a)}" for a in r.assumptions]
    lines += ["", "## DP hyperparameters (as recorded in the ledger)", "", "| name | value |"]
    lines.append("|---|---|")
    lines += [f"| {k} | {_escape(_fmt(v))} |" for k, v in r.hyperparameters.items()]
    lines += ["", f"## Epsilon by accounting method (delta = {r.delta:g})", ""]
    lines.append("| method | epsilon |")
    lines.append("|---|---|")
    for name, res in r.other_methods.items():
        if isinstance(res, dict):
            cell = _fmt(res["epsilon"])
            if res.get("epsilon_estimate") is not None:
                cell += f" (estimate {_fmt(res['epsilon_estimate'])})"
            if res.get("epsilon_lower") is not None:
                cell += f" (lower bound {_fmt(res['epsilon_lower'])})"
            if not res.get("provable", True):
                cell += " (holds with high probability)"
        else:
            cell = _fmt(res)
        lines.append(f"| {name} | {_escape(cell)} |")
    lines += _user_level_lines(r.user_level, r.delta)
    lines += _attack_risk_lines(r.attack_risk, r.unit_of_privacy)
    lines += _audit_lines(r.audit)
    if r.utility:
        lines += ["", "## Utility", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_escape(_fmt(v))} |" for k, v in r.utility.items()]
    if r.figures:
        lines += ["", "## Figures", ""]
        lines += [f"![{name}]({path})" for name, path in r.figures.items()]
    lines += _publishing_lines(r.publishing)
    lines += ["", "## Reproduce", ""]
    if r.reproduce.get("ledger"):
        lines.append(f"- ledger: `{r.reproduce['ledger']}` ({r.reproduce['steps_recorded']} steps)")
    if r.ledger_integrity:
        lines.append(f"- Ledger integrity: {r.ledger_integrity['summary']}")
        lines.append(f"- {signature_line(r.ledger_integrity)}")
    if r.reproduce.get("command"):
        lines.append(f"- re-account: `{r.reproduce['command']}`")
    if r.reproduce.get("train_command"):
        lines.append(f"- re-train: `{r.reproduce['train_command']}`")
    config = r.reproduce.get("config")
    if isinstance(config, dict) and config.get("out"):
        run_toml = shlex.quote(str(Path(str(config["out"])) / "run.toml"))
        lines.append(f"- re-train from its configuration file: `dpfy train --config {run_toml}` "
                     "(give a new --out)")
    return "\n".join(lines) + "\n"


def _publishing_lines(p: dict[str, Any]) -> list[str]:
    """The "Publishing" section of a run directory (empty without one)."""
    if not p:
        return []
    files = ", ".join(f"`{name}`" for name in p.get("safe_to_publish", []))
    lines = ["", "## Publishing", "",
             f"- Safe to publish (derived from {p.get('derived_from')}): {files}"]
    if p.get("not_covered"):
        lines.append(
            f"- NOT covered by this guarantee, do not publish: `{p['not_covered']}` (private "
            "diagnostics computed from the training data without noise)"
        )
    else:
        lines.append("- No private diagnostics were kept (`--private-diagnostics` not given)")
    return lines


def _user_level_lines(u: dict[str, Any], delta: float) -> list[str]:
    """The unit, the grouping and the labelled example-level reading of a user-level run."""
    if not u:
        return []
    unit = u["unit"]
    cap = u["max_examples_per_user"]
    lines = ["", f"## Unit of privacy: one {unit}", ""]
    lines.append(
        f"- Every {unit}-level figure above protects all of one {unit}'s examples at once: "
        f"N = {u['num_users']} {unit}s, "
        + (f"at most {cap} examples per {unit} (cap)." if cap is not None
           else f"no cap on the examples per {unit}.")
    )
    lines.append(
        f"- Each {unit}'s gradients are reduced by their {u['reduction']} and that one vector "
        f"is clipped ({u['subset']})."
    )
    lines.append(f"- {u['delta_vs_1_over_n']}.")
    ex = u.get("example_level") or {}
    if ex:
        eps = ex["epsilon"]
        eps_s = "infinity" if isinstance(eps, str) or math.isinf(eps) else f"{eps:.5g}"
        lines.append(
            f"- Example level (group privacy, labelled as such): epsilon = {eps_s} at delta = "
            f"{_fmt(ex['delta'])}; {ex['derivation']}."
        )
    return lines


def _attack_risk_lines(risk: dict[str, Any], unit: str) -> list[str]:
    """The attack-risk table: the TPR bound of a membership-inference attacker per FPR."""
    table = risk.get("tpr_at_fpr") or {}
    if not table:
        return []
    lines = [
        "",
        "## Attack risk (membership inference)",
        "",
        f"An attacker who tries to tell whether one {unit} was in the training data, and "
        "accepts a false-positive rate (FPR), cannot reach a true-positive rate (TPR) above "
        "these bounds, whatever it knows about the other data. A random guess reaches "
        "TPR = FPR.",
        "",
        "| FPR | TPR at most |",
        "|---|---|",
    ]
    for fpr, tpr in table.items():
        lines.append(f"| {fpr} | {tpr:.4g} ({tpr / float(fpr):.3g} x FPR) |")
    notes = " ".join(risk.get("notes", []))
    lines += ["", _escape(f"Method: {risk.get('method')}. {notes}")]
    return lines


def _audit_lines(audit: dict[str, Any]) -> list[str]:
    """The Audit section (``dpfy audit``): a measured lower bound beside the claim."""
    if not audit:
        return []
    conf = audit.get("confidence", 0.0)
    rows = [
        ("Verdict", audit.get("verdict")),
        ("Empirical lower bound on epsilon", _fmt(audit.get("epsilon_lower"))),
        ("Audited claim", f"{_fmt(audit.get('audited_claim'))} ({audit.get('audited_release')})"),
        ("Run's claimed epsilon", _fmt(audit.get("run_epsilon"))),
        ("Method", audit.get("method")),
        ("Confidence", f"{100 * float(conf):g} %"),
        ("Trials (canaries)", _fmt(audit.get("trials"))),
        ("Ceiling of the method", _fmt(audit.get("ceiling"))),
    ]
    if "self_tests" in audit:
        rows.append(
            ("Self-tests (replay, sampler)", "; ".join(audit.get("self_tests") or []) or "passed")
        )
    if audit.get("self_tests_run"):
        rows.append(("Self-tests run", ", ".join(str(t) for t in audit["self_tests_run"])))
    for key, label in (("replayed_layer_types", "Layer types replayed"),
                       ("not_replayed_layer_types", "Layer types not replayed (no probe model)")):
        if audit.get(key):
            rows.append((label, ", ".join(str(t).rsplit(".", 1)[-1] for t in audit[key])))
    real = audit.get("real_model")
    if isinstance(real, dict):
        rows.append(("Noise on the run's own model", (
            f"{real.get('tensors')} tensors, {real.get('values')} values, "
            f"{real.get('releases')} noise-only releases: std ratio "
            f"{_fmt(real.get('min_std_ratio'))} to {_fmt(real.get('max_std_ratio'))}; false "
            f"alarm <= {_fmt(real.get('alpha'))}, a half-noise tensor missed with probability "
            f"<= {_fmt(real.get('half_noise_miss'))}; {_fmt(real.get('seconds'))} s")))
    if audit.get("self_test_notes"):
        rows.append(("Not covered", "; ".join(str(t) for t in audit["self_test_notes"])))
    if audit.get("guesses") is not None:
        rows.append(("Guesses (correct)", f"{audit['guesses']} ({audit.get('correct')})"))
    if audit.get("mu_lower") is not None:
        rows.append(("Gaussian-DP mu estimate", _fmt(audit.get("mu_lower"))))
    if audit.get("fdp_epsilon_lower") is not None:
        rows.append((
            "f-DP (Gaussian) lower bound",
            f"mu >= {_fmt(audit.get('fdp_mu_lower'))}, epsilon >= "
            f"{_fmt(audit.get('fdp_epsilon_lower'))} (ceiling mu "
            f"{_fmt(audit.get('fdp_mu_ceiling'))}, epsilon {_fmt(audit.get('fdp_ceiling'))})",
        ))
    for row in audit.get("scores") or []:
        rows.append((
            f"Score {row.get('score')}",
            f"{row.get('correct')} correct; epsilon >= {_fmt(row.get('epsilon_lower'))}; "
            f"f-DP epsilon >= {_fmt(row.get('fdp_epsilon_lower'))}",
        ))
    lines = ["", "## Audit", "", "| item | value |", "|---|---|"]
    lines += [f"| {k} | {_escape(str(v))} |" for k, v in rows]
    for key in ("description", "meaning"):
        lines += ["", _escape(str(audit.get(key, "")))]
    return lines


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")

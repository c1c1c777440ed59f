"""The "Privacy" section of a model card, rendered from a privacy report.

The section is rendered from a :class:`dpfy.report.PrivacyReport`, i.e. from the ledger alone
(Ponomareva et al. 2023, "How to DP-fy ML", Sec. 5.3.3: the statement ships with the model):
the formal statement, the method, adjacency, unit of privacy, epsilon and delta, the ledger's
integrity line, the run's public key with the chain head it signed, and where the ledger is.
:func:`dpfy.hf.model_card.write_model_card` writes it into a saved model's ``README.md``;
:mod:`dpfy.report.crosscheck` renders it again to check a published card.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dpfy.report.consistency import signature_line
from dpfy.report.statement import PrivacyReport

#: The ``## Privacy`` section of a card's markdown, up to the next section.
SECTION = re.compile(r"^## Privacy\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)


def _number(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _sampler(spec: dict[str, Any]) -> str:
    rest = ", ".join(
        f"{k} = {v}" for k, v in spec.items() if k not in ("sampler", "adjacency", "unit")
    )
    return f"{spec.get('sampler', 'unknown')} ({rest})" if rest else str(spec.get("sampler"))


def privacy_section(report: PrivacyReport, ledger_ref: str = "ledger.jsonl") -> str:
    """Markdown of the card's ``## Privacy`` section for ``report``."""
    integrity = report.ledger_integrity.get("summary", "not checked")
    lines = [
        "## Privacy",
        "",
        report.release,
        "",
        f"**Formal statement.** {report.formal_statement}",
        "",
        f"- Method: {report.dp_setting}; accounting: {report.accounting_method}",
        f"- Adjacency: {report.adjacency}",
        f"- Unit of privacy: {report.unit_of_privacy}",
        f"- Epsilon: {_number(report.epsilon)}; delta: {report.delta:.3g}",
        f"- Sampler: {_sampler(report.sampler)}",
        f"- Ledger integrity: {integrity}",
        f"- {signature_line(report.ledger_integrity)}",
        f"- Ledger: `{ledger_ref}` (every sample and noisy release, hash-chained); the full "
        "report is `privacy_report.md` / `privacy_report.json` in the training output "
        "directory. Recompute with `dpfy.accounting.epsilon(dpfy.ledger.Ledger.load(path), "
        f"{report.delta:.3g})`.",
        "",
        "Written by dpfy from the ledger; no number here was computed by the training code.",
        "",
    ]
    return "\n".join(lines)

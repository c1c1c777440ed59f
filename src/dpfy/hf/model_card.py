"""The "Privacy" section of a saved model's card (``README.md`` in the save directory).

The section is rendered from a :class:`dpfy.report.PrivacyReport`, i.e. from the ledger alone
(Ponomareva et al. 2023, "How to DP-fy ML", Sec. 5.3.3: the statement ships with the model):
the formal statement, the method, adjacency, unit of privacy, epsilon and delta, the ledger's
integrity line, the run's public key with the chain head it signed, and where the ledger is.
An existing card (``peft`` writes one) is kept: only its ``## Privacy`` section is replaced.
``huggingface_hub.ModelCard`` writes the file when it is importable (no network is used),
plain text otherwise.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from dpfy.ledger import Ledger
from dpfy.report import PrivacyReport, build_report
from dpfy.report.consistency import signature_line

_SECTION = re.compile(r"^## Privacy\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)


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


def write_model_card(
    save_dir: str | os.PathLike[str],
    ledger: Ledger | str | os.PathLike[str],
    *,
    delta: float,
    method: str = "auto",
    ledger_ref: str | None = None,
) -> Path:
    """Add (or replace) the ``## Privacy`` section of ``save_dir/README.md``; returns its path.

    Use it after ``model.save_pretrained(save_dir)`` (``DPTrainer.save_model`` calls it).

    Args:
      save_dir: the directory the model was saved to.
      ledger: the run's ledger, or the path of its file.
      delta: the delta of the formal statement.
      method: accounting method (``auto``: the tightest valid one).
      ledger_ref: how the card names the ledger (default: its path, else ``ledger.jsonl``).
    """
    if not isinstance(ledger, Ledger):
        ledger = Ledger.load(ledger)
    ref = ledger_ref or ledger.path or "ledger.jsonl"
    report = build_report(ledger, delta=delta, method=method, ledger_path=ledger.path)
    section = privacy_section(report, str(ref))
    path = Path(save_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if _SECTION.search(old):
        text = _SECTION.sub(lambda _: section + "\n", old, count=1)
    else:
        text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + section
    _save(path, text)
    return path


def _save(path: Path, text: str) -> None:
    card: Any
    try:
        from huggingface_hub import ModelCard

        card = ModelCard(text, ignore_metadata_errors=True)
    except Exception:  # no huggingface_hub, or a card it cannot parse: plain text
        card = None
    tmp = path.with_name(path.name + ".tmp")
    if card is not None:
        card.save(str(tmp))
    else:
        tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

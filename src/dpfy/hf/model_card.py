"""The "Privacy" section of a saved model's card (``README.md`` in the save directory).

The section (:mod:`dpfy.report.card`) is rendered from a :class:`dpfy.report.PrivacyReport`,
i.e. from the ledger alone (Ponomareva et al. 2023, "How to DP-fy ML", Sec. 5.3.3: the
statement ships with the model): the formal statement, the method, adjacency, unit of privacy,
epsilon and delta, the ledger's integrity line, the run's public key with the chain head it
signed, and where the ledger is.
An existing card (``peft`` writes one) is kept: only its ``## Privacy`` section is replaced.
``huggingface_hub.ModelCard`` writes the file when it is importable (no network is used),
plain text otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dpfy.ledger import Ledger
from dpfy.report import build_report
from dpfy.report.card import SECTION as _SECTION
from dpfy.report.card import privacy_section


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

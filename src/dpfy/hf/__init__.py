"""Hugging Face integration: :class:`DPTrainer`, a private drop-in for ``transformers.Trainer``,
and ``DPSFTTrainer`` for TRL's ``SFTTrainer`` (:mod:`dpfy.hf.sft`; needs the ``sft`` extra,
imported on first use of the name).

``import dpfy`` never imports this package (nor ``transformers``); ``import dpfy.hf`` does.
See :mod:`dpfy.hf.trainer` for what the trainer changes and what it refuses, and
:mod:`dpfy.hf.model_card` for the privacy section it writes into a saved model's card.
"""

from __future__ import annotations

from typing import Any

from dpfy.hf.model_card import write_model_card
from dpfy.hf.trainer import DPTrainer, PrivacyArguments


def __getattr__(name: str) -> Any:
    if name == "DPSFTTrainer":  # TRL is optional: import it only when asked for
        from dpfy.hf.sft import DPSFTTrainer

        return DPSFTTrainer
    raise AttributeError(f"module 'dpfy.hf' has no attribute {name!r}")

__all__ = [
    "DPTrainer",
    "DPSFTTrainer",
    "PrivacyArguments",
    "write_model_card",
]

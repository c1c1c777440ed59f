"""Hugging Face integration: :class:`DPTrainer`, a private drop-in for ``transformers.Trainer``.

``import dpfy`` never imports this package (nor ``transformers``); ``import dpfy.hf`` does.
See :mod:`dpfy.hf.trainer` for what the trainer changes and what it refuses, and
:mod:`dpfy.hf.model_card` for the privacy section it writes into a saved model's card.
"""

from __future__ import annotations

from dpfy.hf.model_card import privacy_section, write_model_card
from dpfy.hf.trainer import DPTrainer, DPTrainingMixin, LogicalBatch

__all__ = ["DPTrainer", "DPTrainingMixin", "LogicalBatch", "privacy_section", "write_model_card"]

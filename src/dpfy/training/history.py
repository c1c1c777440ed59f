"""What a :class:`dpfy.training.trainer.PrivateTrainer` run records about itself: per-step and
per-epoch monitoring records, the progress callbacks' argument and the result of ``fit``.

Monitoring only: the privacy of a run is read from its ledger, never from these records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from torch import nn

from dpfy.ledger import Ledger


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """One logical step (monitoring only: loss/accuracy are of the private batch, not noised).

    Attributes:
      step: global step index (0-based). epoch: epoch index.
      batch_size: real examples in the logical batch.
      loss: mean per-example loss over the batch (nan for an empty batch).
      accuracy: fraction of correct argmax predictions (classification), else nan.
      num_nonfinite: examples dropped because their gradient was not finite.
    """

    step: int
    epoch: int
    batch_size: int
    loss: float
    accuracy: float
    num_nonfinite: int


@dataclasses.dataclass(frozen=True, slots=True)
class EpochRecord:
    """End-of-epoch summary.

    Attributes:
      epoch: epoch index. steps: global steps done at the end of the epoch.
      train_loss: mean of the epoch's step losses (monitoring only).
      test_accuracy: accuracy of the released model on the test data (None without test data).
      model_test_accuracy: accuracy of the raw (non-EMA) weights when EMA is on, else None.
      epsilon: ledger epsilon at ``delta`` so far (``monitor_accounting`` method).
      seconds: wall time since the run started (this process).
    """

    epoch: int
    steps: int
    train_loss: float
    test_accuracy: float | None
    model_test_accuracy: float | None
    epsilon: float
    seconds: float


@dataclasses.dataclass
class History:
    """Per-step and per-epoch records of a run."""

    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    epochs: list[EpochRecord] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every record, private ones included (monitoring only: never beside the model)."""
        return {
            "steps": [dataclasses.asdict(s) for s in self.steps],
            "epochs": [dataclasses.asdict(e) for e in self.epochs],
        }

    def public_dict(self) -> dict[str, Any]:
        """The records that may be published beside the model: per epoch, the global step
        count (public: the sampler's plan), the released model's accuracy on the test data
        (public data) and the ledger's epsilon so far (a function of the DP releases).

        Left out, as computed from the private training data without noise: every
        :class:`StepRecord` (realised batch sizes, losses and accuracies on the training
        batches, dropped examples), each epoch's ``train_loss``, and each epoch's wall time
        (it grows with the realised batch sizes). :meth:`to_dict` keeps them for private
        diagnostics.
        """
        return {
            "epochs": [
                {"epoch": e.epoch, "steps": e.steps, "test_accuracy": e.test_accuracy,
                 "model_test_accuracy": e.model_test_accuracy, "epsilon": e.epsilon}
                for e in self.epochs
            ]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        return cls(
            [StepRecord(**s) for s in data.get("steps", [])],
            [EpochRecord(**e) for e in data.get("epochs", [])],
        )


@dataclasses.dataclass(frozen=True)
class ProgressInfo:
    """What a progress callback receives after each step (``kind="step"``) and epoch."""

    kind: Literal["step", "epoch"]
    epoch: int
    step: int
    total_steps: int
    loss: float
    accuracy: float
    epsilon: float | None
    test_accuracy: float | None


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :meth:`PrivateTrainer.fit` returns.

    Attributes:
      model: the released model (the EMA copy when ``ema_decay`` is set, else the trained one).
      ledger: the run's ledger (account it again with
        ``dpfy.accounting.epsilon(ledger, delta, method)``).
      privacy: final :class:`dpfy.accounting.PrivacyResult` from the ledger (``accounting``).
      history: per-step and per-epoch records.
      noise_multiplier: z used for every step (calibrated or given).
      steps: logical steps taken in total. stopped: ``"completed"``, ``"budget"`` or
        ``"max_steps"``.
      seconds: wall time of this ``fit`` call.
      trained_model: the raw trained model (same object as ``model`` without EMA).
    """

    model: nn.Module
    ledger: Ledger
    privacy: Any
    history: History
    noise_multiplier: float
    steps: int
    stopped: str
    seconds: float
    trained_model: nn.Module

"""The optimizer ``PrivacyEngine.make_private`` returns: dpfy's release behind Opacus' names.

``step()`` first runs dpfy's per-example backward of the physical batch (in
``grad_sample_mode="hooks"``, from the gradients the user's ``loss.backward()`` left on the
model's outputs, :mod:`dpfy.opacus.outputs`), then the step of the run's
:class:`dpfy.training.PrivateOptimizer`: after the last physical batch of a logical batch the
Gaussian query writes its ledger entry, noise goes on every trainable parameter, the sum is
divided by the expected batch size and the user's optimizer steps; after any other physical
batch (``BatchMemoryManager``) nothing is released. ``param_groups``, ``state`` and
``defaults`` are the user's optimizer's, so learning-rate schedulers work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpfy.ledger import Ledger
from dpfy.opacus.outputs import OutputGradients
from dpfy.training import PrivateCriterion, PrivateOptimizer


class DPOptimizer(torch.optim.Optimizer):
    """The user's optimizer with dpfy's private step (module docstring).

    Args:
      private: the run's optimizer (from :func:`dpfy.training.make_private`).
      criterion: the run's criterion; in hooks mode its loss function is
        ``outputs.per_example_losses``.
      outputs: the hooks-mode per-example losses, or None (``grad_sample_mode="ghost"``: the
        returned criterion's ``loss.backward()`` has already run dpfy's backward).
      max_grad_norm: the clip norm C (Opacus' name), for reading back.
      expected_batch_size: the sampler's expected logical batch size, for reading back.
    """

    def __init__(
        self,
        private: PrivateOptimizer,
        criterion: PrivateCriterion,
        outputs: OutputGradients | None,
        max_grad_norm: float,
        expected_batch_size: float,
    ) -> None:
        original = private.original_optimizer
        super().__init__(original.param_groups, original.defaults)
        self.param_groups = original.param_groups
        self.state = original.state
        self.defaults = original.defaults
        self.private = private
        self._criterion = criterion
        self._outputs = outputs
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)

    @property
    def original_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer passed to ``make_private`` (Opacus' name)."""
        return self.private.original_optimizer

    @property
    def noise_multiplier(self) -> float:
        """Noise standard deviation / clip norm of every release (calibrated or given)."""
        return self.private.noise_multiplier

    @property
    def ledger(self) -> Ledger:
        """The run's ledger (every sample and noisy release, written before it happens)."""
        return self.private.ledger

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Per-example backward of the physical batch, then dpfy's release at the end of a
        logical batch (module docstring). A closure is refused: the loss comes from the
        loader's batches."""
        if closure is not None:
            raise ValueError(
                "closure must be None: the private loss is computed from the loader's batches"
            )
        if self._outputs is not None:
            self._criterion(None, None).backward()
        self.private.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.private.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.private.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.private.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, "
            f"noise_multiplier={self.noise_multiplier:.4g}, max_grad_norm={self.max_grad_norm})"
        )

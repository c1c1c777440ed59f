"""The first step's run-time checks on a sample batch, with nothing released or written.

Some of the engine's checks need data: where each tensor's batch dimension is (the layout
probe of :mod:`dpfy.training.norms.layout`), whether the recorded per-example gradients sum
to the batch gradient (:mod:`dpfy.training.norms.coverage`), whether each example got its own
(:mod:`dpfy.training.norms.attribution`), and the capture's refusals (a layer called on
single-example slices inside ``forward``, a call ``torch.func`` cannot transform). They run
on the first chunk of a real step. :func:`first_step_issues` runs that chunk on a deep copy of
the model -- accumulate only: no noise drawn, no release, no ledger, the caller's model and its
gradients untouched -- so ``check_module(model, example_batch)`` gives the verdict the first
real step on that batch would give.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: What the checks that need a batch look at (``check_module`` without a batch names them).
RUN_TIME_CHECKS: tuple[str, ...] = (
    "where each input's batch dimension is (a time-major layer, a shared argument with as many "
    "rows as the batch)",
    "a layer called on single-example slices inside forward (a per-example loop)",
    "calls the generic rule's torch.func cannot transform (dropout or an old-style "
    "autograd.Function inside a layer without a rule)",
    "per-example gradients that sum to the batch gradient (coverage)",
    "each example's gradient given to that example (attribution: batch-mixing operations)",
)


def first_step_issues(
    model: nn.Module,
    example_batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> list[str]:
    """The refusal the first step on ``example_batch`` would raise (as one message), or none.

    Args:
      model: the network (not changed: the checks run on a deep copy).
      example_batch: ``(inputs, targets)`` as ``PrivateGradient.accumulate`` takes them
        (``inputs`` a tensor, a tuple for ``model(*inputs)`` or a mapping for
        ``model(**inputs)``).
      loss_fn: per-example losses ``loss_fn(outputs, targets)`` of shape [B]; default
        ``nn.CrossEntropyLoss(reduction="none")``.
    """
    from dpfy.queries import GaussianSumQuery
    from dpfy.training.step import PrivateGradient

    if not (isinstance(example_batch, tuple | list) and len(example_batch) == 2):
        raise ValueError(
            "example_batch must be (inputs, targets), as PrivateGradient.accumulate takes them; "
            f"got {type(example_batch).__name__}"
        )
    inputs, targets = example_batch
    loss = loss_fn if loss_fn is not None else nn.CrossEntropyLoss(reduction="none")
    twin = copy.deepcopy(model)
    batch = int(torch.as_tensor(targets).shape[0]) if targets is not None else 1
    try:
        pg = PrivateGradient(
            twin, GaussianSumQuery(1.0, 1.0), expected_batch_size=float(max(batch, 1)),
            coverage_check="every",
        )
        pg.attribution.every = 1
        pg.accumulate(inputs, targets, loss)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
        return [f"{type(err).__name__}: {err}"]
    return []

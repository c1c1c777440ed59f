"""Checks of what a user's training loop hands dpfy beside the model's layers.

:func:`dpfy.make_private` and :class:`dpfy.training.trainer.PrivateTrainer` call these before
anything is drawn or written: the optimizer's learning rates (read from its param groups, where
a scheduler or a typo puts them), the randomness object, the model's train/eval mode, and the
class labels of a classification batch. Each refusal is one line in the project's template
(``"{name} must be in {range}, got {name}={value!r}"``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from dpfy._validate import MAX_SCALE
from dpfy.randomness import Randomness

#: Losses whose targets of one dimension fewer than the outputs are class indices in [0, C).
CLASS_INDEX_LOSSES: tuple[type[nn.Module], ...] = (nn.CrossEntropyLoss, nn.NLLLoss)


def check_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    """Every param group's ``lr`` is a finite real number in [0, 1e15] (``MAX_SCALE``).

    A NaN or infinite rate spends the whole budget on a model that becomes NaN at the first
    step; it is refused before the first step instead.

    Raises:
      ValueError: names the group and shows the rate.
    """
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        value = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
        number = float(value) if isinstance(value, int | float) else math.nan
        if isinstance(value, bool) or math.isnan(number) or not 0.0 <= number <= MAX_SCALE:
            raise ValueError(
                f"lr must be in [0.0, {MAX_SCALE:g}] (a finite learning rate in the optimizer's "
                f"param_groups[{i}]), got lr={lr!r}"
            )


def check_randomness(randomness: Any, name: str = "randomness") -> None:
    """``randomness`` is ``None`` (secure by default) or a :class:`dpfy.randomness.Randomness`.

    Raises:
      TypeError: anything else (``randomness=0``: pass ``Randomness(0)`` for a seeded run).
    """
    if randomness is not None and not isinstance(randomness, Randomness):
        raise TypeError(
            f"{name} must be None or a dpfy.randomness.Randomness (Randomness(seed) for a "
            f"seeded run), got {name}={randomness!r}"
        )


def warn_eval_mode(model: nn.Module) -> None:
    """Warn when ``model`` is in eval mode (``model.eval()`` left over from an evaluation):
    dropout is then off and any mode-dependent layer trains as in evaluation."""
    if not model.training:
        warnings.warn(
            "model is in eval mode: training it privately as is keeps dropout off; call "
            "model.train() before training (or ignore this if it is intended)",
            UserWarning,
            stacklevel=3,
        )


def check_class_labels(loss_fn: Any, outputs: Any, targets: Any) -> None:
    """For a class-index loss (cross-entropy, NLL), the batch's ``targets`` are integer class
    indices in ``[0, C)`` (C: the outputs' size along dimension 1), or its ``ignore_index``.

    Other losses, and class probabilities of the outputs' shape, are left alone.

    Raises:
      TypeError: targets of a floating or boolean dtype.
      ValueError: a label outside ``[0, C - 1]`` (the first one found is shown).
    """
    if not isinstance(loss_fn, CLASS_INDEX_LOSSES):
        return
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return
    if outputs.dim() < 2 or targets.dim() != outputs.dim() - 1:
        return  # class probabilities (same shape as the outputs) or an unknown layout
    classes = int(outputs.shape[1])
    if targets.dtype == torch.bool or targets.dtype.is_floating_point or targets.is_complex():
        raise TypeError(
            f"targets must be integer class indices in [0, {classes - 1}] (torch.long), got "
            f"targets of dtype {targets.dtype}"
        )
    ignore = getattr(loss_fn, "ignore_index", None)
    kept = targets if ignore is None else targets[targets != ignore]
    bad = kept[(kept < 0) | (kept >= classes)]
    if bad.numel():
        raise ValueError(
            f"targets must be in [0, {classes - 1}] (class indices of {classes} outputs), got "
            f"targets={int(bad.reshape(-1)[0])}"
        )


def check_tensor_labels(
    model: nn.Module, loss_fn: Any, inputs: Any, targets: Any, device: Any = None
) -> None:
    """:func:`check_class_labels` on every label of in-memory tensor data, before a run starts.

    The number of classes C is read from the model's output on the first input row (no
    gradient; the random generators are restored afterwards, so a seeded run draws as without
    the check). Data sets, other losses and empty data are left to the loop.
    """
    if not isinstance(loss_fn, CLASS_INDEX_LOSSES) or not isinstance(targets, torch.Tensor):
        return
    if not isinstance(inputs, torch.Tensor) or len(inputs) == 0:
        return
    first = inputs[:1] if device is None else inputs[:1].to(device)
    devices = [first.device] if first.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        outputs = model(first)
    if isinstance(outputs, torch.Tensor) and outputs.dim() >= 2:
        check_class_labels(loss_fn, outputs.expand(len(targets), *outputs.shape[1:]), targets)

"""Evaluation mode for a block of code, with every submodule's own mode restored after.

``model.train(was_training)`` is not a restore: it sets *every* submodule to the root's mode.
A model whose parts were left in different modes (a pretrained encoder loaded in eval mode
inside a new head in train mode, so its dropout is off) would come back from an evaluation
with all of its dropout switched on, changing the training it was in the middle of.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; each submodule's ``training`` flag as it was
    before, after (also when the block raises)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, mode in modes:
            m.training = mode

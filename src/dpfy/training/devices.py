"""Host copies of what a run writes next to its model, whichever device trained it (the
device a run names is checked by :func:`dpfy.config.check_device`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def host_copy(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` detached and on the CPU: a model file that loads on any machine,
    whichever device trained it (``model.state_dict().items()`` or named parameters)."""
    return {n: t.detach().cpu() for n, t in named}

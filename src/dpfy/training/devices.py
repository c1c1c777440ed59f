"""Where a one-process run trains: the device check of ``RunConfig.device``, and host copies
of what a run writes next to its model."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dpfy._validate import _short_repr

if TYPE_CHECKING:
    import torch


def check_device(name: str, value: Any) -> None:
    """A torch device for one process's training: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``,
    and, for CUDA, one this process can see (torch is imported only then)."""
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", value):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:<index>', "
                         f"got {name}={_short_repr(value)}")
    if value == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(value.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"{name}={value!r} needs CUDA device {index}, but this process sees "
                         f"{count} (torch.cuda.is_available() is {torch.cuda.is_available()})")


def host_copy(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` detached and on the CPU: a model file that loads on any machine,
    whichever device trained it (``model.state_dict().items()`` or named parameters)."""
    return {n: t.detach().cpu() for n, t in named}

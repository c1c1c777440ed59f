"""Where a one-process run trains: the device check shared by the configuration and the CLI."""

from __future__ import annotations

from typing import Any


def check_device(name: str, value: Any) -> None:
    """A torch device for one process's training: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``,
    and, for CUDA, one this process can see (torch is imported only then)."""
    import re

    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", value):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:<index>', "
                         f"got {name}={value!r}")
    if value == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(value.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"{name}={value!r} needs CUDA device {index}, but this process sees "
                         f"{count} (torch.cuda.is_available() is {torch.cuda.is_available()})")

"""The few torchvision names Opacus' ``examples/mnist.py`` imports, for running it where no
torchvision build matches the installed torch (no network either): ``datasets.MNIST`` gives
random images of MNIST's shape and labels (sizes from ``MNIST_STANDIN_SIZES``, default 64
train, 32 test), ``transforms`` the three transforms the script composes. Only the example's
import line changes: ``from torchvision import datasets, transforms`` becomes
``from torchvision_standin import datasets, transforms``."""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch


class MNIST(torch.utils.data.Dataset):
    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Callable[[Any], Any] | None = None) -> None:
        sizes = [int(s) for s in os.environ.get("MNIST_STANDIN_SIZES", "64,32").split(",")]
        n = sizes[0] if train else sizes[1]
        g = torch.Generator().manual_seed(0 if train else 1)
        self.images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image: Any = self.images[i]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])


class Compose:
    def __init__(self, steps: list[Callable[[Any], Any]]) -> None:
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.float().div(255.0).unsqueeze(0)  # [1, H, W] in [0, 1]


class Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


datasets = types.SimpleNamespace(MNIST=MNIST)
transforms = types.SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)

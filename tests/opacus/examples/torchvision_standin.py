"""The few torchvision names Opacus' examples (``mnist.py``, ``cifar10.py``, ``dcgan.py``)
import, for running them where no torchvision build matches the installed torch (and without
network): ``datasets.MNIST`` and ``datasets.CIFAR10`` give random images of their shapes and
labels (sizes from ``STANDIN_SIZES``, default 64 train, 32 test), ``transforms`` the transforms
the scripts compose (on tensors), ``utils.save_image`` saves the tensor with ``torch.save``.
Only the examples' import lines change (``torchvision`` becomes ``torchvision_standin``)."""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch


class _Images(torch.utils.data.Dataset):
    shape: tuple[int, ...] = (28, 28)

    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Callable[[Any], Any] | None = None) -> None:
        sizes = [int(s) for s in os.environ.get("STANDIN_SIZES", "64,32").split(",")]
        n = sizes[0] if train else sizes[1]
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.randint(0, 256, (n, *self.shape), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        image: Any = self.data[i]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])


class MNIST(_Images):
    shape = (28, 28)


class CIFAR10(_Images):
    shape = (3, 32, 32)


class Compose:
    def __init__(self, steps: list[Callable[[Any], Any]]) -> None:
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        x = image.float().div(255.0)  # [C, H, W] in [0, 1]
        return x.unsqueeze(0) if x.dim() == 2 else x


class Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class Resize:
    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        x = image.float()[None, None] if image.dim() == 2 else image.float()[None]
        out = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear")
        return out[0, 0].to(image.dtype) if image.dim() == 2 else out[0].to(image.dtype)


class RandomCrop:
    def __init__(self, size: int, padding: int = 0) -> None:
        self.size, self.padding = int(size), int(padding)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p = self.padding
        x = torch.nn.functional.pad(x, (p, p, p, p))
        top, left = (int(torch.randint(0, d - self.size + 1, ())) for d in x.shape[-2:])
        return x[..., top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if bool(torch.rand(()) < 0.5) else x


def save_image(tensor: torch.Tensor, path: str, **_: Any) -> None:
    torch.save(tensor.detach().cpu(), path)


datasets = types.SimpleNamespace(MNIST=MNIST, CIFAR10=CIFAR10)
transforms = types.SimpleNamespace(
    Compose=Compose, ToTensor=ToTensor, Normalize=Normalize, Resize=Resize,
    RandomCrop=RandomCrop, RandomHorizontalFlip=RandomHorizontalFlip,
)
utils = types.SimpleNamespace(save_image=save_image)

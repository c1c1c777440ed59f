"""ScatterNet features (Oyallon & Mallat 2015) as used by Tramer & Boneh (2021), with a cache.

The scattering transform is a fixed, non-learned cascade of Morlet wavelet convolutions and
complex moduli followed by a local average: with ``J = 2`` scales and ``L = 8`` orientations a
grey ``H x W`` image becomes ``1 + J L + L^2 J (J - 1) / 2 = 81`` channels of
``H / 2^J x W / 2^J`` coefficients (MNIST: ``81 x 7 x 7 = 3969`` features). It sees no labels
and no statistics of the data, so computing it spends no privacy: a model trained by DP-SGD on
the features is private for the training images exactly as one trained on the pixels.

The transform is kymatio's (``kymatio==0.3.0``, torch backend, in the ``images`` extra). Its
package entry point ``kymatio.torch`` also imports the 3-D transform, which needs
``scipy.special.sph_harm`` (removed from SciPy 1.17); the 2-D frontend is imported directly.

Cache: the features of a dataset split are stored under ``$DPFY_CACHE_DIR/features`` (see
:func:`dpfy.features.extract.cache_dir`) as ``<key>.npy`` beside ``<key>.json``, which records
the transform's parameters, kymatio's version, the SHA-256 of the input images and the SHA-256
of the feature file. A cached file is used only when all of these match: a stale file (other
images, parameters or kymatio version) or a tampered one (its checksum differs) is refused with
:class:`FeatureCacheError`, never silently used or overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from dpfy._validate import check_int
from dpfy.features.extract import _progress, cache_dir

#: Tramer & Boneh's setting for 28x28 and 32x32 images.
DEFAULT_J = 2
DEFAULT_L = 8
#: Channel groups of the per-example GroupNorm on the 81 channels (the models' and the rows').
GROUPS = 27


class FeatureCacheError(ValueError):
    """A cached feature file is stale or does not match its recorded checksum."""


def scattering_channels(j: int = DEFAULT_J, orientations: int = DEFAULT_L) -> int:
    """Channels per input channel of a second-order scattering: ``1 + J L + L^2 J (J-1) / 2``."""
    return 1 + j * orientations + orientations**2 * j * (j - 1) // 2


def _kymatio_2d() -> Any:
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "ScatterNet features need kymatio: pip install 'kymatio==0.3.0' (the `images` extra; "
            "`make` installs it)", name="kymatio",
        ) from err
    return ScatteringTorch2D


def kymatio_version() -> str:
    """The installed kymatio version (recorded with every cached file)."""
    import kymatio.version

    return str(kymatio.version.version)


class ScatterNet(nn.Module):
    """The fixed scattering transform of ``[N, C, H, W]`` images: ``[N, C * K, H/2^J, W/2^J]``.

    ``K`` is :func:`scattering_channels`. No trainable parameters; ``forward`` runs without
    autograd history (a fixed feature map, never trained).
    """

    def __init__(
        self, shape: tuple[int, int], j: int = DEFAULT_J, orientations: int = DEFAULT_L
    ) -> None:
        super().__init__()
        check_int("j", j, low=1, high=6)
        check_int("orientations", orientations, low=1, high=16)
        for name, size in zip(("height", "width"), shape, strict=True):
            check_int(name, size, low=2**j)
        self.shape, self.j, self.orientations = (int(shape[0]), int(shape[1])), j, orientations
        self.transform = _kymatio_2d()(J=j, shape=self.shape, L=orientations)

    def output_shape(self, channels: int) -> tuple[int, int, int]:
        """``(C * K, H / 2^J, W / 2^J)`` for ``channels`` input channels."""
        k = scattering_channels(self.j, self.orientations)
        return channels * k, self.shape[0] // 2**self.j, self.shape[1] // 2**self.j

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or tuple(images.shape[-2:]) != self.shape:
            raise ValueError(
                f"images must be [N, C, {self.shape[0]}, {self.shape[1]}], "
                f"got shape {tuple(images.shape)}"
            )
        out: torch.Tensor = self.transform(images.float().contiguous())  # [N, C, K, h, w]
        n, c, k, h, w = out.shape
        return out.reshape(n, c * k, h, w)


def transform_images(
    images: torch.Tensor,
    *,
    j: int = DEFAULT_J,
    orientations: int = DEFAULT_L,
    chunk_size: int = 1024,
    progress: Callable[[int], None] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """ScatterNet features of ``images`` ``[N, C, H, W]``, computed ``chunk_size`` at a time.

    ``progress(n)`` is called after each chunk with the number of images it held. ``device``
    (default: the images') is where the transform runs and the features are returned: each
    chunk is moved there, so the images may stay on the CPU while a GPU computes.
    """
    check_int("chunk_size", chunk_size, low=1)
    device = images.device if device is None else torch.device(device)
    net = ScatterNet((int(images.shape[-2]), int(images.shape[-1])), j, orientations).to(device)
    parts = []
    for start in range(0, len(images), chunk_size):
        chunk = images[start : start + chunk_size]
        parts.append(net(chunk.to(device)))
        if progress is not None:
            progress(len(chunk))
    if not parts:
        return torch.empty((0, *net.output_shape(int(images.shape[1]))), device=device)
    return torch.cat(parts)


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _expected_record(images: torch.Tensor, j: int, orientations: int) -> dict[str, Any]:
    raw = np.ascontiguousarray(images.detach().cpu().numpy(), dtype=np.float32)
    return {
        "transform": "scatternet",
        "j": j,
        "orientations": orientations,
        "kymatio": kymatio_version(),
        "input_shape": list(raw.shape),
        "input_sha256": _sha256(raw.data),
    }


def cached_features(
    images: torch.Tensor,
    key: str,
    *,
    j: int = DEFAULT_J,
    orientations: int = DEFAULT_L,
    directory: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """ScatterNet features of ``images``, read from the cache or computed and cached.

    Args:
      images: ``[N, C, H, W]`` float images (any fixed scaling: the transform is linear before
        its moduli, and the models normalise per example).
      key: the file name stem, e.g. ``"scatternet-J2-L8-mnist-train"``; the image count and
        the first 12 hex digits of the images' SHA-256 are appended, so other images (a
        limit, added canaries) get another file.
      directory: the cache directory (default :func:`dpfy.features.extract.cache_dir`).
      progress: a progress bar while computing.

    Raises:
      FeatureCacheError: ``<key>.npy`` exists but was made from other images, parameters or
        kymatio version (stale), or its SHA-256 differs from the recorded one (tampered).
        The message names the file; delete it and its ``.json`` to recompute.
    """
    if not key or any(ch in key for ch in "/\\") or key.startswith("."):
        raise ValueError(f"key must be a plain file name stem, got key={key!r}")
    folder = Path(directory) if directory is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    expected = _expected_record(images, j, orientations)
    stem = f"{key}-{len(images)}-{expected['input_sha256'][:12]}"
    data_path, record_path = folder / f"{stem}.npy", folder / f"{stem}.json"
    if data_path.exists() or record_path.exists():
        return torch.from_numpy(_read_cached(data_path, record_path, expected))
    with _progress("ScatterNet features", len(images), progress) as advance:
        features = transform_images(images, j=j, orientations=orientations, progress=advance)
    array = np.ascontiguousarray(features.numpy(), dtype=np.float32)
    tmp = data_path.with_suffix(".npy.tmp")
    with tmp.open("wb") as f:
        np.save(f, array)
    record = {**expected, "output_shape": list(array.shape), "sha256": _file_sha256(tmp)}
    record_tmp = record_path.with_suffix(".json.tmp")
    record_tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(data_path)  # data first: a crash between the two leaves a refused, not a
    record_tmp.replace(record_path)  # silently wrong, cache entry
    return features


def _read_cached(
    data_path: Path, record_path: Path, expected: dict[str, Any]
) -> npt.NDArray[np.float32]:
    fix = f"delete {data_path} and {record_path.name} to recompute"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as err:
        raise FeatureCacheError(f"{record_path}: unreadable cache record ({err}); {fix}") from err
    if not isinstance(record, dict):
        raise FeatureCacheError(f"{record_path}: not a cache record; {fix}")
    stale = sorted(k for k, v in expected.items() if record.get(k) != v)
    if stale:
        raise FeatureCacheError(
            f"{data_path} is stale: its {', '.join(stale)} differ from this run's; {fix}"
        )
    if not data_path.exists() or _file_sha256(data_path) != record.get("sha256"):
        raise FeatureCacheError(
            f"{data_path} does not match the SHA-256 recorded in {record_path.name} "
            f"(changed or truncated after it was written); {fix}"
        )
    array: npt.NDArray[np.float32] = np.load(data_path, allow_pickle=False)
    if list(array.shape) != record.get("output_shape"):
        raise FeatureCacheError(f"{data_path}: shape {array.shape} differs from its record; {fix}")
    return array


def dataset_features(
    dataset: str, split: str, images: torch.Tensor, *, progress: bool = False
) -> torch.Tensor:
    """ScatterNet features (J=2, L=8) of a dataset split's images, from the cache."""
    key = f"scatternet-J{DEFAULT_J}-L{DEFAULT_L}-{dataset}-{split}"
    return cached_features(images, key, progress=progress)


def flat_normalised(features: torch.Tensor, groups: int = GROUPS) -> npt.NDArray[np.float64]:
    """ScatterNet features as rows for the linear estimators (:mod:`dpfy.features`).

    Each example is normalised on its own (GroupNorm of ``groups`` channel groups, no
    parameters: the normalisation of the ``scatternet-*`` models; no statistics of other
    examples, so no privacy cost), flattened, and scaled by ``1 / sqrt(d)``: a row's L2 norm is
    at most about 1 (less where a group's coefficients are nearly constant, which GroupNorm's
    ``eps`` shrinks), so the estimators' row clipping at ``clip_norm = 1`` rarely bites.
    """
    if features.dim() != 4:
        raise ValueError(f"features must be [N, C, h, w], got shape {tuple(features.shape)}")
    z = nn.functional.group_norm(features.float(), groups).flatten(1)
    return (z / float(np.sqrt(z.shape[1]))).numpy().astype(np.float64)

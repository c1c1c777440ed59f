"""dpfy.datasets: idx parsing, MNIST slice, missing-package messages."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from dpfy import datasets


def _write_idx(path, array: np.ndarray, code: int = 0x08, compress: bool = False) -> None:
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array).tobytes()
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def test_read_idx_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    _write_idx(tmp_path / "a", images)
    np.testing.assert_array_equal(datasets.read_idx(tmp_path / "a"), images)
    floats = rng.normal(size=(3, 4)).astype(">f4")
    _write_idx(tmp_path / "b.gz", floats, code=0x0D, compress=True)
    np.testing.assert_allclose(datasets.read_idx(tmp_path / "b.gz"), floats.astype(np.float32))


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx file"):
        datasets.read_idx(tmp_path / "bad")
    _write_idx(tmp_path / "short", np.zeros((4, 2), np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="header announces"):
        datasets.read_idx(tmp_path / "short")


def test_fashion_mnist_from_tiny_idx_files(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images, compress=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels)
    x, y = datasets.load_fashion_mnist("test", root=tmp_path)
    assert x.shape == (7, 1, 28, 28) and str(x.dtype) == "torch.float32"
    assert y.tolist() == labels.tolist()
    expected = (images[2].astype(np.float32) / 255.0 - 0.2860) / 0.3530
    np.testing.assert_allclose(x[2, 0].numpy(), expected, rtol=1e-6, atol=1e-6)
    x3, _ = datasets.load_fashion_mnist("test", root=tmp_path, limit=3)
    assert x3.shape[0] == 3


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    match = "apt-get install dataset-fashion-mnist"
    with pytest.raises(datasets.DatasetNotFoundError, match=match):
        datasets.load_fashion_mnist("train", root=tmp_path)


def test_mnist_slice():
    x, y = datasets.load_mnist("test", limit=100)
    assert x.shape == (100, 1, 28, 28) and y.shape == (100,)
    assert str(x.dtype) == "torch.float32" and str(y.dtype) == "torch.int64"
    assert set(y.tolist()) <= set(range(10)) and len(set(y.tolist())) > 5
    assert -0.5 < float(x.min()) < -0.3 and float(x.max()) > 2.5  # normalised pixels


def test_bad_names():
    with pytest.raises(ValueError, match="split must be one of"):
        datasets.load_mnist("valid")
    with pytest.raises(ValueError, match="name must be one of"):
        datasets.load("cifar10")

"""Chunked one-pass sufficient statistics equal the in-memory ones (memory-mapped input too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfy.features.stats import clip_rows, label_matrix, sufficient_statistics


def _data(n=500, d=7, m=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) * rng.uniform(0.1, 3, size=(n, 1)), rng.integers(0, m, n)


def _direct(x, Y, clip):
    xc = clip_rows(torch.as_tensor(x), clip).numpy()
    A = np.stack([xc[Y[:, j] > 0].T @ xc[Y[:, j] > 0] for j in range(Y.shape[1])])
    return xc.T @ xc, A, xc.T @ Y


def test_memmapped_chunks_match_in_memory(tmp_path):
    x, y = _data()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    xm = np.load(tmp_path / "x.npy", mmap_mode="r")
    ym = np.load(tmp_path / "y.npy", mmap_mode="r")
    chunks = ((xm[i : i + 77], ym[i : i + 77]) for i in range(0, len(ym), 77))
    s = sufficient_statistics(chunks, clip_norm=1.5, num_classes=4)
    G, A, b = _direct(x, np.eye(4)[y], 1.5)
    np.testing.assert_allclose(s.covariance.numpy(), G, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.class_covariance.numpy(), A, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.class_sums.numpy(), b, rtol=1e-12, atol=1e-12)
    assert s.rows == 500 and s.covariance.dtype == torch.float64


def test_multi_label_and_float32_products():
    x, y = _data()
    Y = np.eye(4)[y]
    Y[::3, 0] = 1.0  # up to two positives per row; some rows are all-negative below
    Y[1::7] = 0.0
    s = sufficient_statistics([(x[:250], Y[:250]), (x[250:], Y[250:])], clip_norm=2.0,
                              num_classes=4, max_positives=2)
    G, A, b = _direct(x, Y, 2.0)
    np.testing.assert_allclose(s.covariance.numpy(), G, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.class_covariance.numpy(), A, rtol=1e-12, atol=1e-12)
    f32 = sufficient_statistics([(x, Y)], clip_norm=2.0, num_classes=4, max_positives=2,
                                dtype=torch.float32)
    np.testing.assert_allclose(f32.covariance.numpy(), G, rtol=1e-5, atol=1e-4)


def test_positive_bound_is_enforced():
    x, y = _data()
    Y = np.eye(4)[y]
    Y[0] = 1.0
    with pytest.raises(ValueError, match="max_positives must bound"):
        sufficient_statistics([(x, Y)], clip_norm=1.0, num_classes=4, max_positives=2)
    with pytest.raises(ValueError, match="batches must contain"):
        sufficient_statistics([], clip_norm=1.0, num_classes=4)
    with pytest.raises(ValueError, match="clip_norm must be in"):
        sufficient_statistics([(x, y)], clip_norm=0.0, num_classes=4)
    with pytest.raises(ValueError, match="only 0 and 1"):
        label_matrix(np.full((3, 2), 2.0))

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


def test_multi_label():
    x, y = _data()
    Y = np.eye(4)[y]
    Y[::3, 0] = 1.0  # up to two positives per row; some rows are all-negative below
    Y[1::7] = 0.0
    s = sufficient_statistics([(x[:250], Y[:250]), (x[250:], Y[250:])], clip_norm=2.0,
                              num_classes=4, max_positives=2)
    G, A, b = _direct(x, Y, 2.0)
    np.testing.assert_allclose(s.covariance.numpy(), G, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.class_covariance.numpy(), A, rtol=1e-12, atol=1e-12)
    assert s.covariance.dtype == torch.float64


def test_a_row_that_breaks_a_bound_is_a_zero_row_not_an_error():
    """More than k positives, a label outside the class list, a 2-d row holding a 2, a NaN
    feature: each such row adds nothing (a per-example operation), the others are kept."""
    x, y = _data()
    Y = np.eye(4)[y]
    bad = [0, 5, 9]
    Y[0] = 1.0  # 4 positives > k = 2
    Y[5, 1] = 2.0  # not a 0/1 row
    x[9, 3] = np.nan
    s = sufficient_statistics([(x, Y)], clip_norm=1.0, num_classes=4, max_positives=2)
    keep = np.setdiff1d(np.arange(len(x)), bad)
    G, A, b = _direct(x[keep], Y[keep], 1.0)
    np.testing.assert_allclose(s.covariance.numpy(), G, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.class_sums.numpy(), b, rtol=1e-12, atol=1e-12)
    assert s.rows == len(x)  # the size N counts every row given
    idx = y.astype(float)
    idx[[1, 2, 3]] = [4, -1, 0.5]  # outside [0, 4), negative, non-integral
    s1 = sufficient_statistics([(x[10:], idx[10:])], clip_norm=1.0, num_classes=4)
    s0 = sufficient_statistics([(x[10:], y[10:])], clip_norm=1.0, num_classes=4)
    torch.testing.assert_close(s1.covariance, s0.covariance)
    np.testing.assert_array_equal(label_matrix(np.array([1, 7, -2]), 3).numpy(),
                                  [[0, 1, 0], [0, 0, 0], [0, 0, 0]])


def test_clip_rows_never_overflows():
    huge = torch.tensor([[1e300, -1e300, 3e299], [1e308, 1e308, 0.0], [0.5, 0.0, 0.0],
                         [0.0, 0.0, 0.0], [float("inf"), 1.0, 0.0], [5e-324, 0.0, 0.0]],
                        dtype=torch.float64)
    c = clip_rows(huge, 2.0)
    norms = torch.linalg.vector_norm(c, dim=1)
    assert bool(torch.isfinite(c).all())
    torch.testing.assert_close(norms[:2], torch.full((2,), 2.0, dtype=torch.float64))
    direction = torch.tensor([1.0, -1.0, 0.3], dtype=torch.float64)
    torch.testing.assert_close(c[0], 2.0 * direction / direction.norm())  # its own direction
    assert torch.equal(c[2:4], huge[2:4]) and torch.equal(c[5], huge[5])  # inside: unchanged
    assert torch.equal(c[4], torch.zeros(3, dtype=torch.float64))  # non-finite: a zero row


def test_shapes_and_arguments_are_checked():
    x, y = _data()
    with pytest.raises(ValueError, match="batches must contain"):
        sufficient_statistics([], clip_norm=1.0, num_classes=4)
    with pytest.raises(ValueError, match="clip_norm must be in"):
        sufficient_statistics([(x, y)], clip_norm=0.0, num_classes=4)
    with pytest.raises(ValueError, match="num_classes must be the public number"):
        sufficient_statistics([(x, y)], clip_norm=1.0, num_classes=None)
    with pytest.raises(ValueError, match="num_classes must be the public number"):
        label_matrix(y, None)
    with pytest.raises(ValueError, match="num_classes=3 columns"):
        label_matrix(np.zeros((5, 2)), 3)
    with pytest.raises(ValueError, match="features must be"):
        sufficient_statistics([(x, y[:-1])], clip_norm=1.0, num_classes=4)

"""Clipped sufficient statistics of least squares, in one pass over chunks of data.

For features ``x_i`` clipped to L2 norm ``C`` and label vectors ``y_i`` in ``{0, 1}^m`` with at
most ``k`` positives (Mehta et al. 2023, Eq. 6):

    G   = sum_i x_i x_i^T                  (feature covariance, d x d)
    A_j = sum_{i: y_ij = 1} x_i x_i^T      (per-class covariance, m x d x d)
    b_j = sum_{i: y_ij = 1} x_i            (per-class sums, d x m)

These are sums, so they can be accumulated chunk by chunk (e.g. over memory-mapped ``.npy``
files) and data larger than memory works. Sums are kept in float64; each chunk's products are
computed in ``dtype`` (float64 by default; float32 halves the time, and its rounding error is far
below any DP noise). No normalisation by the number of examples is done (under add-or-remove
adjacency the count itself is private).

Add-or-remove L2 sensitivities (one example, ``||x|| <= C``, at most ``k`` positives):
``G``: ``C^2``; ``A`` (all classes, Frobenius): ``sqrt(k) C^2``; ``b`` (all classes):
``sqrt(k) C``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from dpfy._validate import check_int, check_range

#: Features ``[b, d]`` or labels as NumPy (possibly memory-mapped), nested sequences or torch.
ArrayOrTensor = npt.ArrayLike | torch.Tensor
#: One chunk ``(x, y)`` of :func:`sufficient_statistics`.
Batch = tuple[ArrayOrTensor, ArrayOrTensor]


def clip_rows(x: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale each row to L2 norm at most ``clip_norm``: ``x * min(1, C / ||x||)``."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x * torch.clamp(clip_norm / norms.clamp_min(1e-300), max=1.0)


def label_matrix(
    y: ArrayOrTensor, num_classes: int | None = None, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Labels as an ``[n, m]`` 0/1 matrix: class indices ``[n]`` become one-hot rows."""
    t = y if isinstance(y, torch.Tensor) else torch.from_numpy(np.array(y))
    if t.ndim == 2:
        if not bool(((t == 0) | (t == 1)).all()):
            raise ValueError("a 2-d label matrix must hold only 0 and 1")
        return t.to(dtype)
    if t.ndim != 1:
        raise ValueError(f"labels must be 1-d class indices or a 2-d 0/1 matrix, got {t.ndim}-d")
    t = t.long()
    m = int(num_classes) if num_classes is not None else int(t.max()) + 1
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= m):
        raise ValueError(f"class indices must be in [0, {m}), got min={int(t.min())}")
    return torch.nn.functional.one_hot(t, m).to(dtype)


@dataclass(frozen=True)
class SufficientStats:
    """Clipped sufficient statistics (sums, float64) and the facts that bound their sensitivity.

    Attributes:
      covariance: ``G``, ``[d, d]``.
      class_covariance: ``A``, ``[m, d, d]``.
      class_sums: ``b``, ``[d, m]``.
      clip_norm: ``C``, the feature clip norm used.
      max_positives: ``k``, the bound on positive labels per example that was enforced.
      rows: number of rows seen (informative only; private under add-or-remove).
    """

    covariance: torch.Tensor
    class_covariance: torch.Tensor
    class_sums: torch.Tensor
    clip_norm: float
    max_positives: int
    rows: int


@dataclass
class _Sums:
    """The running float64 sums ``G``, ``A`` (``[0, d, d]`` when not wanted) and ``b``."""

    G: torch.Tensor
    A: torch.Tensor
    b: torch.Tensor

    @classmethod
    def zeros(cls, d: int, num_classes: int, class_covariance: bool) -> _Sums:
        return cls(
            G=torch.zeros(d, d, dtype=torch.float64),
            A=torch.zeros(num_classes if class_covariance else 0, d, d, dtype=torch.float64),
            b=torch.zeros(d, num_classes, dtype=torch.float64),
        )


def sufficient_statistics(
    batches: Iterable[Batch],
    *,
    clip_norm: float,
    num_classes: int,
    max_positives: int = 1,
    dtype: torch.dtype = torch.float64,
    class_covariance: bool = True,
) -> SufficientStats:
    """One pass over ``(features, labels)`` chunks; returns the clipped sums.

    Args:
      batches: iterable of ``(x, y)``: ``x`` ``[b, d]`` (NumPy, memory-mapped NumPy or torch),
        ``y`` class indices ``[b]`` or a 0/1 matrix ``[b, m]``.
      clip_norm: feature clip norm ``C`` in (0, inf).
      num_classes: ``m``.
      max_positives: ``k``; a row with more positives raises ValueError (the sensitivity
        would not hold).
      dtype: dtype of each chunk's matrix products (sums are float64).
      class_covariance: also accumulate ``A`` (DP-LS needs it; DP-FC does not).

    Raises:
      ValueError: bad arguments, inconsistent shapes, or a row with more than ``k`` positives.
    """
    check_range("clip_norm", clip_norm, 0.0, float("inf"), low_open=True, high_open=True)
    check_int("num_classes", num_classes)
    check_range("max_positives", max_positives, 1, num_classes, integer=True)
    sums: _Sums | None = None
    rows = 0
    for xb, y in batches:
        x = xb if isinstance(xb, torch.Tensor) else torch.from_numpy(np.array(xb, dtype=np.float64))
        yy = label_matrix(y, num_classes, dtype=torch.float64)
        if x.ndim != 2 or yy.shape != (x.shape[0], num_classes):
            raise ValueError(
                f"a batch must be x [b, d] with labels [b] or [b, {num_classes}], "
                f"got x {tuple(x.shape)} and labels {tuple(yy.shape)}"
            )
        positives = yy.sum(1)
        if x.shape[0] and int(positives.max()) > max_positives:
            raise ValueError(
                f"max_positives must bound the positive labels per example, got max_positives="
                f"{max_positives} but a row has {int(positives.max())}"
            )
        d = x.shape[1]
        if sums is None:
            sums = _Sums.zeros(d, num_classes, class_covariance)
        xc = clip_rows(x.to(torch.float64), clip_norm)
        sums.b += xc.T @ yy
        xd = xc.to(dtype)
        one_hot = bool((positives == 1).all())
        if class_covariance:
            gc = torch.zeros(d, d, dtype=torch.float64) if one_hot else None
            for j in range(num_classes):
                sel = xd[yy[:, j] > 0]
                if sel.shape[0]:
                    aj = (sel.T @ sel).to(torch.float64)
                    sums.A[j] += aj
                    if gc is not None:
                        gc += aj
            # a one-hot chunk: every row is in exactly one class, so G is the sum of the A_j
            sums.G += gc if gc is not None else (xd.T @ xd).to(torch.float64)
        else:
            sums.G += (xd.T @ xd).to(torch.float64)
        rows += x.shape[0]
    if sums is None:
        raise ValueError("batches must contain at least one batch")
    return SufficientStats(sums.G, sums.A, sums.b, float(clip_norm), int(max_positives), rows)


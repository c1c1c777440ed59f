"""Clipped sufficient statistics of least squares, in one pass over chunks of data.

For features ``x_i`` clipped to L2 norm ``C`` and label vectors ``y_i`` in ``{0, 1}^m`` with at
most ``k`` positives (Mehta et al. 2023, Eq. 6):

    G   = sum_i x_i x_i^T                  (feature covariance, d x d)
    A_j = sum_{i: y_ij = 1} x_i x_i^T      (per-class covariance, m x d x d)
    b_j = sum_{i: y_ij = 1} x_i            (per-class sums, d x m)

These are sums, so they can be accumulated chunk by chunk (e.g. over memory-mapped ``.npy``
files) and data larger than memory works. Products and sums are float64: float32 products
exceed the sensitivities below by their rounding (measured +6e-6 relative at n = 500 and
+2.8e-4 at n = 60,000, d = 64), a margin no ledger entry records. No normalisation by the number
of examples is done.

Every row is handled on its own, so that one example can change the sums by at most the
sensitivities below, whatever it holds (:func:`usable_rows`): a row whose features are not all
finite, or whose label names no class of the public list (an index outside ``[0, m)``, a
non-integral index, a 2-d row holding anything but 0 and 1, more than ``k`` positives), is
replaced by a zero row, which adds nothing to any sum. Nothing is refused because of the value
of one row; only the shapes (public) are checked.

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

_F64 = torch.float64


def check_num_classes(num_classes: int | None) -> int:
    """``num_classes`` as an int >= 1; None is refused: the class list must be public.

    Taking the number of classes from the labels (``max(y) + 1``) would make the shape of every
    release, and the noise calibrated on it, depend on whether one example of the largest class
    is present.
    """
    if num_classes is None:
        raise ValueError(
            "num_classes must be the public number of classes (an int >= 1, from the data set's "
            "definition, not from its labels), got num_classes=None"
        )
    check_int("num_classes", num_classes)
    return int(num_classes)


def split_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = peak * unit`` per row, with ``peak = max_j |x_ij|`` ``[n, 1]`` and ``|unit| <= 1``.

    ``unit``'s rows have norm in ``[1, sqrt(d)]`` (0 for a zero row), so norms and products
    formed from it cannot overflow, however large the row. A row holding inf or NaN is a zero
    row here (``peak = 0``).
    """
    finite = torch.isfinite(x).all(dim=1, keepdim=True)
    x = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
    peak = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1)
    unit = x / torch.where(peak > 0, peak, torch.ones((), dtype=x.dtype))
    return unit, peak


def clip_rows(x: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale each row to L2 norm at most ``clip_norm``: ``x * min(1, C / ||x||)``.

    The norm is never formed from ``x`` itself: with ``x = peak * unit`` (:func:`split_rows`),
    the clipped row is ``unit * min(peak, C / ||unit||)``, whose norm is ``min(||x||, C)`` (up
    to float64 rounding) even when ``||x||`` overflows (a finite row of entries near 1e300 is
    scaled to norm ``C`` in its own direction). A row already inside the ball is returned
    unchanged; a row holding inf or NaN becomes a zero row. The L2 sensitivity of a sum of
    clipped rows is therefore exactly ``C`` under add-or-remove, for every finite or non-finite
    row.
    """
    unit, peak = split_rows(x)
    unit_norm = torch.linalg.vector_norm(unit, dim=1, keepdim=True)
    scaled = unit * torch.minimum(peak, clip_norm / unit_norm)  # 0 * min(0, inf) for zero rows
    inside = torch.isfinite(x).all(dim=1, keepdim=True) & (peak * unit_norm <= clip_norm)
    return torch.where(inside, x, scaled)


def _label_rows(y: ArrayOrTensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Y [n, m] float64 0/1, usable [n] bool)``: rows that name no class are all zero."""
    t = y if isinstance(y, torch.Tensor) else torch.from_numpy(np.array(y))
    m = num_classes
    if t.ndim == 2:
        if t.shape[1] != m:
            raise ValueError(
                f"a 2-d label matrix must have num_classes={m} columns, got shape {tuple(t.shape)}"
            )
        t = t.to(_F64)
        usable = ((t == 0) | (t == 1)).all(dim=1)
        return torch.where(usable[:, None], t, torch.zeros((), dtype=_F64)), usable
    if t.ndim != 1:
        raise ValueError(f"labels must be 1-d class indices or a 2-d 0/1 matrix, got {t.ndim}-d")
    if t.is_complex():
        raise ValueError("class indices must be real numbers, got a complex dtype")
    if t.is_floating_point():
        f = t.to(_F64)
        usable = torch.isfinite(f) & (f == f.round()) & (f >= 0) & (f < m)
        index = torch.where(usable, f, torch.zeros((), dtype=_F64)).long()
    else:
        t = t.long()
        usable = (t >= 0) & (t < m)
        index = torch.where(usable, t, torch.zeros((), dtype=torch.long))
    one_hot = torch.nn.functional.one_hot(index, m).to(_F64) if m else t.new_zeros(len(t), 0)
    return one_hot * usable[:, None].to(_F64), usable


def label_matrix(
    y: ArrayOrTensor, num_classes: int | None, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Labels as an ``[n, m]`` 0/1 matrix: class indices ``[n]`` become one-hot rows.

    A row that names no class of ``[0, m)`` (an index outside it, non-integral or not finite; a
    2-d row holding anything but 0 and 1) is all zero. ``num_classes`` is required (public).

    Raises:
      ValueError: ``num_classes`` is None or not a positive int, or the labels' shape (public)
        is neither ``[n]`` nor ``[n, num_classes]``. Never because of one row's value.
    """
    return _label_rows(y, check_num_classes(num_classes))[0].to(dtype)


def usable_rows(
    x: torch.Tensor, y: ArrayOrTensor, num_classes: int, *, max_positives: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, Y)`` float64 with every unusable example replaced by a zero row in both.

    Unusable: features not all finite, a label that names no class of the public list
    (:func:`label_matrix`), or more than ``max_positives`` positive labels. A zero row adds
    nothing to any release of :mod:`dpfy.features` (each is a sum of terms linear in ``x_i``),
    so the example counts as absent: a per-example operation, which keeps every sensitivity, and
    never a halt whose occurrence depends on one example.

    Raises:
      ValueError: ``x`` is not 2-d or its length differs from the labels' (shapes are public).
    """
    m = check_num_classes(num_classes)
    x = x.to(_F64)
    Y, usable = _label_rows(y, m)
    if x.ndim != 2 or Y.shape[0] != x.shape[0]:
        raise ValueError(
            f"features must be [n, d] with labels [n] or [n, {m}], got features "
            f"{tuple(x.shape)} and labels of length {Y.shape[0]}"
        )
    usable = usable & torch.isfinite(x).all(dim=1)
    if max_positives is not None:
        usable = usable & (Y.sum(dim=1) <= max_positives)
    zero = torch.zeros((), dtype=_F64)
    return torch.where(usable[:, None], x, zero), torch.where(usable[:, None], Y, zero)


@dataclass(frozen=True)
class SufficientStats:
    """Clipped sufficient statistics (sums, float64) and the facts that bound their sensitivity.

    Attributes:
      covariance: ``G``, ``[d, d]``.
      class_covariance: ``A``, ``[m, d, d]``.
      class_sums: ``b``, ``[d, m]``.
      clip_norm: ``C``, the feature clip norm used.
      max_positives: ``k``, the bound on positive labels per example that was enforced.
      rows: number of rows seen, zeroed ones included (the data set size N, which the ledger
        records and the report treats as public).
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
            G=torch.zeros(d, d, dtype=_F64),
            A=torch.zeros(num_classes if class_covariance else 0, d, d, dtype=_F64),
            b=torch.zeros(d, num_classes, dtype=_F64),
        )


def sufficient_statistics(
    batches: Iterable[Batch],
    *,
    clip_norm: float,
    num_classes: int,
    max_positives: int = 1,
    class_covariance: bool = True,
) -> SufficientStats:
    """One pass over ``(features, labels)`` chunks; returns the clipped sums (float64).

    Args:
      batches: iterable of ``(x, y)``: ``x`` ``[b, d]`` (NumPy, memory-mapped NumPy or torch),
        ``y`` class indices ``[b]`` or a 0/1 matrix ``[b, m]``.
      clip_norm: feature clip norm ``C`` in (0, inf).
      num_classes: ``m``, public (the data set's definition, never the labels').
      max_positives: ``k``; a row with more positives is a zero row (:func:`usable_rows`).
      class_covariance: also accumulate ``A`` (DP-LS needs it; DP-FC does not).

    Raises:
      ValueError: bad arguments or inconsistent shapes; never the value of one row.
    """
    check_range("clip_norm", clip_norm, 0.0, float("inf"), low_open=True, high_open=True)
    m = check_num_classes(num_classes)
    check_range("max_positives", max_positives, 1, m, integer=True)
    sums: _Sums | None = None
    rows = 0
    for xb, y in batches:
        x = xb if isinstance(xb, torch.Tensor) else torch.from_numpy(np.array(xb, dtype=np.float64))
        x, yy = usable_rows(x, y, m, max_positives=max_positives)
        d = x.shape[1]
        if sums is None:
            sums = _Sums.zeros(d, m, class_covariance)
        elif d != sums.G.shape[0]:
            raise ValueError(f"every batch must have {sums.G.shape[0]} features, got {d}")
        xc = clip_rows(x, clip_norm)
        sums.b += xc.T @ yy
        if class_covariance:
            # every row is in exactly one class or is zero: G is the sum of the A_j
            one_hot = bool(((yy.sum(1) == 1) | (xc == 0).all(1)).all())
            gc = torch.zeros(d, d, dtype=_F64) if one_hot else None
            for j in range(m):
                sel = xc[yy[:, j] > 0]
                if sel.shape[0]:
                    aj = sel.T @ sel
                    sums.A[j] += aj
                    if gc is not None:
                        gc += aj
            sums.G += gc if gc is not None else xc.T @ xc
        else:
            sums.G += xc.T @ xc
        rows += x.shape[0]
    if sums is None:
        raise ValueError("batches must contain at least one batch")
    return SufficientStats(sums.G, sums.A, sums.b, float(clip_norm), int(max_positives), rows)

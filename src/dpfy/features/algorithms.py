"""DP learning of a linear classifier on fixed features (Mehta et al. 2023, Algorithms 1-4).

Every algorithm releases *sums over the whole dataset* with Gaussian noise, never divides by the
number of examples, and records each release in a :class:`dpfy.ledger.Ledger` (write-ahead: the
entry is written before the noisy value exists). The sampler is ``full_batch``: no subsampling,
so the run is a plain composition of Gaussian mechanisms, accounted exactly by
:mod:`dpfy.features.accounting`. Its ledger entries record the data set size N, which the
report states is treated as public (docs/architecture.md, 5.12).

What holds for every release, whatever one example holds (each is checked, removing or adding
one row, by ``tests/features/test_sensitivity_property.py``):

* The class list is public: ``num_classes`` is required (:func:`~dpfy.features.stats.
  check_num_classes`); it is never read from the labels.
* One example changes each noise-free sum by at most the sensitivity its ledger entry records,
  and never makes it non-finite. Rows are clipped without forming a norm that can overflow
  (:func:`~dpfy.features.stats.clip_rows`, :func:`clipped_gradient_sum`); a row with
  non-finite features or a label outside the class list is a zero row
  (:func:`~dpfy.features.stats.usable_rows`), not an error.
* Sums, products and Hessians are float64 (float32 rounding alone exceeded the sensitivity:
  +2.8e-4 relative for a 64 x 64 covariance of 60,000 rows). What float64 rounding leaves is
  of the order of ``n 2^-53`` relative and is not added to the recorded sensitivity.

Regularisation coefficients are in the same "sum" units (a ridge of ``lam`` adds ``lam * I`` to a
sum of ``n`` outer products), so ``l2 = 1 / C_sklearn`` reproduces scikit-learn's
``LogisticRegression(C=C_sklearn, fit_intercept=False)`` objective.

Noisy symmetric matrices are symmetrised (``(M + M^T) / 2``) and, unless adding the ridge already
makes them positive definite, projected onto the positive semi-definite cone (eigenvalues clipped
at 0) before the ridge is added and the system solved (:class:`PSDSolver`). Both steps are
post-processing and cost no privacy.

Weights are returned as a float64 ``[d, m]`` tensor; scores are ``x @ weights`` (no intercept:
append a constant feature to learn one).

References:
  Mehta, Krichene, Thakurta, Kurakin, Cutkosky. Differentially Private Image Classification
  from Features. TMLR 2023. Algorithm 1 (DP-SGD/Adam), 2 (DP-Newton), 3 (DP-LS), 4 (DP-FC).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from dpfy._validate import check_int, check_range
from dpfy.features.stats import (
    ArrayOrTensor,
    Batch,
    SufficientStats,
    check_num_classes,
    clip_rows,
    split_rows,
    sufficient_statistics,
    usable_rows,
)
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling.spec import SampleSpec

Loss = Literal["softmax", "sigmoid"]
LOSSES = ("softmax", "sigmoid")
#: Bound beta_H on the second derivative of the logistic loss, sigma'(z) <= 1/4.
HESSIAN_BOUND = 0.25
_F64 = torch.float64


@dataclass(frozen=True, slots=True, kw_only=True)
class Preconditioner:
    """The noisy feature covariance that preconditions DP-FC (Mehta et al., Alg. 4).

    Attributes:
      clip_norm: ``C_G``, the norm features are clipped to before ``G = sum_i x~_i x~_i^T``
        (sensitivity ``C_G^2``).
      ridge: ``lambda`` added to the preconditioner (sum units).
      stats: statistics of the same ``x`` clipped to ``clip_norm``; their covariance is used
        instead of recomputing it (it is released by the fit, with its noise).
    """

    clip_norm: float
    ridge: float = 1.0
    stats: SufficientStats | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Adam:
    """Adam's constants for :func:`dp_adam` (Kingma & Ba 2015): ``betas`` and ``eps``."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True)
class Fitted:
    """Result of a DP fit: ``weights`` ``[d, m]`` (float64) and the ``ledger`` of its releases."""

    weights: torch.Tensor
    ledger: Ledger


# ----------------------------------------------------------------------------- helpers


def _ledger(ledger: Ledger | None) -> Ledger:
    return Ledger() if ledger is None else ledger


def _randomness(randomness: Randomness | None) -> Randomness:
    return Randomness.secure_mode() if randomness is None else randomness


def _release(
    value: torch.Tensor,
    *,
    sensitivity: float,
    noise_multiplier: float,
    ledger: Ledger,
    sample_id: int,
    randomness: Randomness,
    name: str,
    symmetric: bool = False,
) -> torch.Tensor:
    """Add N(0, (z S)^2) to every coordinate of ``value`` after writing the ledger entry.

    With ``symmetric`` the noisy matrices (last two dims) are symmetrised afterwards.
    """
    std = float(noise_multiplier) * float(sensitivity)
    ledger.record_sum_query(sample_id, sensitivity=float(sensitivity), noise_std=std, name=name)
    if std > 0.0:
        value = value + randomness.torch_normal(tuple(value.shape), std, dtype=value.dtype)
    if symmetric:
        value = 0.5 * (value + value.transpose(-1, -2))
    return value


def _full_batch(ledger: Ledger, n: int, step: int) -> int:
    """A full-batch sample entry; it records ``n`` (treated as public, see the module doc)."""
    return ledger.record_sample(SampleSpec(sampler="full_batch", dataset_size=int(n)), step=step)


@dataclass(frozen=True)
class _CholeskyFactor:
    """``M = L L^T`` (the positive definite case)."""

    chol: torch.Tensor

    def solve(self, r: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_solve(r, self.chol)


@dataclass(frozen=True)
class _EigenFactor:
    """``M = V diag(vals) V^T`` with ``vals`` the clipped eigenvalues plus the ridge."""

    vecs: torch.Tensor
    vals: torch.Tensor

    def solve(self, r: torch.Tensor) -> torch.Tensor:
        return self.vecs @ ((self.vecs.T @ r) / self.vals[:, None])


class PSDSolver:
    """Solve ``M w = r`` for a noisy symmetric ``S`` made positive definite (post-processing).

    ``M = S + ridge I`` when that is positive definite (checked by a Cholesky factorisation, the
    cheap common case when the ridge is at least the noise level); otherwise ``M = P(S) + ridge
    I`` where ``P`` projects ``S`` onto the PSD cone by clipping its negative eigenvalues to 0.
    Either way ``M`` is a deterministic function of the released ``S``, so no privacy is spent.
    """

    def __init__(self, S: torch.Tensor, ridge: float) -> None:
        S = 0.5 * (S + S.T).to(_F64)
        d = S.shape[0]
        scale = float(S.diagonal().abs().max()) if d else 1.0
        shift = max(float(ridge), 1e-12 * max(scale, 1.0))
        eye = torch.eye(d, dtype=_F64)
        chol, info = torch.linalg.cholesky_ex(S + shift * eye)
        self.projected = int(info) != 0
        self._factor: _CholeskyFactor | _EigenFactor
        if not self.projected:
            self._factor = _CholeskyFactor(chol)
        else:
            vals, vecs = torch.linalg.eigh(S)
            self._factor = _EigenFactor(vecs, vals.clamp_min(0.0) + shift)

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        rhs = rhs.to(_F64)
        vec = rhs.ndim == 1
        r = rhs[:, None] if vec else rhs
        out = self._factor.solve(r)
        return out[:, 0] if vec else out


def residuals(scores: torch.Tensor, y: torch.Tensor, loss: Loss) -> torch.Tensor:
    """``d loss / d scores`` per example: ``softmax(s) - y`` or ``sigmoid(s) - y`` (``[n, m]``)."""
    if loss == "softmax":
        if scores.numel() >= 1 << 16:
            return torch.softmax(scores, dim=1) - y
        e = (scores - scores.amax(dim=1, keepdim=True)).exp()  # small inputs: avoids the
        return e / e.sum(dim=1, keepdim=True) - y  # thread-pool overhead of torch.softmax
    if loss == "sigmoid":
        return torch.sigmoid(scores) - y
    raise ValueError(f"loss must be one of {LOSSES}, got loss={loss!r}")


#: Scores are clamped to +-this before the loss: a finite row near 1e300 can score +-inf, and
#: ``inf - inf`` in the softmax is NaN. The clamp changes no residual of a finite score below it.
_SCORE_BOUND = 1e300


def clipped_gradient_sum(
    x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, clip_norm: float, loss: Loss
) -> torch.Tensor:
    """``sum_i clip(grad_i)`` (``[d, m]``) of the per-example loss gradients ``x_i r_i^T``.

    The per-example gradient ``x_i r_i^T`` has Frobenius norm ``||x_i|| ||r_i||``, so clipping
    needs no per-example materialisation. Add-or-remove sensitivity: exactly ``clip_norm``
    for every row, finite or not (a row with non-finite features adds nothing).

    No product that can overflow is formed: with ``x_i = peak_i u_i`` (``|u_i| <= 1``,
    :func:`~dpfy.features.stats.split_rows`), the score is ``peak_i (u_i w)`` clamped to
    ``+-1e300`` and the clipped gradient is ``u_i r_i^T min(peak_i, C / (||u_i|| ||r_i||))``.
    A huge row predicted correctly (``r_i = 0``) adds 0, never ``inf x 0 = NaN``.
    """
    unit, peak = split_rows(x.to(_F64))
    return _clipped_gradient_sum(unit, peak, y, weights, clip_norm, loss)


def _clipped_gradient_sum(
    unit: torch.Tensor, peak: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
    clip_norm: float, loss: Loss,
) -> torch.Tensor:
    """:func:`clipped_gradient_sum` of ``x = peak * unit`` (split once, reused every step)."""
    scores = ((unit @ weights) * peak).clamp(-_SCORE_BOUND, _SCORE_BOUND)
    r = residuals(scores, y, loss)
    r = torch.where(torch.isfinite(r).all(dim=1, keepdim=True), r, torch.zeros((), dtype=_F64))
    norms = torch.linalg.vector_norm(unit, dim=1) * torch.linalg.vector_norm(r, dim=1)
    scale = torch.minimum(peak[:, 0], clip_norm / norms)  # norms = 0: the row adds 0 anyway
    return unit.T @ (r * scale[:, None])


def newton_statistics(
    x: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    *,
    covariance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient sums ``[d, m]`` and Hessian sums ``[m, d, d]`` of the one-vs-rest logistic loss.

    ``x`` must already be clipped to norm ``C``. Class ``j``: ``g_j = sum_i (s_ij - y_ij) x_i``
    and ``H_j = sum_i s_ij (1 - s_ij) x_i x_i^T`` with ``s = sigmoid(x w)``. Add-or-remove
    sensitivities over all ``m`` classes: ``sqrt(m) C`` and ``sqrt(m) C^2 / 4``. Everything is
    float64 (float32 Hessians exceeded that bound by their rounding). At ``weights = 0`` every
    ``s_ij = 1/2`` and ``H_j = G / 4``: a precomputed ``covariance`` ``G = sum_i x_i x_i^T`` of
    the same clipped ``x`` is then used instead of a new product.
    """
    x, y = x.to(_F64), y.to(_F64)
    s = torch.sigmoid(x @ weights)
    grad = x.T @ (s - y)
    curv = s * (1.0 - s)
    m = weights.shape[1]
    same = bool((weights == weights[:, :1]).all()) if m > 1 else True
    if covariance is not None and not bool(weights.any()):
        hess = (0.25 * covariance.to(_F64)).expand(m, -1, -1).clone()
    elif same:  # identical columns (e.g. the zero start): one product serves every class
        hess = (x.T @ (x * curv[:, :1])).expand(m, -1, -1).clone()
    else:
        hess = torch.stack([x.T @ (x * curv[:, j : j + 1]) for j in range(m)])
    return grad, hess


def _as_f64(x: ArrayOrTensor) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.to(_F64)


def _checked_covariance(
    stats: SufficientStats | None, clip: float, name: str
) -> torch.Tensor | None:
    if stats is None:
        return None
    if stats.clip_norm != float(clip):
        raise ValueError(
            f"covariance_stats were clipped with clip_norm={stats.clip_norm}, but {name}={clip}"
        )
    return stats.covariance


def _check_common(noise_multiplier: float, name: str = "noise_multiplier") -> None:
    check_range(name, noise_multiplier, 0.0, math.inf, high_open=True)


# ----------------------------------------------------------------------------- DP-LS (Alg. 3)


def dp_least_squares(
    data: SufficientStats | Batch,
    *,
    noise_multiplier: float | tuple[float, float, float],
    clip_norm: float | None = None,
    alpha: float = 1.0,
    ridge: float = 1.0,
    max_positives: int = 1,
    num_classes: int | None = None,
    ledger: Ledger | None = None,
    randomness: Randomness | None = None,
) -> Fitted:
    """DP least squares (Alg. 3): ``w_j = (A~_j + alpha G~ + ridge I)^-1 b~_j`` from noisy sums.

    Args:
      data: :class:`SufficientStats` (e.g. from the chunked
        :func:`~dpfy.features.stats.sufficient_statistics`) or ``(x, y)``.
      noise_multiplier: ``sigma`` (noise std / sensitivity) of the three releases, or one per
        release ``(G, A, b)``. Sensitivities: ``C^2``, ``sqrt(k) C^2``, ``sqrt(k) C``.
      clip_norm: feature clip norm ``C`` (required with ``(x, y)``).
      alpha: weight of the negative-label term in (0, inf).
      ridge: ``lambda`` in [0, inf), sum units.
      max_positives: ``k``, the maximum number of positive labels per example (a row with
        more is a zero row).
      num_classes: ``m``, the public number of classes (required with ``(x, y)``; None is
        refused, :func:`~dpfy.features.stats.check_num_classes`).
      ledger: where the releases are recorded (default: a new in-memory ledger).
      randomness: noise source (default: the secure generator, ``Randomness.secure_mode()``).

    Returns:
      :class:`Fitted` with weights ``[d, m]``.
    """
    if isinstance(data, SufficientStats):
        stats = data
    else:
        if clip_norm is None:
            raise ValueError("clip_norm must be given when data is (x, y)")
        x, y = data
        stats = sufficient_statistics(
            [(x, y)], clip_norm=clip_norm, num_classes=check_num_classes(num_classes),
            max_positives=max_positives,
        )
    z = (noise_multiplier,) * 3 if not isinstance(noise_multiplier, tuple) else noise_multiplier
    if len(z) != 3:
        raise ValueError(f"noise_multiplier must be a float or 3 floats, got {noise_multiplier!r}")
    for zi in z:
        _check_common(zi)
    check_range("alpha", alpha, 0.0, math.inf, low_open=True, high_open=True)
    check_range("ridge", ridge, 0.0, math.inf, high_open=True)
    if stats.class_covariance.shape[0] == 0:
        raise ValueError("DP-LS needs class covariances: compute stats with class_covariance=True")
    ledger, rng = _ledger(ledger), _randomness(randomness)
    C, k = stats.clip_norm, stats.max_positives
    sid = _full_batch(ledger, stats.rows, 0)
    release = functools.partial(_release, ledger=ledger, sample_id=sid, randomness=rng)
    G = release(stats.covariance, sensitivity=C**2, noise_multiplier=z[0], name="G",
                symmetric=True)
    A = release(stats.class_covariance, sensitivity=math.sqrt(k) * C**2, noise_multiplier=z[1],
                name="A", symmetric=True)
    b = release(stats.class_sums, sensitivity=math.sqrt(k) * C, noise_multiplier=z[2], name="b")
    weights = torch.stack(
        [PSDSolver(A[j] + alpha * G, ridge).solve(b[:, j]) for j in range(b.shape[1])], dim=1
    )
    return Fitted(weights, ledger)


# ----------------------------------------------------------------------------- DP-Newton (Alg. 2)


def dp_newton(
    x: ArrayOrTensor,
    y: ArrayOrTensor,
    *,
    clip_norm: float,
    noise_multiplier: float | tuple[float, float],
    steps: int = 2,
    ridge: float = 1.0,
    learning_rate: float = 1.0,
    num_classes: int | None = None,
    covariance_stats: SufficientStats | None = None,
    ledger: Ledger | None = None,
    randomness: Randomness | None = None,
) -> Fitted:
    """DP Newton's method (Alg. 2) for one-vs-rest logistic regression with an L2 ridge.

    Minimises ``sum_i sum_j logistic(w_j^T x~_i, y_ij) + ridge/2 ||w||^2`` with clipped features
    ``x~``. Each step releases, for all ``m`` classes together, the gradient sums (sensitivity
    ``sqrt(m) C``) and the Hessian sums (sensitivity ``sqrt(m) beta_H C^2``, ``beta_H = 1/4``),
    then ``w_j <- w_j - lr (P(H~_j) + ridge I)^-1 (g~_j + ridge w_j)``.

    Args:
      x: features ``[n, d]``. y: class indices ``[n]`` or 0/1 matrix ``[n, m]``; a row with
        non-finite features or a label outside ``[0, m)`` is a zero row.
      clip_norm: ``C``. noise_multiplier: ``sigma`` for both releases, or ``(grad, hessian)``.
      steps: ``T`` Newton steps. ridge: ``lambda`` (sum units). learning_rate: ``eta``.
      num_classes: ``m``, public and required (None is refused).
      covariance_stats: statistics of the same data clipped to ``clip_norm`` (e.g. shared with
        DP-LS / DP-FC runs); their covariance gives the first step's Hessians without a new
        ``n d^2`` product. Never released by itself.
    """
    check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
    check_int("steps", steps)
    cov = _checked_covariance(covariance_stats, clip_norm, "clip_norm")
    check_range("ridge", ridge, 0.0, math.inf, high_open=True)
    check_range("learning_rate", learning_rate, 0.0, math.inf, low_open=True, high_open=True)
    zg, zh = noise_multiplier if isinstance(noise_multiplier, tuple) else (noise_multiplier,) * 2
    _check_common(zg)
    _check_common(zh)
    xu, yy = usable_rows(_as_f64(x), y, check_num_classes(num_classes))
    xc = clip_rows(xu, clip_norm)
    n, d = xc.shape
    m = yy.shape[1]
    ledger, rng = _ledger(ledger), _randomness(randomness)
    w = torch.zeros(d, m, dtype=_F64)
    for t in range(steps):
        sid = _full_batch(ledger, n, t)
        release = functools.partial(_release, ledger=ledger, sample_id=sid, randomness=rng)
        grad, hess = newton_statistics(xc, yy, w, covariance=cov)
        g = release(grad, sensitivity=math.sqrt(m) * clip_norm, noise_multiplier=zg,
                    name="gradient")
        h = release(hess, sensitivity=math.sqrt(m) * HESSIAN_BOUND * clip_norm**2,
                    noise_multiplier=zh, name="hessian", symmetric=True)
        step = torch.stack(
            [PSDSolver(h[j], ridge).solve(g[:, j] + ridge * w[:, j]) for j in range(m)], dim=1
        )
        w = w - learning_rate * step
    return Fitted(w, ledger)


# ----------------------------------------------------------------------------- DP-FC (Alg. 4)


def dp_feature_covariance(
    x: ArrayOrTensor,
    y: ArrayOrTensor,
    *,
    preconditioner: Preconditioner,
    gradient_clip_norm: float,
    noise_multiplier: float | tuple[float, float],
    steps: int = 10,
    learning_rate: float = 1.0,
    l2: float = 0.0,
    loss: Loss = "softmax",
    num_classes: int | None = None,
    ledger: Ledger | None = None,
    randomness: Randomness | None = None,
) -> Fitted:
    """DP-SGD preconditioned by a noisy feature covariance (DP-FC, Alg. 4), full batch.

    Releases ``G = sum_i x~_i x~_i^T`` once (features clipped to ``C_G``; sensitivity ``C_G^2``),
    then for ``T`` steps the sum of per-example gradients clipped to ``C_g`` (sensitivity
    ``C_g``), and updates ``w <- w - lr (P(G~) + ridge I)^-1 (g~ + l2 w)``.

    Args:
      x: features ``[n, d]``. y: class indices ``[n]`` or 0/1 matrix ``[n, m]``; a row with
        non-finite features or a label outside ``[0, m)`` is a zero row.
      preconditioner: ``C_G``, ``lambda`` and how the covariance is formed
        (:class:`Preconditioner`). gradient_clip_norm: ``C_g``.
      noise_multiplier: ``sigma`` of every release, or ``(covariance, gradient)``.
      steps: ``T`` (one full-batch step = one epoch).
      learning_rate: ``eta``; with the covariance as preconditioner 1 to 4 is a natural range.
      l2: L2 penalty of the objective ``sum_i loss_i + l2/2 ||w||^2`` (sum units).
      loss: ``"softmax"`` (multinomial logistic) or ``"sigmoid"`` (one-vs-rest logistic).
      num_classes: ``m``, public and required (None is refused).
    """
    covariance_clip_norm, ridge = preconditioner.clip_norm, preconditioner.ridge
    covariance_stats = preconditioner.stats
    check_range("covariance_clip_norm", covariance_clip_norm, 0.0, math.inf, low_open=True,
                high_open=True)
    check_range("gradient_clip_norm", gradient_clip_norm, 0.0, math.inf, low_open=True,
                high_open=True)
    check_int("steps", steps, 0)
    check_range("learning_rate", learning_rate, 0.0, math.inf, low_open=True, high_open=True)
    check_range("ridge", ridge, 0.0, math.inf, high_open=True)
    check_range("l2", l2, 0.0, math.inf, high_open=True)
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got loss={loss!r}")
    zc, zg = noise_multiplier if isinstance(noise_multiplier, tuple) else (noise_multiplier,) * 2
    _check_common(zc)
    _check_common(zg)
    x, yy = usable_rows(_as_f64(x), y, check_num_classes(num_classes))
    n, d = x.shape
    m = yy.shape[1]
    ledger, rng = _ledger(ledger), _randomness(randomness)
    cov = _checked_covariance(covariance_stats, covariance_clip_norm, "covariance_clip_norm")
    if cov is None:
        xg = clip_rows(x, covariance_clip_norm)
        cov = xg.T @ xg
    unit, peak = split_rows(x)
    sid = _full_batch(ledger, n, 0)
    G = _release(cov, sensitivity=covariance_clip_norm**2, noise_multiplier=zc,
                 ledger=ledger, sample_id=sid, randomness=rng, name="covariance", symmetric=True)
    solver = PSDSolver(G, ridge)
    w = torch.zeros(d, m, dtype=_F64)
    for t in range(steps):
        sid = _full_batch(ledger, n, t + 1)
        g = _release(_clipped_gradient_sum(unit, peak, yy, w, gradient_clip_norm, loss),
                     sensitivity=gradient_clip_norm, noise_multiplier=zg, ledger=ledger,
                     sample_id=sid, randomness=rng, name="gradient")
        w = w - learning_rate * solver.solve(g + l2 * w)
    return Fitted(w, ledger)


# ------------------------------------------------------------------------ DP-SGD / Adam (Alg. 1)


def dp_adam(
    x: ArrayOrTensor,
    y: ArrayOrTensor,
    *,
    clip_norm: float,
    noise_multiplier: float,
    steps: int = 100,
    learning_rate: float = 0.1,
    l2: float = 0.0,
    loss: Loss = "softmax",
    optimizer: Literal["adam", "sgd"] | Adam = "adam",
    num_classes: int | None = None,
    ledger: Ledger | None = None,
    randomness: Randomness | None = None,
) -> Fitted:
    """Full-batch DP-SGD / DP-Adam on features (Alg. 1 with the whole dataset as the batch).

    Each step releases the sum of per-example gradients clipped to ``clip_norm`` (sensitivity
    ``clip_norm``) and feeds ``g~ + l2 w`` to Adam (scale-free) or to SGD (``w -= lr g``, so
    the SGD learning rate is per *sum* of gradients). Returns the last iterate.
    ``num_classes`` is public and required (None is refused); a row with non-finite features or
    a label outside ``[0, m)`` is a zero row.
    """
    check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
    _check_common(noise_multiplier)
    check_int("steps", steps, 0)
    check_range("learning_rate", learning_rate, 0.0, math.inf, low_open=True, high_open=True)
    check_range("l2", l2, 0.0, math.inf, high_open=True)
    if not isinstance(optimizer, Adam) and optimizer not in ("adam", "sgd"):
        raise ValueError(
            f"optimizer must be 'adam', 'sgd' or an Adam(betas, eps), got optimizer={optimizer!r}"
        )
    adam = optimizer if isinstance(optimizer, Adam) else Adam()
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got loss={loss!r}")
    x, yy = usable_rows(_as_f64(x), y, check_num_classes(num_classes))
    n, d = x.shape
    m = yy.shape[1]
    unit, peak = split_rows(x)
    ledger, rng = _ledger(ledger), _randomness(randomness)
    w = torch.zeros(d, m, dtype=_F64)
    mom = torch.zeros_like(w)
    var = torch.zeros_like(w)
    (b1, b2), eps = adam.betas, adam.eps
    for t in range(steps):
        sid = _full_batch(ledger, n, t)
        g = _release(_clipped_gradient_sum(unit, peak, yy, w, clip_norm, loss),
                     sensitivity=clip_norm,
                     noise_multiplier=noise_multiplier, ledger=ledger, sample_id=sid,
                     randomness=rng, name="gradient")
        g = g + l2 * w
        if optimizer == "sgd":
            w = w - learning_rate * g
            continue
        mom = b1 * mom + (1 - b1) * g
        var = b2 * var + (1 - b2) * g * g
        mhat = mom / (1 - b1 ** (t + 1))
        vhat = var / (1 - b2 ** (t + 1))
        w = w - learning_rate * mhat / (vhat.sqrt() + eps)
    return Fitted(w, ledger)

"""scikit-learn-style DP classifiers on fixed features (Mehta et al. 2023, Algorithms 1-4).

Each estimator follows scikit-learn's conventions: ``__init__`` only stores its arguments,
``fit(X, y)`` validates, trains and returns ``self``; fitted state ends in ``_``:

* ``coef_`` ``[n_classes, n_features]`` (scores are ``clip(X) @ coef_.T``, no intercept),
* ``classes_``, ``n_features_in_``,
* ``ledger_``: the :class:`dpfy.ledger.Ledger` of every noisy release,
* ``privacy_``: a :class:`dpfy.accounting.PrivacyResult`, the ledger accounted like any other,
  ``dpfy.accounting.epsilon(ledger_, delta, method="gaussian")`` (through
  :func:`dpfy.features.accounting.ledger_statement`; exact GDP composition; epsilon
  at ``delta``, adjacency add-or-remove, unit example): computed from the ledger, not from the
  hyperparameters. The exact GDP ``mu`` and the paper's zCDP ``rho`` of the same run:
  :func:`dpfy.features.accounting.gdp_figures` of ``ledger_``.

Privacy is set either by a target ``epsilon`` (with ``delta``): the noise is calibrated with the
exact GDP curve and split evenly over the releases (as the paper's theorems assume) -- or by an
explicit ``noise_multiplier``. ``epsilon=math.inf`` (or ``noise_multiplier=0``) trains the
non-private model with the same code; its ``privacy_.epsilon`` is then ``inf``.

The unit of privacy is one row of ``X`` with its label. The class list is public and required:
``classes`` (the labels of the data set's definition) becomes ``classes_``; ``fit`` refuses
``classes=None``, since a list taken from ``y`` would release which labels occur (removing the
only example of a class would change the shape of the output). A row whose label is not in
``classes`` adds nothing to any release (a zero row, :func:`dpfy.features.stats.usable_rows`):
it is never the reason a fit stops. The data set size N is recorded in the ledger and treated
as public (docs/architecture.md, 5.12). Feature extraction and any per-row transform before
``fit`` (e.g. ``sklearn.preprocessing.Normalizer``) are public and cost no privacy; a transform
fitted on the private data (e.g. ``StandardScaler``) is not.

scikit-learn is not needed at run time; when it is installed the estimators also derive from
its ``BaseEstimator`` and ``ClassifierMixin`` so that ``clone``, ``Pipeline`` and the grid-search
tools treat them as native.

Example:
    >>> import numpy as np
    >>> from dpfy.features.estimators import DPLeastSquaresClassifier
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(1000, 8)); y = (X[:, 0] > 0).astype(int)
    >>> clf = DPLeastSquaresClassifier(epsilon=1.0, delta=1e-5, classes=[0, 1],
    ...                                random_state=0).fit(X, y)
    >>> round(clf.privacy_.epsilon, 3)
    1.0
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, Self

import numpy as np
import numpy.typing as npt
import torch

from dpfy._validate import check_int, check_range
from dpfy.features import algorithms as alg
from dpfy.features.accounting import PrivacyResult, ledger_statement, mu_for_target
from dpfy.features.algorithms import Loss
from dpfy.features.stats import ArrayOrTensor, SufficientStats, clip_rows
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness

#: ``ridge="auto"``: the ridge is this multiple of the public noise scale (see :func:`auto_ridge`).
#: ``c = 1`` was chosen on validation splits of both datasets of benchmarks/features.py (MiniLM
#: text embeddings, 384-d; EfficientNet image features, 1280-d) at most epsilons for DP-LS and
#: DP-FC; a fixed ridge of 1 instead leaves the noisy covariance badly conditioned (DP-FC on the
#: text embeddings at epsilon 8: 63 % instead of 76 %). On 3969-d ScatterNet features 1/16 of the
#: auto value did best for DP-FC (docs/architecture.md, 5.12): search the ridge on validation data.
AUTO_RIDGE_SCALE = 1.0


def auto_ridge(noise_multiplier: float, clip_norm: float, dim: int, factor: float = 1.0) -> float:
    """Ridge matched to the noise on a ``dim x dim`` noisy second-moment matrix (sum units).

    Entry noise of the released matrix is ``z C^2`` (``C`` the clip norm), so its spectral
    norm is about ``2 z C^2 sqrt(d)``; the ridge is ``AUTO_RIDGE_SCALE * factor * z C^2
    sqrt(d)`` (``factor`` is the matrix's own sensitivity per ``C^2``, e.g. ``sqrt(m)/4`` for
    the logistic Hessians of ``m`` classes), and never below 1 (the non-private default). It
    depends on public quantities only, so it costs no privacy.
    """
    scale = AUTO_RIDGE_SCALE * factor * noise_multiplier * clip_norm**2 * math.sqrt(dim)
    return max(float(scale), 1.0)


def _ridge(ridge: float | str, auto: float) -> float:
    """``ridge`` as given, or ``auto`` for ``"auto"``; anything else is refused."""
    if isinstance(ridge, str):
        if ridge != "auto":
            raise ValueError(f"ridge must be 'auto' or a number in [0, inf), got ridge={ridge!r}")
        return auto
    return ridge  # range checked by the algorithm


Float64Array = npt.NDArray[np.float64]


class _Predictor(Protocol):
    def predict(self, X: ArrayOrTensor) -> npt.NDArray[Any]: ...


if not TYPE_CHECKING:  # scikit-learn is a dev/test dependency; derive from it when it is there
    try:
        from sklearn.base import BaseEstimator, ClassifierMixin
        from sklearn.exceptions import DataConversionWarning, NotFittedError

        _HAVE_SKLEARN = True
    except ImportError:  # pragma: no cover - exercised only without scikit-learn
        _HAVE_SKLEARN = False

# scikit-learn ships no type information, so the type checker sees the stand-ins below: they
# provide the part of its API that these estimators use and are the bases when it is missing.
if TYPE_CHECKING or not _HAVE_SKLEARN:

    class _EstimatorBase:
        """get_params / set_params / score for the case where scikit-learn is not installed."""

        @classmethod
        def _get_param_names(cls) -> list[str]:
            sig = inspect.signature(cls.__init__)
            return sorted(p.name for p in sig.parameters.values() if p.name != "self")

        def get_params(self, deep: bool = True) -> dict[str, Any]:
            return {name: getattr(self, name) for name in self._get_param_names()}

        def set_params(self, **params: Any) -> Self:
            valid = self._get_param_names()
            for key, value in params.items():
                if key not in valid:
                    raise ValueError(f"Invalid parameter {key!r} for estimator {self!r}.")
                setattr(self, key, value)
            return self

        def score(
            self: _Predictor,
            X: ArrayOrTensor,
            y: ArrayOrTensor,
            sample_weight: Sequence[float] | npt.NDArray[np.number[Any]] | None = None,
        ) -> float:
            pred = self.predict(X)
            correct = (np.asarray(pred) == np.asarray(y)).astype(np.float64)
            return float(np.average(correct, weights=sample_weight))

        def __repr__(self) -> str:
            args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
            return f"{type(self).__name__}({args})"

    class NotFittedError(ValueError, AttributeError):
        """The estimator is used before ``fit``."""

    class DataConversionWarning(UserWarning):
        """A column-vector ``y`` was flattened."""

else:

    class _EstimatorBase(ClassifierMixin, BaseEstimator):
        """scikit-learn's ``ClassifierMixin`` and ``BaseEstimator``."""


def _features(X: ArrayOrTensor) -> torch.Tensor:
    if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
        raise TypeError("sparse input is not supported; pass a dense array (X.toarray())")
    if isinstance(X, torch.Tensor):
        if X.is_complex():
            raise ValueError("Complex data not supported")
        t = X.detach().to("cpu", torch.float64)
    else:
        a = np.asarray(X)
        if np.iscomplexobj(a):
            raise ValueError("Complex data not supported")
        t = torch.as_tensor(np.asarray(a, dtype=np.float64))
    if t.ndim != 2:
        raise ValueError(
            f"Expected a 2-d array [n_samples, n_features], got shape {tuple(t.shape)}. Reshape "
            "your data with X.reshape(-1, 1) for one feature or X.reshape(1, -1) for one sample."
        )
    if t.shape[0] == 0:
        raise ValueError(
            f"Found array with 0 sample(s) (shape={tuple(t.shape)}) while a minimum of 1 is "
            "required."
        )
    if t.shape[1] == 0:
        raise ValueError(
            f"Found array with 0 feature(s) (shape={tuple(t.shape)}) while a minimum of 1 is "
            "required."
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError("Input X contains NaN or infinity")
    return t


def _labels(y: ArrayOrTensor | None) -> npt.NDArray[Any]:
    if y is None:
        raise ValueError("this estimator requires y to be passed, but the target y is None")
    labels = np.asarray(y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else y)
    if labels.ndim == 2 and labels.shape[1] == 1:
        import warnings

        warnings.warn("A column-vector y was passed when a 1d array was expected; it is "
                      "flattened to shape (n_samples,).",
                      DataConversionWarning, stacklevel=3)
        labels = labels.ravel()
    if labels.ndim != 1:
        raise ValueError(f"y must be 1-d class labels, got shape {labels.shape}")
    return labels


def public_classes(classes: npt.ArrayLike | None) -> npt.NDArray[Any]:
    """The sorted, distinct public class labels; ``None`` or fewer than 2 are refused.

    Raises:
      ValueError: ``classes`` is None (the list must come from the data set's definition,
        never from the private labels) or names fewer than 2 labels.
    """
    if classes is None:
        raise ValueError(
            "classes must be the public list of class labels (from the data set's definition; "
            "taking it from y would release which labels occur), got classes=None"
        )
    out = np.unique(np.asarray(classes))
    if out.ndim != 1 or len(out) < 2:
        raise ValueError(f"classes must list at least 2 distinct labels, got classes={classes!r}")
    return out


def class_indices(labels: npt.NDArray[Any], classes: npt.NDArray[Any]) -> torch.Tensor:
    """Index of each label in ``classes``; -1 for a label not in it (a zero row in the fit).

    A lookup per label, so no label (of any type, NaN included) can make it fail.
    """
    index = {c: i for i, c in enumerate(classes.tolist())}

    def find(label: Any) -> int:
        try:
            return index.get(label, -1)
        except TypeError:  # unhashable
            return -1

    return torch.tensor([find(v) for v in labels.tolist()], dtype=torch.long)


class _DPFeatureClassifier(_EstimatorBase):
    """Shared fit/predict logic; subclasses define ``__init__`` and ``_train``."""

    _algorithm: ClassVar[str] = ""

    # parameters every subclass's __init__ stores
    epsilon: float | None
    delta: float
    noise_multiplier: float | None
    classes: npt.ArrayLike | None
    random_state: int | Randomness | None

    # fitted state (absent before fit)
    classes_: npt.NDArray[Any]
    n_features_in_: int
    coef_: Float64Array
    ledger_: Ledger
    privacy_: PrivacyResult

    # -- privacy ------------------------------------------------------------------------------
    def _noise_multipliers(self, shares: list[float]) -> list[float]:
        """Noise multiplier of each release: calibrated from (epsilon, delta) or given."""
        check_range("delta", self.delta, 0.0, 1.0, low_open=True, high_open=True)
        if self.epsilon is not None:
            check_range("epsilon", self.epsilon, 0.0, math.inf, low_open=True)
            if math.isinf(self.epsilon):
                return [0.0] * len(shares)
            mu = mu_for_target(float(self.epsilon), float(self.delta))
            total = float(sum(shares))
            return [1.0 / (mu * math.sqrt(s / total)) for s in shares]
        if self.noise_multiplier is None:
            raise ValueError("one of epsilon or noise_multiplier must be set, got both None")
        check_range("noise_multiplier", self.noise_multiplier, 0.0, math.inf, high_open=True)
        return [float(self.noise_multiplier)] * len(shares)

    def _randomness(self) -> Randomness:
        """``random_state`` as a source: None is the secure generator (a DP release); an int
        is a seeded, reproducible experiment (docs/randomness.md)."""
        rs = self.random_state
        if isinstance(rs, Randomness):
            return rs
        return Randomness.secure_mode() if rs is None else Randomness(seed=int(rs))

    @staticmethod
    def _record_randomness(ledger: Ledger, rng: Randomness) -> None:
        """The ledger names the noise source; there is no sampling (every release is full
        batch)."""
        ledger.record_metadata(
            sampling_randomness="none (full batch: every release uses every row)",
            noise_randomness=rng.describe(),
        )

    # -- fitting ------------------------------------------------------------------------------
    def _prepare(
        self, X: ArrayOrTensor, y: ArrayOrTensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        classes = public_classes(self.classes)
        x = _features(X)
        yy = _labels(y)
        if len(yy) != x.shape[0]:
            raise ValueError(f"X and y must have the same length, got {x.shape[0]} and {len(yy)}")
        self.classes_ = classes
        self.n_features_in_ = x.shape[1]
        return x, class_indices(yy, classes)

    def fit(self, X: ArrayOrTensor, y: ArrayOrTensor | None) -> Self:
        """Train on features ``X`` ``[n, d]`` (NumPy or torch) and labels ``y``; returns self."""
        x, idx = self._prepare(X, y)
        ledger = Ledger()
        ledger.record_metadata(estimator=type(self).__name__, params=_jsonable(self.get_params()))
        rng = self._randomness()
        self._record_randomness(ledger, rng)
        fitted = self._train(x, idx, len(self.classes_), ledger, rng)
        self._finish(fitted)
        return self

    def _train(
        self, x: torch.Tensor, idx: torch.Tensor, m: int, ledger: Ledger, rng: Randomness
    ) -> alg.Fitted:
        """Run the algorithm on features ``x`` and class indices ``idx`` in ``[0, m)`` (-1: a
        label not in ``classes``, a zero row)."""
        raise NotImplementedError

    def _finish(self, fitted: alg.Fitted) -> None:
        self.coef_ = fitted.weights.T.numpy().copy()
        self.ledger_ = fitted.ledger
        self.privacy_ = ledger_statement(fitted.ledger, float(self.delta))

    # -- prediction ---------------------------------------------------------------------------
    def _clip_for_predict(self) -> float | None:
        return None

    def _scores(self, X: ArrayOrTensor) -> Float64Array:
        if not hasattr(self, "coef_"):
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet. Call 'fit' first."
            )
        x = _features(X)
        if x.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {x.shape[1]} features, but {type(self).__name__} is expecting "
                f"{self.n_features_in_} features as input."
            )
        clip = self._clip_for_predict()
        if clip is not None:
            x = clip_rows(x, clip)
        return (x @ torch.as_tensor(self.coef_).T).numpy()

    def decision_function(self, X: ArrayOrTensor) -> Float64Array:
        """Scores ``[n, n_classes]``; for two classes ``[n]`` (positive: ``classes_[1]``)."""
        s = self._scores(X)
        return s[:, 1] - s[:, 0] if s.shape[1] == 2 else s

    def predict(self, X: ArrayOrTensor) -> npt.NDArray[Any]:
        """Most likely class of each row."""
        best: npt.NDArray[np.intp] = np.argmax(self._scores(X), axis=1)
        return self.classes_[best]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(state.get("ledger_"), Ledger):  # holds a lock; pickle its records
            state["ledger_"] = list(state["ledger_"].entries)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        records = state.get("ledger_")
        if isinstance(records, list):
            state["ledger_"] = Ledger.from_records(records)
        self.__dict__.update(state)


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    def ok(v: Any) -> bool:
        if isinstance(v, float):
            return math.isfinite(v)
        return isinstance(v, (int, str, bool, type(None)))

    return {k: v if ok(v) else repr(v) for k, v in params.items()}


def _softmax(s: Float64Array) -> Float64Array:
    row_max: Float64Array = s.max(axis=1, keepdims=True)  # keepdims: NumPy's stubs say Any
    e = np.exp(s - row_max)
    row_sum: Float64Array = e.sum(axis=1, keepdims=True)
    return e / row_sum


def _ovr_proba(s: Float64Array) -> Float64Array:
    """One-vs-rest sigmoid probabilities, normalised over classes (as scikit-learn's OvR)."""
    p = 1.0 / (1.0 + np.exp(-s))
    row_sum: Float64Array = p.sum(axis=1, keepdims=True)
    return p / row_sum


class DPLeastSquaresClassifier(_DPFeatureClassifier):
    """DP least squares on one-hot labels (DP-LS, Mehta et al. 2023, Alg. 3; three releases).

    Args:
      epsilon: target epsilon (``math.inf``: non-private), or None to use ``noise_multiplier``.
      delta: target delta.
      noise_multiplier: ``sigma`` of each of the three releases (used when epsilon is None).
      clip_norm: feature clip norm ``C``.
      alpha: weight of the negative-label term.
      ridge: ``lambda`` added to ``A_j + alpha G`` (sum units), or ``"auto"`` (default):
        :func:`auto_ridge` of the covariance release's noise.
      classes: the public list of class labels, required (``fit`` refuses None: a list read
        from ``y`` would release which labels occur); a row labelled otherwise is a zero row.
      random_state: None (default: the secure generator, a DP release), a seed (int: a
        reproducible experiment, not a DP release) or a :class:`dpfy.randomness.Randomness`.
    """

    _algorithm = "dp_ls"

    def __init__(
        self,
        epsilon: float | None = 1.0,
        delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        alpha: float = 1.0,
        ridge: float | Literal["auto"] = "auto",
        classes: npt.ArrayLike | None = None,
        random_state: int | Randomness | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.alpha = alpha
        self.ridge = ridge
        self.classes = classes
        self.random_state = random_state

    def _train(
        self, x: torch.Tensor, idx: torch.Tensor, m: int, ledger: Ledger, rng: Randomness
    ) -> alg.Fitted:
        zg, za, zb = self._noise_multipliers([1.0, 1.0, 1.0])
        ridge = _ridge(self.ridge, auto_ridge(zg, self.clip_norm, x.shape[1]))
        return alg.dp_least_squares((x, idx), noise_multiplier=(zg, za, zb),
                                    clip_norm=self.clip_norm, alpha=self.alpha, ridge=ridge,
                                    num_classes=m, ledger=ledger, randomness=rng)

    def fit_statistics(self, stats: SufficientStats, classes: npt.ArrayLike) -> Self:
        """Train from precomputed clipped statistics (e.g. a chunked pass over memory-mapped
        data, :func:`dpfy.features.stats.sufficient_statistics`); ``classes`` name its columns.

        The statistics must have been clipped with ``self.clip_norm`` and ``max_positives=1``.
        """
        if stats.clip_norm != float(self.clip_norm) or stats.max_positives != 1:
            raise ValueError(
                f"stats must be clipped with clip_norm={self.clip_norm} and max_positives=1, got "
                f"clip_norm={stats.clip_norm}, max_positives={stats.max_positives}"
            )
        public_classes(classes)  # refuses None and fewer than 2; the order names the columns
        self.classes_ = np.asarray(classes)
        if len(self.classes_) != stats.class_sums.shape[1]:
            raise ValueError("classes must name every column of the statistics")
        self.n_features_in_ = stats.covariance.shape[0]
        ledger = Ledger()
        zg, za, zb = self._noise_multipliers([1.0, 1.0, 1.0])
        rng = self._randomness()
        self._record_randomness(ledger, rng)
        ridge = _ridge(self.ridge, auto_ridge(zg, self.clip_norm, self.n_features_in_))
        fitted = alg.dp_least_squares(stats, noise_multiplier=(zg, za, zb), alpha=self.alpha,
                                      ridge=ridge, ledger=ledger, randomness=rng)
        self._finish(fitted)
        return self

    def _clip_for_predict(self) -> float | None:
        return float(self.clip_norm)


class DPNewtonClassifier(_DPFeatureClassifier):
    """DP Newton's method, one-vs-rest logistic regression (Mehta et al. 2023, Alg. 2).

    ``2 * steps`` releases (gradients and Hessians of all classes at each step).

    Args:
      epsilon, delta, noise_multiplier, classes, random_state: as in
        :class:`DPLeastSquaresClassifier`.
      clip_norm: feature clip norm ``C``.
      steps: Newton steps ``T``.
      ridge: L2 penalty ``lambda`` of the objective and the Hessian (sum units; sklearn's
        ``C = 1 / ridge``), or ``"auto"`` (default): :func:`auto_ridge` of the Hessian
        release's noise (sensitivity ``sqrt(m)/4`` per ``C^2``).
      learning_rate: ``eta``.
    """

    _algorithm = "dp_newton"

    def __init__(
        self,
        epsilon: float | None = 1.0,
        delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        steps: int = 2,
        ridge: float | Literal["auto"] = "auto",
        learning_rate: float = 1.0,
        classes: npt.ArrayLike | None = None,
        random_state: int | Randomness | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.steps = steps
        self.ridge = ridge
        self.learning_rate = learning_rate
        self.classes = classes
        self.random_state = random_state

    def _train(
        self, x: torch.Tensor, idx: torch.Tensor, m: int, ledger: Ledger, rng: Randomness
    ) -> alg.Fitted:
        check_int("steps", self.steps)
        zg, zh = self._noise_multipliers([1.0] * (2 * int(self.steps)))[:2]
        auto = auto_ridge(zh, self.clip_norm, x.shape[1], factor=math.sqrt(m) / 4.0)
        return alg.dp_newton(x, idx, clip_norm=self.clip_norm, noise_multiplier=(zg, zh),
                             steps=int(self.steps), ridge=_ridge(self.ridge, auto),
                             learning_rate=self.learning_rate, num_classes=m, ledger=ledger,
                             randomness=rng)

    def _clip_for_predict(self) -> float | None:
        return float(self.clip_norm)

    def predict_proba(self, X: ArrayOrTensor) -> Float64Array:
        """One-vs-rest probabilities, normalised over classes (as scikit-learn's OvR)."""
        return _ovr_proba(self._scores(X))


class DPFeatureCovarianceClassifier(_DPFeatureClassifier):
    """DP-SGD preconditioned by the noisy feature covariance (DP-FC, Mehta et al. 2023, Alg. 4).

    ``1 + steps`` releases. With ``covariance_share=None`` every release gets the same noise
    multiplier (the paper's Theorem 2.3); a share ``s`` in (0, 1) gives the covariance release
    the fraction ``s`` of the ``mu^2`` budget and splits the rest evenly over the steps.

    Args:
      epsilon, delta, noise_multiplier, classes, random_state: as in
        :class:`DPLeastSquaresClassifier`.
      covariance_clip_norm: ``C_G`` (feature clip norm for the covariance).
      gradient_clip_norm: ``C_g`` (per-example gradient clip norm).
      steps: full-batch steps ``T`` (one step = one epoch).
      learning_rate: ``eta``.
      ridge: ``lambda`` added to the noisy covariance (sum units), or ``"auto"`` (default):
        :func:`auto_ridge` of the covariance release's noise.
      l2: L2 penalty of the objective (sum units).
      loss: ``"softmax"`` or ``"sigmoid"``.
      covariance_share: see above.
    """

    _algorithm = "dp_fc"

    def __init__(
        self,
        epsilon: float | None = 1.0,
        delta: float = 1e-5,
        noise_multiplier: float | None = None,
        covariance_clip_norm: float = 1.0,
        gradient_clip_norm: float = 1.0,
        steps: int = 10,
        learning_rate: float = 1.0,
        ridge: float | Literal["auto"] = "auto",
        l2: float = 0.0,
        loss: Loss = "softmax",
        covariance_share: float | None = None,
        classes: npt.ArrayLike | None = None,
        random_state: int | Randomness | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.noise_multiplier = noise_multiplier
        self.covariance_clip_norm = covariance_clip_norm
        self.gradient_clip_norm = gradient_clip_norm
        self.steps = steps
        self.learning_rate = learning_rate
        self.ridge = ridge
        self.l2 = l2
        self.loss = loss
        self.covariance_share = covariance_share
        self.classes = classes
        self.random_state = random_state

    def _train(
        self, x: torch.Tensor, idx: torch.Tensor, m: int, ledger: Ledger, rng: Randomness
    ) -> alg.Fitted:
        check_int("steps", self.steps)
        t = int(self.steps)
        if self.covariance_share is None:
            shares = [1.0] * (t + 1)
        else:
            s = self.covariance_share
            check_range("covariance_share", s, 0.0, 1.0, low_open=True, high_open=True)
            shares = [s] + [(1.0 - s) / t] * t
        z = self._noise_multipliers(shares)
        ridge = _ridge(self.ridge, auto_ridge(z[0], self.covariance_clip_norm, x.shape[1]))
        return alg.dp_feature_covariance(
            x, idx, preconditioner=alg.Preconditioner(
                clip_norm=self.covariance_clip_norm, ridge=ridge
            ),
            gradient_clip_norm=self.gradient_clip_norm, noise_multiplier=(z[0], z[-1]),
            steps=t, learning_rate=self.learning_rate,
            l2=self.l2,
            loss=self.loss, num_classes=m, ledger=ledger, randomness=rng,
        )

    def predict_proba(self, X: ArrayOrTensor) -> Float64Array:
        """Class probabilities (softmax, or normalised one-vs-rest sigmoids)."""
        s = self._scores(X)
        return _softmax(s) if self.loss == "softmax" else _ovr_proba(s)


class DPAdamClassifier(_DPFeatureClassifier):
    """Full-batch DP-Adam / DP-SGD on features (Mehta et al. 2023, Alg. 1; the baseline).

    ``steps`` releases of the clipped gradient sum.

    Args:
      epsilon, delta, noise_multiplier, classes, random_state: as in
        :class:`DPLeastSquaresClassifier`.
      clip_norm: per-example gradient clip norm.
      steps: full-batch steps. learning_rate: step size. l2: L2 penalty (sum units).
      loss: ``"softmax"`` or ``"sigmoid"``. optimizer: ``"adam"`` or ``"sgd"``.
    """

    _algorithm = "dp_adam"

    def __init__(
        self,
        epsilon: float | None = 1.0,
        delta: float = 1e-5,
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        steps: int = 100,
        learning_rate: float = 0.1,
        l2: float = 0.0,
        loss: Loss = "softmax",
        optimizer: Literal["adam", "sgd"] = "adam",
        classes: npt.ArrayLike | None = None,
        random_state: int | Randomness | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.steps = steps
        self.learning_rate = learning_rate
        self.l2 = l2
        self.loss = loss
        self.optimizer = optimizer
        self.classes = classes
        self.random_state = random_state

    def _train(
        self, x: torch.Tensor, idx: torch.Tensor, m: int, ledger: Ledger, rng: Randomness
    ) -> alg.Fitted:
        check_int("steps", self.steps)
        z = self._noise_multipliers([1.0] * int(self.steps))[0]
        return alg.dp_adam(x, idx, clip_norm=self.clip_norm, noise_multiplier=z,
                           steps=int(self.steps), learning_rate=self.learning_rate, l2=self.l2,
                           loss=self.loss, optimizer=self.optimizer, num_classes=m,
                           ledger=ledger, randomness=rng)

    def predict_proba(self, X: ArrayOrTensor) -> Float64Array:
        """Class probabilities (softmax, or normalised one-vs-rest sigmoids)."""
        s = self._scores(X)
        return _softmax(s) if self.loss == "softmax" else _ovr_proba(s)

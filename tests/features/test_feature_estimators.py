"""The DP feature classifiers follow scikit-learn's estimator conventions."""

from __future__ import annotations

import functools
import math
import pickle

import numpy as np
import pytest
import torch

from dpfy import accounting
from dpfy.features import accounting as facc
from dpfy.features import estimators as est

sklearn_base = pytest.importorskip("sklearn.base")
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import Normalizer  # noqa: E402
from sklearn.utils import estimator_checks as checks  # noqa: E402

ESTIMATORS = [
    est.DPLeastSquaresClassifier,
    est.DPNewtonClassifier,
    est.DPFeatureCovarianceClassifier,
    est.DPAdamClassifier,
]


NAMES = ["cat", "dog", "eel"]


def _data(n=600, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 6))
    y = np.array(["cat", "dog", "eel"])[np.argmax(X[:, :3] + 0.2 * rng.normal(size=(n, 3)), 1)]
    return X, y


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_clone_pipeline_and_params(cls):
    X, y = _data()
    model = cls(epsilon=math.inf, classes=NAMES, random_state=0)
    twin = sklearn_base.clone(model)
    assert twin.get_params() == model.get_params() and twin is not model
    twin.set_params(delta=1e-6)
    assert twin.delta == 1e-6 and model.delta == 1e-5
    with pytest.raises(ValueError):
        twin.set_params(nonsense=1)
    pipe = make_pipeline(Normalizer(), cls(epsilon=math.inf, classes=NAMES,
                                           random_state=0)).fit(X, y)
    assert pipe.score(X, y) > 0.8  # non-private fit on an easy problem
    assert set(pipe.predict(X)) <= {"cat", "dog", "eel"}
    pipe.set_params(**{f"{cls.__name__.lower()}__epsilon": 2.0}).fit(X, y)
    assert pipe[-1].privacy_.epsilon == pytest.approx(2.0, rel=1e-7)
    assert pipe[-1].coef_.shape == (3, 6)


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_numpy_and_torch_inputs_agree(cls):
    X, y = _data(n=300)
    codes = np.searchsorted(np.unique(y), y)
    a = cls(epsilon=1.0, classes=[0, 1, 2], random_state=3).fit(X, codes)
    b = cls(epsilon=1.0, classes=[0, 1, 2], random_state=3).fit(torch.tensor(X),
                                                                torch.tensor(codes))
    np.testing.assert_allclose(a.coef_, b.coef_)
    np.testing.assert_array_equal(a.predict(X), b.predict(torch.tensor(X)))
    if hasattr(a, "predict_proba"):
        p = a.predict_proba(X)
        np.testing.assert_allclose(p.sum(1), 1.0)
        np.testing.assert_array_equal(a.classes_[p.argmax(1)], a.predict(X))


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_pickle_keeps_the_ledger(cls):
    X, y = _data(n=200)
    m = cls(epsilon=1.0, classes=NAMES, random_state=0).fit(X, y)
    back = pickle.loads(pickle.dumps(m))
    np.testing.assert_array_equal(back.predict(X), m.predict(X))
    assert accounting.epsilon(back.ledger_, 1e-5, method="gaussian").epsilon == pytest.approx(
        m.privacy_.epsilon, rel=1e-7)


CHECKS = [
    checks.check_get_params_invariance,
    checks.check_set_params,
    checks.check_dont_overwrite_parameters,
    checks.check_estimators_unfitted,
    checks.check_n_features_in_after_fitting,
    checks.check_fit2d_predict1d,
    checks.check_estimators_nan_inf,
    checks.check_supervised_y_2d,
    checks.check_estimators_pickle,
]
# Not run: check_classifiers_classes expects classes_ to be the labels found in y, and
# check_classifiers_regression_target expects a continuous y to be refused. Here the class list
# is public and required (reading it from y releases which labels occur), and a label outside it
# is a zero row, never an error that one row could cause: the tests below check what holds
# instead (test_classes_are_public_and_required, test_a_label_outside_classes_is_a_zero_row).


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_sklearn_checks(check):
    for cls in ESTIMATORS:
        model = cls(noise_multiplier=0.0, classes=[0, 1, 2], random_state=0)
        if "steps" in model.get_params():
            model.set_params(steps=5)
        check(cls.__name__, model)


def test_privacy_settings_are_validated():
    X, y = _data(n=100)
    with pytest.raises(ValueError, match="epsilon must be in"):
        est.DPLeastSquaresClassifier(epsilon=-1.0, classes=NAMES).fit(X, y)
    with pytest.raises(ValueError, match="one of epsilon or noise_multiplier"):
        est.DPLeastSquaresClassifier(epsilon=None, classes=NAMES).fit(X, y)
    with pytest.raises(ValueError, match="delta must be in"):
        est.DPNewtonClassifier(delta=0.0, classes=NAMES).fit(X, y)
    m = est.DPLeastSquaresClassifier(epsilon=math.inf, classes=NAMES).fit(X, y)
    assert math.isinf(m.privacy_.epsilon)  # non-private is reported as such


def test_fit_statistics_matches_fit():
    from dpfy.features.stats import sufficient_statistics

    X, y = _data(n=400)
    classes, codes = np.unique(y, return_inverse=True)
    chunks = [(X[i : i + 64], codes[i : i + 64]) for i in range(0, 400, 64)]
    stats = sufficient_statistics(chunks, clip_norm=1.0, num_classes=3)
    a = est.DPLeastSquaresClassifier(epsilon=1.0, random_state=5).fit_statistics(stats, classes)
    b = est.DPLeastSquaresClassifier(epsilon=1.0, classes=NAMES, random_state=5).fit(X, y)
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-9, atol=1e-12)
    assert a.privacy_ == b.privacy_


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_random_state_none_is_secure_and_an_int_is_a_seeded_experiment(cls):
    from dpfy.randomness import SECURE_DESCRIPTION

    X, y = _data(200)
    a, b = cls(epsilon=1.0, classes=NAMES).fit(X, y), cls(epsilon=1.0, classes=NAMES).fit(X, y)
    assert a._randomness().secure
    assert a.ledger_.metadata["noise_randomness"] == SECURE_DESCRIPTION
    assert a.ledger_.metadata["sampling_randomness"].startswith("none")
    assert not np.array_equal(a.coef_, b.coef_)  # fresh secret noise each fit
    c = cls(epsilon=1.0, classes=NAMES, random_state=4).fit(X, y)
    d = cls(epsilon=1.0, classes=NAMES, random_state=4).fit(X, y)
    assert c.ledger_.metadata["noise_randomness"] == "seeded (seed 4)"
    assert np.array_equal(c.coef_, d.coef_)


@pytest.mark.parametrize(
    ("cls", "target", "factor", "releases"),
    [
        (est.DPLeastSquaresClassifier, "dp_least_squares", 1.0, 3),
        (est.DPNewtonClassifier, "dp_newton", math.sqrt(3) / 4.0, 4),
        (est.DPFeatureCovarianceClassifier, "dp_feature_covariance", 1.0, 11),
    ],
)
def test_auto_ridge_is_matched_to_the_noise_and_public(cls, target, factor, releases,
                                                       monkeypatch):
    """``ridge="auto"`` is ``z C^2 sqrt(d)`` (times the matrix's sensitivity factor), at least
    1: the algorithm receives exactly that; without noise it is the old default of 1."""
    X, y = _data()
    seen: list[float] = []
    real = getattr(est.alg, target)

    def spy(*args, **kwargs):
        # DP-FC carries its ridge in the preconditioner record; DP-Newton as a keyword
        seen.append(kwargs["preconditioner"].ridge if "preconditioner" in kwargs
                    else kwargs["ridge"])
        return real(*args, **kwargs)

    monkeypatch.setattr(est.alg, target, spy)
    cls = functools.partial(cls, classes=NAMES)
    cls(epsilon=0.5, random_state=0).fit(X, y)
    z = facc.noise_multipliers(facc.mu_for_target(0.5, 1e-5), [1.0] * releases)[0]
    assert seen[-1] == pytest.approx(max(factor * z * math.sqrt(6), 1.0), rel=1e-12)
    assert seen[-1] > 1.0
    cls(epsilon=math.inf, random_state=0).fit(X, y)
    assert seen[-1] == 1.0
    cls(epsilon=0.5, ridge=2.5, random_state=0).fit(X, y)
    assert seen[-1] == 2.5
    with pytest.raises(ValueError, match="ridge must be 'auto' or a number"):
        cls(epsilon=0.5, ridge="large", random_state=0).fit(X, y)


def _few_steps(cls) -> dict[str, int]:
    return {"steps": 5} if "steps" in cls().get_params() else {}


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_classes_are_public_and_required(cls):
    """classes=None is refused; classes_ is the public list whatever y holds, so removing the
    only example of a class (or every example but one class's) changes no shape."""
    X, y = _data(n=200)
    with pytest.raises(ValueError, match="classes must be the public list of class labels"):
        cls(epsilon=1.0).fit(X, y)
    with pytest.raises(ValueError, match="classes must list at least 2"):
        cls(epsilon=1.0, classes=["cat"]).fit(X, y)
    kw = dict(epsilon=1.0, classes=NAMES, random_state=0, **_few_steps(cls))
    only = np.flatnonzero(y == "eel")[:1]
    rest = np.flatnonzero(y != "eel")
    one_eel = np.concatenate([rest, only])
    fits = [cls(**kw).fit(X[rows], y[rows]) for rows in (one_eel, rest, rest[y[rest] == "cat"])]
    for m in fits:
        assert list(m.classes_) == NAMES and m.coef_.shape == (3, 6)
        assert np.isfinite(m.coef_).all()
    assert set(fits[1].predict(X)) <= set(NAMES)
    ints = cls(**{**kw, "classes": [-1, 1]}).fit(X, np.where(X[:, 0] > 0, 1, -1))
    assert list(ints.classes_) == [-1, 1] and set(ints.predict(X)) <= {-1, 1}


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_a_label_outside_classes_is_a_zero_row(cls):
    """Rows labelled outside the public list add nothing: the fit equals the fit without them
    (same seeded noise), and no such label, continuous or NaN, stops the fit."""
    X, y = _data(n=300)
    kw = dict(epsilon=1.0, classes=["cat", "dog"], random_state=2, **_few_steps(cls))
    keep = y != "eel"
    a = cls(**kw).fit(X, y)
    b = cls(**kw).fit(X[keep], y[keep])
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-9, atol=1e-12)
    odd = np.where(keep, y, np.array([1.5, np.nan, None, "x"], dtype=object)[np.arange(300) % 4])
    c = cls(**kw).fit(X, odd)
    np.testing.assert_allclose(c.coef_, b.coef_, rtol=1e-9, atol=1e-12)
    continuous = cls(**{**kw, "classes": [0, 1]}).fit(X, X[:, 0] * 0.37)
    assert np.isfinite(continuous.coef_).all()

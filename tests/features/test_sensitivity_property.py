"""One example moves every release of the four feature learners by at most its recorded
sensitivity, and never makes it non-finite (docs/architecture.md, 5.12).

The seam is ``algorithms._release``, through which every noisy sum passes after its ledger entry
is written: a wrapper keeps the noise-free value it receives and the sensitivity that entry
records. The runs are adaptive (a Newton, DP-FC or Adam step is taken at the weights the
previous releases gave), so the neighbour's run is replayed against the base run's released
values: both then compute each statistic at the same weights, which is the condition of the
adaptive composition the accounting assumes. Neighbours: every data set minus one row (the only
example of a class among them), plus one row that is ordinary, tiny, zero, far beyond the clip
norm (1e300- and 1e308-scaled, whose norm overflows), or labelled outside the class list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from dpfy.features import algorithms as alg
from dpfy.features import estimators as est
from dpfy.ledger.records import SumQueryRecord
from dpfy.randomness import Randomness

REAL_RELEASE = alg._release
CLASSES = [0, 1, 2]
#: Relative slack for float64 rounding of sums of a few dozen rows.
RTOL = 1e-9

LEARNERS: dict[str, Callable[[], est._DPFeatureClassifier]] = {
    "dp-ls": lambda: est.DPLeastSquaresClassifier(
        epsilon=None, noise_multiplier=1.0, clip_norm=1.5, classes=CLASSES, random_state=0),
    "dp-newton": lambda: est.DPNewtonClassifier(
        epsilon=None, noise_multiplier=1.0, clip_norm=1.5, steps=3, classes=CLASSES,
        random_state=0),
    "dp-fc": lambda: est.DPFeatureCovarianceClassifier(
        epsilon=None, noise_multiplier=1.0, covariance_clip_norm=1.5, gradient_clip_norm=0.7,
        steps=3, learning_rate=2.0, classes=CLASSES, random_state=0),
    "dp-adam": lambda: est.DPAdamClassifier(
        epsilon=None, noise_multiplier=1.0, clip_norm=0.7, steps=4, learning_rate=5.0,
        classes=CLASSES, random_state=0),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # hundreds of tiny passes


@dataclass
class Tape:
    """Wraps ``_release``: the noise-free value, the ledger's sensitivity, the released value.

    With ``replay``, each release returns the replayed run's released value instead of its own.
    """

    replay: Tape | None = None
    names: list[str] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    sensitivities: list[float] = field(default_factory=list)
    released: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, value: torch.Tensor, **kw: Any) -> torch.Tensor:
        out = REAL_RELEASE(value, **kw)
        record = kw["ledger"].entries[-1]
        assert isinstance(record, SumQueryRecord) and record.name == kw["name"]
        self.names.append(record.name)
        self.values.append(value.detach().clone())
        self.sensitivities.append(float(record.sensitivity))
        if self.replay is not None:
            out = self.replay.released[len(self.released)]
        self.released.append(out)
        return out


def _fit(learner: str, X: np.ndarray, y: np.ndarray, replay: Tape | None,
         monkeypatch: pytest.MonkeyPatch) -> Tape:
    tape = Tape(replay)
    monkeypatch.setattr(alg, "_release", tape)
    LEARNERS[learner]().fit(X, y)
    return tape


def _base_sets(rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Small data sets: mixed scales, one with a single example of class 2, one single-class."""
    for _ in range(3):
        n, d = int(rng.integers(4, 12)), int(rng.integers(1, 5))
        X = rng.normal(size=(n, d)) * rng.choice([0.1, 1.0, 5.0], size=(n, 1))
        y = rng.integers(0, 2, n)
        y[rng.integers(n)] = 2  # the only example of class 2
        yield X, y
    yield rng.normal(size=(6, 3)), np.full(6, 1)  # one class only


def _extra_rows(rng: np.random.Generator, d: int) -> Iterator[tuple[np.ndarray, Any]]:
    """Rows to add: every class for the extreme rows, and labels outside the class list."""
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)
    for label in CLASSES:
        for x in (rng.normal(size=d), 1e300 * u, np.full(d, 1e308), np.full(d, -1e308),
                  1e-300 * u, np.zeros(d), 3.0 * u):
            yield x, label
    for label in (7, -1, 1.5):
        yield 1e300 * u, label
        yield rng.normal(size=d), label


def _neighbours(X: np.ndarray, y: np.ndarray, rng: np.random.Generator
                ) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        yield f"remove row {i} (label {y[i]})", X[keep], y[keep]
    for x, label in _extra_rows(rng, X.shape[1]):
        labels = np.concatenate([y.astype(type(label) if isinstance(label, float) else y.dtype),
                                 [label]])
        yield f"add {x[:2]}... label {label}", np.vstack([X, x]), labels


@pytest.mark.parametrize("learner", list(LEARNERS))
def test_one_example_moves_each_release_by_at_most_its_recorded_sensitivity(
    learner, monkeypatch
):
    rng = np.random.default_rng(sum(map(ord, learner)))
    worst: dict[str, float] = {}
    checked = 0
    for X, y in _base_sets(rng):
        base = _fit(learner, X, y, None, monkeypatch)
        assert all(torch.isfinite(v).all() for v in base.values)
        for what, Xn, yn in _neighbours(X, y, rng):
            run = _fit(learner, Xn, yn, base, monkeypatch)
            # the same releases, the same recorded sensitivities: nothing depends on the data
            assert run.names == base.names and run.sensitivities == base.sensitivities, what
            for name, a, b, s in zip(base.names, base.values, run.values, base.sensitivities,
                                     strict=True):
                assert a.shape == b.shape, (what, name)  # the class list is public
                assert bool(torch.isfinite(b).all()), (what, name)
                moved = float(torch.linalg.vector_norm(b - a))
                assert moved <= s * (1 + RTOL), (what, name, moved, s)
                worst[name] = max(worst.get(name, 0.0), moved / s)
                checked += 1
    assert checked > 100
    # not vacuous: each kind of release is moved by (nearly) its whole sensitivity somewhere
    assert min(worst.values()) > 0.9, worst


def test_functional_forms_zero_non_finite_rows(monkeypatch):
    """The functional forms take any row, inf and NaN included: such a row is a zero row."""
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(12, 3)))
    y = torch.as_tensor(rng.integers(0, 3, 12))
    fits: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "dp-ls": lambda a, b: alg.dp_least_squares(
            (a, b), noise_multiplier=1.0, clip_norm=1.0, num_classes=3,
            randomness=Randomness(0)),
        "dp-newton": lambda a, b: alg.dp_newton(
            a, b, clip_norm=1.0, noise_multiplier=1.0, steps=2, num_classes=3,
            randomness=Randomness(0)),
        "dp-fc": lambda a, b: alg.dp_feature_covariance(
            a, b, preconditioner=alg.Preconditioner(clip_norm=1.0), gradient_clip_norm=1.0,
            noise_multiplier=1.0, steps=2, num_classes=3, randomness=Randomness(0)),
        "dp-adam": lambda a, b: alg.dp_adam(
            a, b, clip_norm=1.0, noise_multiplier=1.0, steps=2, num_classes=3,
            randomness=Randomness(0)),
    }
    for name, fit in fits.items():
        base = Tape()
        monkeypatch.setattr(alg, "_release", base)
        fit(x, y)
        for row in ([math.inf, 0.0, 1.0], [math.nan, 1.0, 1.0], [-math.inf, math.inf, 0.0]):
            run = Tape(base)
            monkeypatch.setattr(alg, "_release", run)
            fit(torch.cat([x, torch.tensor([row], dtype=torch.float64)]),
                torch.cat([y, torch.tensor([1])]))
            for a, b in zip(base.values, run.values, strict=True):
                assert bool(torch.isfinite(b).all()), (name, row)
                assert float(torch.linalg.vector_norm(b - a)) <= 1e-12, (name, row)

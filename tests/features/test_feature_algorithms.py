"""DP-LS, DP-Newton, DP-FC, DP-Adam: worst-case sensitivities, noise-free limits, projection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpfy.features import algorithms as alg
from dpfy.features.stats import clip_rows, label_matrix, sufficient_statistics
from dpfy.ledger.records import SumQueryRecord
from dpfy.randomness import Randomness

F64 = torch.float64


def _data(n=300, d=6, m=3, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(n, d, generator=g, dtype=F64)
    w = torch.randn(d, m, generator=g, dtype=F64)
    y = (x @ w + torch.randn(n, m, generator=g, dtype=F64)).argmax(1)
    return x, y


def _recorded(ledger) -> dict[str, float]:
    """Sensitivity recorded for each release name (checks it is the same at every step)."""
    out: dict[str, float] = {}
    for r in ledger.entries:
        if isinstance(r, SumQueryRecord):
            assert out.setdefault(r.name, r.sensitivity) == r.sensitivity
    return out


def _worst_rows(d: int, clip: float) -> list[torch.Tensor]:
    """Candidate extra examples: on an axis, diagonal, far beyond the clip norm, tiny."""
    e1 = torch.zeros(d, dtype=F64)
    e1[0] = 1.0
    diag = torch.ones(d, dtype=F64) / math.sqrt(d)
    return [clip * e1, 50 * clip * diag, -7.0 * clip * e1, 0.01 * diag]


# ----------------------------------------------------------------------------- sensitivities


@pytest.mark.parametrize("k", [1, 2])
def test_least_squares_sensitivity_matches_ledger(k):
    x, y = _data()
    m, clip = 4, 2.0
    Y = label_matrix(y, m)
    if k == 2:  # multi-label: add a second positive to half the rows
        Y[::2, 3] = 1.0
    fitted = alg.dp_least_squares(
        sufficient_statistics([(x, Y)], clip_norm=clip, num_classes=m, max_positives=k),
        noise_multiplier=1.0, alpha=0.5, ridge=1.0, randomness=Randomness(0),
    )
    rec = _recorded(fitted.ledger)
    base = sufficient_statistics([(x, Y)], clip_norm=clip, num_classes=m, max_positives=k)
    seen = {"G": 0.0, "A": 0.0, "b": 0.0}
    for row in _worst_rows(x.shape[1], clip):
        label = torch.zeros(1, m, dtype=F64)
        label[0, :k] = 1.0  # k positives: the worst case for A and b
        nb = sufficient_statistics([(torch.cat([x, row[None]]), torch.cat([Y, label]))],
                                   clip_norm=clip, num_classes=m, max_positives=k)
        diffs = {
            "G": torch.linalg.norm(nb.covariance - base.covariance),
            "A": torch.linalg.norm(nb.class_covariance - base.class_covariance),
            "b": torch.linalg.norm(nb.class_sums - base.class_sums),
        }
        for name, diff in diffs.items():
            assert float(diff) <= rec[name] * (1 + 1e-9)
            seen[name] = max(seen[name], float(diff))
    want = {"G": clip**2, "A": math.sqrt(k) * clip**2, "b": math.sqrt(k) * clip}
    assert rec == pytest.approx(want)
    assert seen == pytest.approx(rec, rel=1e-9)  # the bound is attained: noise is not wasted


def test_newton_sensitivity_matches_ledger():
    x, y = _data()
    m, clip = 3, 1.5
    fitted = alg.dp_newton(x, y, clip_norm=clip, noise_multiplier=1.0, steps=1, num_classes=m,
                           randomness=Randomness(0))
    rec = _recorded(fitted.ledger)
    assert rec == pytest.approx({"gradient": math.sqrt(m) * clip,
                                 "hessian": math.sqrt(m) * clip**2 / 4})
    xc, Y = clip_rows(x, clip), label_matrix(y, m)
    d = x.shape[1]
    for w, label, kind in [
        (torch.zeros(d, m, dtype=F64), torch.zeros(1, m, dtype=F64), "hessian"),  # s(1-s) = 1/4
        (torch.full((d, m), 40.0, dtype=F64), torch.zeros(1, m, dtype=F64), "gradient"),  # s -> 1
    ]:
        g0, h0 = alg.newton_statistics(xc, Y, w)
        worst = 0.0
        for row in _worst_rows(d, clip):
            xn = torch.cat([xc, clip_rows(row[None], clip)])
            g1, h1 = alg.newton_statistics(xn, torch.cat([Y, label]), w)
            dg, dh = float(torch.linalg.norm(g1 - g0)), float(torch.linalg.norm(h1 - h0))
            assert dg <= rec["gradient"] * (1 + 1e-9)
            assert dh <= rec["hessian"] * (1 + 1e-9)
            worst = max(worst, dg if kind == "gradient" else dh)
        assert worst == pytest.approx(rec[kind], rel=1e-6)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_gradient_sum_sensitivity(loss):
    x, y = _data()
    m, clip = 3, 0.7
    Y = label_matrix(y, m)
    w = torch.randn(x.shape[1], m, generator=torch.Generator().manual_seed(1), dtype=F64)
    base = alg.clipped_gradient_sum(x, Y, w, clip, loss)
    worst = 0.0
    for row in _worst_rows(x.shape[1], clip * 100):
        for j in range(m):
            label = torch.zeros(1, m, dtype=F64)
            label[0, j] = 1.0
            new = alg.clipped_gradient_sum(torch.cat([x, row[None]]), torch.cat([Y, label]),
                                           w, clip, loss)
            diff = float(torch.linalg.norm(new - base))
            assert diff <= clip * (1 + 1e-9)
            worst = max(worst, diff)
    assert worst == pytest.approx(clip, rel=1e-9)
    fc = alg.dp_feature_covariance(x, y, preconditioner=alg.Preconditioner(clip_norm=2.0),
                                   gradient_clip_norm=clip, num_classes=m,
                                   noise_multiplier=1.0, steps=2, loss=loss,
                                   randomness=Randomness(0))
    assert _recorded(fc.ledger) == pytest.approx({"covariance": 4.0, "gradient": clip})
    adam = alg.dp_adam(x, y, clip_norm=clip, noise_multiplier=1.0, steps=2, loss=loss,
                       num_classes=m, randomness=Randomness(0))
    assert _recorded(adam.ledger) == pytest.approx({"gradient": clip})


def test_per_example_gradient_norm_is_exact():
    """The closed-form clipping norm equals the norm of the materialised per-example gradient."""
    x, y = _data(n=20)
    Y = label_matrix(y, 3)
    w = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    total = torch.zeros(6, 3, dtype=F64)
    for i in range(20):
        wi = w.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy((x[i : i + 1] @ wi), y[i : i + 1],
                                                 reduction="sum")
        (g,) = torch.autograd.grad(loss, wi)
        total += g * min(1.0, 0.5 / float(torch.linalg.norm(g)))
    assert torch.allclose(alg.clipped_gradient_sum(x, Y, w, 0.5, "softmax"), total, atol=1e-12)


def test_ledger_records_before_release_and_counts_every_release():
    x, y = _data()
    fc = alg.dp_feature_covariance(x, y, preconditioner=alg.Preconditioner(clip_norm=1.0),
                                   gradient_clip_norm=1.0, num_classes=3,
                                   noise_multiplier=2.0, steps=5, randomness=Randomness(0))
    queries = [r for r in fc.ledger.entries if isinstance(r, SumQueryRecord)]
    assert len(queries) == 6
    assert all(r.noise_std == pytest.approx(2.0 * r.sensitivity) for r in queries)
    nt = alg.dp_newton(x, y, clip_norm=1.0, noise_multiplier=(1.0, 3.0), steps=3, num_classes=3,
                       randomness=Randomness(0))
    stds = [(r.name, round(r.noise_std / r.sensitivity, 12)) for r in nt.ledger.entries
            if isinstance(r, SumQueryRecord)]
    assert stds == [("gradient", 1.0), ("hessian", 3.0)] * 3


# ----------------------------------------------------------------------------- noise-free limits


def test_least_squares_without_noise_is_the_closed_form():
    x, y = _data(n=400, d=5, m=3)
    clip, alpha, ridge = 4.0, 0.3, 2.0
    fitted = alg.dp_least_squares((x, y), noise_multiplier=0.0, clip_norm=clip, alpha=alpha,
                                  ridge=ridge, num_classes=3)
    xc = clip_rows(x, clip).numpy()
    Y = np.eye(3)[y.numpy()]
    G = xc.T @ xc
    for j in range(3):
        sel = xc[Y[:, j] == 1]
        want = np.linalg.solve(sel.T @ sel + alpha * G + ridge * np.eye(5), sel.sum(0))
        np.testing.assert_allclose(fitted.weights[:, j].numpy(), want, rtol=1e-10, atol=1e-12)
    assert math.isinf(__import__("dpfy.accounting", fromlist=["x"]).epsilon(
        fitted.ledger, 1e-5, method="gaussian").epsilon)


def test_newton_without_noise_reaches_the_logistic_optimum():
    sklearn = pytest.importorskip("sklearn.linear_model")
    x, y = _data(n=400, d=5, m=3, scale=1.0)
    clip, ridge = 2.0, 3.0
    fitted = alg.dp_newton(x, y, clip_norm=clip, noise_multiplier=0.0, steps=12, ridge=ridge,
                           num_classes=3)
    xc = clip_rows(x, clip).numpy()
    for j in range(3):  # one-vs-rest: class j against the rest, L2 penalty 1/C = ridge
        lr = sklearn.LogisticRegression(C=1.0 / ridge, fit_intercept=False, tol=1e-12,
                                        max_iter=10_000)
        lr.fit(xc, (y.numpy() == j).astype(int))
        np.testing.assert_allclose(fitted.weights[:, j].numpy(), lr.coef_[0], atol=1e-6)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_feature_covariance_without_noise_reaches_the_logistic_optimum(loss):
    sklearn = pytest.importorskip("sklearn.linear_model")
    x, y = _data(n=400, d=5, m=3, scale=1.0)
    l2 = 2.0
    fitted = alg.dp_feature_covariance(
        x, y, preconditioner=alg.Preconditioner(clip_norm=100.0, ridge=1.0),
        gradient_clip_norm=1e6, noise_multiplier=0.0, steps=300, learning_rate=2.0, l2=l2,
        loss=loss, num_classes=3,
    )
    xn = x.numpy()
    if loss == "softmax":
        lr = sklearn.LogisticRegression(C=1.0 / l2, fit_intercept=False, tol=1e-12,
                                        max_iter=10_000).fit(xn, y.numpy())
        want = lr.coef_.T
        # softmax weights are identified up to a per-feature shift; the penalty centres them
        np.testing.assert_allclose(fitted.weights.numpy(), want, atol=1e-5)
    else:
        for j in range(3):
            lr = sklearn.LogisticRegression(C=1.0 / l2, fit_intercept=False, tol=1e-12,
                                            max_iter=10_000)
            lr.fit(xn, (y.numpy() == j).astype(int))
            np.testing.assert_allclose(fitted.weights[:, j].numpy(), lr.coef_[0], atol=1e-5)


def test_adam_without_noise_approaches_the_optimum():
    sklearn = pytest.importorskip("sklearn.linear_model")
    x, y = _data(n=400, d=5, m=3, scale=1.0)
    fitted = alg.dp_adam(x, y, clip_norm=1e6, noise_multiplier=0.0, steps=1500,
                         learning_rate=0.02, l2=2.0, num_classes=3)
    lr = sklearn.LogisticRegression(C=0.5, fit_intercept=False, tol=1e-12, max_iter=10_000)
    lr.fit(x.numpy(), y.numpy())
    np.testing.assert_allclose(fitted.weights.numpy(), lr.coef_.T, atol=2e-2)


# ----------------------------------------------------------------------------- post-processing


def test_psd_solver_projects_indefinite_matrices():
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=F64))
    vals = torch.tensor([-3.0, -0.5, 0.0, 1.0, 2.0, 5.0], dtype=F64)
    S = q @ torch.diag(vals) @ q.T
    rhs = torch.randn(6, 2, generator=g, dtype=F64)
    solver = alg.PSDSolver(S, ridge=0.5)
    assert solver.projected
    want = q @ torch.diag(1.0 / (vals.clamp_min(0) + 0.5)) @ q.T @ rhs
    assert torch.allclose(solver.solve(rhs), want, atol=1e-12)
    pd = alg.PSDSolver(q @ torch.diag(vals.abs() + 1) @ q.T, ridge=0.5)
    assert not pd.projected  # a PD matrix is left alone (Cholesky path)
    want = torch.linalg.solve(q @ torch.diag(vals.abs() + 1.5) @ q.T, rhs)
    assert torch.allclose(pd.solve(rhs), want, atol=1e-12)


def test_noisy_release_is_symmetrised_and_seeded():
    x, y = _data()
    a = alg.dp_least_squares((x, y), noise_multiplier=5.0, clip_norm=1.0, num_classes=3,
                             randomness=Randomness(7))
    b = alg.dp_least_squares((x, y), noise_multiplier=5.0, clip_norm=1.0, num_classes=3,
                             randomness=Randomness(7))
    assert torch.equal(a.weights, b.weights)
    assert torch.isfinite(a.weights).all()


def test_bad_arguments_raise():
    x, y = _data()
    with pytest.raises(ValueError, match="noise_multiplier must be in"):
        alg.dp_least_squares((x, y), noise_multiplier=-1.0, clip_norm=1.0, num_classes=3)
    with pytest.raises(ValueError, match="clip_norm must be given"):
        alg.dp_least_squares((x, y), noise_multiplier=1.0, num_classes=3)
    with pytest.raises(ValueError, match="loss must be one of"):
        alg.dp_adam(x, y, clip_norm=1.0, noise_multiplier=1.0, loss="hinge", num_classes=3)
    with pytest.raises(ValueError, match="steps must be an integer in"):
        alg.dp_newton(x, y, clip_norm=1.0, noise_multiplier=1.0, steps=0, num_classes=3)
    # the class list is public: never read from the labels
    for fit in (lambda: alg.dp_least_squares((x, y), noise_multiplier=1.0, clip_norm=1.0),
                lambda: alg.dp_newton(x, y, clip_norm=1.0, noise_multiplier=1.0),
                lambda: alg.dp_adam(x, y, clip_norm=1.0, noise_multiplier=1.0),
                lambda: alg.dp_feature_covariance(
                    x, y, preconditioner=alg.Preconditioner(clip_norm=1.0),
                    gradient_clip_norm=1.0, noise_multiplier=1.0)):
        with pytest.raises(ValueError, match="num_classes must be the public number"):
            fit()


def test_shared_covariance_statistics_give_identical_runs():
    x, y = _data()
    stats = sufficient_statistics([(x, y)], clip_norm=1.0, num_classes=3)
    fresh = alg.Preconditioner(clip_norm=1.0)
    shared = alg.Preconditioner(clip_norm=1.0, stats=stats)
    fc = [alg.dp_feature_covariance(x, y, preconditioner=p, gradient_clip_norm=1.0, steps=3,
                                    num_classes=3,
                                    noise_multiplier=1.0, randomness=Randomness(4))
          for p in (fresh, shared)]
    kw = dict(clip_norm=1.0, steps=2, num_classes=3)
    newton = [alg.dp_newton(x, y, noise_multiplier=1.0, randomness=Randomness(4), **kw),
              alg.dp_newton(x, y, noise_multiplier=1.0, randomness=Randomness(4),
                            covariance_stats=stats, **kw)]
    for a, b in (fc, newton):
        assert torch.allclose(a.weights, b.weights, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="clipped with clip_norm"):
        alg.dp_newton(x, y, clip_norm=2.0, noise_multiplier=1.0, covariance_stats=stats,
                      num_classes=3)

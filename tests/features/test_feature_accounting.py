"""Exact GDP accounting of the feature algorithms: calibration, ledger, paper's zCDP figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from dpfy import accounting
from dpfy import events as ev
from dpfy.features import accounting as acc
from dpfy.features import algorithms as alg
from dpfy.features import estimators as est
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec


def _delta_by_quadrature(mu: float, eps: float) -> float:
    """delta(eps) = E_{N(mu,1)}[(1 - e^{eps - L})_+] with privacy loss L = mu Z' - mu^2/2."""
    def integrand(z):  # z ~ N(mu, 1): the loss is mu z - mu^2 / 2
        loss = mu * z - mu * mu / 2.0
        return stats.norm.pdf(z - mu) * max(0.0, 1.0 - math.exp(eps - loss))

    val, _ = integrate.quad(integrand, (eps + mu * mu / 2) / mu, mu + 40, epsabs=1e-14)
    return val


@pytest.mark.parametrize("mu", [0.1, 0.7, 2.0, 5.0])
def test_gdp_delta_matches_quadrature(mu):
    for eps in [0.0, 0.5, 2.0]:
        assert acc.gdp_delta(mu, eps) == pytest.approx(_delta_by_quadrature(mu, eps),
                                                      rel=1e-6, abs=1e-15)


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0, 2.0, 8.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_mu_for_target_is_tight_and_safe(eps, delta):
    mu = acc.mu_for_target(eps, delta)
    assert acc.gdp_delta(mu, eps) <= delta
    assert acc.gdp_delta(mu * (1 + 1e-8), eps) > delta * (1 - 1e-6)
    assert acc.gdp_epsilon(mu, delta) <= eps
    assert acc.gdp_epsilon(mu, delta) == pytest.approx(eps, rel=1e-8)


def test_noise_multipliers_split_mu_exactly():
    z = acc.noise_multipliers(1.3, [1, 1, 2])
    assert np.sum(1.0 / z**2) == pytest.approx(1.3**2)
    assert z[0] == pytest.approx(z[1]) and z[2] == pytest.approx(z[0] / math.sqrt(2))
    with pytest.raises(ValueError):
        acc.noise_multipliers(1.0, [1, -1])


def _fit_all(eps: float):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    kw = dict(epsilon=eps, classes=[0, 1, 2], random_state=0)
    return {
        "dp_ls": est.DPLeastSquaresClassifier(**kw).fit(x, y),
        "dp_newton": est.DPNewtonClassifier(steps=3, **kw).fit(x, y),
        "dp_fc": est.DPFeatureCovarianceClassifier(steps=4, **kw).fit(x, y),
        "dp_adam": est.DPAdamClassifier(steps=5, **kw).fit(x, y),
    }


@pytest.mark.parametrize("eps", [0.5, 4.0])
def test_estimator_epsilon_is_the_exact_gaussian_composition(eps):
    delta = 1e-5
    for name, model in _fit_all(eps).items():
        p, g = model.privacy_, acc.gdp_figures(model.ledger_)
        assert p.epsilon <= eps and p.epsilon == pytest.approx(eps, rel=1e-7), name
        # independent recomputation from the released (sensitivity, std) pairs
        ratios = [r.sensitivity / r.noise_std for r in model.ledger_.entries
                  if type(r).__name__ == "SumQueryRecord"]
        mu = math.sqrt(sum(r * r for r in ratios))
        assert g.mu == pytest.approx(mu, rel=1e-12)
        assert g.releases == len(ratios)
        composed = ev.Composed(tuple(ev.Gaussian(1.0 / r) for r in ratios))
        exact = accounting.epsilon(composed, delta, method="gaussian").epsilon
        assert p.epsilon == pytest.approx(exact, rel=1e-7)
        assert accounting.epsilon(model.ledger_, delta, method="gaussian").epsilon == (
            pytest.approx(exact, rel=1e-7))
        assert g.zcdp_rho == pytest.approx(mu * mu / 2)
        assert g.zcdp_epsilon(delta) > p.epsilon  # the generic zCDP conversion is looser
        assert (p.adjacency, model.ledger_.unit) == ("add_or_remove", "example")


def test_paper_zcdp_figures_match_the_ledger():
    """Theorems 2.1-2.3 give rho = mu^2 / 2 when every release has the same sigma."""
    x = torch.randn(100, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (100,))
    sigma, T, m = 2.5, 4, 3
    cases = {
        "dp_ls": (alg.dp_least_squares((x, y), noise_multiplier=sigma, clip_norm=1.0,
                                       num_classes=m, randomness=Randomness(0)), 1),
        "dp_newton": (alg.dp_newton(x, y, clip_norm=1.0, noise_multiplier=sigma, steps=T,
                                    num_classes=m, randomness=Randomness(0)), T),
        "dp_fc": (alg.dp_feature_covariance(x, y,
                                            preconditioner=alg.Preconditioner(clip_norm=1.0),
                                            gradient_clip_norm=1.0, noise_multiplier=sigma,
                                            steps=T, num_classes=m, randomness=Randomness(0)), T),
        "dp_adam": (alg.dp_adam(x, y, clip_norm=1.0, noise_multiplier=sigma, steps=T,
                                num_classes=m, randomness=Randomness(0)), T),
    }
    for name, (fitted, steps) in cases.items():
        mu = acc.gdp_figures(fitted.ledger).mu
        assert mu * mu / 2 == pytest.approx(acc.paper_zcdp_rho(name, sigma, steps)), name


def test_gdp_figures_refuse_sampled_runs_and_non_private_is_infinite():
    led = Ledger()
    sid = led.record_sample(SampleSpec("poisson", dataset_size=10, sampling_rate=0.1))
    led.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    with pytest.raises(ValueError, match="full-batch runs only"):
        acc.gdp_figures(led)
    led = Ledger()
    sid = led.record_sample(SampleSpec("full_batch", dataset_size=10))
    led.record_sum_query(sid, sensitivity=1.0, noise_std=0.0)
    assert math.isinf(accounting.epsilon(led, 1e-5, method="gaussian").epsilon)


def test_covariance_share_moves_budget_but_keeps_epsilon():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 3, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    m = est.DPFeatureCovarianceClassifier(epsilon=1.0, steps=3, covariance_share=0.5,
                                          classes=[0, 1], random_state=0).fit(x, y)
    ratios = [r.sensitivity / r.noise_std for r in m.ledger_.entries
              if type(r).__name__ == "SumQueryRecord"]
    assert ratios[0] ** 2 == pytest.approx(sum(r * r for r in ratios[1:]))
    assert m.privacy_.epsilon == pytest.approx(1.0, rel=1e-7)

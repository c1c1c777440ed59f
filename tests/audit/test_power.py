"""Power of the audits: each deliberately broken release is flagged (issue Done-when list).

Claim: epsilon 2 at delta 1e-5 for one release (z calibrated below). Each broken variant
lives only here (monkeypatch); each must give a replay finding or a canary lower bound above
the claim.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from torch import nn

from dpfy.accounting.gaussian import gaussian_epsilon
from dpfy.audit import canary_audit
from dpfy.audit.canary import CanaryModel
from dpfy.audit.replay import replay_release, sampler_check
from dpfy.queries import GaussianSumQuery
from dpfy.queries.base import QueryBase
from dpfy.sampling.poisson import PoissonSampler
from dpfy.training import PrivateGradient
from dpfy.training.norms import registry

torch.set_num_threads(1)
DELTA, CLAIM, C = 1e-5, 2.0, 1.0
#: one Gaussian release with epsilon(delta=1e-5) = 2
Z = brentq(lambda z: gaussian_epsilon(1.0 / z, DELTA) - CLAIM, 0.5, 20.0, xtol=1e-10) + 1e-9
N = 6


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(N, 4, generator=g), torch.randn(N, 3, generator=g)
    t[0] *= 1000.0  # the removed row: far above C
    return x, t


def _loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (out * t).sum(1)


def _replay(expected_batch_size: float = 5.0) -> tuple[str, ...]:
    x, t = _batch()
    return replay_release(
        _make,
        lambda: GaussianSumQuery(C, Z),
        x,
        t,
        _loss,
        expected_batch_size=expected_batch_size,
        clip_norm=C,
    ).findings


def _without_attribution_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm rule that under-reports is refused at run time by the attribution check
    (tests/training/test_attribution.py); here the audit must find it on its own."""
    from dpfy.training.norms.attribution import AttributionCheck

    monkeypatch.setattr(AttributionCheck, "due", lambda self: False)


def test_the_correct_release_is_not_flagged() -> None:
    assert gaussian_epsilon(1.0 / Z, DELTA) <= CLAIM
    assert _replay() == ()
    assert _replay(expected_batch_size=0.5) == ()  # tiny data: E below one example
    assert sampler_check("poisson") == ()


def test_noise_halved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GaussianSumQuery, "noise_stds", lambda self: 0.5 * self.noise_std)
    assert any(f.startswith("noise:") for f in _replay())
    audit = canary_audit(C, Z, delta=DELTA, trials=100_000, model=CanaryModel(32, 32, 32, 32))
    assert audit.epsilon > CLAIM


def test_one_parameter_group_without_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = QueryBase.add_noise

    def broken(self, clipped_sum, *, ledger, sample_id, randomness, out=None, scale=1.0):  # type: ignore[no-untyped-def]
        last = list(clipped_sum)[-1]
        clean = clipped_sum[last].clone()
        res = orig(
            self,
            clipped_sum,
            ledger=ledger,
            sample_id=sample_id,
            randomness=randomness,
            out=out,
            scale=scale,
        )
        res[last].copy_(clean * scale)
        return res

    monkeypatch.setattr(QueryBase, "add_noise", broken)
    findings = _replay()
    assert any(f.startswith("noise:") and "'2.bias'" in f for f in findings)
    audit = canary_audit(C, Z, delta=DELTA, trials=20_000, model=CanaryModel(16, 16, 16, 16))
    assert audit.per_parameter["embedding.weight"].epsilon > CLAIM


def test_clipping_skipped_for_one_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = PrivateGradient._clip_weights

    def broken(self, sq, total_sq, real, n, dtype):  # type: ignore[no-untyped-def]
        w = orig(self, sq, total_sq, real, n, dtype)
        w["0.weight"] = torch.full_like(w["0.weight"], self._weight_scale)
        return w

    monkeypatch.setattr(PrivateGradient, "_clip_weights", broken)
    findings = _replay()
    assert any(f.startswith("sensitivity:") for f in findings)
    assert any(f.startswith("clipped sum:") and "'0.weight'" in f for f in findings)


def test_realised_batch_size_as_denominator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        PrivateGradient, "denominator_", property(lambda self: float(max(self._examples, 1)))
    )
    findings = _replay(expected_batch_size=0.5)  # tiny data: E = 0.5 examples
    assert any(f.startswith("denominator:") for f in findings)
    assert any(f.startswith("clipped sum:") for f in findings)


def test_poisson_silently_replaced_by_shuffling(monkeypatch: pytest.MonkeyPatch) -> None:
    def shuffled(self):  # type: ignore[no-untyped-def]
        b = round(self.sampling_rate * self.dataset_size)
        if getattr(self, "_left", None) is None or self._left.size < b:
            self._left = self.randomness.permutation(self.dataset_size)
        batch, self._left = self._left[:b], self._left[b:]
        return np.sort(batch)

    monkeypatch.setattr(PoissonSampler, "_draw_step", shuffled)
    assert any(f.startswith("poisson:") for f in sampler_check("poisson"))


def test_norm_rule_under_reports_by_ten_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_attribution_check(monkeypatch)
    rule = registry._RULES[nn.Linear]

    class Under:
        def __init__(self, inner):  # type: ignore[no-untyped-def]
            self._inner = inner

        def squared_norms(self):  # type: ignore[no-untyped-def]
            return {k: v * 0.81 for k, v in self._inner.squared_norms().items()}

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self._inner, name)

        def weighted_sum(self, weights, out=None):  # type: ignore[no-untyped-def]
            return self._inner.weighted_sum(weights, out)

    monkeypatch.setitem(registry._RULES, nn.Linear, lambda m, caps, k: Under(rule(m, caps, k)))
    findings = _replay()
    assert any(f.startswith("sensitivity:") for f in findings)

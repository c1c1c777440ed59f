"""Shuffled / deterministic accounting: no-amplification upper bound, Chua et al. (2024a) lower
bound, and refusal of Poisson accounting for shuffled runs."""

from __future__ import annotations

import math

import pytest

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting import UnsupportedEventError
from dpfy.accounting.gaussian import gaussian_delta, gaussian_epsilon
from dpfy.accounting.shuffle import (
    ShuffleAccountant,
    no_amplification_mu,
    shuffle_lower_bound_delta,
    shuffle_lower_bound_epsilon,
)


def test_upper_bound_is_exact_gaussian_composition():
    e = ev.Shuffled(1.2, steps_per_epoch=50, epochs=4)
    assert no_amplification_mu(e) == pytest.approx(2.0 / 1.2)
    res = accounting.epsilon(e, 1e-5, method="shuffle")
    assert res.epsilon == pytest.approx(float(gaussian_epsilon(2.0 / 1.2, 1e-5)))
    assert res.provable and res.method == "shuffle"
    assert 0.0 < res.epsilon_lower <= res.epsilon
    assert any("no tight upper bound" in n for n in res.notes)
    # the lower bound is named for what it is: a max-bit bound on Chua et al.'s epoch pair
    assert any("max-bit lower bound on the shuffled-epoch pair of Chua et al." in n
               for n in res.notes)
    d = accounting.delta(e, 2.0, method="shuffle")
    assert d.delta == pytest.approx(float(gaussian_delta(2.0 / 1.2, 2.0)))


def test_deterministic_lower_equals_upper():
    e = ev.Deterministic(0.9, steps_per_epoch=10, epochs=3)
    res = ShuffleAccountant().epsilon(e, 1e-6)
    assert res.epsilon_lower == res.epsilon == pytest.approx(
        float(gaussian_epsilon(math.sqrt(3) / 0.9, 1e-6))
    )


def test_single_batch_shuffle_lower_bound_is_tight():
    # T = 1: the pair is N(2, z^2) vs N(1, z^2), a Gaussian with shift 1: lower = upper
    e = ev.Shuffled(1.0, steps_per_epoch=1)
    assert shuffle_lower_bound_delta(e, 1.0) == pytest.approx(float(gaussian_delta(1.0, 1.0)),
                                                              rel=1e-4)


def test_lower_bound_is_far_above_poisson_at_small_noise():
    # Chua et al. (2024a): at small z shuffling is far less private than Poisson accounting says
    z, t = 0.6, 1000
    lower = shuffle_lower_bound_epsilon(ev.Shuffled(z, t), 1e-5)
    poisson = accounting.epsilon(
        ev.SelfComposed(ev.PoissonSampled(1 / t, ev.Gaussian(z)), t), 1e-5, method="rdp"
    )
    assert lower > 2 * poisson.epsilon
    assert lower <= ShuffleAccountant().epsilon(ev.Shuffled(z, t), 1e-5).epsilon


def test_lower_bound_grows_with_epochs_and_stays_below_upper():
    vals = [shuffle_lower_bound_epsilon(ev.Shuffled(1.0, 100, epochs=k), 1e-5) for k in (1, 3, 9)]
    assert vals == sorted(vals)
    for k, v in zip((1, 3, 9), vals, strict=True):
        assert v <= float(gaussian_epsilon(math.sqrt(k), 1e-5)) * (1 + 1e-9)


def test_compositions_with_gaussians_are_supported():
    e = ev.Composed((ev.Shuffled(1.0, 10, 2), ev.SelfComposed(ev.Gaussian(2.0), 4)))
    assert ShuffleAccountant().unsupported(e) is None
    assert no_amplification_mu(e) == pytest.approx(math.sqrt(2 + 1))
    res = ShuffleAccountant().epsilon(e, 1e-5)
    assert res.epsilon_lower <= res.epsilon


@pytest.mark.parametrize("method", ["rdp", "pld"])
@pytest.mark.parametrize(
    "event", [ev.Shuffled(1.0, 100), ev.Composed((ev.Shuffled(1.0, 100), ev.Gaussian(1.0)))]
)
def test_poisson_accounting_of_a_shuffled_run_is_an_error(method, event):
    assert method in accounting.accountants()
    with pytest.raises(UnsupportedEventError, match="(?i)shuffl"):
        accounting.epsilon(event, 1e-5, method=method)


def test_auto_never_reports_a_poisson_number_for_shuffle():
    e = ev.Shuffled(1.0, 100, epochs=2)
    res = accounting.epsilon(e, 1e-5)
    assert res.method in ("shuffle", "gaussian")
    assert res.epsilon == pytest.approx(float(gaussian_epsilon(math.sqrt(2), 1e-5)))


def test_unsupported_events_are_named():
    acc = ShuffleAccountant()
    assert "PoissonSampled" in acc.unsupported(ev.PoissonSampled(0.1, ev.Gaussian(1.0)))
    assert "replace_one" in acc.unsupported(ev.Shuffled(1.0, 10, adjacency="replace_one"))
    with pytest.raises(UnsupportedEventError):
        no_amplification_mu(ev.BallsAndBins(1.0, 10))


def test_epoch_samplers_state_zero_out_and_refuse_add_or_remove():
    import pytest as _pytest

    from dpfy import accounting
    from dpfy import events as ev
    from dpfy.sampling import SampleSpec

    for cls in (ev.Shuffled, ev.Deterministic):
        res = accounting.epsilon(cls(1.0, 100, 2), 1e-5)
        assert res.adjacency == "zero_out"
        for method in ("auto", "shuffle", "gaussian"):
            with _pytest.raises(accounting.UnsupportedEventError, match="add_or_remove"):
                accounting.epsilon(cls(1.0, 100, 2, adjacency="add_or_remove"), 1e-5, method)
    assert SampleSpec("shuffle", steps_per_epoch=10).adjacency == "zero_out"
    assert SampleSpec("deterministic", steps_per_epoch=10).adjacency == "zero_out"
    assert SampleSpec("poisson", sampling_rate=0.1).adjacency == "add_or_remove"

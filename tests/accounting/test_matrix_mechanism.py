"""Accounting of correlated-noise runs: one Gaussian with mu = sensitivity / z (exact GDP)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from dpfy import accounting
from dpfy import events as ev
from dpfy.accounting.gaussian import gaussian_epsilon, mu_of_event
from dpfy.correlated import MinSeparation, SingleEpoch, TreeAggregation
from dpfy.correlated.schemas import sensitivity


def _event(c: np.ndarray, schema: MinSeparation | SingleEpoch, z: float, name: str) -> ev.Event:
    sens = sensitivity(c, schema)
    return ev.MatrixMechanism(z, sens, c.shape[1], name, str(schema.to_dict()))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_identity_strategy_is_dpsgd_without_amplification(k: int) -> None:
    z, delta, per_epoch = 1.3, 1e-5, 4
    event = _event(np.eye(k * per_epoch), MinSeparation(per_epoch, k), z, "identity")
    assert mu_of_event(event) == pytest.approx(math.sqrt(k) / z, rel=1e-12)
    eps = accounting.epsilon(event, delta, method="gaussian").epsilon
    assert eps == pytest.approx(float(gaussian_epsilon(math.sqrt(k) / z, delta)), rel=1e-9)
    # the no-amplification bound of a shuffled run with k epochs is the same release
    shuffled = accounting.epsilon(ev.Shuffled(z, per_epoch, k), delta, method="gaussian")
    assert eps == pytest.approx(shuffled.epsilon, rel=1e-9)


@pytest.mark.parametrize("steps", [1, 5, 8, 100, 1000])
def test_tree_matches_closed_form_and_dp_accounting_rdp(steps: int) -> None:
    z = 2.0
    c = TreeAggregation(steps).strategy_matrix()
    event = _event(c, SingleEpoch(), z, "tree")
    mu = mu_of_event(event)
    assert mu == pytest.approx(math.sqrt(math.floor(math.log2(steps)) + 1) / z, rel=1e-12)
    orders = [1.5, 2.0, 8.0, 64.0]
    # dp_accounting's tree event is defined under REPLACE_SPECIAL (our zero_out)
    special = NeighboringRelation.REPLACE_SPECIAL
    rdp = RdpAccountant(orders, neighboring_relation=special)
    rdp.compose(dpe.SingleEpochTreeAggregationDpEvent(z, steps))
    # a mu-GDP Gaussian has RDP alpha mu^2 / 2 at every order alpha
    np.testing.assert_allclose(rdp._rdp, [a * mu**2 / 2 for a in orders], rtol=1e-12)
    # exact GDP is never looser than the RDP conversion of the same mechanism
    delta = 1e-5
    exact = accounting.epsilon(event, delta, method="gaussian").epsilon
    loose = RdpAccountant(neighboring_relation=special)
    loose.compose(dpe.SingleEpochTreeAggregationDpEvent(z, steps))
    assert exact <= loose.get_epsilon(delta)


def test_round_trip_replace_one_and_add_or_remove() -> None:
    event = ev.MatrixMechanism(1.5, 2.0, 50, "bandmf", "cyclic(period=10)", band=4)
    assert ev.event_from_dict(event.to_dict()) == event
    doubled = ev.MatrixMechanism(1.5, 2.0, 50, "bandmf", "x", adjacency="replace_one")
    assert mu_of_event(doubled) == pytest.approx(2 * mu_of_event(event))
    loose = ev.MatrixMechanism(1.5, 2.0, 50, "bandmf", "x", adjacency="add_or_remove")
    with pytest.raises(accounting.UnsupportedEventError, match="add_or_remove"):
        accounting.epsilon(loose, 1e-5, method="gaussian")
    with pytest.raises(ValueError, match="sensitivity must be in"):
        ev.MatrixMechanism(1.0, 0.0, 5, "tree", "x")
    with pytest.raises(ValueError, match="strategy must be a non-empty string"):
        ev.MatrixMechanism(1.0, 1.0, 5, "", "x")


def test_calibration_of_a_matrix_mechanism_is_the_safe_side_of_the_target() -> None:
    from dpfy.accounting.calibrate import calibrate_noise_multiplier

    sens, target, delta = 2.5, 3.0, 1e-5
    z = calibrate_noise_multiplier(
        lambda z: ev.MatrixMechanism(z, sens, 100, "bandmf", "cyclic(period=20)", band=8),
        target,
        delta,
        method="gaussian",
    )
    got = accounting.epsilon(ev.MatrixMechanism(z, sens, 100, "bandmf", "x"), delta).epsilon
    assert got <= target and got == pytest.approx(target, rel=1e-3)
    # sensitivity scales the noise linearly: the whole run is one Gaussian with mu = sens / z
    z1 = calibrate_noise_multiplier(
        lambda z: ev.MatrixMechanism(z, 1.0, 100, "tree", "x"), target, delta, method="gaussian"
    )
    assert z == pytest.approx(sens * z1, rel=2e-4)

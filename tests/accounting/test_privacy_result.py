"""float() of a PrivacyResult: the epsilon of an epsilon result, refused for a delta result."""

from __future__ import annotations

import math

import pytest

from dpfy import accounting
from dpfy import events as ev

EVENT = ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.1)), 1000)


def test_float_of_an_epsilon_result_is_its_epsilon():
    result = accounting.epsilon(EVENT, 1e-5, method="rdp")
    assert result.solved_for == "epsilon"
    assert float(result) == result.epsilon
    assert f"{result:.3f}" == f"{result.epsilon:.3f}"
    assert f"{result}" == str(result)  # no format spec: the record itself
    assert math.isinf(float(accounting.epsilon(ev.NonPrivate(reason="debug"), 1e-5)))


def test_float_of_a_delta_result_is_refused_with_the_fields_to_read():
    result = accounting.delta(EVENT, 2.0, method="rdp")
    assert result.solved_for == "delta" and result.epsilon == 2.0 and 0 < result.delta < 1
    with pytest.raises(TypeError, match=r"accounting\.delta\(\).*read \.delta or \.epsilon"):
        float(result)
    with pytest.raises(TypeError):
        f"{result:.2f}"  # noqa: B018  (formatting is what is tested)
    non_private = accounting.delta(ev.NonPrivate(reason="debug"), 1.0)
    assert non_private.solved_for == "delta" and non_private.delta == 1.0

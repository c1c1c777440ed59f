"""The accountant and event-type registries refuse a duplicate name unless told to replace."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

from dpfy import events as ev
from dpfy.accounting import PrivacyResult, epsilon, register_accountant
from dpfy.accounting._api import _ACCOUNTANTS, _AUTO


class _FakePld:
    """Claims epsilon 0 for everything: must never slip in under a built-in's name."""

    name = "pld"

    def unsupported(self, event: ev.Event) -> str | None:
        return None

    def epsilon(self, event: ev.Event, delta: float) -> PrivacyResult:
        return PrivacyResult(0.0, delta, self.name)

    def delta(self, event: ev.Event, epsilon: float) -> PrivacyResult:
        return PrivacyResult(epsilon, 0.0, self.name)


EVENT = ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100)


def test_fake_accountant_under_a_builtin_name_is_refused() -> None:
    before = epsilon(EVENT, 1e-5, method="pld").epsilon
    original = _ACCOUNTANTS["pld"]
    with pytest.raises(ValueError, match="'pld'.*replace=True"):
        register_accountant(_FakePld())
    assert _ACCOUNTANTS["pld"] is original
    assert epsilon(EVENT, 1e-5, method="pld").epsilon == before > 0.0


def test_registering_the_same_accountant_again_is_harmless() -> None:
    original = _ACCOUNTANTS["pld"]
    auto = list(_AUTO)
    assert register_accountant(original) is original
    assert _ACCOUNTANTS["pld"] is original and _AUTO == auto


def test_replace_true_replaces_and_can_be_undone() -> None:
    original = _ACCOUNTANTS["pld"]
    auto = list(_AUTO)
    try:
        register_accountant(_FakePld(), replace=True)
        assert epsilon(EVENT, 1e-5, method="pld").epsilon == 0.0
        assert _AUTO == auto  # kept its place among the auto methods
    finally:
        register_accountant(original, replace=True)
    assert _ACCOUNTANTS["pld"] is original and _AUTO == auto
    assert epsilon(EVENT, 1e-5, method="pld").epsilon > 0.0


def test_replace_with_auto_false_leaves_auto_and_is_undone() -> None:
    original = _ACCOUNTANTS["pld"]
    auto = list(_AUTO)
    try:
        register_accountant(_FakePld(), auto=False, replace=True)
        assert "pld" not in _AUTO
    finally:
        register_accountant(original, replace=True)
        _AUTO[:] = auto  # restore the original order exactly
    assert _ACCOUNTANTS["pld"] is original and _AUTO == auto


def test_event_kind_registry_refuses_a_duplicate_kind() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class FakeGaussian(ev.Event):
        noise_multiplier: float
        kind: ClassVar[str] = "gaussian"

    with pytest.raises(ValueError, match="'gaussian'.*Gaussian.*replace=True"):
        ev._register(FakeGaussian)
    assert ev._REGISTRY["gaussian"] is ev.Gaussian
    assert ev.event_from_dict(ev.Gaussian(2.0).to_dict()) == ev.Gaussian(2.0)
    assert ev._register(ev.Gaussian) is ev.Gaussian  # the same class again: a no-op


def test_event_kind_registry_replace_true_works_and_is_undone() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class FakeGaussian(ev.Event):
        noise_multiplier: float
        kind: ClassVar[str] = "gaussian"

    try:
        ev._register(FakeGaussian, replace=True)
        assert isinstance(ev.event_from_dict({"type": "gaussian", "noise_multiplier": 1.0}),
                          FakeGaussian)
    finally:
        ev._register(ev.Gaussian, replace=True)
    assert ev._REGISTRY["gaussian"] is ev.Gaussian
    assert ev.event_from_dict(ev.Gaussian(2.0).to_dict()) == ev.Gaussian(2.0)

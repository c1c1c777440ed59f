"""Contract tests for the accountant registry and the public epsilon/delta/compare API.

The contract runs over every registered accountant (the built-ins and any registered when the
tests are collected), on a panel of events that gives each of them events it accounts and
events it must refuse by name.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from typing import Any

import pytest

from dpfy import events as ev
from dpfy.accounting import (
    PrivacyResult,
    UnsupportedEventError,
    accountants,
    compare,
    delta,
    epsilon,
)
from dpfy.accounting._api import _ACCOUNTANTS

BUILT_INS = (
    "gaussian", "monte_carlo", "pld", "random_allocation", "rdp", "rdp_tuning", "shuffle",
)
ALL = tuple(sorted(accountants()))

PANEL = [
    ev.Gaussian(1.0),
    ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100),
    ev.SelfComposed(ev.FixedSizeSampled(10, 1000, ev.Gaussian(1.0)), 100),
    ev.Composed((ev.Gaussian(2.0), ev.ZCDP(0.01))),
    ev.Laplace(3.0),
    ev.Deterministic(2.0, 10, 3),
    ev.Shuffled(2.0, 10, 3),
    ev.BallsAndBins(2.0, 10, 3),
    ev.RepeatAndSelect(ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100), 10.0, 1.0),
]


def _accountant(name: str) -> Any:
    """The registered accountant; Monte Carlo's own class with fewer samples and the
    order-statistics sampler (seeded, as registered: the same numbers on every run) so that
    its cases take a fraction of a second."""
    acc = _ACCOUNTANTS[name]
    if name == "monte_carlo":
        return dataclasses.replace(
            acc, samples=50_000, method="order_statistics", progress=False
        )
    return acc


def test_registry_names() -> None:
    assert set(BUILT_INS) <= set(ALL)
    for name in ALL:  # the panel gives every accountant at least one event it accounts
        assert any(_ACCOUNTANTS[name].unsupported(e) is None for e in PANEL), name


@pytest.mark.parametrize("name", sorted(_ACCOUNTANTS))
@pytest.mark.parametrize("event", PANEL, ids=lambda e: type(e).__name__)
def test_unsupported_is_none_or_a_reason(name: str, event: ev.Event) -> None:
    reason = _ACCOUNTANTS[name].unsupported(event)
    assert reason is None or (isinstance(reason, str) and reason)


def _check_result(res: PrivacyResult, name: str, event: ev.Event, target: float) -> None:
    assert isinstance(res, PrivacyResult)
    assert res.method == name and res.delta == target
    assert res.adjacency == event.adjacency_relation.value
    assert 0.0 <= res.epsilon < math.inf
    # A bound is provable, or an estimate that states how often it may be wrong.
    assert res.provable or 0.0 < (res.error_probability or 0.0) < 1.0
    assert res.provable == (res.error_probability is None)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("event", PANEL, ids=lambda e: type(e).__name__)
def test_contract_of_every_accountant(name: str, event: ev.Event) -> None:
    acc = _accountant(name)
    reason = acc.unsupported(event)
    if reason is not None:
        with pytest.raises(UnsupportedEventError) as info:
            epsilon(event, 1e-5, method=acc)
        assert reason in str(info.value)
        return
    res = epsilon(event, 1e-5, method=acc)
    _check_result(res, name, event, 1e-5)
    back = delta(event, res.epsilon, method=acc)
    assert back.method == name and back.delta <= 1e-5 * (1 + 1e-6)
    assert back.adjacency == res.adjacency and back.epsilon == res.epsilon


def test_contract_of_a_monte_carlo_estimate() -> None:
    # The panel's Monte Carlo cases end on the provable no-amplification bound; at a larger
    # delta the estimate itself is reported (seeded: the same numbers on every run).
    event = ev.BallsAndBins(2.0, 10, 1)
    res = epsilon(event, 1e-3, method=_accountant("monte_carlo"))
    _check_result(res, "monte_carlo", event, 1e-3)
    assert not res.provable and res.epsilon_lower is not None
    assert res.epsilon_lower <= res.epsilon
    back = delta(event, res.epsilon, method=_accountant("monte_carlo"))
    assert not back.provable and back.delta <= 1e-3 * (1 + 1e-6)


@pytest.mark.parametrize(
    ("event", "method", "needle"),
    [
        (ev.Shuffled(1.0, 10, 2), "rdp", "Shuffled"),
        (ev.SelfComposed(ev.BallsAndBins(1.0, 10), 2), "rdp", "BallsAndBins"),
        (ev.PoissonSampled(0.1, ev.Gaussian(1.0)), "gaussian", "PoissonSampled"),
        (ev.Composed((ev.Gaussian(1.0), ev.Laplace(1.0))), "gaussian", "Laplace"),
    ],
)
def test_unsupported_sub_event_is_named(event: ev.Event, method: str, needle: str) -> None:
    with pytest.raises(UnsupportedEventError, match=needle):
        epsilon(event, 1e-5, method=method)
    assert needle in (_ACCOUNTANTS[method].unsupported(event) or "")


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-5, math.nan, 2])
def test_bad_delta(bad: float) -> None:
    with pytest.raises(ValueError, match=r"^delta must be in \(0\.0, 1\.0\), got delta="):
        epsilon(ev.Gaussian(1.0), bad)


def test_bad_epsilon_and_method() -> None:
    with pytest.raises(ValueError, match=r"^epsilon must be in \[0\.0, inf\), got epsilon=-1"):
        delta(ev.Gaussian(1.0), -1.0)
    allowed = r"^method must be one of \{auto, .*rdp.*\}, got method='x'"
    with pytest.raises(ValueError, match=allowed):
        epsilon(ev.Gaussian(1.0), 1e-5, method="x")
    with pytest.raises(ValueError, match="event must be a dpfy.events.Event"):
        epsilon("gaussian", 1e-5)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["auto", *ALL])
def test_non_private_gives_infinite_epsilon(method: str) -> None:
    # A non-private release beside events the accountant accounts (or even refuses): epsilon
    # = inf and delta = 1 whatever the method, never a finite number.
    acc = method if method == "auto" else _accountant(method)
    leak = ev.SelfComposed(ev.NonPrivate("debug print"), 1)
    for base in (ev.Gaussian(1.0), ev.BallsAndBins(2.0, 10, 3)):
        tree = ev.Composed((base, leak))
        res = epsilon(tree, 1e-5, method=acc)
        assert res.epsilon == math.inf and res.method == method
        assert delta(tree, 3.0, method=acc).delta == 1.0


def test_auto_picks_the_tightest_valid_method() -> None:
    for event in (
        ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100),
        ev.Composed((ev.SelfComposed(ev.Gaussian(3.0), 50), ev.ZCDP(0.01))),
    ):
        res = epsilon(event, 1e-6)
        for name in ("rdp", "gaussian", "pld"):
            if _ACCOUNTANTS[name].unsupported(event) is None:
                assert res.epsilon <= epsilon(event, 1e-6, method=name).epsilon


def test_compare_lists_results_and_reasons() -> None:
    out = compare(ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 10), 1e-5)
    assert isinstance(out["rdp"], PrivacyResult) and out["rdp"].method == "rdp"
    assert isinstance(out["gaussian"], str) and "PoissonSampled" in out["gaussian"]


def test_import_does_not_pull_in_torch() -> None:
    code = "import sys, dpfy, dpfy.accounting; sys.exit(1 if 'torch' in sys.modules else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr or "dpfy.accounting imported torch"

"""Contract tests for the accountant registry and the public epsilon/delta/compare API."""

from __future__ import annotations

import math
import subprocess
import sys

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

MINE = ("rdp", "gaussian")

PANEL = [
    ev.Gaussian(1.0),
    ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100),
    ev.SelfComposed(ev.FixedSizeSampled(10, 1000, ev.Gaussian(1.0)), 100),
    ev.Composed((ev.Gaussian(2.0), ev.ZCDP(0.01))),
    ev.Laplace(3.0),
    ev.Deterministic(2.0, 10, 3),
    ev.Shuffled(2.0, 10, 3),
    ev.BallsAndBins(2.0, 10, 3),
]


def test_registry_names() -> None:
    assert set(MINE) <= set(accountants())


@pytest.mark.parametrize("name", sorted(_ACCOUNTANTS))
@pytest.mark.parametrize("event", PANEL, ids=lambda e: type(e).__name__)
def test_unsupported_is_none_or_a_reason(name: str, event: ev.Event) -> None:
    reason = _ACCOUNTANTS[name].unsupported(event)
    assert reason is None or (isinstance(reason, str) and reason)


@pytest.mark.parametrize("name", MINE)
@pytest.mark.parametrize("event", PANEL, ids=lambda e: type(e).__name__)
def test_contract_of_my_accountants(name: str, event: ev.Event) -> None:
    reason = _ACCOUNTANTS[name].unsupported(event)
    if reason is not None:
        with pytest.raises(UnsupportedEventError) as info:
            epsilon(event, 1e-5, method=name)
        assert reason in str(info.value)
        return
    res = epsilon(event, 1e-5, method=name)
    assert isinstance(res, PrivacyResult)
    assert res.method == name and res.delta == 1e-5 and res.provable
    assert res.adjacency == event.adjacency_relation.value
    assert 0.0 <= res.epsilon < math.inf
    back = delta(event, res.epsilon, method=name)
    assert back.method == name and back.delta <= 1e-5 * (1 + 1e-6)
    assert back.adjacency == res.adjacency


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


@pytest.mark.parametrize("method", ["auto", *MINE])
def test_non_private_gives_infinite_epsilon(method: str) -> None:
    tree = ev.Composed((ev.Gaussian(1.0), ev.SelfComposed(ev.NonPrivate("debug print"), 1)))
    res = epsilon(tree, 1e-5, method=method)
    assert res.epsilon == math.inf
    assert delta(tree, 3.0, method=method).delta == 1.0


def test_auto_picks_the_tightest_valid_method() -> None:
    for event in (
        ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(1.0)), 100),
        ev.Composed((ev.SelfComposed(ev.Gaussian(3.0), 50), ev.ZCDP(0.01))),
    ):
        res = epsilon(event, 1e-6)
        for name in MINE:
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

"""Shared test setup: private ledger-signing keys go to a temporary directory, and
``fixed_os_key`` keys secure randomness reproducibly for statistical checks.

Every file ledger draws an Ed25519 key and stores its private half under ``$DPFY_KEY_DIR``
(``dpfy.ledger.signing``); tests must not fill the user's ``~/.config/dpfy/keys``. Secure runs
register their key commitments in ``$DPFY_KEY_REGISTRY`` (``dpfy.ledger.commitments``): a
temporary file for the session, and one per test under ``fixed_os_key``, whose keys repeat
from test to test by design.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

# Under pytest-xdist (`make test` runs one worker per core) each worker has one core: torch's
# default of one thread per core would have two workers' thread pools fight over both cores,
# where a second thread mostly spins on these tiny models. Set before any test imports torch;
# subprocesses (ranks, the CLI) inherit it. Tests that set a thread count still do.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files holding a ``slow`` test run first, each file's tests kept together and in
    order (a module's shared fixtures are built once). ``pytest -n 2`` hands each worker a
    contiguous share of this order and an idle worker takes queued tests from the other: slow
    tests collected last (tests/training sorts last) would run alone at the end instead."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order is otherwise kept


@pytest.fixture(autouse=True, scope="session")
def _ledger_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("DPFY_KEY_DIR")
    os.environ["DPFY_KEY_DIR"] = str(tmp_path_factory.mktemp("dpfy-keys"))
    old_registry = os.environ.get("DPFY_KEY_REGISTRY")
    os.environ["DPFY_KEY_REGISTRY"] = str(tmp_path_factory.mktemp("dpfy-data") / "commitments")
    yield
    if old is None:
        os.environ.pop("DPFY_KEY_DIR", None)
    else:
        os.environ["DPFY_KEY_DIR"] = old
    if old_registry is None:
        os.environ.pop("DPFY_KEY_REGISTRY", None)
    else:
        os.environ["DPFY_KEY_REGISTRY"] = old_registry


class _SeededOS:
    """``os`` as :mod:`dpfy.randomness` sees it, with ``urandom`` replaced by a seeded byte
    stream: every secure :class:`~dpfy.randomness.Randomness` created meanwhile gets a fixed
    AES key (a fresh key per stream, in creation order) and every unseeded one a fixed seed, so
    the secure code paths run exactly as in production, but reproducibly."""

    def __init__(self, seed: int) -> None:
        self._bytes = random.Random(seed)

    def urandom(self, n: int) -> bytes:
        return self._bytes.randbytes(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


@pytest.fixture
def fixed_os_key(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
                 ) -> None:
    """Secure randomness keyed from a seeded stream instead of the OS, in this process only
    (spawned ranks key their own). For statistical checks on the secure path: deterministic,
    where an OS key would fail a check at level alpha in a fraction alpha of the runs. The
    keys repeat from test to test, so the test registers them in a key registry of its own."""
    import dpfy.randomness

    monkeypatch.setattr(dpfy.randomness, "os", _SeededOS(0))
    registry = tmp_path_factory.mktemp("dpfy-data") / "commitments"
    monkeypatch.setenv("DPFY_KEY_REGISTRY", str(registry))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread for the test: for hundreds of passes over a few rows, a thread
    pool's start-up would dominate them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small_image_chunks(patch: pytest.MonkeyPatch) -> None:
    """Image recipes in physical batches of 64 rows (they pad every batch to 512-4096 rows)."""
    import dataclasses

    from dpfy.training import recipes

    real = recipes.train_image_classifier

    def small_chunks(config, recipe=None, hooks=None):  # type: ignore[no-untyped-def]
        recipe = recipes.default_recipe(config.model) if recipe is None else recipe
        return real(config, dataclasses.replace(recipe, max_physical_batch_size=64), hooks)

    patch.setattr(recipes, "train_image_classifier", small_chunks)


@pytest.fixture
def quick_image_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Image runs of `dpfy train` in this process without their fixed cost: physical batches
    of 64 rows (the image recipes pad every batch to 512-4096 rows) and the report without
    its figures (seconds of drawing per run). For tests of what a run records (ledger, report
    text, model), not of its padding or figures (tests/training, tests/test_report.py and
    tests/test_runs.py test those)."""
    import functools

    from dpfy import runs

    _small_image_chunks(monkeypatch)
    monkeypatch.setattr(runs, "_report_files",
                        functools.partial(runs._report_files, figures=False))


@pytest.fixture
def image_chunks_of_64(monkeypatch: pytest.MonkeyPatch) -> None:
    """One test's image runs in physical batches of 64 rows, figures kept: an end-to-end run
    whose padding tests/training covers."""
    _small_image_chunks(monkeypatch)


@pytest.fixture(scope="module")
def small_image_chunks() -> Iterator[None]:
    """For a module's shared image runs: physical batches of 64 rows, figures kept, from the
    first test that needs it to the end of the module. For tests of what a run publishes, not
    of its padding (tests/training tests that)."""
    with pytest.MonkeyPatch.context() as patch:
        _small_image_chunks(patch)
        yield

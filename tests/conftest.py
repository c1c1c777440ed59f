"""Shared test setup: private ledger-signing keys go to a temporary directory.

Every file ledger draws an Ed25519 key and stores its private half under ``$DPFY_KEY_DIR``
(``dpfy.ledger.signing``); tests must not fill the user's ``~/.config/dpfy/keys``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _ledger_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    old = os.environ.get("DPFY_KEY_DIR")
    os.environ["DPFY_KEY_DIR"] = str(tmp_path_factory.mktemp("dpfy-keys"))
    yield
    if old is None:
        os.environ.pop("DPFY_KEY_DIR", None)
    else:
        os.environ["DPFY_KEY_DIR"] = old

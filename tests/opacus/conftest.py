"""The Opacus port's tests: one thread (tiny models; two threads on a busy two-core machine
make every small kernel 10-30x slower) and a fresh working directory (the engines write their
ledgers under ``runs/``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_in_a_fresh_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

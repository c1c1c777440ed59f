"""The README's Python examples run as written, each one alone (a reader copies one block)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 5


@pytest.mark.parametrize("i", range(len(python_blocks())))
def test_readme_example_runs_alone(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (e.g. a ledger)
    block = python_blocks()[i]
    try:
        exec(compile(block, f"README.md block {i}", "exec"), {"__name__": "__readme__"})  # noqa: S102
    except Exception as err:  # pragma: no cover - the failure message is the point
        raise AssertionError(f"README python block {i} failed alone: {err!r}\n{block}") from err

"""The README's Python examples run as written (in order, sharing one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 5


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (e.g. a ledger)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README.md block {i}", "exec"), namespace)  # noqa: S102
        except Exception as err:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"README python block {i} failed: {err!r}\n{block}") from err

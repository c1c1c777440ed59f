"""The README's "From Opacus" section: both scripts run, and the README shows them verbatim."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPACUS = "docs/examples/from_opacus_opacus.py"
DPFY = "docs/examples/from_opacus_dpfy.py"


def _diff() -> list[str]:
    a = (ROOT / OPACUS).read_text(encoding="utf-8").splitlines(keepends=True)
    b = (ROOT / DPFY).read_text(encoding="utf-8").splitlines(keepends=True)
    return [
        line
        for line in difflib.unified_diff(a, b, "opacus", "dpfy", n=0)
        if not line.startswith(("---", "+++", "@@"))
    ]


def test_the_readme_includes_the_scripts_and_their_diff_verbatim():
    text = README.read_text(encoding="utf-8")
    included = dict(re.findall(r"<!-- include: (\S+) -->\n```py\n(.*?)```", text, flags=re.S))
    assert set(included) == {OPACUS, DPFY}
    for path, block in included.items():
        assert block == (ROOT / path).read_text(encoding="utf-8"), path
    shown = re.search(r"<!-- diff: \S+ \S+ -->\n```diff\n(.*?)```", text, flags=re.S)
    assert shown is not None and shown.group(1) == "".join(_diff())


def test_at_most_ten_lines_change():
    lines = _diff()
    assert sum(x.startswith("-") for x in lines) <= 10
    assert sum(x.startswith("+") for x in lines) <= 10


def _run(path: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_dpfy_script_runs():
    eps = float(re.search(r"epsilon = ([\d.]+)", _run(DPFY)).group(1))
    assert 0 < eps <= 3.0


def test_the_opacus_script_runs():
    if importlib.util.find_spec("opacus") is None:
        pytest.skip("opacus is not installed: the Opacus side of the README cannot be run")
    assert "epsilon = " in _run(OPACUS)

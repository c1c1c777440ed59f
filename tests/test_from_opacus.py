"""docs/from_opacus.md: the scripts it shows are the files it names, its diffs
are the real diffs, the one-line port runs and reads its epsilon from its ledger, and both the
Opacus and the native scripts run."""

from __future__ import annotations

import contextlib
import difflib
import glob
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

from dpfy import accounting
from dpfy.ledger import Ledger

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from_opacus.md"
OPACUS = "docs/examples/from_opacus_opacus.py"
DPFY = "docs/examples/from_opacus_dpfy.py"


def _section() -> str:
    return PAGE.read_text(encoding="utf-8")


def _read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def _port(source: str) -> str:
    """The one-line port: ``from opacus`` imports become ``from dpfy.opacus``."""
    return re.sub(r"^from opacus\b", "from dpfy.opacus", source, flags=re.M)


def _diff(a: str, b: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True), "a", "b", n=0
        )
        if not line.startswith(("---", "+++", "@@"))
    ]


def test_the_readme_includes_the_scripts_and_their_diffs_verbatim():
    text = _section()
    included = dict(re.findall(r"<!-- include: (\S+) -->\n```py\n(.*?)```", text, flags=re.S))
    assert set(included) == {OPACUS, DPFY}
    for path, block in included.items():
        assert block == _read(path), path
    native = re.search(r"<!-- diff: (\S+) (\S+) -->\n```diff\n(.*?)```", text, flags=re.S)
    assert native is not None and native.group(1, 2) == (OPACUS, DPFY)
    assert native.group(3) == "".join(_diff(_read(OPACUS), _read(DPFY)))
    port = re.search(r"<!-- port: (\S+) -->\n```diff\n(.*?)```", text, flags=re.S)
    assert port is not None and port.group(1) == OPACUS
    assert port.group(2) == "".join(_diff(_read(OPACUS), _port(_read(OPACUS))))


def test_the_port_changes_one_line_and_the_native_api_at_most_ten():
    port = _diff(_read(OPACUS), _port(_read(OPACUS)))
    assert port == [
        "-from opacus import PrivacyEngine\n", "+from dpfy.opacus import PrivacyEngine\n"
    ]
    native = _diff(_read(OPACUS), _read(DPFY))
    assert sum(x.startswith("-") for x in native) <= 10
    assert sum(x.startswith("+") for x in native) <= 10


def _exec(source: str, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a script's source as ``__main__`` in this process, from ``tmp_path`` (where it writes
    its runs/), on one thread; return what it printed. In-process rather than ``python path``:
    the same script, without a second interpreter importing torch (and Opacus) again."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is the fast one on a busy machine
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, path, "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


def test_the_ported_script_prints_its_ledgers_epsilon(tmp_path, monkeypatch):
    printed = float(re.search(r"epsilon = ([\d.]+)",
                              _exec(_port(_read(OPACUS)), OPACUS, tmp_path, monkeypatch)).group(1))
    (path,) = glob.glob("runs/opacus-*/ledger.jsonl")
    ledger = Ledger.load(path)
    assert ledger.metadata["secure_randomness"] is True
    assert printed == round(accounting.epsilon(ledger, 1e-5, "pld").epsilon, 2)
    assert 2.9 <= printed <= 3.0  # calibrated to target_epsilon=3.0 over the 2 epochs


def test_the_native_script_runs(tmp_path, monkeypatch):
    printed = _exec(_read(DPFY), DPFY, tmp_path, monkeypatch)
    eps = float(re.search(r"epsilon = ([\d.]+)", printed).group(1))
    assert 0 < eps <= 3.0


def test_the_opacus_script_runs(tmp_path, monkeypatch):
    if importlib.util.find_spec("opacus") is None:
        pytest.skip("opacus is not installed: the Opacus side of docs/from_opacus.md cannot be run")
    printed = _exec(_read(OPACUS), OPACUS, tmp_path, monkeypatch)
    eps = float(re.search(r"epsilon = ([\d.]+)", printed).group(1))
    assert 2.99 <= eps <= 3.0  # within Opacus' epsilon_tolerance of the target

"""Every Python block of README.md and docs/*.md runs as written, each one alone (a reader
copies one block), or says in a marker on the line above it why and where else it runs:

* ``<!-- example: NAME -->``: a worked example of docs/architecture.md, run in a fresh
  interpreter by ``tests/test_architecture.py`` (NAME must be one of its ``EXAMPLES``);
* ``<!-- include: PATH -->``: the file PATH verbatim (checked here), run by a test that names it;
* ``<!-- not run: REASON -->``: an excerpt that cannot run alone; REASON names the complete
  ``docs/examples/`` file it comes from and the test under ``tests/`` that runs that file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:<!-- (?P<marker>[a-z ]+): (?P<arg>[^\n]*?) -->\n)?"
    r"```(?P<lang>python|py)\n(?P<code>.*?)```",
    re.S,
)


def blocks() -> list[tuple[str, str | None, str, str]]:
    """(where, marker, marker argument, code) of every python block, in document order."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for i, m in enumerate(BLOCK.finditer(text)):
            line = text.count("\n", 0, m.start("lang")) + 1
            found.append((f"{doc.relative_to(ROOT)} block {i} (line {line})", m.group("marker"),
                          m.group("arg") or "", m.group("code")))
    return found


BLOCKS = blocks()
RUN = [(where, code) for where, marker, _, code in BLOCKS if marker is None]


def _tests_naming(name: str) -> list[Path]:
    return [p for p in (ROOT / "tests").rglob("test_*.py")
            if p.name != "test_readme.py" and name in p.read_text(encoding="utf-8")]


def test_the_documents_have_examples():
    assert sum(where.startswith("README.md") for where, _ in RUN) >= 5
    assert any(where.startswith("docs/") for where, _ in RUN)


@pytest.mark.parametrize(("where", "code"), RUN, ids=[w.split(" (")[0] for w, _ in RUN])
def test_a_python_block_runs_alone(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (e.g. a ledger)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__doc_example__"})  # noqa: S102
    except Exception as err:  # pragma: no cover - the failure message is the point
        raise AssertionError(f"{where} failed alone: {err!r}\n{code}") from err


def test_every_block_that_does_not_run_here_says_where_it_runs():
    architecture = (ROOT / "tests" / "test_architecture.py").read_text(encoding="utf-8")
    listed = re.search(r"^EXAMPLES = \[(.*?)\]", architecture, re.M | re.S)
    assert listed is not None
    examples = set(re.findall(r'"(\w+)"', listed.group(1)))
    for where, marker, arg, code in BLOCKS:
        if marker is None:
            continue
        if marker == "example":
            assert where.startswith("docs/architecture.md") and arg in examples, (where, arg)
        elif marker == "include":
            path = ROOT / arg
            assert path.is_file() and path.read_text(encoding="utf-8") == code, (where, arg)
            assert _tests_naming(path.name), f"{where}: no test runs {arg}"
        elif marker == "not run":
            sources = re.findall(r"docs/examples/\w+\.py", arg)
            tests = re.findall(r"tests/[\w/]+\.py", arg)
            assert sources and tests, f"{where}: name the file it comes from and its test"
            for source in sources:
                assert (ROOT / source).is_file(), (where, source)
                name = Path(source).name
                assert all(name in (ROOT / t).read_text(encoding="utf-8") for t in tests), (
                    f"{where}: {tests} do not run {source}")
        else:
            pytest.fail(f"{where}: unknown marker {marker!r}")

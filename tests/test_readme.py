"""Every Python block of README.md and docs/*.md runs as written, each one alone (a reader
copies one block), or says in a marker on the line above it why and where else it runs
(README.md's blocks all run; its shell lines run in tests/test_doc_commands.py), and every
relative link of those documents resolves:

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
    assert sum(where.startswith("README.md") for where, _ in RUN) >= 2
    assert sum(where.startswith("docs/") for where, _ in RUN) >= 5


def test_the_readme_is_short_and_every_block_in_it_runs():
    """At most 300 lines; its python blocks run here as written (none is an excerpt), and its
    shell blocks hold only lines that tests/test_doc_commands.py runs (``dpfy`` lines) or dry-runs
    (``make`` targets)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    fenced = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    assert {lang for lang, _ in fenced} <= {"python", "bash"}, "a README block nothing runs"
    python = [where for where, _, _, _ in BLOCKS if where.startswith("README.md")]
    assert len(python) == sum(lang == "python" for lang, _ in fenced)
    assert all(where in dict(RUN) for where in python), "README python blocks all run here"
    for lang, code in fenced:
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            assert lang != "bash" or not line or line.split()[0] in ("dpfy", "make"), line


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    made ``-`` (fenced code skipped: its ``#`` lines are comments)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    """A link to a file names one that exists; a ``#anchor`` names a heading of its page."""
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        assert page.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
        if anchor and page.suffix == ".md":
            assert anchor in _anchors(page), f"{doc.relative_to(ROOT)}: no heading for {target}"


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

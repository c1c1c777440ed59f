"""The ``>>>`` examples in the docstrings of ``src/dpfy`` run and print what they show, and
every fully qualified cross-reference (``:func:`dpfy.x.y```) names something that exists.

One test per module that holds an example, found by reading the source files (nothing is
imported to collect them), so a new example is checked from the commit that adds it. A module
whose import needs an optional extra that is not installed is skipped, naming the missing
package; any other import error fails. Examples marked ``# doctest: +SKIP`` (a whole training
run) are left out by ``doctest`` itself.

Every example that prints a number derived from noise seeds its randomness, so the output is
fixed (no statistical check here).
"""

from __future__ import annotations

import doctest
import importlib
import io
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted((SRC / "dpfy").rglob("*.py")):
        if ">>>" not in path.read_text(encoding="utf-8"):
            continue
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    # The collection above reads files: if it found nothing, every test below would vanish.
    assert "dpfy.queries" in MODULES and "dpfy.training.step" in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] == "dpfy":
            raise
        pytest.skip(f"{name} needs the optional package {err.name!r}")
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in tests:
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} failing example(s)\n{out.getvalue()}"


_REFERENCE = re.compile(r":(?:class|func|meth|data|mod|attr|exc):`~?(dpfy(?:\.\w+)+)`")


def _resolves(reference: str) -> bool:
    parts = reference.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not err.name.startswith("dpfy"):
                return True  # behind an optional extra that is not installed: not judged
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_qualified_references_in_docstrings_resolve() -> None:
    # A name that moved (SampleSpec left dpfy.ledger) must not linger in the text.
    stale = sorted(
        f"{path.relative_to(SRC)}: {ref}"
        for path in (SRC / "dpfy").rglob("*.py")
        for ref in set(_REFERENCE.findall(path.read_text(encoding="utf-8")))
        if not _resolves(ref)
    )
    assert not stale, "references to names that do not exist:\n" + "\n".join(stale)

"""The public API is the list in docs/api.md, and nothing else declares itself public.

docs/api.md lists, per public module, the names of its ``__all__``; every other module under
``src/dpfy`` is internal and declares no ``__all__``. A package ``__init__`` imports only what
it lists (or a submodule loaded for its registrations), so no name is re-exported by accident.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
API_DOC = ROOT / "docs" / "api.md"
MAX_PUBLIC_NAMES = 150
# A deliberate re-export (``from x import Name as Name``), with the reason beside it in the code.
DELIBERATE_REEXPORTS = {"dpfy.features.accounting": {"PrivacyResult"}}


def _documented() -> dict[str, list[str]]:
    modules: dict[str, list[str]] = {}
    current = None
    for line in API_DOC.read_text().splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line)
        if heading:
            current = heading.group(1)
            modules[current] = []
            continue
        item = re.match(r"- `(\w+)` — \S", line)
        if item:
            assert current is not None, f"docs/api.md: {line!r} is under no module"
            modules[current].append(item.group(1))
    return modules


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text()) for p in (SRC / "dpfy").rglob("*.py")}


def _declares_all(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_the_public_api_is_small():
    documented = _documented()
    total = sum(len(names) for names in documented.values())
    assert 0 < total <= MAX_PUBLIC_NAMES, total
    stated = re.search(r"(\d+) names in (\d+) modules", API_DOC.read_text())
    assert stated and (int(stated.group(1)), int(stated.group(2))) == (total, len(documented))


@pytest.mark.parametrize("module", sorted(_documented()))
def test_every_listed_module_exports_exactly_its_list(module):
    names = _documented()[module]
    assert len(names) == len(set(names)), f"{module}: a name is listed twice in docs/api.md"
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(names), (
        f"{module}.__all__ and docs/api.md disagree: "
        f"only in __all__ {sorted(set(mod.__all__) - set(names))}, "
        f"only in the docs {sorted(set(names) - set(mod.__all__))}"
    )
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lists names it does not have: {missing}"


def test_no_other_module_declares_itself_public():
    documented = set(_documented())
    extra = sorted(m for m, tree in _sources().items() if _declares_all(tree))
    extra = [m for m in extra if m not in documented]
    assert not extra, f"only the modules in docs/api.md declare __all__: {extra}"


def test_packages_import_only_what_they_list():
    """A public package's ``__init__`` imports the names it lists and nothing else (a submodule
    imported for its registrations is marked ``# noqa: F401``); an internal package's
    ``__init__`` imports only submodules."""
    documented = _documented()
    for path in (SRC / "dpfy").rglob("__init__.py"):
        module = _module_name(path)
        lines = path.read_text().splitlines()
        listed = set(documented.get(module, []))
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpfy")):
                continue
            span = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            for alias in node.names:
                name = alias.asname or alias.name
                where = SRC / f"{node.module}.{alias.name}".replace(".", "/")
                submodule = where.is_dir() or where.with_suffix(".py").exists()
                if submodule and "noqa: F401" in span:
                    continue
                assert name in listed, f"{module} imports {name!r} without listing it"


def test_re_exports_are_deliberate():
    """``from x import Name as Name`` (an explicit re-export) appears only where intended."""
    found: dict[str, set[str]] = {}
    for module, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.asname == alias.name:
                        found.setdefault(module, set()).add(alias.name)
    assert found == DELIBERATE_REEXPORTS

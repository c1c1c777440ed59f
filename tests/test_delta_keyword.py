"""One spelling of delta across the native API: ``delta``.

``dpfy.make_private(delta=...)``, ``dpfy.hf.PrivacyArguments(delta=...)``, the accounting
functions and the command line (``--delta``) all say ``delta``. Only ``dpfy.opacus`` keeps
Opacus' ``target_delta``, where Opacus itself uses it (``make_private_with_epsilon``). A
ledger's recorded fact ``target_delta`` is a record field, not a keyword, and stays.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dpfy"


def _keywords(path: Path) -> set[str]:
    """Parameter names of every function, and field names of every class, in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        elif isinstance(node, ast.ClassDef):
            names.update(
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            )
    return names


def test_no_native_keyword_is_spelt_target_delta():
    native = [p for p in SRC.rglob("*.py") if "opacus" not in p.relative_to(SRC).parts]
    offenders = [str(p.relative_to(SRC)) for p in native if "target_delta" in _keywords(p)]
    assert offenders == [], f"spell it delta (as dpfy.make_private does): {offenders}"


def test_the_hugging_face_privacy_arguments_say_delta():
    from dpfy.hf.trainer import PrivacyArguments

    fields = {f.name for f in dataclasses.fields(PrivacyArguments)}
    assert "delta" in fields and "target_delta" not in fields
    assert PrivacyArguments(target_epsilon=3.0, delta=1e-6).delta == 1e-6

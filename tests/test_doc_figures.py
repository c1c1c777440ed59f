"""The accounting figures README.md and docs/*.md quote are what the code computes
now (``benchmarks/doc_figures.py``: accounting only, no training)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "benchmarks" /
                                                  "doc_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_figures"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


figures = _load()


@pytest.mark.parametrize("figure", figures.FIGURES, ids=lambda f: f"{f.doc}: {f.name}")
def test_a_quoted_figure_is_what_the_code_computes_now(figure):
    text, stale = figures.check(figure)
    assert stale is None, (
        f"{figure.doc} quotes a stale figure ({figure.name}):\n  quoted:   {stale}\n"
        f"  computed: {text}\n(python benchmarks/doc_figures.py prints them all)"
    )


def test_each_quoted_sentence_is_found_once_whatever_its_numbers():
    """A reworded sentence is reported as gone, not silently skipped."""
    for figure in figures.FIGURES:
        found = figure.pattern().findall(figures.doc_text(figure.doc))
        assert len(found) == 1, (figure.doc, figure.name, found)


def test_a_stale_figure_is_caught(monkeypatch):
    """The check compares numbers: the demo's epsilon quoted one digit off is stale."""
    demo = next(f for f in figures.FIGURES if f.name == "demo epsilon by PLD and RDP")
    text = figures.doc_text("README.md")
    current = demo.text()
    monkeypatch.setattr(figures, "doc_text", lambda doc: text.replace(
        current, current.replace("certifies 3.433", "certifies 3.436")))
    _, stale = figures.check(demo)
    assert stale is not None and "3.436" in stale

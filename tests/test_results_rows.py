"""Accuracy is quoted at the total epsilon of the procedure that produced it, tuning included.

What is parsed, precisely:

1. Every JSON file under ``benchmarks/results/`` (lists of rows or one row per file): a row
   (a dict) that carries ``hp_source`` must carry ``total_epsilon``; ``hp_source`` is one of
   ``accounted search``, ``transfer from <data set>``, ``rule``, ``unaccounted search``; an
   ``unaccounted search`` row has ``total_epsilon`` null (no total can be stated), an
   ``accounted search`` row a number at least its released run's own ``epsilon``.
2. :data:`HEADLINES`: the results JSON rows README.md quotes as headline accuracies. Each
   must carry both fields, with a number as ``total_epsilon`` (or null for a non-private
   reference) and an ``hp_source`` other than ``unaccounted search``.
3. README.md's "## Results" section: every table row that names ``epsilon`` and quotes a
   percentage (``<number> %``) must sit in a table whose header has a ``total epsilon``
   column. In such a table, each row links its details (the last column); every number of
   its ``total epsilon`` cell is the ``total_epsilon`` of a headline row of that link (to
   0.005), and every ``<number> %`` of its ``test accuracy`` cell is one of those rows'
   accuracies (to 0.005 points).
4. docs/results.md: a table whose header names ``epsilon`` and quotes accuracy (``accuracy``
   or ``%`` in the header) must have a ``total epsilon`` column; a paragraph outside tables
   that quotes a percentage with a decimal point (``98.88 %``) and names ``epsilon`` must say
   which: ``total epsilon`` or ``per-run epsilon``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = ("accounted search", "rule", "unaccounted search")
PERCENT = re.compile(r"(\d+(?:\.\d+)?) ?%")

#: README details link -> the JSON rows behind that headline (path, key of the accuracy,
#: percent per unit of that key: 100 for a fraction, 1 for a percentage).
HEADLINES: dict[str, list[tuple[str, str, float]]] = {
    "benchmarks/results/sentiment/README.md": [
        *((f"sentiment/bitfit-eps{e}.json", "test_accuracy", 100.0) for e in (1, 3, 8)),
        ("sentiment/total_eps.json", "mean", 1.0),
        ("sentiment/tuned_total/tuned_total_eps.json", "mean", 1.0)],
    "benchmarks/results/fedavg/README.md": [("fedavg/results.json", "final_accuracy", 100.0)],
    "benchmarks/results/images/README.md": [("images/total_eps3.json", "mean", 1.0)],
}


def _rows(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = data if isinstance(data, list) else [data]
    return [r for r in rows if isinstance(r, dict)]


def _valid_source(source: Any) -> bool:
    return source in SOURCES or (isinstance(source, str)
                                 and re.fullmatch(r"transfer from \S.*", source) is not None)


def test_every_labelled_results_row_is_consistent():
    labelled = 0
    for path in sorted(RESULTS.rglob("*.json")):
        if path.stat().st_size > 20_000_000:
            continue
        for row in _rows(path):
            if "hp_source" not in row:
                continue
            labelled += 1
            where = f"{path.relative_to(ROOT)} ({row.get('config') or row.get('name')})"
            assert _valid_source(row["hp_source"]), where
            assert "total_epsilon" in row, where
            if row["hp_source"] == "unaccounted search":
                assert row["total_epsilon"] is None, where
            if row["hp_source"] == "accounted search":
                assert row["total_epsilon"] >= row.get("epsilon", 0.0) - 1e-9, where
    assert labelled > 0


def _headline_rows(link: str) -> list[tuple[dict[str, Any], str, float]]:
    """The rows behind a headline; a row marked ``"private": false`` beside them (a
    non-private reference in the same file) is not one."""
    return [(row, key, percent) for name, key, percent in HEADLINES[link]
            for row in _rows(RESULTS / name) if row.get("private", True) is not False]


@pytest.mark.parametrize("link", sorted(HEADLINES))
def test_headline_rows_carry_a_total_epsilon_and_their_source(link):
    for row, _, _ in _headline_rows(link):
        assert _valid_source(row.get("hp_source")) and row["hp_source"] != "unaccounted search"
        total = row["total_epsilon"]
        assert total is None or (isinstance(total, float) and math.isfinite(total)), row
        if total is None:  # only a non-private reference has no total
            assert row.get("target_epsilon") is None and row.get("epsilon") is None


def _tables(lines: list[str]) -> list[list[list[str]]]:
    """Markdown tables as lists of rows of cells (header first, the --- row dropped)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _section(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    return lines[start:end]


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell.replace(",", ""))]


def test_readme_headlines_are_at_the_procedures_total_epsilon():
    tables = _tables(_section((ROOT / "README.md").read_text(encoding="utf-8"), "## Results"))
    totals = [t for t in tables if any("total epsilon" in h.lower() for h in t[0])]
    assert totals, "README's Results need a table with a 'total epsilon' column"
    for table in tables:
        if table in totals:
            continue
        for row in table[1:]:
            text = " ".join(row)
            assert not ("epsilon" in text.lower() and PERCENT.search(text)), (
                f"an accuracy at an epsilon outside a 'total epsilon' table: {text}")
    for table in totals:
        header = [h.lower() for h in table[0]]
        at_total = header.index("total epsilon")
        accuracy = next(i for i, h in enumerate(header) if "accuracy" in h)
        for row in table[1:]:
            link = re.search(r"\]\(([^)]+)\)", row[-1])
            assert link and link.group(1) in HEADLINES, f"no headline rows for {row[-1]}"
            rows = _headline_rows(link.group(1))
            stated = [r["total_epsilon"] for r, _, _ in rows if r["total_epsilon"] is not None]
            for value in _numbers(row[at_total]):
                assert any(abs(value - t) <= 0.005 for t in stated), (value, stated)
            measured = [percent * float(r[key]) for r, key, percent in rows]
            for match in PERCENT.finditer(row[accuracy]):
                value = float(match.group(1))
                assert any(abs(value - m) <= 0.005 for m in measured), (value, measured)


def test_docs_results_say_which_epsilon_an_accuracy_is_at():
    lines = (ROOT / "docs" / "results.md").read_text(encoding="utf-8").splitlines()
    for table in _tables(lines):
        header = " ".join(table[0]).lower()
        if "epsilon" in header and ("accuracy" in header or "%" in header):
            assert "total epsilon" in header, f"table without a total epsilon: {table[0]}"
    paragraph: list[str] = []
    for line in [*lines, ""]:
        if line.strip() and not line.startswith("|"):
            paragraph.append(line)
            continue
        text = " ".join(paragraph)
        paragraph = []
        if re.search(r"\d+\.\d+ ?%", text) and "epsilon" in text.lower():
            assert re.search(r"(total|per-run) epsilon", text.lower()), (
                f"docs/results.md: an accuracy at an epsilon that is not named total or "
                f"per-run: {text[:200]}")

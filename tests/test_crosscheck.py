"""The cross-check of a run directory: every field of every published file, edited in turn, is
named (file and field) by ``dpfy report`` and by ``dpfy audit``, and refused without a report
being written or replaced.

One tiny real ``dpfy train`` run (2 epochs of 2 steps, an EMA, a long-lived signing key) is
made once for the module; a model card is added beside it. The fields are walked from the
files themselves, so a field added to a published file later is covered without a change here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpfy import runs
from dpfy.cli import main
from dpfy.ledger import Ledger
from dpfy.ledger.trust import new_long_lived_key
from dpfy.report import build_report
from dpfy.report.card import privacy_section
from dpfy.report.crosscheck import RunDirMismatch, check_run_dir, file_sha256
from dpfy.training import recipes

TRAIN = ["train", "mnist", "--train-limit", "32", "--test-limit", "16", "--epochs", "2",
         "--batch-size", "8", "--seed", "0", "--threads", "1"]  # 8-row batches: one thread


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("crosscheck")
    new_long_lived_key(root / "org.key")
    out = root / "run"
    recipe = recipes.default_recipe

    def small(model: str | None = None) -> recipes.ImageRecipe:
        # the recipe's own knob: 8-row forward passes instead of 1,024 (a tiny, fast run)
        return dataclasses.replace(recipe(model), max_physical_batch_size=8)

    import torch

    threads = torch.get_num_threads()  # --threads sets it for the process: put it back after
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(recipes, "default_recipe", small)
        try:
            code = main([*TRAIN, "--out", str(out), "--signing-key", str(root / "org.key")])
        finally:
            torch.set_num_threads(threads)
    assert code == 0
    ledger = Ledger.load(out / "ledger.jsonl")
    card = privacy_section(build_report(ledger, delta=1e-5, method="pld",
                                        ledger_path=ledger.path), "ledger.jsonl")
    (out / "README.md").write_text("# A tiny model\n\n" + card, encoding="utf-8")
    return out


Keys = tuple[str | int, ...]


def _leaves(value: Any, keys: Keys = ()) -> Iterator[tuple[Keys, Any]]:
    """Every field of a JSON value: object keys recursively, every element of a list of
    objects, a list of plain values as its first element (or the list, when empty)."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, (*keys, key))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for i, item in enumerate(value):
            yield from _leaves(item, (*keys, i))
    elif isinstance(value, list) and value:
        yield (*keys, 0), value[0]
    else:
        yield keys, value


def _name(keys: Keys) -> str:
    """A field's name as the cross-check writes it: ``a.b[0].c``."""
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _edited(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 0.25
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 0.5
    if isinstance(value, dict):
        return {"edited": 1}
    return [*value, 1]


def _set(data: Any, keys: Keys, new: Any) -> None:
    for key in keys[:-1]:
        data = data[key]
    data[keys[-1]] = new


def _names(found: list[str], file: str, field: str) -> bool:
    """A mismatch names ``file`` and ``field`` (or a field inside it, or the object it is in)."""
    for line in found:
        head = line.split(": published")[0]
        if not head.startswith(f"{file} "):
            continue
        named = head[len(file) + 1:]
        if named == field or named.startswith((f"{field}.", f"{field}[")) or \
                field.startswith((f"{named}.", f"{named}[")):
            return True
    return False


def _edits(run: Path) -> Iterator[tuple[str, str, str]]:
    """(file, field, new text) for every field of every published file."""
    for name in ("report.json", "summary.json"):
        text = (run / name).read_text(encoding="utf-8")
        for keys, value in _leaves(json.loads(text)):
            data = json.loads(text)
            _set(data, keys, _edited(value))
            yield name, _name(keys), json.dumps(data, indent=2)
    text = (run / "run.toml").read_text(encoding="utf-8")
    for field, value in tomllib.loads(text).items():
        new = "fashion-mnist" if field == "dataset" else _edited(value)
        line = next(x for x in text.splitlines() if x.startswith(f"{field} ="))
        yield "run.toml", field, text.replace(line, f"{field} = {json.dumps(new)}")
    yield "run.toml", "delta", text + "delta = 0.0001\n"  # a field the file left at its default
    for name in ("report.md", "README.md"):
        text = (run / name).read_text(encoding="utf-8")
        lines = text.splitlines()
        first = lines.index("## Privacy") if name == "README.md" else 0
        for i in range(first, len(lines)):
            edited = [*lines[:i], lines[i] + " x", *lines[i + 1:]]
            yield name, f"line {i + 1 - first}", "\n".join(edited) + "\n"


def _restore(run: Path, copy: Path, name: str) -> None:
    shutil.copyfile(copy / name, run / name)
    for extra in run.glob("report-*"):  # a report written beside one of another head
        extra.unlink()


def test_the_run_directory_as_written_passes_and_the_model_hash_is_signed(run):
    ledger = Ledger.load(run / "ledger.jsonl")
    assert check_run_dir(run, ledger) == []
    end = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()
           if '"type":"end"' in x][-1]
    assert end["files"] == {"model.pt": file_sha256(run / "model.pt")}
    assert ledger.verification.complete
    model = bytearray((run / "model.pt").read_bytes())
    model[-1] ^= 1
    (run / "model.pt").write_bytes(bytes(model))
    try:
        found = [m.describe() for m in check_run_dir(run, ledger)]
        assert _names(found, "model.pt", "sha256")
    finally:
        model[-1] ^= 1
        (run / "model.pt").write_bytes(bytes(model))


def _named(err: str, file: str, field: str) -> bool:
    """The refusal names ``field`` of ``file`` (or, for an object, a field inside it)."""
    return re.search(rf"{re.escape(file)} {re.escape(field)}(: published|\.|\[)", err) is not None


def _refusal(call: Any) -> str:
    """The one-line refusal of ``call()`` ("" if it passed)."""
    try:
        call()
    except RunDirMismatch as err:
        return str(err)
    return ""


def test_every_edited_field_of_every_published_file_is_named_by_report_and_audit(run, tmp_path):
    # dpfy report and dpfy audit are runs.report_ledger and runs.audit_and_report
    copy = tmp_path / "kept"
    shutil.copytree(run, copy)
    ledger_path = run / "ledger.jsonl"
    unnamed: list[str] = []
    count = 0
    for name, field, text in _edits(run):
        count += 1
        (run / name).write_text(text, encoding="utf-8")
        try:
            err = _refusal(lambda: runs.report_ledger(ledger_path, figures=False))
            if name == "report.json" and field == "ledger_integrity.head":
                # kept, the new report written beside it (and saying so): not over it
                named = err == "" and len(list(run.glob("report-*.json"))) == 1
            else:
                named = _named(err, name, field) and "Nothing is written" in err
            if not named or (run / name).read_text(encoding="utf-8") != text:
                unnamed.append(f"dpfy report {name} {field}: {err[:300]}")
            err = _refusal(lambda: runs.audit_and_report(run, method="one-run", trials=4))
            if not _named(err, name, field):
                unnamed.append(f"dpfy audit {name} {field}: {err[:300]}")
        finally:
            _restore(run, copy, name)
    assert count > 150  # every field of report.json, summary.json, run.toml, both texts
    assert unnamed == [], "\n".join(unnamed)


def test_the_commands_refuse_with_one_line_and_exit_2(run, capsys):
    original = (run / "summary.json").read_text()
    data = json.loads(original)
    data["epsilon"] /= 2
    (run / "summary.json").write_text(json.dumps(data))
    kept = (run / "report.json").read_bytes()
    try:
        for args in (["report", str(run / "ledger.jsonl")], ["audit", str(run)]):
            assert main(args) == 2
            err = capsys.readouterr().err.strip()
            assert "summary.json epsilon: published" in err and "\n" not in err
        assert (run / "report.json").read_bytes() == kept
    finally:
        (run / "summary.json").write_text(original)


def test_a_torchrun_runs_configuration_is_checked_as_launched(tmp_path, monkeypatch):
    """run.toml of a sharded torchrun run, read back outside torchrun (the audit, a later
    `dpfy report`): validated under the launch its ledger records, not this process's."""
    from dpfy.config import RunConfig, as_launched
    from dpfy.report.crosscheck import _check_run_toml

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with as_launched(2):
        ran = RunConfig(dataset="mnist", shard=True, epochs=1)
    (tmp_path / "run.toml").write_text(ran.to_toml(), encoding="utf-8")
    ledger = Ledger()
    ledger.record_metadata(config=ran.to_dict(), workers=2)
    found = _check_run_toml(tmp_path / "run.toml", ledger)  # no launcher: one process's shard
    assert [m.published for m in found] == ["not a run configuration"]
    ledger.record_metadata(launcher="torchrun")
    assert _check_run_toml(tmp_path / "run.toml", ledger) == []

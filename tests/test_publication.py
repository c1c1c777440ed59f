"""A ``dpfy train`` run directory holds nothing computed from the private training data without
noise; the per-step diagnostics go to a separate directory only when asked for."""

from __future__ import annotations

import json
import re

import pytest

from dpfy import runs
from dpfy.config import RunConfig
from dpfy.publication import DIAGNOSTICS_FILE, DIAGNOSTICS_README

#: The figures the report draws, each from the ledger (and the test accuracies, public data).
LEDGER_FIGURES = {"epsilon_over_training", "epsilon_vs_delta", "accountant_comparison",
                  "attack_risk"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(text)


def _significant(text: str) -> int:
    mantissa = text.lstrip("-").split("e")[0].split("E")[0].replace(".", "").lstrip("0")
    return len(mantissa)


def _leaks(published: list[str], private: float) -> bool:
    """Whether a published number of 4 or more significant digits is ``private`` rounded."""
    for text in published:
        digits = _significant(text)
        if digits >= 4 and float(f"{private:.{digits}g}") == float(text):
            return True
    return False


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_image_chunks):
    base = tmp_path_factory.mktemp("publish")
    run = runs.train_and_report(RunConfig(
        dataset="mnist", out=base / "run", epochs=1, batch_size=64, train_limit=256,
        test_limit=64, seed=0, threads=1, private_diagnostics=base / "private",
    ))
    return run, base / "private"


def test_every_published_file_is_free_of_private_quantities(tiny_run):
    run, private_dir = tiny_run
    history = json.loads((private_dir / DIAGNOSTICS_FILE).read_text())["history"]
    steps = history["steps"]
    assert len(steps) == 4 and len({s["batch_size"] for s in steps}) > 1  # Poisson sizes vary
    public = {e["test_accuracy"] for e in history["epochs"]}
    public |= {e["model_test_accuracy"] for e in history["epochs"]}
    private = [s["loss"] for s in steps] + [s["accuracy"] for s in steps]
    private += [e["train_loss"] for e in history["epochs"]]
    private = [p for p in private if p not in public]  # a coincidence with public data
    sizes = [s["batch_size"] for s in steps]

    files = sorted(p for p in run.out_dir.rglob("*") if p.is_file())
    listed = run.report.publishing["safe_to_publish"]
    for path in files:
        rel = path.relative_to(run.out_dir).as_posix()
        assert rel in listed or rel.startswith("figures/"), rel
        if path.suffix not in (".json", ".jsonl", ".md", ".toml"):
            continue  # model.pt is the release itself; the figures are checked below
        text = path.read_text(encoding="utf-8")
        published = _numbers(text)
        for value in private:
            assert not _leaks(published, value), (rel, value)
        ints = [int(x) for x in published if re.fullmatch(r"\d+", x)]
        runs_of_sizes = [ints[i:i + len(sizes)] for i in range(len(ints))]
        assert sizes not in runs_of_sizes, rel  # the realised batch sizes, in order
    summary = json.loads((run.out_dir / "summary.json").read_text())
    assert set(summary["history"]) == {"epochs"}
    assert "train_loss" not in summary["history"]["epochs"][0]
    assert set(run.report.figures) <= LEDGER_FIGURES


def test_the_report_lists_what_to_publish_and_names_the_private_directory(tiny_run):
    run, private_dir = tiny_run
    markdown = (run.out_dir / "report.md").read_text()
    assert "## Publishing" in markdown and "`summary.json`" in markdown
    assert f"NOT covered by this guarantee, do not publish: `{private_dir}`" in markdown
    assert json.loads((run.out_dir / "report.json").read_text())["publishing"][
        "not_covered"] == str(private_dir)
    assert "NOT cover" in (private_dir / DIAGNOSTICS_README).read_text()
    assert "private_diagnostics" in (run.out_dir / "run.toml").read_text()  # in the config
    assert not any(p.name == DIAGNOSTICS_FILE for p in run.out_dir.rglob("*"))


def test_private_diagnostics_are_off_by_default_and_kept_apart(tmp_path):
    assert RunConfig().private_diagnostics is None
    out = tmp_path / "run"
    for inside in (out, out / "diagnostics", tmp_path):
        with pytest.raises(ValueError, match=r"^private_diagnostics must be a directory apart"):
            runs.train_and_report(RunConfig(dataset="mnist", out=out,
                                            private_diagnostics=inside))
    assert not out.exists()  # refused before anything was written
    with pytest.raises(TypeError, match=r"^private_diagnostics must be a path or None"):
        RunConfig(private_diagnostics=3)  # type: ignore[arg-type]



def test_a_second_train_on_one_out_is_one_line_and_exit_2(tmp_path, capsys):
    from dpfy.cli import main
    from dpfy.publication import claimed_run_dir

    out = tmp_path / "run"
    with claimed_run_dir(out):  # another `dpfy train` holds the directory
        code = main(["train", "mnist", "--epochs", "1", "--batch-size", "32", "--train-limit",
                     "64", "--test-limit", "32", "--seed", "0", "--out", str(out)])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, captured.err
    assert "out must be a run directory that no other run is writing" in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert list(out.iterdir()) == []  # the loser wrote nothing
    with claimed_run_dir(out):  # released: the directory can be claimed again
        pass


# ---------------------------------------------------------------------------------------------
# every field of every published file has a provenance: a release, public, or configuration
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validation_run(tmp_path_factory, small_image_chunks):
    """A --validation run: its accuracies are measured on held-out training images."""
    base = tmp_path_factory.mktemp("validation")
    return runs.train_and_report(RunConfig(
        dataset="mnist", out=base / "run", epochs=1, batch_size=64, train_limit=256,
        test_limit=64, seed=0, threads=1, validation=True,
    ))


@pytest.mark.parametrize("run_type", ["image", "validation"])
def test_every_published_field_is_a_release_public_or_configuration(
    tiny_run, validation_run, run_type
):
    from dpfy.publication import unclassified_fields

    run = tiny_run[0] if run_type == "image" else validation_run
    assert unclassified_fields(run.out_dir) == []


def test_a_validation_accuracy_is_never_published(validation_run):
    out = validation_run.out_dir
    accuracy = validation_run.test_accuracy  # on held-out training images: private
    assert accuracy is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] is None
    assert all(e["test_accuracy"] is None and e["model_test_accuracy"] is None
               for e in summary["history"]["epochs"])
    meta = validation_run.model.ledger.metadata
    assert "test_accuracy" not in meta and meta["accuracy_by_step"] == []
    assert meta["model_accuracy_by_step"] == []
    assert "test_accuracy" not in json.loads((out / "report.json").read_text())["utility"]

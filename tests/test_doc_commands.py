"""The ``dpfy`` command lines in the shell blocks of README.md and docs/*.md, as written.

Accounting commands (``epsilon``, ``calibrate``, ``plan``) run to the end and must exit 0.
``dpfy train`` lines (also those that torchrun starts with ``--no-python``) run up to the
point where training would start: every option is parsed and the run's configuration is built
and checked (``RunConfig``), then the test stops it; training itself is the recipes' tests'.
``dpfy report LEDGER`` lines run to the end on a small ledger written at LEDGER (the training
run that would have written it is the line above them). ``make TARGET`` lines must name a
Makefile target that ``make -n`` (a dry run: nothing is built or trained) accepts. Every other
line is listed in :data:`NOT_RUN` with the reason, so a new kind of line fails until someone
decides how it is checked.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dpfy.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_TO_THE_END = ("epsilon", "calibrate", "plan")
#: Lines that are not run here, by their first word(s), and why.
NOT_RUN = {
    "torchrun": "a script on several machines (docs/examples/torchrun_train.py runs under "
                "torchrun in tests/training/test_torchrun.py)",
    "srun": "SLURM",
    "head=$(scontrol": "SLURM",
}


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, words) of every command line of every shell block."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"^```(?:bash|sh|console)\n(.*?)^```", text, re.S | re.M):
            for line in m.group(1).replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line and not line.startswith("#"):
                    where = f"{doc.relative_to(ROOT)}: {' '.join(line.split())}"
                    found.append((where, shlex.split(line)))
    return found


def _dpfy_words(words: list[str]) -> list[str] | None:
    """The ``dpfy`` command of a line: the line itself, or what torchrun starts."""
    if words[0] == "dpfy":
        return words[1:]
    if words[0] == "torchrun" and "--no-python" in words:
        rest = words[words.index("--no-python") + 1:]
        return rest[1:] if rest and rest[0] == "dpfy" else None
    return None


def _once(lines: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Each distinct command once (README.md repeats a few of docs/cli.md's), where it is first."""
    seen: dict[tuple[str, ...], tuple[str, list[str]]] = {}
    for where, args in lines:
        seen.setdefault(tuple(args), (where, args))
    return list(seen.values())


LINES = command_lines()
DPFY = _once([(w, args) for w, words in LINES if (args := _dpfy_words(words)) is not None
              and args[0] != "report"])
REPORT = _once([(w, args) for w, words in LINES if (args := _dpfy_words(words)) is not None
                and args[0] == "report"])
MAKE = [(w, words[1:]) for w, words in LINES if words[0] == "make"]


def _run(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


def test_the_documents_have_command_lines():
    assert len(DPFY) >= 15
    assert {args[0] for _, args in DPFY} >= {"epsilon", "calibrate", "plan", "train"}


@pytest.mark.parametrize(("where", "args"), DPFY, ids=[w for w, _ in DPFY])
def test_a_documented_dpfy_line_runs_as_written(where, args, tmp_path, monkeypatch):
    from dpfy import runs
    from dpfy.config import RunConfig

    monkeypatch.chdir(tmp_path)
    if args[0] in RUN_TO_THE_END:
        code, printed = _run(args)
        assert code == 0, f"{where}\n{printed}"
        return
    assert args[0] == "train", f"{where}: decide how this command is checked"
    seen: list[RunConfig] = []

    def stop(config: RunConfig, **kwargs: object) -> None:
        seen.append(config)
        raise ValueError("stopped before training")

    monkeypatch.setattr(runs, "train_launched", stop)
    if "--config" in args:  # the run directory of an earlier `dpfy train mnist --out runs/mnist`
        path = tmp_path / args[args.index("--config") + 1]
        path.parent.mkdir(parents=True)
        path.write_text(RunConfig(dataset="mnist", out=str(path.parent)).to_toml(),
                        encoding="utf-8")
    code, printed = _run(args)
    assert seen and "stopped before training" in printed, f"{where}\n{printed}"
    assert code == 2 and "Traceback" not in printed
    if "--out" in args:
        assert str(seen[0].out) == args[args.index("--out") + 1]


@pytest.mark.parametrize(("where", "args"), REPORT, ids=[w for w, _ in REPORT])
def test_a_documented_report_line_runs_on_a_ledger(where, args, tmp_path, monkeypatch):
    from dpfy.ledger import Ledger
    from dpfy.sampling import SampleSpec

    monkeypatch.chdir(tmp_path)
    path = tmp_path / args[1]
    path.parent.mkdir(parents=True)
    ledger = Ledger(path, fsync=False)  # 10 Poisson steps of DP-SGD, as a training run writes
    ledger.record_metadata(clip_norm=1.0, delta=1e-5)
    spec = SampleSpec("poisson", dataset_size=60_000, sampling_rate=256 / 60_000)
    for step in range(10):
        sid = ledger.record_sample(spec, step=step)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.1, name="gradient")
    ledger.close()
    import dpfy.report  # figures off: drawing them is most of the time (test_report.py draws them)

    write_report = dpfy.report.write_report
    monkeypatch.setattr(dpfy.report, "write_report",
                        lambda *a, **k: write_report(*a, **{**k, "figures": False}))
    code, printed = _run(args)
    assert code == 0 and "epsilon" in printed, f"{where}\n{printed}"


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
@pytest.mark.parametrize(("where", "targets"), MAKE, ids=[w for w, _ in MAKE])
def test_a_documented_make_line_names_targets_that_dry_run(where, targets):
    assert targets and set(targets) <= _makefile_targets(), f"{where}: not a Makefile target"
    done = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"{where}\n{done.stdout}{done.stderr}"


def test_every_other_line_is_listed_with_its_reason():
    for where, words in LINES:
        if _dpfy_words(words) is not None or words[0] == "make":
            continue
        line = " ".join(words)
        assert any(line.startswith(key) for key in NOT_RUN), f"{where}: run it, or say why not"

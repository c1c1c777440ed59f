"""Every bad input of the careless-user/attacker review (docs: the CLI and API promise).

CLI: exit code 2, exactly one line on stderr naming the parameter, no traceback, nothing
written in the (empty, temporary) working directory. API: ValueError/TypeError naming the
parameter, and a refused release writes no ledger entry. Cases that would train or extract
features are refused before any of that work starts, so the table runs in seconds.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest

from dpfy.cli import main

BIG = "1" + "0" * 400
EPS = ["epsilon", "--dataset-size", "1000", "--batch-size", "10", "--noise-multiplier", "1.0",
       "--delta", "1e-5"]
CAL = ["calibrate", "--target-epsilon", "3", "--dataset-size", "1000", "--batch-size", "10",
       "--delta", "1e-5"]
PLAN = ["plan", "--dataset-size", "60000", "--target-epsilon", "3", "--delta", "1e-5",
        "--max-steps", "200"]
TRAIN = ["train", "mnist", "--epochs", "1", "--batch-size", "32", "--train-limit", "64",
         "--out", "run"]


def _eps(**opts: str) -> list[str]:
    """``dpfy epsilon`` of the review with some options replaced or added."""
    base = {"--dataset-size": "1000", "--batch-size": "10", "--noise-multiplier": "1.0",
            "--delta": "1e-5"}
    base.update(opts)
    return ["epsilon", *[x for kv in base.items() for x in kv]]


SPEC = {"sampler": "poisson", "dataset_size": 1000, "sampling_rate": 0.01,
        "adjacency": "add_or_remove", "unit": "example"}


def _ledger_lines(meta: dict | None = None, noise_std: object = 1.1) -> list[str]:
    lines = [{"type": "header", "format": "dpfy-ledger", "version": 1}]
    for sid in range(3):
        lines.append({"type": "sample", "sample_id": sid, "epoch": 0, "spec": SPEC})
        lines.append({"type": "sum_query", "sample_id": sid, "sensitivity": 1.0,
                      "noise_std": noise_std, "name": "grad"})
    info = {"delta": 1e-5, "target_epsilon": 3.0} if meta is None else meta
    lines.append({"type": "metadata", "info": info})
    return [json.dumps(x) for x in lines]


DEEP = "[" * 100_000 + "]" * 100_000
PREPARED: dict[str, bytes] = {
    "binary": bytes(range(249, 256)) + b"\x00\x01" * 50,
    "deep_nesting": ("\n".join(_ledger_lines()[:1]) + "\n" + DEEP + "\n").encode(),
    "deep_nesting_meta": (
        "\n".join(_ledger_lines()[:-1])
        + '\n{"type": "metadata", "info": {"delta": 1e-5, "x": ' + DEEP + "}}\n"
    ).encode(),
    "string_noise": ("\n".join(_ledger_lines(noise_std="1.1")) + "\n").encode(),
    "meta_delta_str": ("\n".join(_ledger_lines({"delta": "abc"})) + "\n").encode(),
    "meta_delta_list": ("\n".join(_ledger_lines({"delta": [1e-5]})) + "\n").encode(),
    "meta_delta_null": ("\n".join(_ledger_lines({"delta": None})) + "\n").encode(),
    "meta_accuracy_by_step_str": (
        "\n".join(_ledger_lines({"delta": 1e-5, "accuracy_by_step": "abc"})) + "\n"
    ).encode(),
    "meta_accuracy_by_step_bad": (
        "\n".join(_ledger_lines({"delta": 1e-5, "accuracy_by_step": [[1, 0.5], [2]]})) + "\n"
    ).encode(),
    "meta_utility_list": (
        "\n".join(_ledger_lines({"delta": 1e-5, "utility": [1, 2]})) + "\n"
    ).encode(),
    "good": ("\n".join(_ledger_lines()) + "\n").encode(),
}
NON_UTF8 = os.fsdecode(b"led\xff\xfeger.jsonl")

# (review id, argv, prepared ledger or None, parameter the message must name)
CLI_CASES = [
    (5, _eps(**{"--dataset-size": BIG, "--steps": "100"}), None, "dataset_size"),
    (13, _eps(**{"--batch-size": BIG, "--steps": "100"}), None, "batch_size"),
    (19, _eps(**{"--noise-multiplier": "inf", "--steps": "100"}), None, "noise_multiplier"),
    (21, _eps(**{"--noise-multiplier": "1e308", "--steps": "100"}), None, None),
    (25, _eps(**{"--noise-multiplier": "1e400", "--steps": "100"}), None, "noise_multiplier"),
    (40, _eps(**{"--delta": "5e-324", "--steps": "100"}), None, None),
    (47, _eps(**{"--steps": BIG}), None, "steps"),
    (53, _eps(**{"--epochs": "inf"}), None, "epochs"),
    (56, _eps(**{"--epochs": "1e400"}), None, "epochs"),
    (58, _eps(**{"--epochs": "1e308"}), None, "epochs"),
    (66, _eps(**{"--steps": "100", "--max-batch-size": BIG}), None, "max_batch_size"),
    (82, _eps(**{"--steps": "10", "--samples": BIG, "--sampler": "balls-and-bins"}), None,
     "samples"),
    (90, _eps(**{"--steps": "10", "--seed": "-1", "--sampler": "balls-and-bins",
                 "--samples": "1000"}), None, "seed"),
    (98, _eps(**{"--noise-multiplier": "1e-300", "--steps": "100"}), None, None),
    (103, ["calibrate", "--target-epsilon", "inf", *CAL[3:], "--steps", "100"], None,
     "target_epsilon"),
    (109, ["calibrate", "--target-epsilon", "1e400", *CAL[3:], "--steps", "100"], None,
     "target_epsilon"),
    # At delta 1e-5 the PLD certifies epsilon 0 with z ~ 4000 (a valid answer); at 1e-10 the
    # target is out of reach and must be refused by name.
    (111, ["calibrate", "--target-epsilon", "1e-300", *CAL[3:7], "--delta", "1e-10",
           "--steps", "100"], None, "target_epsilon"),
    (119, [*CAL[:-1], "1e-300", "--steps", "100"], None, None),  # RDP: z = 5.27
    (122, [*CAL[:4], BIG, *CAL[5:], "--steps", "100"], None, "dataset_size"),
    (125, [*CAL, "--steps", BIG], None, "steps"),
    (135, [*CAL, "--steps", "100", "--seed", "-5", "--sampler", "balls-and-bins",
           "--samples", "100"], None, "seed"),
    (141, ["plan", "--dataset-size", BIG, *PLAN[3:]], None, "dataset_size"),
    (146, [*PLAN[:3], "--target-epsilon", "inf", *PLAN[5:]], None, "target_epsilon"),
    (148, [*PLAN[:3], "--target-epsilon", "1e308", *PLAN[5:]], None, "target_epsilon"),
    (157, [*PLAN[:-1], BIG], None, "max_steps"),
    (161, [*PLAN, "--max-examples-processed", BIG], None, "max_examples_processed"),
    (164, [*PLAN, "--plot", "/proc/version/sub"], None, "plot"),
    (165, [*PLAN, "--plot", "afile/sub"], None, "plot"),
    (166, [*PLAN, "--plot", "afile"], None, "plot"),
    (167, [*PLAN, "--plot", ""], None, "plot"),
    (175, [*TRAIN, "--target-epsilon", "inf"], None, "target_epsilon"),
    (181, [*TRAIN, "--target-epsilon", "1e400"], None, "target_epsilon"),
    (183, [*TRAIN, "--target-epsilon", "1e-300"], None, "target_epsilon"),
    (195, ["train", "mnist", "--epochs", BIG, *TRAIN[4:]], None, "epochs"),
    (200, [*TRAIN[:4], "--batch-size", BIG, *TRAIN[6:]], None, "batch_size"),
    (204, [*TRAIN, "--learning-rate", "inf"], None, "learning_rate"),
    (209, [*TRAIN, "--clip-norm", "inf"], None, "clip_norm"),
    (211, [*TRAIN, "--clip-norm", "1e308"], None, "clip_norm"),
    (212, [*TRAIN, "--seed", "-1"], None, "seed"),
    (214, [*TRAIN, "--seed", BIG], None, "seed"),
    (218, [*TRAIN[:6], "--train-limit", BIG, *TRAIN[8:]], None, "train_limit"),
    (220, [*TRAIN, "--threads", "0"], None, "threads"),
    (221, [*TRAIN, "--threads", "-1"], None, "threads"),
    (223, [*TRAIN, "--threads", "100000"], None, "threads"),
    (224, [*TRAIN[:-1], "afile"], None, "out"),
    (226, [*TRAIN[:-1], ""], None, "out"),
    (227, [*TRAIN[:-1], "/proc/nope"], None, "out"),
    (233, ["report", "ledger.jsonl"], "binary", "ledger_path"),
    (238, ["report", "ledger.jsonl"], "deep_nesting", "ledger_path"),
    (239, ["report", "ledger.jsonl"], "deep_nesting_meta", "ledger_path"),
    (244, ["report", "ledger.jsonl"], "string_noise", "noise_std"),
    (250, ["report", "ledger.jsonl"], "meta_delta_str", "delta"),
    (251, ["report", "ledger.jsonl"], "meta_delta_list", "delta"),
    (255, ["report", "ledger.jsonl"], "meta_delta_null", "delta"),
    (256, ["report", "ledger.jsonl"], "meta_accuracy_by_step_str", "accuracy_by_step"),
    (257, ["report", "ledger.jsonl"], "meta_accuracy_by_step_bad", "accuracy_by_step"),
    (259, ["report", "ledger.jsonl"], "meta_utility_list", "utility"),
    (268, ["report", NON_UTF8], "good", "ledger_path"),
    (288, ["report", "ledger.jsonl", "--out", "afile"], "good", "out"),
    (289, ["report", "ledger.jsonl", "--out", "afile/sub"], "good", "out"),
    (290, ["report", "ledger.jsonl", "--out", "/proc/nope"], "good", "out"),
    (300, ["features", "rotten-tomatoes", "--target-epsilon", "inf", "--out", "fr"], None,
     "target_epsilon"),
    (310, ["features", "rotten-tomatoes", "--limit", BIG, "--out", "fr"], None, "limit"),
    (312, ["features", "rotten-tomatoes", "--seed", "-1", "--limit", "50", "--out", "fr"], None,
     "seed"),
]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory holding only ``afile``; training and feature extraction
    raise if a case reaches them (every case must be refused before that work)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused case reached training or feature extraction")

    import dpfy.runs
    from dpfy.training import trainer

    monkeypatch.setattr(trainer.PrivateTrainer, "fit", no_work)
    monkeypatch.setattr(dpfy.runs, "_feature_data", no_work)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "prepared", "name"),
    [pytest.param(a, p, n, id=f"{i}-{a[0]}") for i, a, p, n in CLI_CASES],
)
def test_cli_bad_input(workdir: Path, capsys: pytest.CaptureFixture[str], argv, prepared, name):
    if prepared is not None:
        target = argv[1]
        with open(os.fsencode(target), "wb") as f:
            f.write(PREPARED[prepared])
    before = _tree(workdir)
    code = main([*argv, "--json"] if name is None else argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    assert _tree(workdir) == before, "a refused (or accounting-only) command wrote files"
    if name is None:  # the math allows a correct answer: a finite or infinite epsilon, no crash
        assert code == 0, err
        result = json.loads(out)
        assert result["epsilon"] == "inf" or result["epsilon"] >= 0.0
        return
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert name in line or "--" + name.replace("_", "-") in line, line


# ---------------------------------------------------------------------------------------------
# the 14 API probes
# ---------------------------------------------------------------------------------------------
def _poisson(z: float = 1.0):
    from dpfy import events as ev

    return ev.SelfComposed(ev.PoissonSampled(0.01, ev.Gaussian(z)), 100)


def _release(per_example, noise_std: float = 1.1):
    """Release through a GaussianSumQuery; the ledger must gain no entry when refused."""
    from dpfy.ledger import Ledger
    from dpfy.queries import GaussianSumQuery
    from dpfy.randomness import Randomness
    from dpfy.sampling import SampleSpec

    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=1000, sampling_rate=0.01))
    before = len(ledger)
    try:
        GaussianSumQuery(1.0, noise_std).release(
            per_example, ledger=ledger, sample_id=sid, randomness=Randomness(seed=0)
        )
    finally:
        assert len(ledger) == before, "a refused release wrote a ledger entry"


def _tensors(**shapes):
    import torch

    return {k: (torch.randn(*v) if isinstance(v, tuple) else v) for k, v in shapes.items()}


def _api_cases():
    import torch

    from dpfy import accounting
    from dpfy import events as ev
    from dpfy.accounting.calibrate import calibrate_noise_multiplier
    from dpfy.ledger import Ledger
    from dpfy.sampling import SampleSpec, make_sampler

    def record_huge():
        ledger = Ledger()
        sid = ledger.record_sample(SampleSpec("poisson", dataset_size=10, sampling_rate=0.5))
        ledger.record_sum_query(sid, sensitivity=10**400, noise_std=1)

    # (id, call, parameter the error names or None when a correct number is expected)
    return [
        ("gaussian_huge_noise", lambda: accounting.epsilon(ev.Gaussian(1e308), 1e-5), None),
        ("gaussian_tiny_noise", lambda: accounting.epsilon(ev.Gaussian(1e-300), 1e-5), None),
        ("count_huge", lambda: ev.SelfComposed(ev.Gaussian(1), 10**400), "count"),
        ("method_none", lambda: accounting.epsilon(_poisson(), 1e-5, method=None), "method"),
        ("pld_tiny_delta", lambda: accounting.epsilon(_poisson(), 5e-324, "pld"), "delta"),
        ("auto_tiny_delta", lambda: accounting.epsilon(_poisson(), 5e-324, "auto"), None),
        ("calibrate_inf_target", lambda: calibrate_noise_multiplier(
            lambda z: _poisson(z), math.inf, 1e-5), "target_epsilon"),
        ("sensitivity_huge", record_huge, "sensitivity"),
        ("mismatched_batch", lambda: _release(_tensors(a=(8, 3), b=(7, 2))), "per_example"),
        ("zero_dim", lambda: _release({"a": torch.tensor(1.0)}), "per_example"),
        ("int64", lambda: _release({"a": torch.ones(8, 3, dtype=torch.int64)}), "per_example"),
        ("empty", lambda: _release({}), "per_example"),
        ("noise_std_tiny", lambda: _release(_tensors(a=(8, 3)), noise_std=1e-300), "noise_std"),
        ("sampler_huge", lambda: make_sampler("poisson", 10**400, 5), "dataset_size"),
    ]


API_IDS = [
    "gaussian_huge_noise", "gaussian_tiny_noise", "count_huge", "method_none", "pld_tiny_delta",
    "auto_tiny_delta", "calibrate_inf_target", "sensitivity_huge", "mismatched_batch",
    "zero_dim", "int64", "empty", "noise_std_tiny", "sampler_huge",
]


@pytest.mark.parametrize("case", API_IDS)
def test_api_bad_input(case):
    call, name = {c[0]: c[1:] for c in _api_cases()}[case]
    if name is None:  # a correct number: huge noise ~0, tiny noise inf, RDP at a tiny delta
        result = call()
        assert result.epsilon >= 0.0 and not math.isnan(result.epsilon)
        if case == "gaussian_huge_noise":
            assert result.epsilon < 1e-4
        if case == "gaussian_tiny_noise":
            assert result.epsilon == math.inf
        return
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert name in str(info.value)


# ---------------------------------------------------------------------------------------------
# atomic report writes and the crash-cut delta default
# ---------------------------------------------------------------------------------------------
def test_report_write_is_atomic_on_a_full_disk(workdir, capsys, monkeypatch):
    from dpfy.report import write as report_write

    Path("ledger.jsonl").write_bytes(PREPARED["good"])
    before = _tree(workdir)
    calls = []

    def full_disk(path, text):
        calls.append(path.name)
        if path.name == "report.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        path.write_text(text, encoding="utf-8")

    monkeypatch.setattr(report_write, "_write_text", full_disk)
    code = main(["report", "ledger.jsonl"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "out" in lines[0] and "No space left" in lines[0], err
    assert calls == ["report.md", "report.json"]  # report.md was written, then removed
    assert _tree(workdir) == before  # no report.md, report.json, figures/ or temp folder
    monkeypatch.undo()
    monkeypatch.chdir(workdir)
    assert main(["report", "ledger.jsonl", "--no-figures"]) == 0
    assert {"report.md", "report.json"} <= _tree(workdir)


@pytest.mark.parametrize(
    ("meta", "expected_delta", "needle"),
    [
        ({"target_delta": 1e-6}, 1e-6, "recorded target delta"),
        ({"dataset": "mnist"}, 1e-4, "1/(10 N)"),  # N = 1000 from the sample specs
    ],
)
def test_report_on_a_crash_cut_ledger_defaults_delta(workdir, capsys, meta, expected_delta,
                                                     needle):
    Path("ledger.jsonl").write_text("\n".join(_ledger_lines(meta)) + "\n")
    code = main(["report", "ledger.jsonl", "--json", "--no-figures"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["delta"] == pytest.approx(expected_delta)
    assert any(needle in a for a in report["assumptions"])
    assert needle in Path("report.md").read_text()


# ---------------------------------------------------------------------------------------------
# a ledger the command may not read
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["first look", "while loading"])
def test_an_unreadable_ledger_is_one_line(workdir, capsys, monkeypatch, where):
    import builtins

    import dpfy._validate

    path = workdir / "ledger.jsonl"
    path.write_text("\n".join(_ledger_lines()) + "\n")
    real_open = builtins.open

    def denied(file, *args, **kwargs):  # root reads any file: chmod 000 cannot show it
        if isinstance(file, str | os.PathLike) and os.path.abspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: denied(str(self), *a, **k))
    if where == "while loading":  # the first look passes, the ledger's own read is refused
        monkeypatch.setattr(dpfy._validate, "open", real_open, raising=False)
    before = _tree(workdir)
    code = main(["report", str(path), "--delta", "1e-5"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Permission denied" in lines[0] and "ledger" in lines[0]
    assert lines[0].startswith("dpfy: error: ledger_path must be a readable file" if where ==
                               "first look" else "dpfy: error: cannot use"), lines[0]
    assert _tree(workdir) == before


def test_a_huge_ledger_line_is_refused_without_reading_it(workdir, capsys):
    import tracemalloc

    from dpfy.ledger import Ledger
    from dpfy.ledger.chain import LedgerFormatError

    path = workdir / "ledger.jsonl"
    with open(path, "wb") as f:
        f.write((_ledger_lines()[0] + "\n").encode())
        f.truncate(2**30)  # 1 GiB, sparse: a second line of zero bytes and no newline
    tracemalloc.start()
    try:
        with pytest.raises(LedgerFormatError, match=r"line 2: a line must be at most 16777216"):
            Ledger.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # one capped line read, not the gigabyte
    code = main(["report", str(path), "--delta", "1e-5"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err + out, err
    assert "a line must be at most" in lines[0]

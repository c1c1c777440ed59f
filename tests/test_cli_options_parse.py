"""``dpfy train`` / ``dpfy tune`` parsing: the options given on the command line reach the
RunConfig the command runs, whatever typer (and whichever copy of click) builds the command.

Nothing trains: the function the command hands its RunConfig to is replaced by one that
records it and stops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpfy import runs, tuning_runs
from dpfy.cli import main
from dpfy.config import RunConfig


class _Stop(Exception):
    """Raised by the stand-in for the training entry point once it has the RunConfig."""


def _capture(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[RunConfig]:
    seen: list[RunConfig] = []

    def stand_in(config: RunConfig, *args: Any, **kwargs: Any) -> None:
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(module, name, stand_in)
    return seen


def _train_config(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> RunConfig:
    seen = _capture(monkeypatch, runs, "train_launched")
    with pytest.raises(_Stop):
        main(["train", *args])
    (config,) = seen
    return config


def test_train_options_reach_the_run_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "run"
    config = _train_config(monkeypatch, [
        "rotten-tomatoes", "--device", "cpu", "--seed", "0", "--epochs", "1",
        "--target-epsilon", "8", "--delta", "1e-6", "--batch-size", "32", "--bias-only",
        "--train-limit", "256", "--out", str(out),
    ])
    assert config.dataset == "rotten-tomatoes"
    assert config.device == "cpu"
    assert config.seed == 0
    assert config.epochs == 1
    assert config.target_epsilon == 8.0
    assert config.delta == 1e-6
    assert config.batch_size == 32
    assert config.bias_only is True
    assert config.train_limit == 256
    assert Path(str(config.out)) == out


def test_train_options_left_out_keep_the_config_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    toml = tmp_path / "run.toml"
    toml.write_text('dataset = "mnist"\nepochs = 5\ntarget_epsilon = 2.0\nseed = 7\n',
                    encoding="utf-8")
    config = _train_config(monkeypatch, ["--config", str(toml), "--target-epsilon", "8"])
    assert config.target_epsilon == 8.0  # given: overrides the file
    assert config.epochs == 5 and config.seed == 7  # left out: the file's values


def test_tune_options_reach_the_base_run_config(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch):
    seen = _capture(monkeypatch, tuning_runs, "tune_and_report")
    space = tmp_path / "space.toml"
    space.write_text("[learning_rate]\nlog_uniform = [1e-4, 1e-2]\n", encoding="utf-8")
    with pytest.raises(_Stop):
        main(["tune", "mnist", "--space", str(space), "--epochs", "1", "--seed", "3",
              "--target-epsilon", "5"])
    (config,) = seen
    assert (config.epochs, config.seed, config.target_epsilon) == (1, 3, 5.0)


def test_method_choice_is_checked_in_one_line(capsys: pytest.CaptureFixture[str]):
    code = main(["epsilon", "-n", "60000", "-b", "256", "-z", "1.1", "--delta", "1e-5",
                 "--epochs", "1", "--method", "bogus"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("dpfy: error:") and "'bogus' is not one of 'auto'" in err
    assert "Traceback" not in err and err.count("\n") == 1

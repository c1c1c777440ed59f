"""dpfy train's RunConfig: validated once, read from a TOML file, recorded with the run."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from tiny_encoder import tiny_minilm_encoder

from dpfy import cli, runs
from dpfy.cli import main
from dpfy.config import RunConfig
from dpfy.ledger import Ledger


def test_defaults_are_valid_and_the_cli_shows_the_same_defaults():
    config = RunConfig()
    assert config.sampler_kind == "poisson" and not config.text
    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    shown = {
        name: p.default for name, p in inspect.signature(cli.train).parameters.items()
        if name in fields and name != "dataset"  # the positional argument
    }
    # every field is a `dpfy train` option, and its shown default is the field's
    assert set(shown) | {"dataset"} == set(fields)
    for name, default in shown.items():
        value = getattr(default, "value", default)
        assert value == fields[name], name


def test_the_option_tables_of_the_configuration_are_the_recipes_own():
    """The configuration holds the names (it imports no recipe); each recipe builds from them."""
    from dpfy import config
    from dpfy.training import precision, recipes, text

    assert config.IMAGE_MODELS == tuple(name.replace("_", "-") for name in recipes.MODELS)
    for name in config.IMAGE_MODELS:
        assert recipes.default_recipe(name).model == name.replace("-", "_")
    assert set(config.LORA_TARGETS) == {"attention", "all-linear"}
    assert text.text_model_name(RunConfig(dataset=config.TEXT_DATASETS[0])) == "minilm"
    assert [precision.check_precision(p) for p in config.PRECISIONS] == list(config.PRECISIONS)
    with pytest.raises(ValueError, match="precision must be one of {fp32, bf16, fp16}"):
        RunConfig(precision="fp8")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:<index>'"):
        RunConfig(device="tpu")


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"epochs": 0}, "epochs must be"),
        ({"delta": 1.0}, "delta must be"),
        ({"dataset": "cifar"}, "dataset must be one of"),
        ({"lora": True}, "lora applies only to the text datasets"),
        ({"unit": "user"}, "users is missing"),
        ({"shard": True}, "shard needs workers >= 2"),
        ({"audit_guesses": 5}, "audit_guesses needs audit_canaries"),
        ({"mechanism": "laplace"}, "mechanism must be one of"),
        ({"tan_steps": 50, "epochs": 3}, "tan_steps chooses batch_size and epochs"),
        ({"tan_steps": 50, "sampler": "shuffle"}, "tan_steps plans Poisson DP-SGD"),
        ({"tan_steps": 0}, "tan_steps must be"),
        ({"attribution_check": -1}, "attribution_check must be"),
        ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:<index>'"),
        ({"device": "cuda:99"}, r"device='cuda:99' needs CUDA device 99, but this process"),
    ],
)
def test_bad_values_are_refused_in_one_line(changes, needle):
    with pytest.raises(ValueError, match=needle) as info:
        RunConfig(**changes)
    assert "\n" not in str(info.value)


def test_toml_round_trip_and_unknown_keys(tmp_path: Path):
    config = RunConfig(dataset="fashion-mnist", epochs=3, learning_rate=0.5, seed=7,
                       out=tmp_path / "r", precision="bf16")
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml(), encoding="utf-8")
    assert RunConfig.from_file(path) == config
    assert RunConfig.from_file(path, epochs=5).epochs == 5  # overrides win
    path.write_text('dataset = "mnist"\nlearning-rate = 0.1\nepoch = 2\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown option\(s\) epoch; valid: .*epochs"):
        RunConfig.from_file(path)
    path.write_text("dataset = \n", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid TOML"):
        RunConfig.from_file(path)


def test_options_given_on_the_command_line_override_the_file(tmp_path, monkeypatch):
    seen: list[RunConfig] = []

    def fake(config: RunConfig, **kw: object) -> None:
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setattr(runs, "train_and_report", fake)
    path = tmp_path / "run.toml"
    path.write_text('dataset = "fashion-mnist"\nepochs = 4\nclip_norm = 0.5\n', encoding="utf-8")
    assert main(["train", "--config", str(path), "--epochs", "2"]) == 2
    assert main(["train", "mnist", "--config", str(path)]) == 2
    assert (seen[0].dataset, seen[0].epochs, seen[0].clip_norm) == ("fashion-mnist", 2, 0.5)
    assert (seen[1].dataset, seen[1].epochs) == ("mnist", 4)


def test_a_bad_file_or_no_dataset_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "cannot read" in err[0] and "dataset is missing" in err[1]


@pytest.mark.slow
@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
def test_train_from_a_config_file_records_it_in_ledger_and_report(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'dataset = "mnist"\nepochs = 1\nbatch_size = 64\ntrain_limit = 256\n'
        "test_limit = 256\nseed = 0\nthreads = 1\nattribution_check = 2\n",
        encoding="utf-8",
    )
    out = tmp_path / "run"
    assert main(["train", "mnist", "--config", str(path), "--out", str(out)]) == 0
    recorded = RunConfig.from_file(out / "run.toml")  # beside the model, re-trainable
    assert recorded == RunConfig.from_file(path, out=str(out))
    meta = Ledger.load(out / "ledger.jsonl").metadata
    assert meta["config"] == recorded.to_dict()
    report = json.loads((out / "report.json").read_text())
    assert report["reproduce"]["config"] == recorded.to_dict()
    assert f"dpfy train --config {out / 'run.toml'}" in (out / "report.md").read_text()


def test_device_cpu_trains_a_text_run_and_the_cli_refuses_an_unseen_device(tmp_path: Path,
                                                                            capsys, monkeypatch):
    from dpfy.models import pretrained
    from dpfy.training.text import train_text_classifier

    # the device, not the weights, is under test: a tiny encoder of MiniLM's architecture
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)

    summary = train_text_classifier(RunConfig(
        dataset="rotten-tomatoes", device="cpu", seed=0, epochs=1, train_limit=64,
        test_limit=32, batch_size=16, max_length=16, bias_only=True, target_epsilon=8.0))
    assert 0.0 <= summary.test_accuracy <= 1.0 and summary.steps >= 1
    out = tmp_path / "never"
    assert main(["train", "mnist", "--device", "cuda:7", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "device='cuda:7' needs CUDA device 7" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.usefixtures("image_chunks_of_64")  # the image run's padding: tests/training
def test_tan_steps_takes_the_planned_batch_and_epochs_for_text_and_images(tmp_path: Path,
                                                                           monkeypatch):
    from dpfy.models import pretrained
    from dpfy.planning import plan, tan_scaled
    from dpfy.training.recipes import train_image_classifier
    from dpfy.training.text import train_text_classifier

    # the planner's recommendation: the smallest batch with z >= 2 for the most steps <= S
    rec = plan(512, 8.0, 1e-5, max_steps=20).recommendation
    assert rec.noise_multiplier >= 2.0
    assert tan_scaled(512, 8.0, 1e-5, 20) == (rec.batch_size,
                                              round(rec.batch_size * rec.steps / 512))
    from dpfy.runs import batch_plan
    from dpfy.training.skeleton import RunHooks

    # the plan, not the weights, is under test: a tiny encoder of MiniLM's architecture
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
    config = RunConfig(dataset="rotten-tomatoes", seed=0, train_limit=96, test_limit=16,
                       max_length=8, bias_only=True, target_epsilon=8.0, tan_steps=6,
                       out=tmp_path / "text")
    with pytest.raises(ValueError, match="tan_steps=6 needs hooks.batch_plan"):
        train_text_classifier(config.replace(out=None))
    text = train_text_classifier(config, hooks=RunHooks(batch_plan=batch_plan(config)))
    batch, epochs = tan_scaled(96, 8.0, 1e-5, 6)
    assert (text.batch_size, text.epochs) == (batch, epochs)
    assert text.ledger.metadata["tan_steps"] == 6
    assert text.noise_multiplier > 1.0  # near the planned z >= 2 (calibrated to the steps run)
    image_config = RunConfig(dataset="mnist", seed=0, train_limit=256, test_limit=16,
                             target_epsilon=8.0, tan_steps=4)
    image = train_image_classifier(image_config,
                                   hooks=RunHooks(batch_plan=batch_plan(image_config)))
    assert (image.batch_size, image.epochs) == tan_scaled(256, 8.0, 1e-5, 4)

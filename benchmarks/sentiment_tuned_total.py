"""Tuned DP fine-tuning on rotten tomatoes at the TOTAL epsilon of the whole search (1 / 3 / 8).

``benchmarks/sentiment.py``'s tuned rows calibrate every run to the target alone, so a row
labelled 8 spends 15.4 in all (search plus release). Here the user's one number is the total:
each procedure is ``dpfy tune --total-epsilon E`` (:func:`dpfy.tuning_runs.tune_and_report` with
``TuneOptions(total_epsilon=E)``): a fixed number of trials ``--trials`` (default 2) drawn from
:func:`sentiment.tuned_space` (Adam's rate log-uniform within a factor 3 of the recipe's
default, warm-up none or a tenth of the steps: the space the per-run rows searched, declared
before any of them ran), each trial scored by a noisy count of correct predictions on the
validation split (held-out training movies), the best retrained on the whole training split and
released. Every run is calibrated to the per-run target that meets ``E`` under the tuning
accountant (fixed K: every ledger composed by PLD); the figure quoted is the test accuracy of
the release, at the search's total epsilon read back from its ledgers.

A seed is a **whole procedure**: the seed draws the trials' hyperparameters, their noise and the
release's; its epsilon is the procedure's total, not a second release of one search. Three
seeds give three independent procedures at the same total.

Recipes (:data:`sentiment.RECIPES`): ``bitfit`` (bias-only + head, Bu et al. 2022; the best of
the per-run rows at every epsilon), ``lpft``, ``lora16all``.

One procedure (writes ``<out>/<recipe>-total<E>-s<seed>.json`` and its search directory)::

    PYTHONPATH=src python benchmarks/sentiment_tuned_total.py run --recipe bitfit \
        --total 8 --seed 0 --device cuda --out /tmp/tuned

Then the table (goals, seed std, test SE, verdicts of ``benchmarks/goals.py``) from every
finished procedure, written to ``<out>/tuned_total_eps.json``::

    PYTHONPATH=src python benchmarks/sentiment_tuned_total.py summarise --out DIR

On one H200 the nine procedures of a recipe (totals 1 / 3 / 8, seeds 0 / 1 / 2) run at once,
one process each (``benchmarks/gpu/tuned_total.sh``); on one CPU core a procedure takes about
1.5-2 hours (three runs of 3 epochs, two of them on 80 % of the snippets).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import goals  # benchmarks/goals.py: the verdict rule every README states
import sentiment  # benchmarks/sentiment.py: recipes, searched space, base run
from sentiment_total_eps import GOALS  # the goals at total epsilon 1 / 3 / 8, one home

TOTALS = (1.0, 3.0, 8.0)


def _name(recipe: str, total: float, seed: int) -> str:
    return f"{recipe}-total{total:g}-s{seed}"


def run_procedure(recipe: str, total: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One whole procedure: the accounted search at ``total`` and its release (seed ``seed``)."""
    from dpfy import tuning_runs

    name = _name(recipe, total, seed)
    start = time.perf_counter()
    base = sentiment._base_config(recipe, total, seed, args, args.out / "runs" / name)
    space = sentiment.tuned_space(recipe)
    options = tuning_runs.TuneOptions(trials=args.trials, distribution="fixed",
                                      total_epsilon=total)
    tuned = tuning_runs.tune_and_report(
        base, tuning_runs.SearchSpace.from_mapping(space), options, progress=False)
    assert tuned.final is not None and tuned.chosen is not None  # fixed K >= 1
    chosen = tuned.trials[tuned.chosen].params
    sentiment._log(f"{name}: chosen {chosen}; test {tuned.final.test_accuracy:.4f}; per run "
                   f"{tuned.per_run_epsilon:.3f}, whole search {tuned.search_epsilon:.3f}")
    return {
        "name": name, "recipe": recipe, "seed": seed, "total_target": total,
        "test_accuracy": 100.0 * tuned.final.test_accuracy,
        "total_epsilon": tuned.search_epsilon, "epsilon_method": tuned.method,
        "per_run_epsilon": tuned.per_run_epsilon, "final_epsilon": tuned.final_epsilon,
        "delta": tuned.delta, "hp_source": "accounted search",
        "hp_detail": (f"dpfy tune --total-epsilon {total:g}: {args.trials} trials (fixed K) from "
                      f"{space}, noisy validation scores (std "
                      f"{options.score_noise:g} on the count), every run at "
                      f"the per-run target; seed = whole procedure"),
        "chosen": chosen, "trials": [dataclasses.asdict(t) for t in tuned.trials],
        "per_epoch": sentiment._per_epoch(tuned.final.ledger_path),
        "epochs": sentiment.RECIPES[recipe]["epochs"], "train_limit": args.train_limit,
        "test_limit": args.test_limit, "device": sentiment._device_name(args.device),
        "seconds": time.perf_counter() - start,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _not_searched(recipe: str) -> str:
    """What the search left at the recipe's defaults (not searched by this procedure)."""
    from dpfy.training.text import TEXT_DEFAULTS

    mode = TEXT_DEFAULTS[sentiment._recipe_mode(recipe)]
    fixed = {k: v for k, v in mode.items() if k != "learning_rate"}
    return (f"not searched, the recipe's defaults (dpfy.training.text.TEXT_DEFAULTS): {fixed}, "
            f"epochs {sentiment.RECIPES[recipe]['epochs']}, 64 tokens per snippet")


def summarise(procedures: list[dict[str, Any]], n_test: int) -> list[dict[str, Any]]:
    """Rows (recipe, total) over seeds: accuracies, goal verdict, the largest total epsilon."""
    rows = []
    keys = sorted({(p["recipe"], p["total_target"]) for p in procedures})
    for recipe, total in keys:
        mine = sorted((p for p in procedures
                       if (p["recipe"], p["total_target"]) == (recipe, total)),
                      key=lambda p: p["seed"])
        accs = [p["test_accuracy"] for p in mine]
        rows.append({
            "config": f"{recipe}-total{total:g}", "recipe": recipe, "dataset": "rotten-tomatoes",
            "private": True, "target_total_epsilon": total, "seeds": [p["seed"] for p in mine],
            "accuracy": accs, **goals.summarise(accs, GOALS.get(total), n_test),
            "total_epsilon": max(p["total_epsilon"] for p in mine),
            "per_run_epsilon": mine[0]["per_run_epsilon"], "delta": mine[0]["delta"],
            "epsilon_method": mine[0]["epsilon_method"], "hp_source": "accounted search",
            "hp_detail": f"{mine[0]['hp_detail']}; {_not_searched(recipe)}",
            "chosen": [p["chosen"] for p in mine],
            "per_epoch": [p["per_epoch"] for p in mine], "device": mine[0]["device"],
            "minutes": [round(p["seconds"] / 60, 1) for p in mine],
            "test_limit": mine[0]["test_limit"], "train_limit": mine[0]["train_limit"],
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| recipe | total epsilon (ledgers) | per-run target | test accuracy (%) by seed "
             "| mean | seed std | test SE | goal | verdict | chosen learning rates |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        std = "-" if r["seed_std"] is None else f"{r['seed_std']:.2f}"
        lrs = ", ".join(f"{c['learning_rate']:.3g}" + (" wu" if c.get("warmup") else "")
                        for c in r["chosen"])
        lines.append(
            f"| {r['recipe']} | {r['total_epsilon']:.3f} | {r['per_run_epsilon']:.3f} "
            f"| {' / '.join(f'{a:.2f}' for a in r['accuracy'])} | {r['mean']:.2f} | {std} "
            f"| {r['test_se']:.2f} | {r['goal']:.1f} | {r['verdict']} | {lrs} |")
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: test accuracy after each epoch of every released run, by total epsilon. Right:
    the mean over procedures against the total, with the test split's SE and the goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colours = dict(zip(TOTALS, ("tab:red", "tab:orange", "tab:green"), strict=True))
    for r in rows:
        colour = colours.get(r["target_total_epsilon"], "tab:blue")
        for i, curve in enumerate(r["per_epoch"]):
            left.plot(range(1, len(curve) + 1), [100 * c["test_accuracy"] for c in curve],
                      "o-", color=colour, alpha=0.7,
                      label=f"total {r['target_total_epsilon']:g}" if i == 0 else None)
    left.set_xticks(range(1, 1 + max(len(c) for r in rows for c in r["per_epoch"])))
    left.set(xlabel="epoch of the released run", ylabel="test accuracy (%)",
             title="bias-only MiniLM, each procedure's release")
    left.legend()
    x = [r["total_epsilon"] for r in rows]
    right.errorbar(x, [r["mean"] for r in rows], yerr=[r["test_se"] for r in rows], fmt="o-",
                   capsize=4, label="mean of seeds +- test SE")
    for r in rows:
        right.scatter([r["total_epsilon"]] * len(r["accuracy"]), r["accuracy"], s=10,
                      color="grey")
    right.plot(list(GOALS), list(GOALS.values()), "k_", markersize=18, mew=2,
               label="goal at each total")
    right.set(xscale="log", xlabel="total epsilon of the whole procedure (delta 1e-5)",
              ylabel="test accuracy (%)", title="accounted search + release")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["run", "summarise"])
    parser.add_argument("--recipe", default="bitfit", choices=list(sentiment.RECIPES))
    parser.add_argument("--total", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-limit", type=int, default=None, help="smoke tests only")
    parser.add_argument("--test-limit", type=int, default=None, help="smoke tests only")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--out", type=Path, default=sentiment.RESULTS / "tuned_total")
    parser.add_argument("--figure", action="store_true",
                        help="summarise: also tuned_total_eps.png (per-epoch curves, goals)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "run":
        import torch

        torch.set_num_threads(args.threads)
        result = run_procedure(args.recipe, args.total, args.seed, args)
        path = args.out / f"{result['name']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    procedures = [json.loads(p.read_text()) for p in sorted(args.out.glob("*-total*-s*.json"))]
    if not procedures:
        parser.error(f"--out {args.out} holds no finished procedure (*-total*-s*.json)")
    from dpfy import datasets

    limit = procedures[0]["test_limit"]
    n_test = len(datasets.rotten_tomatoes("test", limit=limit).labels)
    rows = summarise(procedures, n_test)
    (args.out / "tuned_total_eps.json").write_text(json.dumps(rows, indent=1) + "\n")
    if args.figure:
        figure(rows, args.out / "tuned_total_eps.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

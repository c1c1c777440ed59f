"""Image accuracy at a given epsilon: ScatterNet features (Tramer & Boneh 2021) with DP-SGD and
with the second-order DP estimators of Mehta et al. (2023), on MNIST and Fashion-MNIST.

For each dataset the ScatterNet features (J=2, L=8: 81 x 7 x 7) of the 60k training and 10k
test images are computed once (cached, :mod:`dpfy.features.scatternet`). Every method is then:

1. *tuned* on a validation split of the training images (train on the first 50k, score on the
   last 10k; seed 0; the test images are never looked at), one small grid per method and
   epsilon (``TUNED_AT``: the CNN and DP-Newton are searched at epsilon 3 only, and that choice
   runs at every epsilon);
2. *run* with the chosen hyperparameters on all 60k training images, once per seed, and scored
   on the 10k test images.

Methods: ``scatternet-linear`` and ``scatternet-cnn`` (DP-SGD on the features through
:class:`dpfy.training.PrivateTrainer`, Poisson sampling, noise calibrated to the target epsilon
with PLD, the models of ``dpfy train --model ...``); ``dp-ls``, ``dp-newton``, ``dp-fc``
(:mod:`dpfy.features` estimators on the flattened features, normalised per example as the
DP-SGD models do). Every epsilon is the ledger's for the final run alone, at delta 1e-5; the
validation search is not accounted (it ran on the same private training images: a release of
the chosen configuration would add the tuning cost, see ``dpfy.accounting`` ``rdp_tuning``).

Writes ``table.md`` (method x dataset x epsilon: mean over seeds, +- half the range, wall
minutes), ``results.json`` (every run, validation included) and ``accuracy_vs_epsilon.png``
(published anchors as points) to ``--out``. Progress lines go to stderr. ``--probe`` scores
extra configurations on the validation split only (recorded, never chosen).

    PYTHONPATH=src python benchmarks/images.py                       # everything (~1-2 h CPU)
    PYTHONPATH=src python benchmarks/images.py --datasets mnist --methods scatternet-linear \\
        --epsilons 3 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpfy import datasets
from dpfy.features import (
    DPFeatureCovarianceClassifier,
    DPLeastSquaresClassifier,
    DPNewtonClassifier,
)
from dpfy.features.estimators import auto_ridge
from dpfy.features.scatternet import dataset_features, flat_normalised
from dpfy.randomness import Randomness
from dpfy.sampling import make_sampler
from dpfy.training import PrivateTrainer, TrainerOptions
from dpfy.training.recipes import make_model

DELTA = 1e-5
VALIDATION = 10_000
#: Published accuracies at epsilon 3 (Tramer & Boneh 2021, Table 1 / 2), drawn as points.
ANCHORS = {
    "mnist": {"ScatterNet+linear (T&B)": 98.7, "ScatterNet+CNN (T&B)": 98.7,
              "end-to-end CNN (T&B)": 98.1},
    "fashion-mnist": {"ScatterNet+linear (T&B)": 89.7, "ScatterNet+CNN (T&B)": 89.0,
                      "end-to-end CNN (T&B)": 86.0},
}
#: The goals at epsilon 3 this benchmark was built for (above Tramer & Boneh), drawn as lines.
GOALS = {"mnist": 98.8, "fashion-mnist": 90.0}
DPSGD = ("scatternet-linear", "scatternet-cnn")
ESTIMATORS = ("dp-ls", "dp-newton", "dp-fc")
#: One colour per method on every panel of the figure.
COLORS = {"scatternet-linear": "C3", "scatternet-cnn": "C4", "dp-fc": "C0", "dp-ls": "C1",
          "dp-newton": "C2"}
#: Validation grids. DP-SGD: (epochs, learning rate) at expected batch 4096 unless stated,
#: clip 0.1, SGD with momentum 0.9 (Tramer & Boneh's setting for the linear model).
GRIDS: dict[str, list[dict[str, Any]]] = {
    "scatternet-linear": [
        *({"epochs": e, "learning_rate": 4.0} for e in (10, 20, 40)),
        *({"epochs": 20, "learning_rate": lr} for lr in (2.0, 8.0)),
        # TAN (Sander et al. 2023): more steps, and twice the batch at the same epochs
        {"epochs": 80, "learning_rate": 4.0},
        *({"epochs": e, "learning_rate": 8.0, "batch_size": 8192} for e in (40, 80)),
    ],
    "scatternet-cnn": [{"epochs": e, "learning_rate": lr} for e in (10, 20) for lr in (1.0, 4.0)],
    "dp-ls": [{"alpha": a} for a in (0.1, 1.0)],
    "dp-newton": [{"steps": 2, "learning_rate": 1.0}],
    "dp-fc": [
        *({"steps": s, "learning_rate": 1.0} for s in (10, 30)),
        # the ridge as a multiple of the estimator's own "auto" (benchmarks/mehta_ordering.py
        # found the smallest of 1/16 .. 2 best at d = 3969)
        *({"steps": 30, "learning_rate": 1.0, "ridge_x_auto": f} for f in (1/64, 1/32, 1/16, 1/8)),
    ],
}
#: Methods searched at one epsilon only, whose choice is then run at every epsilon: a CNN search
#: costs about an hour of one CPU core per cell, and DP-Newton's grid has a single entry.
TUNED_AT: dict[str, float] = {"scatternet-cnn": 3.0, "dp-newton": 3.0}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def features(dataset: str) -> dict[str, torch.Tensor]:
    """ScatterNet features and labels of the training and test images (cached)."""
    x_train, y_train = datasets.load(dataset, "train")
    x_test, y_test = datasets.load(dataset, "test")
    return {
        "x_train": dataset_features(dataset, "train", x_train, progress=True),
        "y_train": y_train,
        "x_test": dataset_features(dataset, "test", x_test, progress=True),
        "y_test": y_test,
    }


def split(
    x: Any, y: Any, test_x: Any, test_y: Any, validation: bool
) -> tuple[Any, Any, Any, Any]:
    """(fit x, fit y, scored x, scored y): the last 10k training images, or the test images."""
    if validation:
        return x[:-VALIDATION], y[:-VALIDATION], x[-VALIDATION:], y[-VALIDATION:]
    return x, y, test_x, test_y


def dpsgd_fit(net: nn.Module, x_fit: Any, y_fit: Any, x_eval: Any, y_eval: Any, eps: float,
              seed: int, hp: dict[str, Any], physical: int) -> dict[str, Any]:
    """DP-SGD as every row here trains it (Poisson batches, clip 0.1, SGD with momentum 0.9,
    noise calibrated to ``eps`` by the trainer, seeded sampling and noise), scored on
    ``x_eval``; also what benchmarks/mehta_ordering.py trains on projected features."""
    optimizer = torch.optim.SGD(net.parameters(), lr=hp["learning_rate"], momentum=0.9)
    trainer = PrivateTrainer(
        net, optimizer, nn.CrossEntropyLoss(reduction="none"), x_fit, y_fit,
        make_sampler("poisson", len(x_fit), hp.get("batch_size", 4096),
                     randomness=Randomness(seed=seed)),
        options=TrainerOptions(
            clip_norm=0.1, epochs=hp["epochs"], delta=DELTA, target_epsilon=eps,
            max_physical_batch_size=physical,
            randomness=Randomness(seed=10_000 + seed), ema_decay=hp.get("ema_decay"),
            test_data=(x_eval, y_eval),
        ),
    )
    start = time.perf_counter()
    result = trainer.fit()
    accuracy = trainer.evaluate()
    assert accuracy is not None  # the trainer has test_data
    per_epoch = [e.test_accuracy for e in result.history.epochs if e.test_accuracy is not None]
    return {"accuracy": 100 * float(accuracy), "epsilon": float(result.privacy.epsilon),
            "noise_multiplier": result.noise_multiplier, "per_epoch": per_epoch,
            "seconds": time.perf_counter() - start}


def run_dpsgd(method: str, data: dict[str, torch.Tensor], eps: float, seed: int,
              hp: dict[str, Any], validation: bool) -> dict[str, Any]:
    x_fit, y_fit, x_eval, y_eval = split(
        data["x_train"], data["y_train"], data["x_test"], data["y_test"], validation
    )
    torch.manual_seed(seed)
    net = make_model(method.replace("-", "_"))
    return dpsgd_fit(net, x_fit, y_fit, x_eval, y_eval, eps, seed, hp,
                     4096 if method == "scatternet-linear" else 512)


def run_estimator(method: str, flat: dict[str, np.ndarray], eps: float, seed: int,
                  hp: dict[str, Any], validation: bool) -> dict[str, Any]:
    x_fit, y_fit, x_eval, y_eval = split(
        flat["x_train"], flat["y_train"], flat["x_test"], flat["y_test"], validation
    )
    cls = {"dp-ls": DPLeastSquaresClassifier, "dp-newton": DPNewtonClassifier,
           "dp-fc": DPFeatureCovarianceClassifier}[method]
    kwargs = dict(hp)
    if "ridge_x_auto" in kwargs:
        kwargs["ridge"] = kwargs.pop("ridge_x_auto") * fc_auto_ridge(eps, hp["steps"],
                                                                     x_fit.shape[1])
    model = cls(epsilon=eps, delta=DELTA, classes=np.arange(10),
                random_state=Randomness(seed=seed), **kwargs)
    start = time.perf_counter()
    model.fit(x_fit, y_fit)
    accuracy = float(np.mean(model.predict(x_eval) == y_eval))
    return {"accuracy": 100 * accuracy, "epsilon": float(model.privacy_.epsilon),
            "seconds": time.perf_counter() - start}


def fc_auto_ridge(eps: float, steps: int, dim: int) -> float:
    """DP-FC's own ``ridge="auto"`` at this epsilon, number of steps and feature dimension: the
    covariance release's noise multiplier (equal shares) through :func:`auto_ridge`."""
    model = DPFeatureCovarianceClassifier(epsilon=eps, delta=DELTA, steps=steps)
    z = model._noise_multipliers([1.0] * (steps + 1))[0]
    return auto_ridge(z, model.covariance_clip_norm, dim)


class Results:
    """``results.json`` under ``--out``: every run, found again by (dataset, method, epsilon,
    phase, seed, configuration), so that a rerun skips what is already there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []

    @staticmethod
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row["dataset"], row["method"], float(row["epsilon_target"]), row["phase"],
                row["seed"], json.dumps(row["hp"], sort_keys=True))

    @staticmethod
    def find(rows: list[dict[str, Any]], cell: dict[str, Any]) -> dict[str, Any] | None:
        """The first row of ``rows`` with ``cell``'s key, or None."""
        return next((r for r in rows if Results.key(r) == Results.key(cell)), None)

    def get_or_run(self, cell: dict[str, Any], fit: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The stored row of ``cell`` (dataset, method, epsilon_target, phase, seed, hp), else
        ``fit()``'s, stored at once (a crash loses only the run in progress)."""
        found = self.find(self.rows, cell)
        if found is not None:
            return found
        row = {**cell, **fit()}
        self.rows.append(row)
        self.path.write_text(json.dumps(self.rows, indent=1))
        log(f"{cell['dataset']} {cell['method']} eps {cell['epsilon_target']:g} {cell['phase']} "
            f"seed {cell['seed']} {cell['hp']}: {row['accuracy']:.2f} % "
            f"(epsilon {row['epsilon']:.3f})")
        return row


def fit_cell(results: Results, source: Any, dataset: str, method: str, eps: float, phase: str,
             seed: int, hp: dict[str, Any]) -> dict[str, Any]:
    """One run of ``method`` (``phase`` "test": fitted on all training images and scored on the
    test images; else on the validation split), or its stored row."""
    run = run_dpsgd if method in DPSGD else run_estimator
    cell = {"dataset": dataset, "method": method, "epsilon_target": eps, "phase": phase,
            "seed": seed, "hp": hp}
    return results.get_or_run(cell, lambda: run(method, source, eps, seed, hp, phase != "test"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fashion-mnist"])
    parser.add_argument("--methods", nargs="+", default=[*DPSGD, *ESTIMATORS])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[0.5, 1.0, 2.0, 3.0, 8.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/images"))
    parser.add_argument("--probe", nargs="+", type=json.loads, metavar="JSON",
                        help="only score these configurations (JSON objects such as "
                             "'{\"epochs\": 120, \"learning_rate\": 8.0}') on the validation "
                             "split: recorded as phase 'probe', never chosen, no test run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out / "results.json")
    for dataset in args.datasets:
        log(f"{dataset}: ScatterNet features")
        data = features(dataset)
        flat = {"x_train": flat_normalised(data["x_train"]), "y_train": data["y_train"].numpy(),
                "x_test": flat_normalised(data["x_test"]), "y_test": data["y_test"].numpy()}
        for method in args.methods:
            source = data if method in DPSGD else flat
            for eps in args.epsilons:
                if args.probe:  # validation only, outside the grid
                    for hp in args.probe:
                        fit_cell(results, source, dataset, method, eps, "probe", 0, hp)
                    continue
                # 1. validation (seed 0), at TUNED_AT's epsilon for the methods listed there
                tune_eps = TUNED_AT.get(method, eps)
                for hp in GRIDS[method]:
                    fit_cell(results, source, dataset, method, tune_eps, "validation", 0, hp)
                best = chosen_hp(results.rows, dataset, method, eps)
                assert best is not None  # the search above has run
                for seed in args.seeds:  # 2. the chosen configuration on the test set
                    fit_cell(results, source, dataset, method, eps, "test", seed, best)
    write_table(results.rows, args.out)
    write_figure(results.rows, args.out)


def chosen_hp(results: list[dict[str, Any]], dataset: str, method: str,
              eps: float) -> dict[str, Any] | None:
    """The configuration of ``GRIDS[method]`` with the best validation score (seed 0) at the
    epsilon it is searched at, as ``main`` chooses it; None before the search has run."""
    tune_eps = TUNED_AT.get(method, eps)
    best: tuple[float, dict[str, Any]] | None = None
    for hp in GRIDS[method]:
        cell = {"dataset": dataset, "method": method, "epsilon_target": tune_eps,
                "phase": "validation", "seed": 0, "hp": hp}
        found = Results.find(results, cell)
        if found is not None and (best is None or found["accuracy"] > best[0]):
            best = (found["accuracy"], hp)
    return None if best is None else best[1]


def _summary(results: list[dict[str, Any]]) -> dict[tuple[str, str, float], dict[str, Any]]:
    """Per (dataset, method, epsilon): the test rows of the configuration the current grid
    chooses (rows of configurations a grid no longer picks stay in results.json only)."""
    cells: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in results:
        if r["phase"] == "test":
            cells.setdefault((r["dataset"], r["method"], r["epsilon_target"]), []).append(r)
    out = {}
    for key, rows in cells.items():
        hp = chosen_hp(results, *key)
        if hp is not None:
            rows = [r for r in rows if r["hp"] == hp]
        if not rows:
            continue
        acc = np.array([r["accuracy"] for r in rows])
        tuning = [r for r in results if r["phase"] == "validation"
                  and (r["dataset"], r["method"], r["epsilon_target"]) == key]
        out[key] = {"mean": float(acc.mean()), "spread": float(np.ptp(acc) / 2), "n": len(rows),
                    "hp": rows[0]["hp"], "epsilon": max(r["epsilon"] for r in rows),
                    "minutes": sum(r["seconds"] for r in rows + tuning) / 60}
    return out


def write_table(results: list[dict[str, Any]], out: Path) -> None:
    summary = _summary(results)
    tuned_at = ", ".join(f"{m} searched at epsilon {e:g} only" for m, e in TUNED_AT.items())
    lines = [
        "Test accuracy (%), mean over seeds +- half the range (n seeds), delta 1e-5, Poisson "
        "sampling; hyperparameters chosen on a 50k/10k validation split of the training images "
        f"(tuning cost not in the epsilon; {tuned_at}, their choice run at every epsilon); "
        "minutes: training wall time of the tuning and final runs together.", "",
        "| dataset | method | epsilon | test accuracy | chosen | ledger epsilon | minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for (dataset, method, eps), s in sorted(summary.items()):
        lines.append(
            f"| {dataset} | {method} | {eps:g} | {s['mean']:.2f} +- {s['spread']:.2f} ({s['n']}) "
            f"| {json.dumps(s['hp'])} | {s['epsilon']:.3f} | {s['minutes']:.1f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_figure(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = _summary(results)
    names = sorted({d for d, _, _ in summary})
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, dataset in zip(axes[0], names, strict=True):
        for method in sorted({m for d, m, _ in summary if d == dataset}):
            pts = sorted((e, s) for (d, m, e), s in summary.items() if d == dataset and m == method)
            ax.errorbar([e for e, _ in pts], [s["mean"] for _, s in pts],
                        yerr=[s["spread"] for _, s in pts], marker="o", capsize=3, label=method,
                        color=COLORS.get(method))
        for (label, value), (marker, color) in zip(
            ANCHORS.get(dataset, {}).items(), (("*", "black"), ("P", "C4"), ("*", "grey")),
            strict=False,
        ):
            ax.plot([3.0], [value], marker=marker, markersize=11, linestyle="none", label=label,
                    color=color, markeredgecolor="black")
        if dataset in GOALS:
            ax.axhline(GOALS[dataset], color="grey", linestyle="--", linewidth=1,
                       label=f"goal at epsilon 3 ({GOALS[dataset]:g} %)")
        ax.set_xscale("log")
        ax.set_xticks([0.5, 1, 2, 3, 8], ["0.5", "1", "2", "3", "8"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(dataset)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=120)


if __name__ == "__main__":
    main()

"""Image rows at the total epsilon of the whole procedure (tuning included), for headlines.

``benchmarks/images.py`` chose each dataset's configuration by its exact (noise-free) validation
accuracy on that dataset's private training images; the epsilon of its rows covers the final
run only, and no finite epsilon covers the search. Here every private row is a *single* DP-SGD
run whose hyperparameters did not look at that dataset's private images:

* ``transfer from <data set>``: the configuration ``benchmarks/images.py``'s validation grid
  chose on the *other* data set at epsilon 3 (MNIST and Fashion-MNIST are disjoint sets of
  images, so that choice is public with respect to the data set trained here);
* ``rule``: fixed before any search (clip norm 0.1 and SGD momentum 0.9, Tramer & Boneh 2021's
  setting for ScatterNet models, never searched in this repository).

So the ledger's epsilon of the run is the epsilon of the whole procedure. Each row of
:data:`ROWS` is trained with ``dpfy train`` (seeds 0, 1, 2: seeded experiments, each a complete
run with its own signed ledger; ``--train``) and read back from the run directories; the rows of
:data:`REUSED` are ``images.py``'s CNN test rows, whose configuration both grids chose, and take
the ``dpfy train`` runs of the same configuration (rows ``mnist-cnn``, ``fmnist-cnn``) as
further seeds (:func:`merged_rows`). Per row:
test accuracy (10,000 test images), its mean, the seed spread (sample std), the test split's
standard error ``sqrt(p (1 - p) / 10000)``, and the verdict against the goal by
``benchmarks/goals.py`` (met: mean - SE >= goal; missed: mean + SE < goal; else within noise).
Each ledger's epsilon is also given under RDP (dpfy's RDP accountant, Balle et al. 2020's
conversion) and as Tramer & Boneh's code states it (Opacus's RDP of the Poisson-subsampled
Gaussian at their orders 1.1-10.9 and 12-63, converted with
``eps = RDP(a) + log(1/delta) / (a - 1)``; their loader shuffles fixed-size batches and
accounts them as Poisson), so the comparison with their epsilon-3 rows is in their units.

Non-private rows (``--nonprivate``): the same model without clipping or noise, plain SGD with
momentum 0.9 (15 epochs, batches of 256); the step size is chosen on the validation split
(``dpfy.datasets.validation_images``, the split of ``dpfy train --validation``).

    PYTHONPATH=src python benchmarks/images_total_eps.py --runs R --train mnist-cnn  # runs
    PYTHONPATH=src python benchmarks/images_total_eps.py --runs R --nonprivate fashion-mnist mnist
    PYTHONPATH=src python benchmarks/images_total_eps.py --runs R          # the table
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from goals import summarise as goals_summarise  # benchmarks/goals.py: the rule every README states

from dpfy.accounting import epsilon
from dpfy.accounting.rdp import rdp_poisson_gaussian
from dpfy.ledger import Ledger

DELTA = 1e-5
N_TEST = 10_000
GOALS = {"mnist": 98.8, "fashion-mnist": 90.0}
SEEDS = (0, 1, 2)
#: Tramer & Boneh's RDP orders (their dp_utils.py).
TB_ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)
OUT = Path("benchmarks/results/images")


@dataclasses.dataclass(frozen=True)
class Row:
    """One headline row: ``dpfy train`` of ``model`` on ``dataset`` at ``hp``."""

    name: str
    dataset: str
    model: str
    hp: dict[str, Any]
    hp_source: str
    hp_detail: str

    def command(self, seed: int, out: Path) -> list[str]:
        return [
            ".venv/bin/dpfy", "train", self.dataset, "--model", self.model,
            "--target-epsilon", "3", "--delta", str(DELTA), "--seed", str(seed),
            "--threads", "1", "--epochs", str(self.hp["epochs"]),
            "--batch-size", str(self.hp["batch_size"]),
            "--learning-rate", str(self.hp["learning_rate"]), "--out", str(out),
        ]


RULE = "clip 0.1, momentum 0.9: rule (Tramer & Boneh 2021's setting, never searched)"
ROWS = (
    Row("fmnist-linear", "fashion-mnist", "scatternet-linear",
        {"epochs": 80, "batch_size": 4096, "learning_rate": 4.0}, "transfer from MNIST",
        "epochs, batch, step: transfer from MNIST (images.py's grid at epsilon 3 on MNIST's "
        "validation split; the recipe default); " + RULE),
    Row("mnist-linear", "mnist", "scatternet-linear",
        {"epochs": 80, "batch_size": 8192, "learning_rate": 8.0}, "transfer from Fashion-MNIST",
        "epochs, batch, step: transfer from Fashion-MNIST (images.py's grid at epsilon 3 on "
        "Fashion-MNIST's validation split); " + RULE),
    Row("mnist-cnn", "mnist", "scatternet-cnn",
        {"epochs": 20, "batch_size": 4096, "learning_rate": 4.0}, "transfer from Fashion-MNIST",
        "epochs, step: transfer from Fashion-MNIST (images.py's CNN grid at epsilon 3 on "
        "Fashion-MNIST's validation split; the recipe default); batch 4096: rule (the "
        "grid's fixed batch); " + RULE),
    Row("fmnist-cnn", "fashion-mnist", "scatternet-cnn",
        {"epochs": 20, "batch_size": 4096, "learning_rate": 4.0}, "transfer from MNIST",
        "epochs, step: transfer from MNIST (images.py's CNN grid at epsilon 3 on MNIST's "
        "validation split; the recipe default); batch 4096: rule (the grid's fixed batch); "
        + RULE),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def train(runs: Path, names: list[str], seeds: list[int]) -> None:
    """``dpfy train`` for every (row named in ``names``, seed) without a summary yet."""
    for row in (r for r in ROWS if r.name in names):
        for seed in seeds:
            out = runs / f"{row.name}-s{seed}"
            if (out / "summary.json").exists():
                continue
            start = time.perf_counter()
            subprocess.run(row.command(seed, out), check=True)
            (out / "wall.json").write_text(json.dumps({"seconds": time.perf_counter() - start}))
            log(f"{out.name}: done")


def poisson_steps(event: dict[str, Any], count: int = 1) -> list[tuple[float, float, int]]:
    """(sampling rate, noise multiplier, steps) of every Poisson-sampled Gaussian in a ledger's
    event (as ``to_dict``); anything else is refused."""
    kind = event["type"]
    if kind == "self_composed":
        return poisson_steps(event["event"], count * int(event["count"]))
    if kind == "composed":
        return [t for e in event["events"] for t in poisson_steps(e, count)]
    if kind == "poisson_sampled" and event["event"]["type"] == "gaussian":
        return [(float(event["sampling_rate"]), float(event["event"]["noise_multiplier"]), count)]
    raise ValueError(f"event must be Poisson-sampled Gaussian steps, got type={kind!r}")


def tramer_boneh_epsilon(parts: list[tuple[float, float, int]]) -> float:
    """Epsilon at DELTA as Tramer & Boneh's code computes it (Opacus RDP, their orders, the
    conversion RDP(a) + log(1/delta) / (a - 1))."""
    rdp = sum(n * rdp_poisson_gaussian(q, z, TB_ORDERS) for q, z, n in parts)
    return float(np.min(rdp + math.log(1 / DELTA) / (TB_ORDERS - 1)))


def read_run(path: Path) -> dict[str, Any]:
    """Accuracy, wall time and the ledger's epsilon (PLD, RDP, T&B's units) of one run."""
    summary = json.loads((path / "summary.json").read_text())
    ledger = Ledger.load(path / "ledger.jsonl")
    parts = poisson_steps(ledger.to_event().to_dict())
    wall = path / "wall.json"
    return {
        "run": path.name, "accuracy": 100 * float(summary["test_accuracy"]),
        "total_epsilon": float(epsilon(ledger, DELTA).epsilon),
        "epsilon_method": epsilon(ledger, DELTA).method,
        "epsilon_rdp": float(epsilon(ledger, DELTA, "rdp").epsilon),
        "epsilon_tramer_boneh": tramer_boneh_epsilon(parts),
        "noise_multiplier": parts[0][1], "sampling_rate": parts[0][0],
        "steps": sum(n for _, _, n in parts),
        "wall_seconds": json.loads(wall.read_text())["seconds"] if wall.exists() else None,
    }


def summarise(accuracies: list[float], goal: float | None) -> dict[str, Any]:
    """:func:`goals.summarise` on the 10,000 test images."""
    return goals_summarise(accuracies, goal, N_TEST)


def private_rows(runs: Path) -> list[dict[str, Any]]:
    out = []
    for row in ROWS:
        found = [runs / f"{row.name}-s{s}" for s in SEEDS]
        done = [read_run(p) for p in found if (p / "summary.json").exists()]
        if not done:
            continue
        out.append({
            "dataset": row.dataset, "model": row.model, "private": True, "hp": row.hp,
            "hp_source": row.hp_source, "hp_detail": row.hp_detail,
            "source": "dpfy train runs (ledgers)",
            "seeds": [int(r["run"].rsplit("-s", 1)[1]) for r in done],
            "accuracy": [r["accuracy"] for r in done],
            **summarise([r["accuracy"] for r in done], GOALS[row.dataset]),
            "total_epsilon": max(r["total_epsilon"] for r in done),
            "delta": DELTA, "runs": done,
            "wall_seconds": [r["wall_seconds"] for r in done],
        })
    return out


#: Test rows of ``benchmarks/images.py`` (results.json) whose configuration equals the one the
#: *other* data set's validation grid chose: the CNN grid chose 20 epochs at step 4 (batch
#: 4096) on both data sets, so each data set's CNN test rows are also the transfer rows.
REUSED = (
    ("mnist", "scatternet-cnn", {"epochs": 20, "learning_rate": 4.0}, "transfer from Fashion-MNIST",
     "epochs, step: transfer from Fashion-MNIST (images.py's CNN grid at epsilon 3 on "
     "Fashion-MNIST's validation split chose them; MNIST's own grid chose the same, which "
     "does not enter this row); batch 4096: rule (the grid's fixed batch); " + RULE),
    ("fashion-mnist", "scatternet-cnn", {"epochs": 20, "learning_rate": 4.0}, "transfer from MNIST",
     "epochs, step: transfer from MNIST (images.py's CNN grid at epsilon 3 on MNIST's "
     "validation split chose them; Fashion-MNIST's own grid chose the same, which does not "
     "enter this row); batch 4096: rule (the grid's fixed batch); " + RULE),
)


def run_event(hp: dict[str, Any], noise_multiplier: float) -> Any:
    """The event of an images.py run: Poisson batches of 60,000 images, ``hp``'s epochs."""
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler

    sampler = make_sampler("poisson", 60_000, hp.get("batch_size", 4096),
                           randomness=Randomness(seed=0))
    return sampler.privacy_event(noise_multiplier, epochs=hp["epochs"])


def reused_rows(results: Path) -> list[dict[str, Any]]:
    """:data:`REUSED`: the test rows at epsilon 3, their epsilon accounted from the recorded
    noise multiplier (images.py kept no ledger file)."""
    stored = json.loads(results.read_text())
    out = []
    for dataset, model, hp, source, detail in REUSED:
        found = sorted((r for r in stored if r["phase"] == "test" and r["dataset"] == dataset
                        and r["method"] == model and r["epsilon_target"] == 3.0
                        and r["hp"] == hp), key=lambda r: r["seed"])
        event = run_event(hp, found[0]["noise_multiplier"])
        parts = poisson_steps(event.to_dict())
        acc = [r["accuracy"] for r in found]
        out.append({
            "dataset": dataset, "model": model, "private": True,
            "hp": {**hp, "batch_size": 4096}, "hp_source": source, "hp_detail": detail,
            "source": "benchmarks/images.py test rows (results.json), trained by "
                      "dpfy.training.PrivateTrainer on 2026-11-26",
            "seeds": [r["seed"] for r in found], "accuracy": acc,
            **summarise(acc, GOALS[dataset]),
            "total_epsilon": float(epsilon(event, DELTA).epsilon),
            "epsilon_rdp": float(epsilon(event, DELTA, "rdp").epsilon),
            "epsilon_tramer_boneh": tramer_boneh_epsilon(parts),
            "noise_multiplier": parts[0][1], "sampling_rate": parts[0][0],
            "steps": parts[0][2], "delta": DELTA,
            "wall_seconds": [r["seconds"] for r in found],
        })
    return out


def merged_rows(trained: list[dict[str, Any]],
                reused: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row once: a :data:`REUSED` row and the trained row of the same configuration
    (data set, model, hp) are one row, ``images.py``'s seeds followed by the ``dpfy train``
    seeds it lacks (a trained seed it already has is left out: a different code path, so not
    the same run); the mean, spread, SE and verdict are over all of them, the total epsilon
    the largest."""
    def config(row: dict[str, Any]) -> tuple[Any, ...]:
        return row["dataset"], row["model"], row["hp"]

    def seed(run: dict[str, Any]) -> int:  # a run directory's name ends in -s<seed>
        return int(run["run"].rsplit("-s", 1)[1])

    out = [r for r in trained if not any(config(r) == config(u) for u in reused)]
    for row in reused:
        runs = [r for m in trained if config(m) == config(row) for r in m["runs"]
                if seed(r) not in row["seeds"]]
        if not runs:
            out.append(row)
            continue
        seeds = [seed(r) for r in runs]
        acc = row["accuracy"] + [r["accuracy"] for r in runs]
        out.append({
            **row, "source": f"{row['source']}; seed{'s' * (len(seeds) > 1)} "
                             f"{', '.join(map(str, seeds))}: dpfy train runs (ledgers)",
            "seeds": row["seeds"] + seeds, "accuracy": acc,
            **summarise(acc, GOALS[row["dataset"]]),
            "total_epsilon": max([row["total_epsilon"]] + [r["total_epsilon"] for r in runs]),
            "runs": runs,
            "wall_seconds": row["wall_seconds"] + [r["wall_seconds"] for r in runs],
        })
    return out


def _tb_excess(hp: dict[str, Any], z: float) -> float:
    return tramer_boneh_epsilon(poisson_steps(run_event(hp, z).to_dict())) - 3.0


def tramer_boneh_units() -> list[dict[str, Any]]:
    """Per configuration at epsilon 3: the noise multiplier dpfy calibrates (PLD), that run's
    epsilon under RDP and in Tramer & Boneh's units, and the noise multiplier their code
    would calibrate to epsilon 3 with the PLD epsilon it actually gives."""
    from scipy.optimize import brentq

    from dpfy.accounting import calibrate_noise_multiplier

    out = []
    for hp in ({"epochs": 80, "batch_size": 4096}, {"epochs": 80, "batch_size": 8192},
               {"epochs": 20, "batch_size": 4096}):
        z = calibrate_noise_multiplier(functools.partial(run_event, hp), 3.0, DELTA)
        event = run_event(hp, z)
        z_tb = brentq(functools.partial(_tb_excess, hp), 0.5, 50.0, xtol=1e-6)
        out.append({
            **hp, "noise_multiplier": z, "epsilon_pld": float(epsilon(event, DELTA).epsilon),
            "epsilon_rdp": float(epsilon(event, DELTA, "rdp").epsilon),
            "epsilon_tramer_boneh": tramer_boneh_epsilon(poisson_steps(event.to_dict())),
            "noise_multiplier_at_tramer_boneh_3": z_tb,
            "epsilon_pld_at_tramer_boneh_3": float(epsilon(run_event(hp, z_tb), DELTA).epsilon),
        })
    return out


#: Non-private rows: (dataset, model, epochs, batch, step sizes searched on validation, seeds).
#: Small batches: without noise many small steps converge in little CPU time. The steps bracket
#: the best of a first pass at 5 epochs over (0.003, 0.03): 0.003 on Fashion-MNIST (validation
#: 90.54 / 89.07 %), 0.03 on MNIST (98.69 / 98.85 %).
NONPRIVATE = (
    ("fashion-mnist", "scatternet-linear", 15, 256, (0.001, 0.003), (0,)),
    ("mnist", "scatternet-linear", 15, 256, (0.03, 0.1), (0,)),
)


def nonprivate_fit(model: str, data: tuple[Any, ...], epochs: int, batch: int, lr: float,
                   seed: int) -> float:
    """Test (or validation) accuracy % of ``model`` trained without clipping or noise."""
    import torch
    from torch import nn

    from dpfy.training.recipes import make_model

    x_fit, y_fit, x_eval, y_eval = data
    torch.manual_seed(seed)
    net = make_model(model.replace("-", "_"))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        perm = torch.randperm(len(x_fit), generator=order)
        for i in range(0, len(x_fit), batch):
            idx = perm[i:i + batch]
            optimizer.zero_grad()
            loss_fn(net(x_fit[idx]), y_fit[idx]).backward()
            optimizer.step()
    with torch.no_grad():
        right = sum(int((net(x_eval[i:i + 2048]).argmax(1) == y_eval[i:i + 2048]).sum())
                    for i in range(0, len(x_eval), 2048))
    return 100 * right / len(x_eval)


def nonprivate_rows(path: Path, datasets_: list[str]) -> None:
    """:data:`NONPRIVATE`: the step size with the best validation accuracy (seed 0), then
    that step size on all training images, scored on the test images, once per seed; the rows
    are written to ``path`` as each data set ends."""
    import torch

    from dpfy import datasets
    from dpfy.features.scatternet import dataset_features

    torch.set_num_threads(1)
    out: list[dict[str, Any]] = []
    for dataset, model, epochs, batch, lrs, seeds in NONPRIVATE:
        if dataset not in datasets_:
            continue
        x, y = datasets.load(dataset, "train")
        held = torch.as_tensor(datasets.validation_images(x))
        xt, yt = datasets.load(dataset, "test")
        fx, ft = dataset_features(dataset, "train", x), dataset_features(dataset, "test", xt)
        start = time.perf_counter()
        validation = {lr: nonprivate_fit(model, (fx[~held], y[~held], fx[held], y[held]),
                                         epochs, batch, lr, 0) for lr in lrs}
        best = max(validation, key=lambda lr: validation[lr])
        log(f"{dataset} {model} non-private validation {validation}: step {best}")
        accuracy = [nonprivate_fit(model, (fx, y, ft, yt), epochs, batch, best, s)
                    for s in seeds]
        log(f"{dataset} {model} non-private test {accuracy}")
        out.append({
            "dataset": dataset, "model": model, "private": False,
            "hp": {"epochs": epochs, "batch_size": batch, "learning_rate": best},
            "hp_source": "unaccounted search",
            "hp_detail": "non-private reference: epochs, batch: rule (15 epochs of batches of "
                         f"256); step: chosen on the validation split among {list(lrs)}",
            "validation": {str(k): v for k, v in validation.items()},
            "seeds": list(seeds), "accuracy": accuracy, **summarise(accuracy, None),
            "total_epsilon": None, "wall_seconds": time.perf_counter() - start,
        })
        path.write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("/tmp/dpfy-total-eps"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--train", nargs="+", choices=[r.name for r in ROWS],
                        help="run these rows' missing dpfy train runs")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--nonprivate", nargs="+", choices=sorted(GOALS),
                        help="fit these data sets' non-private rows")
    args = parser.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    if args.train:
        train(args.runs, args.train, args.seeds)
    if args.nonprivate:
        for name in args.nonprivate:
            nonprivate_rows(args.runs / f"nonprivate-{name}.json", [name])
    rows = merged_rows(private_rows(args.runs), reused_rows(OUT / "results.json"))
    for path in sorted(args.runs.glob("nonprivate-*.json")):
        rows += json.loads(path.read_text())
    units = tramer_boneh_units()
    (args.out / "total_eps3.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "tramer_boneh_units.json").write_text(json.dumps(units, indent=1) + "\n")
    for u in units:
        print(json.dumps({k: round(v, 3) for k, v in u.items()}))
    for r in rows:
        eps = f"{r['total_epsilon']:.3f}" if r["private"] else "inf"
        std = "-" if r["seed_std"] is None else f"{r['seed_std']:.2f}"
        print(f"{r['dataset']} {r['model']} private={r['private']}: {r['mean']:.2f} "
              f"(std {std}, SE {r['test_se']:.2f}, n={len(r['accuracy'])}) eps {eps} "
              f"{r['verdict']}")


if __name__ == "__main__":
    main()

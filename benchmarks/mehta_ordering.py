"""Why Mehta et al.'s second-order estimators trail DP-SGD on ScatterNet features: a d sweep.

Mehta et al. (2023, "Towards large scale transfer learning for differentially private image
classification") find that DP-LS (noisy ``X^T X`` and ``X^T y``, then a ridge solve) and DP-FC
(DP-SGD preconditioned by a noisy feature covariance) beat first-order DP-SGD on frozen features
at small epsilon. On the 3,969 ScatterNet features of ``benchmarks/images.py`` (Tramer & Boneh
2021) they do not. The suspected mechanism: both release a noisy ``d x d`` matrix, and the
operator norm of a symmetrised Gaussian ``d x d`` matrix of entry std ``s`` is about
``sqrt(2 d) s``, so as ``d`` grows the noise swamps more and more of the covariance's
eigen-directions; DP-SGD adds a ``d``-vector per step instead. This script measures it:

1. *Dimension sweep.* The normalised ScatterNet rows (:func:`dpfy.features.scatternet.
   flat_normalised`) are multiplied by a fixed, seeded Gaussian matrix ``R`` (``3969 x d``,
   entries ``N(0, 1/d)``; data-independent, so choosing it spends no privacy) for
   ``d`` in {64, 256, 1024}, or left as they are at ``d = 3969``; each projected row is rescaled
   to the L2 norm of its unprojected row (a per-example transform: rows keep the norm <= ~1
   the estimators' clip norm 1 expects, and ``d = 3969`` is exactly ``benchmarks/images.py``'s
   rows). At each ``d`` DP-LS (alpha 1) and DP-FC (30 steps, learning rate 1: the choices of
   ``benchmarks/images.py``) run at epsilon 1 and 3 (delta 1e-5). The ridge is chosen from
   ``RIDGE_FACTORS`` x the estimator's own ``ridge="auto"`` value (:func:`dpfy.features.
   estimators.auto_ridge`, which scales with the noise and ``sqrt(d)``) on a 50k/10k validation
   split of the training images (seed 0); the chosen ridge is then fitted on all 60k with seeds
   0 and 1 and scored on the 10k test images. A non-private least squares (epsilon inf, ridge
   from {1, 10, 100} on the same split) shows what the projection alone costs. DP-SGD
   (:class:`dpfy.training.PrivateTrainer`, Poisson sampling, clip 0.1, momentum 0.9, the
   ``scatternet-linear`` setting) trains a linear layer on the projected rows at the
   ``--dpsgd-dims`` (inputs scaled by ``sqrt(3969)``, so that ``d = 3969`` is exactly the
   GroupNorm + linear model); its ``d = 3969`` numbers are those already measured by
   ``benchmarks/images.py`` (``results.json``), not rerun.
2. *Spectra.* For the full 60k training rows at each ``d``: the eigenvalues of the clipped
   feature covariance ``G = sum_i x_i x_i^T`` (the matrix DP-FC releases; DP-LS releases it and
   the class covariances ``A_j`` and solves with ``A_j + alpha G``), and the eigenvalues of a
   unit noise matrix drawn by the library's own release code
   (``dpfy.features.algorithms._release``: i.i.d. Gaussian entries, then ``(M + M^T) / 2``),
   scaled by the noise std that the fitted estimators' ledgers record (their own calibration;
   for DP-LS the std of ``A_j + alpha G``'s noise, ``sqrt(s_A^2 + alpha^2 s_G^2)``). Reported:
   how many eigenvalues of ``G`` lie above the noise matrix's operator norm, and the share of
   ``trace G`` they hold. For DP-LS this undercounts slightly (its signal ``A_j + G`` is
   ``>= G``).

Epsilons are each final run's own (ledger); the validation search is not accounted (as in
``benchmarks/images.py``). The test images are used only for the final scores.

Writes to ``--out`` (default ``benchmarks/results/images``): ``mehta_ordering.json`` (every run,
validation included, and the spectra; the script resumes from it), ``mehta_ordering.md`` (the
tables) and ``mehta_ordering.png`` (one row per dataset: accuracy vs d at epsilon 1 and 3,
spectra at d = 3969, eigenvalue / noise norm at every d). Progress lines go to stderr.

    DPFY_CACHE_DIR=/tmp/dpfycache OMP_NUM_THREADS=1 PYTHONPATH=src \\
        python benchmarks/mehta_ordering.py --datasets fashion-mnist mnist
    PYTHONPATH=src python benchmarks/mehta_ordering.py --report-only   # redraw from the json

Needs the cached ScatterNet features of the 60k training and 10k test images
(``benchmarks/images.py`` computes them). Time on one torch thread of the shared 2-core CPU
(load ~3.7): Fashion-MNIST 57 minutes, of which d <= 1024 with DP-SGD took 10 and d = 3969 took
47 (a DP-LS fit there takes 100-180 s: with the ridge below the noise's operator norm every
class's noisy matrix is projected onto the PSD cone, one 3969 x 3969 eigendecomposition each;
a DP-FC fit 55-65 s); MNIST at d = 64, 256, 1024 with DP-SGD took 8 minutes. The recorded run
(``mehta_ordering.json``) stopped there, before MNIST's d = 3969 (the session's compute budget),
i.e. it is the same as ``--datasets fashion-mnist`` followed by ``--datasets mnist --dims 64 256
1024``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpfy import datasets
from dpfy.features import DPFeatureCovarianceClassifier, DPLeastSquaresClassifier
from dpfy.features import algorithms as alg
from dpfy.features.estimators import auto_ridge
from dpfy.features.scatternet import dataset_features, flat_normalised
from dpfy.features.stats import SufficientStats, sufficient_statistics
from dpfy.ledger import Ledger
from dpfy.ledger.records import SumQueryRecord
from dpfy.randomness import Randomness

sys.path.insert(0, str(Path(__file__).parent))
import images  # noqa: E402  (benchmarks/images.py: the DP-SGD fit both benchmarks share)

DELTA = 1e-5
VALIDATION = 10_000
FULL_D = 3969
DIMS = (64, 256, 1024, FULL_D)
EPSILONS = (1.0, 3.0)
SEEDS = (0, 1)
CLASSES = np.arange(10)
#: Seed of the Gaussian projection matrices (public, fixed before any data is seen).
PROJECTION_SEED = 2023
#: Seed of the unit noise matrices whose spectra are measured.
NOISE_SEED = 7
#: Ridge grid: multiples of the estimator's ``ridge="auto"`` (noise std x sqrt(d)).
RIDGE_FACTORS = (0.0625, 0.125, 0.25, 0.5, 1.0, 2.0)
NONPRIVATE_RIDGES = (1.0, 10.0, 100.0)
LS_ALPHA = 1.0
FC = {"steps": 30, "learning_rate": 1.0}
#: DP-SGD grids (the configurations benchmarks/images.py chose at d = 3969 are in each).
DPSGD_GRID: dict[float, list[dict[str, Any]]] = {
    1.0: [{"epochs": 20, "learning_rate": 4.0},
          {"epochs": 40, "learning_rate": 8.0, "batch_size": 8192}],
    3.0: [{"epochs": 40, "learning_rate": 4.0},
          {"epochs": 80, "learning_rate": 8.0, "batch_size": 8192}],
}
METHODS = ("dp-ls", "dp-fc", "dp-sgd", "non-private-ls", "non-private-fc")
COLORS = {"dp-ls": "C1", "dp-fc": "C0", "dp-sgd": "C3", "non-private-ls": "C1",
          "non-private-fc": "C0"}
LABELS = {"dp-ls": "DP-LS", "dp-fc": "DP-FC", "dp-sgd": "DP-SGD (linear)",
          "non-private-ls": "non-private LS", "non-private-fc": "non-private FC (softmax)"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ data


def load(dataset: str) -> dict[str, Any]:
    """Normalised ScatterNet rows (float32, ``[n, 3969]``) and labels of train and test."""
    out: dict[str, Any] = {}
    for split in ("train", "test"):
        images, labels = datasets.load(dataset, split)
        feats = dataset_features(dataset, split, images)
        del images
        out[f"x_{split}"] = flat_normalised(feats).astype(np.float32)
        out[f"y_{split}"] = labels.numpy()
        del feats
    return out


def projection(d: int) -> np.ndarray | None:
    """The fixed ``3969 x d`` Gaussian projection (entries ``N(0, 1/d)``); None at full d."""
    if d == FULL_D:
        return None
    rng = np.random.default_rng([PROJECTION_SEED, d])
    return (rng.standard_normal((FULL_D, d)) / math.sqrt(d)).astype(np.float32)


def project(x: np.ndarray, r: np.ndarray | None) -> np.ndarray:
    """Rows ``x R``, each rescaled to its unprojected row's L2 norm (per example)."""
    if r is None:
        return x
    p = x @ r
    scale = np.linalg.norm(x, axis=1) / np.maximum(np.linalg.norm(p, axis=1), 1e-30)
    return (p * scale[:, None]).astype(np.float32)


def statistics(x: np.ndarray, y: np.ndarray) -> SufficientStats:
    """Clipped sums ``G``, ``A``, ``b`` of DP-LS (clip 1; float64 products and sums)."""
    chunks = [(torch.from_numpy(x[i : i + 10_000]), torch.from_numpy(y[i : i + 10_000]))
              for i in range(0, len(x), 10_000)]
    return sufficient_statistics(chunks, clip_norm=1.0, num_classes=10)


def add_stats(a: SufficientStats, b: SufficientStats) -> SufficientStats:
    """Statistics of the union of two disjoint row sets (sums add)."""
    return SufficientStats(a.covariance + b.covariance, a.class_covariance + b.class_covariance,
                           a.class_sums + b.class_sums, a.clip_norm, a.max_positives,
                           a.rows + b.rows)


# ------------------------------------------------------------------------------------ methods


def release_stds(ledger: Ledger) -> dict[str, float]:
    """Noise std of each named release of a fitted estimator (first occurrence)."""
    stds: dict[str, float] = {}
    for record in ledger.entries:
        if isinstance(record, SumQueryRecord):
            stds.setdefault(record.name, record.noise_std)
    return stds


def auto_for(method: str, eps: float, d: int) -> float:
    """The estimator's own ``ridge="auto"`` at this epsilon and d (its calibration code)."""
    if method == "dp-ls":
        z = DPLeastSquaresClassifier(epsilon=eps, delta=DELTA)._noise_multipliers([1.0] * 3)[0]
        return auto_ridge(z, 1.0, d)
    return images.fc_auto_ridge(eps, FC["steps"], d)


def fit_estimator(method: str, eps: float, seed: int, ridge: float, stats: SufficientStats,
                  x_fit: np.ndarray, y_fit: np.ndarray, x_eval: np.ndarray,
                  y_eval: np.ndarray) -> dict[str, Any]:
    start = time.perf_counter()
    model: DPLeastSquaresClassifier | DPFeatureCovarianceClassifier
    if method.endswith("-ls"):
        model = DPLeastSquaresClassifier(
            epsilon=eps, delta=DELTA, alpha=LS_ALPHA, ridge=ridge, classes=CLASSES,
            random_state=Randomness(seed=seed)).fit_statistics(stats, CLASSES)
    else:
        model = DPFeatureCovarianceClassifier(
            epsilon=eps, delta=DELTA, ridge=ridge, classes=CLASSES,
            random_state=Randomness(seed=seed), **FC).fit(x_fit, y_fit)
    accuracy = 100 * float(np.mean(model.predict(x_eval) == y_eval))
    return {"accuracy": accuracy, "epsilon": float(model.privacy_.epsilon),
            "noise_std": release_stds(model.ledger_), "seconds": time.perf_counter() - start}


def fit_dpsgd(eps: float, seed: int, hp: dict[str, Any], x_fit: np.ndarray, y_fit: np.ndarray,
              x_eval: np.ndarray, y_eval: np.ndarray) -> dict[str, Any]:
    """A linear layer trained by DP-SGD as ``scatternet-linear`` in benchmarks/images.py
    (its :func:`images.dpsgd_fit`)."""
    scale = math.sqrt(FULL_D)  # the GroupNorm output's scale: rows of norm ~sqrt(3969)
    torch.manual_seed(seed)
    net = nn.Linear(x_fit.shape[1], 10)
    result = images.dpsgd_fit(
        net, torch.from_numpy(x_fit * scale), torch.from_numpy(y_fit),
        torch.from_numpy(x_eval * scale), torch.from_numpy(y_eval), eps, seed, hp, 4096)
    return {k: result[k] for k in ("accuracy", "epsilon", "noise_multiplier", "seconds")}


def estimator_fit(method: str, eps: float, parts: dict[bool, tuple[Any, ...]]) -> Any:
    """``fit(ridge, seed, validation)`` of one estimator on the validation or test split."""
    def fit(ridge: float, seed: int, validation: bool) -> dict[str, Any]:
        return fit_estimator(method, eps, seed, ridge, *parts[validation])
    return fit


def dpsgd_fit(eps: float, parts: dict[bool, tuple[Any, ...]]) -> Any:
    """``fit(hp, seed, validation)`` of DP-SGD on the validation or test split."""
    def fit(hp: dict[str, Any], seed: int, validation: bool) -> dict[str, Any]:
        return fit_dpsgd(eps, seed, hp, *parts[validation][1:])
    return fit


# ------------------------------------------------------------------------------------ spectra


def unit_noise_eigenvalues(d: int) -> np.ndarray:
    """Eigenvalues (descending) of a unit-std noise matrix drawn by the library's release."""
    ledger = Ledger()
    sid = alg._full_batch(ledger, 1, 0)
    w = alg._release(torch.zeros(d, d, dtype=torch.float64), sensitivity=1.0,
                     noise_multiplier=1.0, ledger=ledger, sample_id=sid,
                     randomness=Randomness(seed=NOISE_SEED), name="unit", symmetric=True)
    return np.sort(torch.linalg.eigvalsh(w).numpy())[::-1]


def effective_std(method: str, stds: dict[str, float]) -> float:
    """Noise std of the matrix each method inverts: ``A_j + alpha G`` (DP-LS) or ``G``."""
    if method == "dp-ls":
        return math.hypot(stds["A"], LS_ALPHA * stds["G"])
    return stds["covariance"]


# ------------------------------------------------------------------------------------ driver


class Store:
    """Every run and spectrum, kept in a json file (resumable)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        data = json.loads(path.read_text()) if path.exists() else {}
        self.runs: list[dict[str, Any]] = data.get("runs", [])
        self.spectra: list[dict[str, Any]] = data.get("spectra", [])

    def find(self, **key: Any) -> dict[str, Any] | None:
        for r in self.runs:
            if all(r.get(k) == v for k, v in key.items()):
                return r
        return None

    def add(self, row: dict[str, Any]) -> None:
        self.runs.append(row)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps({"runs": self.runs, "spectra": self.spectra}))


def run_cell(store: Store, key: dict[str, Any], grid: list[Any], fit: Any,
             seeds: tuple[int, ...]) -> None:
    """Validation over ``grid`` (seed 0), then the best on the test split per seed."""
    scored = []
    for hp in grid:
        row = store.find(**key, phase="validation", seed=0, hp=hp)
        if row is None:
            row = {**key, "phase": "validation", "seed": 0, "hp": hp, **fit(hp, 0, True)}
            store.add(row)
            log(f"{key} validation {hp}: {row['accuracy']:.2f} % ({row['seconds']:.0f} s)")
        scored.append(row)
    best = max(scored, key=lambda r: r["accuracy"])["hp"]
    for seed in seeds:
        if store.find(**key, phase="test", seed=seed, hp=best) is None:
            row = {**key, "phase": "test", "seed": seed, "hp": best, **fit(best, seed, False)}
            store.add(row)
            log(f"{key} TEST seed {seed} {best}: {row['accuracy']:.2f} % "
                f"(epsilon {row['epsilon']:.3f}, {row['seconds']:.0f} s)")


def run_dataset(dataset: str, store: Store, dims: tuple[int, ...],
                dpsgd_dims: tuple[int, ...]) -> None:
    log(f"{dataset}: loading ScatterNet features")
    data = load(dataset)
    y_all, y_test = data["y_train"], data["y_test"]
    y_fit, y_val = y_all[:-VALIDATION], y_all[-VALIDATION:]
    for d in dims:
        r = projection(d)
        x_all, x_test = project(data["x_train"], r), project(data["x_test"], r)
        x_fit, x_val = x_all[:-VALIDATION], x_all[-VALIDATION:]
        start = time.perf_counter()
        s_fit = statistics(x_fit, y_fit)
        s_all = add_stats(s_fit, statistics(x_val, y_val))
        log(f"{dataset} d={d}: statistics in {time.perf_counter() - start:.0f} s")

        parts = {True: (s_fit, x_fit, y_fit, x_val, y_val),
                 False: (s_all, x_all, y_all, x_test, y_test)}
        for eps in EPSILONS:
            for method in ("dp-ls", "dp-fc"):
                auto = auto_for(method, eps, d)
                grid = [round(f * auto, 6) for f in RIDGE_FACTORS]
                key = {"dataset": dataset, "d": d, "epsilon_target": eps, "method": method}
                run_cell(store, key, grid, estimator_fit(method, eps, parts), SEEDS)
        for method in ("non-private-ls", "non-private-fc"):
            # epsilon inf: the same estimators without noise ("inf": json has no infinity)
            key = {"dataset": dataset, "d": d, "epsilon_target": "inf", "method": method}
            run_cell(store, key, list(NONPRIVATE_RIDGES), estimator_fit(method, math.inf, parts),
                     (0,))

        if not any(s["dataset"] == dataset and s["d"] == d for s in store.spectra):
            start = time.perf_counter()
            g_eig = np.sort(torch.linalg.eigvalsh(s_all.covariance).numpy())[::-1]
            w_eig = unit_noise_eigenvalues(d)
            stds = {}
            for eps in EPSILONS:
                for method in ("dp-ls", "dp-fc"):
                    row = store.find(dataset=dataset, d=d, epsilon_target=eps, method=method,
                                     phase="test", seed=0)
                    assert row is not None
                    stds[f"{method}@{eps:g}"] = effective_std(method, row["noise_std"])
            store.spectra.append({"dataset": dataset, "d": d,
                                  "covariance": [float(f"{v:.6g}") for v in g_eig],
                                  "unit_noise": [float(f"{v:.6g}") for v in w_eig],
                                  "noise_std": stds})
            store.save()
            log(f"{dataset} d={d}: spectra in {time.perf_counter() - start:.0f} s")
        del s_fit, s_all

        if d in dpsgd_dims and d != FULL_D:
            for eps in EPSILONS:
                key = {"dataset": dataset, "d": d, "epsilon_target": eps, "method": "dp-sgd"}

                run_cell(store, key, DPSGD_GRID[eps], dpsgd_fit(eps, parts), SEEDS)


# ------------------------------------------------------------------------------------ report


def summary(store: Store, images_json: Path) -> dict[tuple[str, int, str, str], dict[str, Any]]:
    """(dataset, d, epsilon, method) -> mean, half range, chosen hp, seconds, source."""
    cells: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for r in store.runs:
        key = (r["dataset"], r["d"], str(r["epsilon_target"]), r["method"])
        cells.setdefault(key, []).append(r)
    if images_json.exists():  # DP-SGD at d = 3969: benchmarks/images.py's runs
        for r in json.loads(images_json.read_text()):
            if r["method"] == "scatternet-linear" and r["epsilon_target"] in EPSILONS:
                key = (r["dataset"], FULL_D, str(r["epsilon_target"]), "dp-sgd")
                if any(k[0] == r["dataset"] for k in cells):
                    cells.setdefault(key, []).append({**r, "source": "images.py"})
    out = {}
    for key, rows in cells.items():
        val = [r for r in rows if r["phase"] == "validation"]
        best = max(val, key=lambda r: r["accuracy"])["hp"] if val else None
        test = [r for r in rows if r["phase"] == "test" and best in (None, r["hp"])]
        if not test:
            continue
        acc = np.array([r["accuracy"] for r in test])
        out[key] = {"mean": float(acc.mean()), "spread": float(np.ptp(acc) / 2), "n": len(test),
                    "hp": test[0]["hp"], "seconds": sum(r["seconds"] for r in rows),
                    "epsilon": max(r["epsilon"] for r in test),
                    "source": test[0].get("source", "this script")}
    return out


def spectrum_counts(store: Store) -> list[dict[str, Any]]:
    rows = []
    for s in store.spectra:
        g = np.array(s["covariance"])
        norm = float(np.max(np.abs(s["unit_noise"])))
        for name, std in sorted(s["noise_std"].items()):
            level = std * norm
            above = g > level
            rows.append({"dataset": s["dataset"], "d": s["d"], "setting": name, "std": std,
                         "norm": level, "above": int(above.sum()),
                         "trace_share": float(g[above].sum() / g.sum()),
                         "top": float(g[0]), "median": float(np.median(g))})
    return rows


def write_table(store: Store, out: Path, images_json: Path) -> None:
    s = summary(store, images_json)
    lines = [
        "Test accuracy (%) of linear classifiers on ScatterNet features projected to d "
        "dimensions (fixed seeded Gaussian projection; d = 3969: none), mean of 2 seeds +- half "
        "the range (n); delta 1e-5. DP-LS (alpha 1) and DP-FC (30 steps, learning rate 1): "
        "ridge chosen on a 50k/10k validation split of the training images from "
        "{1/16, 1/8, 1/4, 1/2, 1, 2} x the estimator's ridge=\"auto\"; non-private LS and FC (the "
        "same estimators at epsilon inf, one fit): ridge from {1, 10, 100}. DP-SGD: "
        "benchmarks/images.py's scatternet-linear runs at d = 3969, this script's at smaller d. "
        "seconds: wall time of the tuning and final fits together (one torch thread, shared "
        "2-core CPU). Written by benchmarks/mehta_ordering.py.", "",
        "| dataset | d | epsilon | method | test accuracy | chosen | ledger epsilon | seconds "
        "| source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def order(k: tuple[str, int, str, str]) -> tuple[str, float, int, int]:
        return (k[0], float(k[2]), METHODS.index(k[3]), k[1])

    for key in sorted(s, key=order):
        c = s[key]
        hp = c["hp"] if isinstance(c["hp"], dict) else {"ridge": c["hp"]}
        if key[3] in ("dp-ls", "dp-fc"):  # the chosen ridge as a multiple of ridge="auto"
            hp["x auto"] = round(c["hp"] / auto_for(key[3], float(key[2]), key[1]), 4)
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {LABELS[key[3]]} | {c['mean']:.2f} +- "
            f"{c['spread']:.2f} ({c['n']}) | {json.dumps(hp)} | {c['epsilon']:.3f} | "
            f"{c['seconds']:.0f} | {c['source']} |")
    lines += [
        "", "Accuracy by d (test %, mean of the seeds):", "",
        "| dataset | epsilon | method | " + " | ".join(f"d={d}" for d in DIMS) + " |",
        "|---|---|---|" + "---|" * len(DIMS),
    ]
    for dataset in sorted({k[0] for k in s}):
        for eps in ("1.0", "3.0", "inf"):
            for method in METHODS:
                cells = [s.get((dataset, d, eps, method)) for d in DIMS]
                if any(cells):
                    lines.append(f"| {dataset} | {eps} | {LABELS[method]} | " + " | ".join(
                        f"{c['mean']:.2f}" if c else "-" for c in cells) + " |")
    lines += [
        "", "Gaps by d (points): DP-SGD minus each estimator, and each private method's loss "
        "from the non-private estimator of the same loss (LS for DP-LS, FC for DP-FC and, as "
        "a reference ceiling, for DP-SGD):", "",
        "| dataset | epsilon | gap | " + " | ".join(f"d={d}" for d in DIMS) + " |",
        "|---|---|---|" + "---|" * len(DIMS),
    ]
    gaps = (("DP-SGD - DP-LS", "dp-sgd", "dp-ls"), ("DP-SGD - DP-FC", "dp-sgd", "dp-fc"),
            ("non-private LS - DP-LS", "non-private-ls", "dp-ls"),
            ("non-private FC - DP-FC", "non-private-fc", "dp-fc"),
            ("non-private FC - DP-SGD", "non-private-fc", "dp-sgd"))
    for dataset in sorted({k[0] for k in s}):
        for eps in ("1.0", "3.0"):
            for name, hi, lo in gaps:
                vals = []
                for d in DIMS:
                    a = s.get((dataset, d, "inf" if hi.startswith("non") else eps, hi))
                    b = s.get((dataset, d, eps, lo))
                    vals.append(f"{a['mean'] - b['mean']:+.2f}" if a and b else "-")
                lines.append(f"| {dataset} | {eps} | {name} | " + " | ".join(vals) + " |")
    lines += [
        "", "Spectra (60k training rows): eigenvalues of G = sum_i x_i x_i^T above the "
        "operator norm of the noise matrix each method inverts (DP-FC: the noisy G; DP-LS: "
        "A_j + G, noise std sqrt(s_A^2 + s_G^2)), and the share of trace G they hold. std: "
        "entry noise std from the fitted estimators' ledgers; noise norm: std x the largest "
        "|eigenvalue| of a unit noise matrix drawn by dpfy's release code.", "",
        "| dataset | d | method@epsilon | entry std | noise norm | top eigenvalue of G | "
        "median eigenvalue | eigenvalues above | share of trace |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(spectrum_counts(store), key=lambda r: (r["dataset"], r["setting"], r["d"])):
        lines.append(
            f"| {r['dataset']} | {r['d']} | {r['setting']} | {r['std']:.2f} | {r['norm']:.0f} | "
            f"{r['top']:.0f} | {r['median']:.3g} | {r['above']} / {r['d']} | "
            f"{100 * r['trace_share']:.1f} % |")
    (out / "mehta_ordering.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_figure(store: Store, out: Path, images_json: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(store, images_json)
    names = sorted({k[0] for k in s})
    if not names:
        return
    fig, axes = plt.subplots(len(names), 4, figsize=(22, 4.6 * len(names)), squeeze=False)
    for row, dataset in zip(axes, names, strict=True):
        for ax, eps in zip(row[:2], ("1.0", "3.0"), strict=True):
            for method in METHODS:
                e = "inf" if method.startswith("non-private") else eps
                pts = sorted((k[1], c) for k, c in s.items()
                             if k[0] == dataset and k[2] == e and k[3] == method)
                if pts:
                    ax.errorbar([d for d, _ in pts], [c["mean"] for _, c in pts],
                                yerr=[c["spread"] for _, c in pts], marker="o", capsize=3,
                                color=COLORS[method], label=LABELS[method],
                                linestyle=":" if method.startswith("non-") else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(DIMS), [str(d) for d in DIMS])
            ax.minorticks_off()
            ax.set_xlabel("d (random projection of the 3969 ScatterNet features)")
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"{dataset}, epsilon {float(eps):g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        spectra = {sp["d"]: sp for sp in store.spectra if sp["dataset"] == dataset}
        ax = row[2]
        if spectra:  # d = 3969, or the largest d measured
            top_d = max(spectra)
            sp = spectra[top_d]
            rank = np.arange(1, top_d + 1)
            ax.plot(rank, sp["covariance"], color="black", label="eigenvalues of G (data)")
            w = np.array(sp["unit_noise"])
            for name, std in sorted(sp["noise_std"].items()):
                color = COLORS[name.split("@")[0]]
                style = "--" if name.endswith("@1") else ":"
                pos = std * w[w > 0]
                ax.plot(np.arange(1, len(pos) + 1), pos, color=color, alpha=0.35,
                        linestyle=style)
                ax.axhline(std * np.max(np.abs(w)), color=color, linestyle=style,
                           label=f"noise norm {name.replace('@', ', eps ')}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylim(bottom=max(1e-3, min(sp["covariance"])))
            ax.set_xlabel("rank")
            ax.set_ylabel("eigenvalue (sum units)")
            ax.set_title(f"{dataset}, d = {top_d}: G vs its noise (faint: noise eigenvalues)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax = row[3]
        for d, color in zip(DIMS, ("C2", "C4", "C5", "black"), strict=True):
            if d not in spectra:
                continue
            sp = spectra[d]
            norm = float(np.max(np.abs(sp["unit_noise"])))
            g = np.array(sp["covariance"])
            for eps, style in (("1", "-"), ("3", "--")):
                level = sp["noise_std"][f"dp-fc@{eps}"] * norm
                ax.plot(np.arange(1, d + 1), g / level, color=color, linestyle=style,
                        label=f"d={d}, eps {eps}")
        ax.axhline(1.0, color="red", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(1e-4, None)
        ax.set_xlabel("rank")
        ax.set_ylabel("eigenvalue of G / DP-FC noise norm")
        ax.set_title(f"{dataset}: directions above the noise (red line) at each d")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "mehta_ordering.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["fashion-mnist", "mnist"])
    parser.add_argument("--dims", nargs="+", type=int, default=list(DIMS))
    parser.add_argument("--dpsgd-dims", nargs="*", type=int, default=[64, 256, 1024])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/images"))
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    store = Store(args.out / "mehta_ordering.json")
    images_json = args.out / "results.json"
    if not args.report_only:
        for dataset in args.datasets:
            run_dataset(dataset, store, tuple(args.dims), tuple(args.dpsgd_dims))
            write_table(store, args.out, images_json)
            write_figure(store, args.out, images_json)
    write_table(store, args.out, images_json)
    write_figure(store, args.out, images_json)


if __name__ == "__main__":
    main()

"""DP learning from pretrained features: a table like Mehta et al. Tables 2-4 (issue 6).

Datasets (features extracted once and cached by :mod:`dpfy.features.extract`):
  * ``fashion-mnist``: EfficientNet-Lite0 ImageNet features (1280-d) of the 28x28 images
    upsampled to 64x64 (an affordable, stated choice on 2 shared CPU cores; the network was
    trained at 224), 60k train / 10k test, 10 classes.
  * ``rotten-tomatoes``: all-MiniLM-L6-v2 embeddings (384-d) of the fresh/rotten snippets,
    split by movie (~80/20), 2 classes.

Every feature vector is scaled to unit L2 norm (a public per-example transform), so the clip
norms are 1 and clipping changes nothing. Methods: DP-LS (Alg. 3), DP-Newton (Alg. 2), DP-FC
with 1 and 10 full-batch steps (= epochs, Alg. 4) and full-batch DP-Adam (Alg. 1), at
epsilon in {0.1, 0.5, 1, 2, 8} and non-private (noise 0), delta = 1e-5, add-or-remove adjacency,
exact GDP accounting; the reported epsilon is recomputed from each run's ledger.

Hyperparameters: a small grid per method and epsilon (the ridge is a multiple ``c`` of the public
noise scale ``z sqrt(d)``; see ``METHODS``) is evaluated on a 10% validation split of the
training set with seed 0; the best setting is then refit on the full training set with
``--seeds`` seeds and evaluated on the test set. As in the paper, the privacy cost of this
tuning is not accounted.

    python benchmarks/features.py [--datasets fashion-mnist rotten-tomatoes] [--seeds 3]
        [--quick] [--out benchmarks/results]

Writes ``features.md`` and ``features.json`` to ``--out`` and prints the table. It also times
DP-LS on all training features through the estimator (statistics included, extraction
excluded) with 2 torch threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfy import accounting
from dpfy.datasets import CLASSES
from dpfy.features import accounting as acc
from dpfy.features import algorithms as alg
from dpfy.features.estimators import DPLeastSquaresClassifier
from dpfy.features.stats import sufficient_statistics
from dpfy.randomness import Randomness

EPSILONS = [0.1, 0.5, 1.0, 2.0, 8.0, math.inf]
DELTA = 1e-5


# ----------------------------------------------------------------------------- data


def load(name: str) -> dict[str, Any]:
    from dpfy.features import extract

    if name == "fashion-mnist":
        xtr, ytr = extract.image_features("fashion-mnist", "train", resolution=64)
        xte, yte = extract.image_features("fashion-mnist", "test", resolution=64)
        desc = "Fashion-MNIST, EfficientNet-Lite0 ImageNet features @64px (1280-d)"
    elif name == "rotten-tomatoes":
        x, y, is_test = extract.text_features()
        xtr, ytr, xte, yte = x[~is_test], y[~is_test], x[is_test], y[is_test]
        desc = "Rotten Tomatoes snippets, all-MiniLM-L6-v2 embeddings (384-d)"
    else:
        raise ValueError(f"unknown dataset {name!r}")

    def prep(x):
        t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        return t / torch.linalg.vector_norm(t, dim=1, keepdim=True).clamp_min(1e-12)

    return {
        "name": name, "description": desc,
        "xtr": prep(xtr), "ytr": torch.as_tensor(ytr).long(),
        "xte": prep(xte), "yte": torch.as_tensor(yte).long(),
        "m": len(CLASSES[name]), "cache": {},  # public: the dataset's definition
    }


def split_validation(data: dict[str, Any]) -> dict[str, Any]:
    n = data["xtr"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))
    nv = n // 10
    va, tr = perm[:nv], perm[nv:]
    return {**data, "xtr": data["xtr"][tr], "ytr": data["ytr"][tr], "xte": data["xtr"][va],
            "yte": data["ytr"][va], "cache": {}}


# ----------------------------------------------------------------------------- methods
# Each method: grid(quick) -> list of hyperparameter dicts; run(data, eps, hp, seed)
# -> (weights, ledger). The noise is calibrated from (eps, delta) with the exact GDP curve and
# split evenly over the releases (the paper's equal-sigma setting).


def _z(eps: float, releases: int) -> float:
    if math.isinf(eps):
        return 0.0
    return float(acc.noise_multipliers(acc.mu_for_target(eps, DELTA), [1.0] * releases)[0])


def _noise_scale(eps: float, releases: int, d: int) -> float:
    """Public scale of the noise on a d x d matrix with unit sensitivity (its spectral norm/2)."""
    return max(_z(eps, releases) * math.sqrt(d), 1.0)


def stats_of(data):
    """Clipped sums of the training set, computed once and shared by all methods and runs."""
    if "stats" not in data["cache"]:
        data["cache"]["stats"] = sufficient_statistics(
            [(data["xtr"][i : i + 8192], data["ytr"][i : i + 8192])
             for i in range(0, data["xtr"].shape[0], 8192)],
            clip_norm=1.0, num_classes=data["m"])
    return data["cache"]["stats"]


def run_ls(data, eps, hp, seed):
    ridge = hp["c"] * _noise_scale(eps, 3, data["xtr"].shape[1])
    return alg.dp_least_squares(stats_of(data), noise_multiplier=_z(eps, 3), alpha=hp["alpha"],
                                ridge=ridge, randomness=Randomness(seed))


def run_newton(data, eps, hp, seed):
    T = hp["steps"]
    ridge = hp["c"] * _noise_scale(eps, 2 * T, data["xtr"].shape[1]) * math.sqrt(data["m"]) / 4
    return alg.dp_newton(data["xtr"], data["ytr"], clip_norm=1.0,
                         noise_multiplier=_z(eps, 2 * T), steps=T, ridge=ridge,
                         learning_rate=hp["lr"], num_classes=data["m"],
                         covariance_stats=stats_of(data), randomness=Randomness(seed))


def run_fc(data, eps, hp, seed):
    T = hp["steps"]
    ridge = hp["c"] * _noise_scale(eps, T + 1, data["xtr"].shape[1])
    return alg.dp_feature_covariance(
        data["xtr"], data["ytr"],
        preconditioner=alg.Preconditioner(clip_norm=1.0, ridge=ridge, stats=stats_of(data)),
        gradient_clip_norm=1.0, noise_multiplier=_z(eps, T + 1), steps=T,
        learning_rate=hp["lr"], l2=hp.get("l2", 0.0), num_classes=data["m"],
        randomness=Randomness(seed),
    )


def run_adam(data, eps, hp, seed):
    return alg.dp_adam(data["xtr"], data["ytr"], clip_norm=1.0,
                       noise_multiplier=_z(eps, hp["steps"]), steps=hp["steps"],
                       learning_rate=hp["lr"], num_classes=data["m"],
                       randomness=Randomness(seed))


def _grid(**axes) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*axes.values())]


def _c_grid(q: bool, d: int, small: list[float], large: list[float]) -> list[float]:
    """Ridge multipliers (of the public noise scale). For d > 512 the grid keeps the ridge above
    the noise's spectral norm, so the noisy matrices are positive definite without a d x d
    eigendecomposition per class (one costs ~9 s for d = 1280 on a loaded 2-core machine)."""
    if q:
        return [large[0]] if d > 512 else [1.0]
    return large if d > 512 else small


METHODS = {
    "DP-LS": (run_ls, lambda q, d: _grid(c=_c_grid(q, d, [0.3, 1.0, 3.0], [2.5, 5.0]),
                                         alpha=[1.0])),
    "DP-Newton": (run_newton, lambda q, d: _grid(c=_c_grid(q, d, [0.3, 1.0, 3.0], [2.5, 5.0]),
                                                 lr=[1.0], steps=[1, 3] if not q else [1])),
    "DP-FC (1 epoch)": (run_fc, lambda q, d: _grid(c=_c_grid(q, d, [0.3, 1.0, 3.0], [1.0, 3.0]),
                                                   lr=[1.0], steps=[1])),
    "DP-FC (10 epochs)": (run_fc, lambda q, d: _grid(c=_c_grid(q, d, [0.3, 1.0, 3.0],
                                                               [1.0, 3.0]),
                                                     lr=[2.0], steps=[10])),
    "DP-Adam": (run_adam, lambda q, d: _grid(steps=[20, 100] if not q and d <= 512 else [30],
                                             lr=[0.05, 0.2] if not q else [0.1])),
}


def accuracy(weights: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x @ weights).argmax(1) == y).double().mean())


def evaluate(data, valid, method: str, eps: float, seeds: int, quick: bool) -> dict[str, Any]:
    run, grid = METHODS[method]
    best, best_acc, tuning = None, -1.0, []
    candidates = grid(quick, data["xtr"].shape[1])
    for hp in candidates:
        if len(candidates) == 1:
            best = hp
            break
        fitted = run(valid, eps, hp, 0)
        a = accuracy(fitted.weights, valid["xte"], valid["yte"])
        tuning.append({"hp": hp, "valid_accuracy": a})
        if a > best_acc:
            best, best_acc = hp, a
    accs, times, eps_ledger = [], [], []
    for seed in range(seeds):
        t0 = time.perf_counter()
        fitted = run(data, eps, best, seed)
        times.append(time.perf_counter() - t0)
        accs.append(accuracy(fitted.weights, data["xte"], data["yte"]))
        eps_ledger.append(accounting.epsilon(fitted.ledger, DELTA, method="gaussian").epsilon)
    assert all(e <= eps * (1 + 1e-9) for e in eps_ledger), (method, eps, eps_ledger)
    return {
        "method": method, "epsilon": eps, "hyperparameters": best, "tuning": tuning,
        "test_accuracy": accs, "mean": statistics.fmean(accs),
        "std": statistics.pstdev(accs) if len(accs) > 1 else 0.0,
        "seconds": times, "ledger_epsilon": eps_ledger[0],
    }


def time_dp_ls_estimator(data) -> dict[str, Any]:
    """Wall time of DPLeastSquaresClassifier.fit on all training features (stats included)."""
    x, y = data["xtr"].numpy(), data["ytr"].numpy()
    runs, cpu = [], []
    for seed in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        clf = DPLeastSquaresClassifier(epsilon=1.0, delta=DELTA, clip_norm=1.0,
                                       ridge=2.5 * _noise_scale(1.0, 3, x.shape[1]),
                                       classes=np.arange(data["m"]),
                                       random_state=seed).fit(x, y)
        runs.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"n": int(x.shape[0]), "d": int(x.shape[1]), "seconds": runs,
            "median_seconds": statistics.median(runs), "cpu_seconds": cpu,
            "load_average": list(__import__("os").getloadavg()),
            "test_accuracy": float(clf.score(data["xte"].numpy(), data["yte"].numpy())),
            "epsilon": clf.privacy_.epsilon, "threads": torch.get_num_threads()}


def _fmt_eps(e: float) -> str:
    return "non-private" if math.isinf(e) else f"eps={e:g}"


def markdown(results: list[dict[str, Any]], ls_timing: dict[str, Any] | None, seeds: int) -> str:
    lines = []
    for ds in results:
        lines.append(f"### {ds['description']}")
        lines.append("")
        lines.append(f"n_train={ds['n_train']}, n_test={ds['n_test']}, classes={ds['m']}; test "
                     f"accuracy (%), mean +- std over {seeds} seeds; delta={DELTA:g}; "
                     "time = mean seconds per fit")
        lines.append("")
        header = "| method | " + " | ".join(_fmt_eps(e) for e in EPSILONS) + " | time (s) |"
        lines.append(header)
        lines.append("|" + "---|" * (len(EPSILONS) + 2))
        for method in METHODS:
            rows = [r for r in ds["rows"] if r["method"] == method]
            if not rows:
                continue
            by_eps = {r["epsilon"]: r for r in rows}
            cells = []
            for e in EPSILONS:
                r = by_eps.get(e)
                cells.append("-" if r is None else f"{100 * r['mean']:.2f} +- {100 * r['std']:.2f}")
            t = statistics.fmean(s for r in rows for s in r["seconds"])
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {t:.2f} |")
        lines.append("")
        if ds.get("reference"):
            lines.append(f"Reference (non-private, scikit-learn LogisticRegression on the same "
                         f"features): {100 * ds['reference']:.2f}%")
            lines.append("")
    if ls_timing:
        lines.append(f"DP-LS estimator fit on all {ls_timing['n']} x {ls_timing['d']} training "
                     f"features (statistics + noise + solve, {ls_timing['threads']} threads): "
                     f"median {ls_timing['median_seconds']:.2f} s wall over 3 runs "
                     f"({', '.join(f'{s:.2f}' for s in ls_timing['seconds'])}; CPU seconds "
                     f"{', '.join(f'{s:.2f}' for s in ls_timing['cpu_seconds'])}; load average "
                     f"{ls_timing['load_average'][0]:.1f} on 2 cores); test accuracy "
                     f"{100 * ls_timing['test_accuracy']:.2f}% at eps=1.")
    return "\n".join(lines)


def sklearn_reference(data) -> float | None:
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        return None
    lr = LogisticRegression(C=10.0, max_iter=300).fit(data["xtr"].numpy(), data["ytr"].numpy())
    return float(lr.score(data["xte"].numpy(), data["yte"].numpy()))


def _clean(obj: Any) -> Any:
    """JSON-safe copy: infinite epsilons become the string "inf"."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", nargs="+", default=["fashion-mnist", "rotten-tomatoes"])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="no tuning grid (one setting each)")
    p.add_argument("--newton-steps", type=int, nargs="+", default=None,
                   help="DP-Newton steps to try (default 1 and 3; each step after the first "
                   "costs m products of n x d^2, so 1 is the affordable choice for 60k x 1280)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is much faster than 2 on an oversubscribed machine)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="features")
    p.add_argument("--epsilons", type=float, nargs="+", default=None,
                   help="subset of epsilons to run (inf = non-private)")
    p.add_argument("--fc-c", type=float, nargs="+", default=None,
                   help="override the DP-FC ridge multipliers c")
    p.add_argument("--time-ls-only", action="store_true",
                   help="only time the DP-LS estimator on all Fashion-MNIST training features")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.newton_steps:
        run, grid = METHODS["DP-Newton"]
        steps = list(args.newton_steps)

        def newton_grid(q, d, grid=grid):
            out = [{**hp, "steps": t} for hp in grid(q, d) for t in steps]
            return [hp for i, hp in enumerate(out) if hp not in out[:i]]

        METHODS["DP-Newton"] = (run, newton_grid)
    if args.epsilons:
        EPSILONS[:] = [e for e in EPSILONS if e in args.epsilons]
    if args.fc_c:
        for name in ("DP-FC (1 epoch)", "DP-FC (10 epochs)"):
            run, grid = METHODS[name]
            METHODS[name] = (run, lambda q, d, grid=grid: [
                {**hp, "c": c} for hp in grid(True, d)[:1] for c in args.fc_c])
    results, ls_timing = [], None
    t_start = time.perf_counter()
    if args.time_ls_only:
        ls_timing = time_dp_ls_estimator(load("fashion-mnist"))
        print(json.dumps(ls_timing, indent=1))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.tag}_dp_ls_timing.json").write_text(json.dumps(ls_timing, indent=1) + "\n")
        return 0
    for name in args.datasets:
        data = load(name)
        valid = split_validation(data)
        ds = {"dataset": name, "description": data["description"],
              "n_train": int(data["xtr"].shape[0]), "n_test": int(data["xte"].shape[0]),
              "m": data["m"], "rows": []}
        print(f"== {data['description']}: train {ds['n_train']}, test {ds['n_test']}",
              flush=True)
        for method in args.methods:
            for eps in EPSILONS:
                row = evaluate(data, valid, method, eps, args.seeds, args.quick)
                ds["rows"].append(row)
                print(f"{method:18s} {_fmt_eps(eps):12s} {100 * row['mean']:6.2f} "
                      f"+- {100 * row['std']:.2f}  {statistics.fmean(row['seconds']):7.2f}s  "
                      f"hp={row['hyperparameters']}", flush=True)
        ds["reference"] = sklearn_reference(data)
        if name == "fashion-mnist" and "DP-LS" in args.methods:
            ls_timing = time_dp_ls_estimator(data)
            print(f"DP-LS estimator on all training features: {ls_timing}", flush=True)
        results.append(ds)
    md = markdown(results, ls_timing, args.seeds)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "torch": torch.__version__,
            "machine": platform.machine(), "threads": args.threads, "seeds": args.seeds,
            "quick": args.quick, "delta": DELTA, "total_seconds": time.perf_counter() - t_start}
    (out / f"{args.tag}.md").write_text(md + "\n")
    payload = _clean({"meta": meta, "datasets": results, "dp_ls_timing": ls_timing})
    (out / f"{args.tag}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

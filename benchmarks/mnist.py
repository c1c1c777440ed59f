"""DP-SGD on real MNIST and Fashion-MNIST at epsilon = 3, delta = 1e-5 (Poisson sampling, PLD).

Goal (issue 5): MNIST >= 98.0 % test accuracy (Tramer & Boneh 2021: ~98.1 % at epsilon ~3);
Fashion-MNIST ~86 %. Issue 8's demo: >= 97.5 % at epsilon <= 3 in under 10 minutes on 2 cores.

Usage:
    python benchmarks/mnist.py                       # both datasets, default hyperparameters
    python benchmarks/mnist.py --dataset mnist --epochs 15 --batch-size 1024 --json

Prints accuracy, epsilon (from the ledger, PLD) and wall time per run, and writes
``benchmarks/results/mnist[-TAG].json``. Per-epoch progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dpfy.config import RunConfig
from dpfy.training.recipes import ImageRecipe, train_image_classifier
from dpfy.training.skeleton import RunHooks

RESULTS = Path(__file__).resolve().parent / "results"

# Per dataset: epochs, expected batch size, learning rate (SGD, momentum 0.9), clip norm.
DEFAULTS = {
    "mnist": dict(epochs=10, batch_size=1024, learning_rate=2.0, clip_norm=0.1),
    "fashion-mnist": dict(epochs=40, batch_size=2048, learning_rate=4.0, clip_norm=0.1),
}


def _progress(dataset: str):
    def callback(info) -> None:
        if info.kind == "epoch":
            print(
                f"[{dataset}] epoch {info.epoch + 1}: steps {info.step}/{info.total_steps} "
                f"train loss {info.loss:.4f} test acc {info.test_accuracy:.4f} "
                f"epsilon so far {info.epsilon:.3f}",
                file=sys.stderr,
                flush=True,
            )

    return callback


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", nargs="+", default=["mnist", "fashion-mnist"])
    p.add_argument("--target-epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--sampler", default="poisson")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--clip-norm", type=float)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--ema", type=float, default=0.99, help="EMA decay (0 disables)")
    p.add_argument("--model", default="tanh_cnn")
    p.add_argument("--physical-batch", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", default=None, help="write model + ledger per dataset here")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)

    runs = []
    for dataset in args.dataset:
        cfg = dict(DEFAULTS.get(dataset, DEFAULTS["mnist"]))
        for key, value in (
            ("epochs", args.epochs),
            ("batch_size", args.batch_size),
            ("learning_rate", args.lr),
            ("clip_norm", args.clip_norm),
        ):
            if value is not None:
                cfg[key] = value
        out_dir = None if args.out_dir is None else Path(args.out_dir) / dataset
        start = time.perf_counter()
        opt = {k: cfg.pop(k) for k in ("epochs", "batch_size", "learning_rate", "clip_norm")
               if k in cfg}
        summary = train_image_classifier(
            RunConfig(
                dataset=dataset,
                target_epsilon=args.target_epsilon,
                delta=args.delta,
                sampler=args.sampler,
                threads=args.threads,
                seed=args.seed,
                out=None if out_dir is None else str(out_dir),
                **opt,
            ),
            ImageRecipe(
                momentum=args.momentum,
                ema_decay=args.ema or None,
                model=args.model,
                max_physical_batch_size=args.physical_batch,
                accounting="pld",
                **cfg,
            ),
            RunHooks(callbacks=(_progress(dataset),)),
        )
        total = time.perf_counter() - start
        run = summary.to_dict(include_history=True, private=True)  # our measurements
        run["total_seconds"] = total
        runs.append(run)
        if not args.json:
            print(
                f"{dataset:14s} test accuracy {summary.test_accuracy * 100:.2f} %  "
                f"epsilon {summary.epsilon:.3f} (delta {summary.delta:g}, {summary.accounting})  "
                f"z {summary.noise_multiplier:.3f}  steps {summary.steps}  "
                f"train {summary.seconds:.0f} s (total {total:.0f} s)",
                flush=True,
            )
    report = {
        "benchmark": "dp-sgd image classification (issue 5)",
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
            "platform": platform.platform(),
        },
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "mnist" + (f"-{args.tag}" if args.tag else "") + ".json"
    with open(RESULTS / name, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Flat vs automatic clipping on MNIST: which knobs remain, measured on a validation split.

Automatic clipping (Bu et al. 2023, AUTO-S; :mod:`dpfy.queries.clipping`) scales every
per-example gradient by ``C / (||g|| + 0.01)``. The noise std is ``z C`` as with flat clipping,
so with SGD (momentum included) a run depends on ``C`` and the learning rate only through
``C x lr``: the clip norm stops being a knob. Flat clipping ``min(1, C / ||g||)`` has no such
identity: at fixed ``C x lr`` a larger C clips fewer examples (less bias, the same noise per
unit of signal only for clipped examples), so C and lr must be tuned jointly.

Each configuration is one ``dpfy train mnist --validation`` run (the image recipe: tanh CNN,
Poisson sampling, expected batch 1024, SGD with momentum 0.9, epsilon 3 at delta 1e-5, the
noise calibrated to the planned epochs): it trains on the training images outside the
validation split and is scored on that split (:func:`dpfy.datasets.validation_images`); the
test split is never read. Validation accuracies are computed from private data and are for
this benchmark only (the runs' reports never print them).

Usage::

    python benchmarks/clipping.py                 # the grid below, 1 seed, 3 epochs
    python benchmarks/clipping.py --epochs 1 --only auto-C1-lr0.2 flat-C0.1-lr2
    python benchmarks/clipping.py --quick         # smoke run: 2000 images, 1 epoch

Writes ``results/clipping/mnist_clipping.json`` (one row per run: configuration, validation
accuracy, noise multiplier, epsilon, wall time, the load average before and after). The
measured figures and their reading are in ``results/clipping/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpfy.config import RunConfig
from dpfy.runs import train_and_report

RESULTS = Path(__file__).resolve().parent / "results" / "clipping"

#: (name, clipping, clip norm C, learning rate). Flat at the recipe's (0.1, 2.0), and at 10x
#: and 1/10x C with C x lr fixed; automatic at the same three points (the same steps in exact
#: arithmetic), then automatic at C = 1 across learning rates: the one knob left.
GRID: tuple[tuple[str, str, float, float], ...] = (  # the most telling runs first
    ("flat-C0.1-lr2", "flat", 0.1, 2.0),
    ("auto-C1-lr0.2", "automatic", 1.0, 0.2),
    ("flat-C1-lr0.2", "flat", 1.0, 0.2),
    ("auto-C0.01-lr20", "automatic", 0.01, 20.0),
    ("flat-C0.01-lr20", "flat", 0.01, 20.0),
    ("auto-C1-lr0.05", "automatic", 1.0, 0.05),
    ("auto-C1-lr0.8", "automatic", 1.0, 0.8),
    ("auto-C0.1-lr2", "automatic", 0.1, 2.0),
    ("flat-C0.1-lr8", "flat", 0.1, 8.0),  # flat at the best automatic C x lr (0.8)
)


def run_one(name: str, clipping: str, clip: float, lr: float, args: argparse.Namespace,
            root: Path) -> dict[str, Any]:
    """One ``dpfy train mnist --validation`` run; its validation accuracy and costs."""
    config = RunConfig(
        dataset="mnist", out=root / name, target_epsilon=args.epsilon, delta=1e-5,
        epochs=args.epochs, learning_rate=lr, clip_norm=clip, clipping=clipping,
        seed=args.seed, threads=1, validation=True,
        train_limit=2000 if args.quick else None,
        batch_size=256 if args.quick else None,
    )
    load_before = os.getloadavg()
    start = time.perf_counter()
    run = train_and_report(config)
    wall = time.perf_counter() - start
    summary = run.model
    command = (f"dpfy train mnist --validation --target-epsilon {args.epsilon:g} "
               f"--epochs {args.epochs} --clipping {clipping} --clip-norm {clip:g} "
               f"--learning-rate {lr:g} --seed {args.seed} --threads 1")
    return {
        "name": name, "clipping": clipping, "clip_norm": clip, "learning_rate": lr,
        "clip_x_lr": clip * lr, "validation_accuracy": float(run.test_accuracy),
        "noise_multiplier": float(summary.noise_multiplier),
        "epsilon": float(summary.epsilon), "steps": int(summary.steps),
        "batch_size": int(summary.batch_size), "epochs": int(summary.epochs),
        "training_seconds": float(summary.seconds), "run_seconds": wall,
        "load_before": list(load_before), "load_after": list(os.getloadavg()),
        "command": command,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="names of GRID rows to run")
    parser.add_argument("--quick", action="store_true", help="2000 images, batch 256")
    parser.add_argument("--json", type=Path, default=RESULTS / "mnist_clipping.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [g for g in GRID if not args.only or g[0] in args.only]
    out: list[dict[str, Any]] = []
    if args.json.exists() and args.only:  # add to the rows measured before
        out = [r for r in json.loads(args.json.read_text())["runs"]
               if r["name"] not in {g[0] for g in rows}]
    with tempfile.TemporaryDirectory(prefix="dpfy-clipping-") as tmp:
        for name, clipping, clip, lr in rows:
            row = run_one(name, clipping, clip, lr, args, Path(tmp))
            out.append(row)
            print(f"{name}: validation accuracy {100 * float(row['validation_accuracy']):.2f} %"
                  f" (z {row['noise_multiplier']:.4f}, {row['training_seconds']:.0f} s)",
                  flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "benchmark": "benchmarks/clipping.py", "dataset": "mnist (validation split)",
                "cpu_count": os.cpu_count(), "torch_threads": 1, "torch": torch.__version__,
                "python": platform.python_version(), "quick": bool(args.quick),
                "runs": out,
            }, indent=2) + "\n")


if __name__ == "__main__":
    main()

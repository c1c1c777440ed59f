"""DP-FTRL (correlated noise) vs DP-SGD on MNIST at one (epsilon, delta), same compute.

Every configuration trains the ``tanh_cnn`` of ``dpfy train mnist`` (SGD with momentum, EMA
of the weights, clip norm 0.1) for the same number of steps at the same batch size, with its
noise multiplier calibrated to epsilon = 3, delta = 1e-5 by the accounting that is *provable*
for the batches it really draws:

* ``bandmf`` / ``blt`` -- correlated noise (``PrivateTrainer(correlated=plan)``) with the
  ``cyclic`` sampler: one secret permutation cut into batches, the same batches every epoch
  (single pass per epoch, no sampling); the whole run is one ``MatrixMechanism``, exact GDP
  with mu = sensitivity / z (``gaussian``);
* ``dpsgd-shuffle`` -- independent noise with the ``shuffle`` sampler (a fresh permutation per
  epoch) under the honest shuffle bound: no amplification, mu = sqrt(epochs) / z
  (``shuffle`` accountant; Chua et al. 2024a show the Poisson number would not be valid);
* ``dpsgd-poisson`` -- independent noise with Poisson sampling at q = B / N (``pld``): what
  amplification by sampling buys when the sampler really is Poisson.

Budget: 3 seeds x 4 configurations must fit in 40 minutes on one thread, so the default uses
the first 30,000 training images, batch 300 (100 steps per epoch) and 3 epochs (300 steps);
the test set is the full 10,000 images. Seeded runs (reproducible experiments, not DP
releases). Resumable: each finished (configuration, seed) is written to
``results/dpftrl_mnist/runs/`` and skipped when the script is run again.

Usage::

    python benchmarks/dpftrl_mnist.py              # the default (see above), 1 thread
    python benchmarks/dpftrl_mnist.py --quick      # smoke run: 2k images, 2 epochs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dpfy import datasets
from dpfy.correlated import Cyclic, make_plan
from dpfy.randomness import Randomness
from dpfy.sampling import make_sampler
from dpfy.training.recipes import make_model
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

OUT = Path(__file__).resolve().parent / "results" / "dpftrl_mnist"
CONFIGS = {  # name: (sampler, mechanism, accountant)
    "bandmf": ("cyclic", "bandmf", "gaussian"),
    "blt": ("cyclic", "blt", "gaussian"),
    "dpsgd-shuffle": ("shuffle", None, "shuffle"),
    "dpsgd-poisson": ("poisson", None, "pld"),
}


def run_one(name: str, seed: int, data: tuple, args: argparse.Namespace) -> dict:
    sampler_kind, mechanism, method = CONFIGS[name]
    x, y, xt, yt = data
    n = len(x)
    torch.manual_seed(seed)  # the same initialisation for every configuration of a seed
    model = make_model("tanh_cnn")
    sampler = make_sampler(sampler_kind, n, args.batch, randomness=Randomness(1000 + seed))
    per_epoch = int(sampler.steps_per_epoch)
    plan = None
    t0 = time.perf_counter()
    if mechanism is not None:
        plan = make_plan(mechanism, per_epoch * args.epochs, Cyclic(per_epoch),
                         band=min(args.band, per_epoch), buffers=args.buffers)
    plan_seconds = time.perf_counter() - t0
    steps = per_epoch * args.epochs
    trainer = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
        nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        sampler,
        options=TrainerOptions(
            clip_norm=args.clip,
            epochs=args.epochs,
            delta=args.delta,
            target_epsilon=args.epsilon,
            max_physical_batch_size=args.batch + (
            int(4 * args.batch**0.5) + 1 if sampler_kind == "poisson" else 0),
            accounting=method,
            randomness=Randomness(2000 + seed),
            ema_decay=0.99,
            test_data=(xt, yt),
            correlated=plan,
        ),
    )
    cpu0 = time.process_time()
    result = trainer.fit(max_steps=steps)  # Poisson: the same number of steps
    return {
        "config": name,
        "seed": seed,
        "sampler": sampler_kind,
        "mechanism": mechanism or "dpsgd",
        "accounting": result.privacy.method,
        "noise_multiplier": result.noise_multiplier,
        "epsilon": float(result.privacy.epsilon),
        "steps": result.steps,
        "test_accuracy": 100.0 * float(trainer.evaluate() or 0.0),
        "accuracy_by_epoch": [100.0 * float(e.test_accuracy or 0.0)
                              for e in result.history.epochs],
        "sensitivity": None if plan is None else plan.sensitivity,
        "plan_seconds": plan_seconds,
        "seconds": float(result.seconds),
        "cpu_seconds": time.process_time() - cpu0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-limit", type=int, default=30_000)
    ap.add_argument("--batch", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--clip", type=float, default=0.1)
    ap.add_argument("--band", type=int, default=16)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="smoke run: 2k images, 2 epochs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.train_limit, args.epochs, args.batch, args.seeds = 2_000, 2, 200, 1
        args.out = args.out / "quick"
    x, y = datasets.load("mnist", "train", limit=args.train_limit)
    xt, yt = datasets.load("mnist", "test", limit=1_000 if args.quick else None)
    data = (x, y, xt, yt)
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    tag = f"n{len(x)}_b{args.batch}_e{args.epochs}_eps{args.epsilon:g}"
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for seed in range(args.seeds):
        for name in args.configs:
            path = runs_dir / f"{tag}_{name}_s{seed}.json"
            if path.exists():  # resumable: a finished (configuration, seed) is kept
                results[name].append(json.loads(path.read_text()))
                continue
            t0 = time.perf_counter()
            res = run_one(name, seed, data, args)
            path.write_text(json.dumps(res, indent=2))
            results[name].append(res)
            print(f"  {name:<14} seed={seed} acc={res['test_accuracy']:.2f} % "
                  f"z={res['noise_multiplier']:.3f} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)

    rows = []
    for name, runs in results.items():
        accs = [r["test_accuracy"] for r in runs]
        rows.append({
            "config": name,
            "sampler": runs[0]["sampler"],
            "accounting": runs[0]["accounting"],
            "noise_multiplier": runs[0]["noise_multiplier"],
            "sensitivity": runs[0]["sensitivity"],
            "epsilon": max(r["epsilon"] for r in runs),
            "test_accuracy": statistics.mean(accs),
            "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else None,
            "per_seed": accs,
            "seconds": statistics.mean(r["seconds"] for r in runs),
        })
    head = (f"{'config':<15}{'sampler':<9}{'accounting':<11}{'z':>8}{'sens':>7}{'eps':>8}"
            f"{'acc %':>8}{'sd':>6}{'time s':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sens = "" if r["sensitivity"] is None else f"{r['sensitivity']:.3f}"
        sd = "" if r["test_accuracy_std"] is None else f"{r['test_accuracy_std']:.2f}"
        lines.append(
            f"{r['config']:<15}{r['sampler']:<9}{r['accounting']:<11}"
            f"{r['noise_multiplier']:>8.3f}{sens:>7}{r['epsilon']:>8.4f}"
            f"{r['test_accuracy']:>8.2f}{sd:>6}{r['seconds']:>8.0f}"
        )
    setup = (f"MNIST tanh_cnn, N={len(x)}, batch {args.batch}, {args.epochs} epochs "
             f"({results[args.configs[0]][0]['steps']} steps), epsilon "
             f"{args.epsilon:g}, delta {args.delta:g}, lr {args.lr:g}, momentum "
             f"{args.momentum:g}, clip {args.clip:g}, EMA 0.99, {args.seeds} seeds, "
             f"{args.threads} thread(s); seeded experiments")
    table = setup + "\n\n" + "\n".join(lines) + "\n"
    print(table)
    (args.out / f"{tag}.txt").write_text(table)
    report = {"setup": setup, "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "runs": results}
    (args.out / f"{tag}.json").write_text(json.dumps(report, indent=2))
    _figure(results, args.out / f"{tag}.png", setup)
    return 0


def _figure(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, runs in results.items():
        per_epoch = [r["accuracy_by_epoch"] for r in runs]
        epochs = range(1, len(per_epoch[0]) + 1)
        mean = [statistics.mean(v) for v in zip(*per_epoch, strict=True)]
        ax.plot(epochs, mean, marker="o", label=f"{name} (z={runs[0]['noise_multiplier']:.2f})")
        for acc in per_epoch:
            ax.plot(epochs, acc, color=ax.lines[-1].get_color(), alpha=0.25, lw=0.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

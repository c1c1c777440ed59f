"""DP fine-tuning of MiniLM on rotten tomatoes vs non-private fine-tuning and frozen-feature DP-FC.

Configurations (``--configs``, comma separated; default all):

* ``{full,lora}-eps{1,3,8}``: :func:`dpfy.training.text.train_text_classifier` (DP-Adam,
  Poisson sampling, expected batch 256, clip 1.0, delta 1e-5, noise calibrated with PLD; full:
  lr 1e-4, head and encoder clipped separately; LoRA r=8 on query/value: lr 5e-4, joint
  clipping; the head lr 1e-2 in both; see that module's docstring);
* ``{full,lora}-nonprivate``: the same model, optimiser, learning rate, batch size and epochs
  without clipping or noise (shuffled batches of 256, Adam);
* ``dpfc-eps{1,3,8}``: DP-FC (Mehta et al. 2023; 10 steps, lr 2.0) on the frozen, mean-pooled
  all-MiniLM-L6-v2 embeddings (:mod:`dpfy.features`); the embeddings are extracted once and
  cached outside the repository.

Every configuration writes ``benchmarks/results/sentiment/<config>.json`` when it finishes; a
rerun skips configurations whose file exists (``--force`` reruns them), so the benchmark is
resumable per configuration. ``sentiment.md`` (table) and ``sentiment.png`` (test accuracy vs
epsilon: lines for full, LoRA and DP-FC, horizontal lines for non-private) are rewritten from
all finished files after every configuration. Runs are seeded experiments (``--seed``, default
0): reproducible, not DP releases; the privacy accounting is the same as a secure run's.

Budget: full fine-tuning gets fewer epochs than LoRA (``--epochs-full`` 2, ``--epochs-lora`` 3
by default); with snippets cut to their batch's length (``trim_padding``) one configuration takes
15-35 minutes on one core, the whole benchmark about 2 hours of two cores. It runs with one
torch thread by default (``--threads``) so as not to starve a shared machine; run two
processes with disjoint ``--configs`` to use two cores (finished files are shared).
``--lr-full`` / ``--lr-lora`` change the encoder's rate (write those runs to their own
``--out``). Quick look::

    PYTHONPATH=src python benchmarks/sentiment.py --configs lora-eps8 --train-limit 512 \\
        --test-limit 256 --out /tmp/sentiment
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

RESULTS = Path(__file__).parent / "results" / "sentiment"
EPSILONS = (1.0, 3.0, 8.0)
DELTA = 1e-5
MODES = ("full", "lora")
CONFIGS = [
    *(f"{mode}-eps{eps:g}" for mode in MODES for eps in EPSILONS),
    *(f"{mode}-nonprivate" for mode in MODES),
    *(f"dpfc-eps{eps:g}" for eps in EPSILONS),
]
#: DP-FC on frozen MiniLM embeddings at eps 8, measured earlier (mean of 3 seeds, 10 steps,
#: tuned ridge): benchmarks/results/features_rotten_tomatoes.md.
DPFC_EARLIER = {1.0: 0.7455, 2.0: 0.7524, 8.0: 0.7588}


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _parse(config: str) -> tuple[str, float | None]:
    mode, _, rest = config.partition("-")
    return mode, (None if rest == "nonprivate" else float(rest.removeprefix("eps")))


def _lr(mode: str, args: argparse.Namespace) -> float | None:
    """The encoder's Adam rate of ``mode`` from ``--lr-full`` / ``--lr-lora`` (None: default)."""
    return args.lr_lora if mode == "lora" else args.lr_full


def run_dp(config: str, args: argparse.Namespace) -> dict[str, Any]:
    from dpfy.config import RunConfig
    from dpfy.training.recipes import RunHooks
    from dpfy.training.text import train_text_classifier

    mode, eps = _parse(config)
    assert eps is not None
    epochs = args.epochs_lora if mode == "lora" else args.epochs_full
    per_epoch: list[dict[str, Any]] = []

    def on_epoch(info: Any) -> None:
        if info.kind == "epoch":
            per_epoch.append({"epoch": info.epoch + 1, "step": info.step,
                              "test_accuracy": info.test_accuracy, "epsilon": info.epsilon,
                              "seconds": time.perf_counter() - start})
            _log(f"{config}: epoch {info.epoch + 1}/{epochs} test {info.test_accuracy:.4f} "
                 f"eps {info.epsilon:.3f}")
        elif info.step % 10 == 0:
            _log(f"{config}: step {info.step}/{info.total_steps} loss {info.loss:.3f}")

    start = time.perf_counter()
    summary = train_text_classifier(
        RunConfig(
            dataset="rotten-tomatoes", lora=mode == "lora", target_epsilon=eps, delta=DELTA,
            epochs=epochs, seed=args.seed, threads=args.threads,
            train_limit=args.train_limit, test_limit=args.test_limit,
            max_length=args.max_length, learning_rate=_lr(mode, args),
        ),
        hooks=RunHooks(callbacks=[on_epoch]),
    )
    return {
        "test_accuracy": summary.test_accuracy, "epsilon": summary.epsilon,
        "accounting": summary.accounting, "noise_multiplier": summary.noise_multiplier,
        "steps": summary.steps, "epochs": epochs, "learning_rate": summary.learning_rate,
        "batch_size": summary.batch_size, "clip_norm": summary.clip_norm,
        "clipping": summary.ledger.metadata.get("clipping"),  # as the run recorded it
        "seconds": summary.seconds, "stopped": summary.stopped, "per_epoch": per_epoch,
    }


def run_nonprivate(config: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dpfy import datasets
    from dpfy.models.pretrained import load_minilm_tokenizer
    from dpfy.training.text import (
        TEXT_DEFAULTS,
        evaluate_text,
        make_text_model,
        text_optimizer,
        tokenize,
        trim_padding,
    )

    mode, _ = _parse(config)
    lora = mode == "lora"
    defaults = TEXT_DEFAULTS[mode]
    epochs = args.epochs_lora if lora else args.epochs_full
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = load_minilm_tokenizer()
    tr = datasets.rotten_tomatoes("train", limit=args.train_limit)
    te = datasets.rotten_tomatoes("test", limit=args.test_limit)
    train, test = (tokenize(s.texts, s.labels, args.max_length, tok) for s in (tr, te))
    lengths = train.lengths()
    net = make_text_model("minilm", lora=lora)
    lr = _lr(mode, args) or defaults["learning_rate"]
    opt = text_optimizer(net, lr, defaults["head_learning_rate"])
    batch, physical = int(defaults["batch_size"]), 64
    gen = torch.Generator().manual_seed(args.seed)
    per_epoch: list[dict[str, Any]] = []
    start = time.perf_counter()
    net.train()
    for epoch in range(epochs):
        order = torch.randperm(len(train), generator=gen)
        for step, i in enumerate(range(0, len(train), batch)):
            # shortest first, so each chunk is cut to about its own length (as the DP runs)
            idx = order[i : i + batch]
            idx = idx[torch.argsort(lengths[idx], stable=True)]
            opt.zero_grad()
            total = 0.0
            for j in range(0, len(idx), physical):
                rows = idx[j : j + physical]
                inputs = trim_padding({k: v[rows] for k, v in train.tokens.items()})
                loss = torch.nn.functional.cross_entropy(
                    net(**inputs).logits, train.labels[rows], reduction="sum"
                ) / len(idx)
                loss.backward()
                total += float(loss.detach())
            opt.step()
            if step % 10 == 0:
                _log(f"{config}: epoch {epoch + 1} step {step} loss {total:.3f}")
        acc = evaluate_text(net, test)
        per_epoch.append({"epoch": epoch + 1, "test_accuracy": acc,
                          "seconds": time.perf_counter() - start})
        _log(f"{config}: epoch {epoch + 1}/{epochs} test {acc:.4f}")
    return {
        "test_accuracy": per_epoch[-1]["test_accuracy"], "epsilon": math.inf, "epochs": epochs,
        "learning_rate": lr, "batch_size": batch,
        "seconds": time.perf_counter() - start, "per_epoch": per_epoch,
    }


#: DP-FC ridge multiplier ``c`` per epsilon (ridge = c * max(z sqrt(d), 1), z for the T + 1
#: releases), the values chosen on a validation split by benchmarks/features.py for 10 steps
#: (benchmarks/results/features_rotten_tomatoes.json); lr 2.0 as there.
DPFC_RIDGE_C = {1.0: 1.0, 3.0: 1.0, 8.0: 3.0}
DPFC_STEPS, DPFC_LR = 10, 2.0


def _dpfc_ridge(eps: float, d: int) -> float:
    """The ridge of benchmarks/features.py: ``c * max(z sqrt(d), 1)`` in sum units."""
    from dpfy.features import accounting as facc

    z = float(facc.noise_multipliers(facc.mu_for_target(eps, DELTA), [1.0] * (DPFC_STEPS + 1))[0])
    return DPFC_RIDGE_C.get(eps, 1.0) * max(z * math.sqrt(d), 1.0)


def run_dpfc(config: str, args: argparse.Namespace) -> dict[str, Any]:
    from dpfy.features import DPFeatureCovarianceClassifier, extract

    _, eps = _parse(config)
    x, y, is_test = extract.text_features()
    x_tr, y_tr, x_te, y_te = x[~is_test], y[~is_test], x[is_test], y[is_test]
    if args.train_limit is not None:
        x_tr, y_tr = x_tr[: args.train_limit], y_tr[: args.train_limit]
    if args.test_limit is not None:
        x_te, y_te = x_te[: args.test_limit], y_te[: args.test_limit]
    start = time.perf_counter()
    ridge = _dpfc_ridge(eps, x_tr.shape[1])
    est = DPFeatureCovarianceClassifier(epsilon=eps, delta=DELTA, steps=DPFC_STEPS,
                                        learning_rate=DPFC_LR, ridge=ridge,
                                        random_state=args.seed).fit(x_tr, y_tr)
    acc = float(np.mean(est.predict(x_te) == np.asarray(y_te)))
    return {"test_accuracy": acc, "epsilon": eps, "steps": DPFC_STEPS,
            "learning_rate": DPFC_LR, "ridge": ridge,
            "seconds": time.perf_counter() - start}


def run(config: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, eps = _parse(config)
    if mode == "dpfc":
        result = run_dpfc(config, args)
    elif eps is None:
        result = run_nonprivate(config, args)
    else:
        result = run_dp(config, args)
    if "per_epoch" in result and result["per_epoch"]:
        result["seconds_per_epoch"] = result["seconds"] / len(result["per_epoch"])
    return {
        "config": config, "mode": mode, "target_epsilon": eps, "delta": DELTA,
        "seed": args.seed, "train_limit": args.train_limit, "test_limit": args.test_limit,
        "max_length": args.max_length, "threads": args.threads, **result,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "### DP fine-tuning of all-MiniLM-L6-v2 on rotten tomatoes (split by movie)",
        "",
        f"Test accuracy (%), delta={DELTA:g}, Poisson sampling, seed 0 (one run each); "
        "time = training wall seconds, 1 torch thread per run (2-3 runs shared 2 cores, so "
        "s / epoch varies with the load); DP-FC: 10 steps on cached embeddings.",
        "",
        "| config | target eps | eps (ledger) | epochs | lr | train / test examples "
        "| test acc (%) | time (s) | s / epoch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        r = results.get(name)
        if r is None:
            continue
        eps = "inf" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        got = "-" if not math.isfinite(r["epsilon"]) else f"{r['epsilon']:.3f}"
        spe = f"{r['seconds_per_epoch']:.0f}" if "seconds_per_epoch" in r else "-"
        limits = f"{r['train_limit'] or 'all'} / {r['test_limit'] or 'all'}"
        lines.append(
            f"| {name} | {eps} | {got} | {r.get('epochs', '-')} "
            f"| {_fmt(r.get('learning_rate'))} | {limits} "
            f"| {100 * r['test_accuracy']:.2f} | {r['seconds']:.0f} | {spe} |"
        )
    lines += ["", "DP-FC on frozen MiniLM embeddings measured earlier (mean of 3 seeds, "
              "benchmarks/results/features_rotten_tomatoes.md): "
              + ", ".join(f"eps {e:g}: {100 * a:.2f} %" for e, a in DPFC_EARLIER.items()), ""]
    return "\n".join(lines)


def figure(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {"full": "C0", "lora": "C1", "dpfc": "C2"}
    for mode, label in (("full", "DP full fine-tuning"), ("lora", "DP LoRA"),
                        ("dpfc", "DP-FC, frozen embeddings")):
        pts = sorted((r["target_epsilon"], 100 * r["test_accuracy"]) for r in results.values()
                     if r["mode"] == mode and r["target_epsilon"] is not None)
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=colors[mode], label=label)
        nonpriv = results.get(f"{mode}-nonprivate")
        if nonpriv is not None:
            ax.axhline(100 * nonpriv["test_accuracy"], color=colors[mode], ls="--",
                       label=f"non-private {mode}")
    if not any(r["mode"] == "dpfc" for r in results.values()):
        e, a = zip(*DPFC_EARLIER.items(), strict=True)
        ax.plot(e, [100 * v for v in a], "s:", color=colors["dpfc"],
                label="DP-FC, frozen embeddings (earlier)")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("rotten tomatoes, all-MiniLM-L6-v2")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--epochs-full", type=int, default=2)
    parser.add_argument("--epochs-lora", type=int, default=3)
    parser.add_argument("--train-limit", type=int, default=None)
    parser.add_argument("--test-limit", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr-full", type=float, default=None,
                        help="encoder Adam rate of full fine-tuning (default: TEXT_DEFAULTS)")
    parser.add_argument("--lr-lora", type=float, default=None,
                        help="Adam rate of the LoRA factors (default: TEXT_DEFAULTS)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--force", action="store_true", help="rerun finished configurations")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs must be a subset of {{{','.join(CONFIGS)}}}, got {unknown}")
    for name in ("epochs_full", "epochs_lora", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for config in configs:
        path = args.out / f"{config}.json"
        if path.exists() and not args.force:
            _log(f"{config}: done earlier ({path}), skipped")
            continue
        _log(f"{config}: start")
        result = run(config, args)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(path)  # a configuration is finished exactly when its file exists
        _log(f"{config}: test accuracy {100 * result['test_accuracy']:.2f} % "
             f"in {result['seconds']:.0f} s")
        results = {p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))}
        (args.out / "sentiment.md").write_text(table(results))
        figure(results, args.out / "sentiment.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  cached outside the repository. Its ridge was chosen on rotten tomatoes' own validation split
  (``DPFC_RIDGE_C``): ``unaccounted search``, no total epsilon. DP-FC rows at the total epsilon
  of the whole procedure: ``benchmarks/sentiment_total_eps.py``.

Recipes whose hyperparameters are chosen on the validation split (held-out movies of the
training split, never the test split), 2 seeds each:

* ``{lpft,bitfit,lora16all}-eps{1,3,8}``: LP-FT (a DP-FC probe on the frozen embeddings
  spending ``LPFT_SHARE`` of the budget, then full DP fine-tuning from its head; one ledger),
  bias-only DP-BiTFiT (Bu et al. 2022) and LoRA r=16 on every linear layer. The search is
  ``dpfy tune`` (:func:`dpfy.tuning_runs.tune_and_report`: ``--trials`` mean, ``--distribution``
  of K, the space of :func:`tuned_space`: Adam's rate log-uniform around the recipe's default
  and the warm-up), the chosen configuration is released with ``--seed`` and retrained with
  ``--seed + 1``; each row gives the mean test accuracy, half the spread of the two seeds, the
  final run's epsilon alone AND the whole search's (trials, choice and the final run,
  accounted from their ledgers), per-epoch test accuracy and wall minutes of the whole row;
* ``{lpft,bitfit,lora16all}-nonprivate``: the same recipe without clipping or noise, the
  encoder's rate chosen from a grid of three on the validation split (no privacy to account),
  then 2 seeds on the test split.

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
``--out``). A tuned DP row is a search (K trials on about 80 % of the training snippets, K
geometric with mean ``--trials`` 4) and two released runs: about 6 runs of 15-35 minutes, 2-3
hours of one core; a tuned non-private row 5 runs without per-example gradients, about 1 hour.
The 12 tuned rows: about 25 core-hours, 13 hours with two processes (disjoint ``--configs``)::

    PYTHONPATH=src python benchmarks/sentiment.py --configs \
        lpft-eps1,lpft-eps3,lpft-eps8,lpft-nonprivate,bitfit-eps1,bitfit-nonprivate
    PYTHONPATH=src python benchmarks/sentiment.py --configs \
        bitfit-eps3,bitfit-eps8,lora16all-eps1,lora16all-eps3,lora16all-eps8,lora16all-nonprivate

(searches live in ``<out>/runs/<config>/`` and resume there). ``--device cuda`` trains every run
on a GPU: on one H200 the 12 tuned rows ran at once, one process each, in 3.6-6.4 minutes per
row (``benchmarks/gpu/sentiment.sh``). Quick look::

    PYTHONPATH=src python benchmarks/sentiment.py --configs lora-eps8 --train-limit 512 \\
        --test-limit 256 --out /tmp/sentiment
"""

from __future__ import annotations

import argparse
import dataclasses
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
#: The recipes tuned on the validation split: RunConfig options and epochs.
RECIPES: dict[str, dict[str, Any]] = {
    "lpft": {"linear_probe": 0.25, "epochs": 2},
    "bitfit": {"bias_only": True, "epochs": 3},
    "lora16all": {"lora": True, "lora_rank": 16, "lora_targets": "all-linear", "epochs": 3},
}
#: LP-FT's share of the target epsilon spent by the probe (calibrated alone; stated).
LPFT_SHARE = RECIPES["lpft"]["linear_probe"]
CONFIGS = [
    *(f"{mode}-eps{eps:g}" for mode in MODES for eps in EPSILONS),
    *(f"{mode}-nonprivate" for mode in MODES),
    *(f"dpfc-eps{eps:g}" for eps in EPSILONS),
    *(f"{r}-eps{eps:g}" for r in RECIPES for eps in EPSILONS),
    *(f"{r}-nonprivate" for r in RECIPES),
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
    from dpfy.training.skeleton import RunHooks
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
            max_length=args.max_length, learning_rate=_lr(mode, args), device=args.device,
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
    from dpfy.training.text import TEXT_DEFAULTS, make_text_model, text_optimizer, tokenize

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
    net = make_text_model("minilm", lora=lora).to(args.device or "cpu")
    lr = _lr(mode, args) or defaults["learning_rate"]
    opt = text_optimizer(net, lr, defaults["head_learning_rate"])
    batch = int(defaults["batch_size"])
    per_epoch: list[dict[str, Any]] = []
    start = time.perf_counter()
    _epochs(net, opt, train, test, epochs, args.seed, config, per_epoch)
    return {
        "test_accuracy": per_epoch[-1]["test_accuracy"], "epsilon": math.inf, "epochs": epochs,
        "learning_rate": lr, "batch_size": batch,
        "seconds": time.perf_counter() - start, "per_epoch": per_epoch,
    }


def _epochs(
    net: Any, opt: Any, train: Any, test: Any, epochs: int, seed: int, config: str,
    per_epoch: list[dict[str, Any]],
) -> None:
    """Non-private Adam epochs (shuffled batches of 256, chunks of 64 cut to their length),
    the test accuracy appended to ``per_epoch`` after each."""
    import torch

    from dpfy.training.text import evaluate_text, trim_padding

    batch = 256
    device = next(net.parameters()).device
    physical = 64 if device.type == "cpu" else 256
    lengths = train.lengths()
    gen = torch.Generator().manual_seed(seed)
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
                inputs = trim_padding({k: v[rows].to(device) for k, v in train.tokens.items()})
                loss = torch.nn.functional.cross_entropy(
                    net(**inputs).logits, train.labels[rows].to(device), reduction="sum"
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


#: DP-FC ridge multiplier ``c`` per epsilon (ridge = c * max(z sqrt(d), 1), z for the T + 1
#: releases), the values chosen on a validation split by benchmarks/features.py for 10 steps
#: (benchmarks/results/features_rotten_tomatoes.json); lr 2.0 as there. That validation split is
#: rotten tomatoes' own training data, searched without noise: the dpfc-eps* rows are
#: ``unaccounted search`` (no total epsilon). Rows whose choice did not look at this data set:
#: benchmarks/sentiment_total_eps.py.
DPFC_RIDGE_C = {1.0: 1.0, 3.0: 1.0, 8.0: 3.0}
DPFC_STEPS, DPFC_LR = 10, 2.0


def _dpfc_ridge(eps: float, d: int, c: float | None = None, steps: int = DPFC_STEPS) -> float:
    """The ridge of benchmarks/features.py: ``c * max(z sqrt(d), 1)`` in sum units (features of
    unit norm), ``z`` the noise multiplier of each of the ``steps + 1`` equal releases at
    (``eps``, ``DELTA``); ``c`` defaults to ``DPFC_RIDGE_C[eps]``."""
    from dpfy.features import accounting as facc

    z = float(facc.noise_multipliers(facc.mu_for_target(eps, DELTA), [1.0] * (steps + 1))[0])
    c = DPFC_RIDGE_C.get(eps, 1.0) if c is None else c
    return c * max(z * math.sqrt(d), 1.0)


def dpfc_data(train_limit: int | None = None, test_limit: int | None = None) -> tuple[Any, ...]:
    """``(x_train, y_train, x_test, y_test)``: the cached unit-norm MiniLM embeddings (384-d) of
    the rotten-tomatoes training and test snippets (split by movie), optionally cut."""
    from dpfy.features import extract

    x, y, is_test = extract.text_features()
    x_tr, y_tr, x_te, y_te = x[~is_test], y[~is_test], x[is_test], y[is_test]
    return x_tr[:train_limit], y_tr[:train_limit], x_te[:test_limit], y_te[:test_limit]


def fit_dpfc(eps: float, seed: int, data: tuple[Any, ...], **hp: Any) -> dict[str, Any]:
    """One DP-FC fit (:class:`dpfy.features.DPFeatureCovarianceClassifier`) at target ``eps``
    (delta ``DELTA``) with noise seed ``seed`` (``random_state``); ``hp`` are its parameters
    (``steps``, ``learning_rate``, ``ridge``: the estimator's defaults where omitted).

    Returns the test accuracy (fraction), the ledger's epsilon, the parameters used and the
    fit's wall seconds."""
    from dpfy.datasets import CLASSES
    from dpfy.features import DPFeatureCovarianceClassifier

    x_tr, y_tr, x_te, y_te = data
    start = time.perf_counter()
    est = DPFeatureCovarianceClassifier(
        epsilon=eps, delta=DELTA, classes=CLASSES["rotten-tomatoes"], random_state=seed, **hp
    ).fit(x_tr, y_tr)
    acc = float(np.mean(est.predict(x_te) == np.asarray(y_te)))
    return {"test_accuracy": acc, "epsilon": float(est.privacy_.epsilon), "steps": est.steps,
            "learning_rate": est.learning_rate, "ridge": est.ridge,
            "seconds": time.perf_counter() - start}


def run_dpfc(config: str, args: argparse.Namespace) -> dict[str, Any]:
    _, eps = _parse(config)
    assert eps is not None
    data = dpfc_data(args.train_limit, args.test_limit)
    fitted = fit_dpfc(eps, args.seed, data, steps=DPFC_STEPS, learning_rate=DPFC_LR,
                      ridge=_dpfc_ridge(eps, data[0].shape[1]))
    # c was chosen on rotten tomatoes' own validation split without noise (DPFC_RIDGE_C)
    return {**fitted, "hp_source": "unaccounted search", "total_epsilon": None}


def _recipe_mode(recipe: str) -> str:
    """The fine-tuning mode of a tuned recipe (its TEXT_DEFAULTS row)."""
    options = RECIPES[recipe]
    return "lora" if options.get("lora") else "bitfit" if options.get("bias_only") else "full"


def tuned_space(recipe: str) -> dict[str, Any]:
    """The searched space of a tuned recipe: Adam's rate of the encoder log-uniform within a
    factor 3 of the recipe's default, and the warm-up (none or a tenth of the steps)."""
    from dpfy.training.text import TEXT_DEFAULTS

    lr = float(TEXT_DEFAULTS[_recipe_mode(recipe)]["learning_rate"])
    return {"learning_rate": {"log_uniform": [lr / 3, lr * 3]},
            "warmup": {"choices": [0.0, 0.1]}}


def _base_config(recipe: str, eps: float, seed: int, args: argparse.Namespace, out: Path) -> Any:
    from dpfy.config import RunConfig

    return RunConfig(
        dataset="rotten-tomatoes", target_epsilon=eps, delta=DELTA, seed=seed,
        threads=args.threads, train_limit=args.train_limit, test_limit=args.test_limit,
        max_length=args.max_length, out=str(out), batch_size=args.batch_size,
        device=args.device, **RECIPES[recipe],
    )


def _per_epoch(ledger_path: Path) -> list[dict[str, Any]]:
    """Test accuracy after each epoch of a released run, as its ledger recorded it."""
    from dpfy.ledger import Ledger

    meta = Ledger.load(ledger_path).metadata
    return [{"step": int(step), "test_accuracy": float(acc)}
            for step, acc in meta.get("accuracy_by_step", [])]


def run_tuned_dp(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """``dpfy tune`` of one recipe at one epsilon, then the chosen configuration with a second
    seed; both epsilons (final run alone, whole search) from the ledgers."""
    from dpfy import runs, tuning_runs

    recipe, eps = _parse(config)
    assert eps is not None
    root = args.out / "runs" / config
    start = time.perf_counter()
    tuned = tuning_runs.tune_and_report(
        _base_config(recipe, eps, args.seed, args, root / "search"),
        tuning_runs.SearchSpace.from_mapping(tuned_space(recipe)),
        tuning_runs.TuneOptions(trials=args.trials, distribution=args.distribution),
        progress=False,
    )
    assert tuned.final is not None and tuned.chosen is not None  # no K = 0 with these
    chosen = tuned.trials[tuned.chosen].params
    second_dir = root / f"seed{args.seed + 1}-{time.strftime('%Y%m%d-%H%M%S')}"
    second = runs.train_and_report(
        _base_config(recipe, eps, args.seed + 1, args, second_dir).replace(**chosen))
    accs = [tuned.final.test_accuracy, second.test_accuracy]
    _log(f"{config}: chosen {chosen}; test {accs}; eps final {tuned.final_epsilon:.3f}, "
         f"whole search {tuned.search_epsilon:.3f}")
    return {
        "test_accuracy": float(np.mean(accs)), "test_accuracies": accs,
        "spread": (max(accs) - min(accs)) / 2, "epsilon": tuned.final_epsilon,
        "search_epsilon": tuned.search_epsilon, "search_method": tuned.method,
        "all_scores_epsilon": tuned.all_scores_epsilon, "chosen": chosen,
        "trials": [dataclasses.asdict(t) for t in tuned.trials],
        "epochs": RECIPES[recipe]["epochs"], "learning_rate": chosen.get("learning_rate"),
        "per_epoch": [_per_epoch(tuned.final.ledger_path), _per_epoch(second.ledger_path)],
        "seconds": time.perf_counter() - start,
    }


def run_tuned_nonprivate(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """The recipe without privacy: the encoder's rate from a grid of three on the validation
    split, then two seeds on the test split."""
    from dpfy import datasets
    from dpfy.training.text import TEXT_DEFAULTS

    recipe, _ = _parse(config)
    options = RECIPES[recipe]
    start = time.perf_counter()
    split = datasets.rotten_tomatoes("train", limit=args.train_limit)
    fit_part, held = datasets.split_rotten_tomatoes(split)
    test = datasets.rotten_tomatoes("test", limit=args.test_limit)
    lr0 = float(TEXT_DEFAULTS[_recipe_mode(recipe)]["learning_rate"])
    grid = {}
    for lr in (lr0 / 3, lr0, lr0 * 3):
        grid[lr] = _nonprivate_fit(options, lr, args.seed, fit_part, held, args, config)
        _log(f"{config}: lr {lr:g} validation {grid[lr][-1]['test_accuracy']:.4f}")
    best = max(grid, key=lambda lr: grid[lr][-1]["test_accuracy"])
    runs_ = [_nonprivate_fit(options, best, seed, split, test, args, config)
             for seed in (args.seed, args.seed + 1)]
    accs = [r[-1]["test_accuracy"] for r in runs_]
    return {
        "test_accuracy": float(np.mean(accs)), "test_accuracies": accs,
        "spread": (max(accs) - min(accs)) / 2, "epsilon": math.inf,
        "epochs": options["epochs"], "learning_rate": best,
        "validation": {f"{lr:g}": r[-1]["test_accuracy"] for lr, r in grid.items()},
        "per_epoch": runs_, "seconds": time.perf_counter() - start,
    }


def _nonprivate_fit(
    options: dict[str, Any], lr: float, seed: int, train_split: Any, test_split: Any,
    args: argparse.Namespace, label: str,
) -> list[dict[str, Any]]:
    """Non-private Adam on ``train_split`` (LP-FT: one epoch of the head alone first);
    per-epoch accuracy on ``test_split``."""
    import torch

    from dpfy.models.pretrained import load_minilm_tokenizer
    from dpfy.training.text import TEXT_DEFAULTS, make_text_model, text_optimizer, tokenize

    torch.manual_seed(seed)
    tok = load_minilm_tokenizer()
    train, test = (tokenize(s.texts, s.labels, args.max_length, tok)
                   for s in (train_split, test_split))
    net = make_text_model("minilm", lora=bool(options.get("lora")),
                          lora_rank=int(options.get("lora_rank", 8)),
                          lora_targets=str(options.get("lora_targets", "attention")),
                          bias_only=bool(options.get("bias_only"))).to(args.device or "cpu")
    head_lr = float(TEXT_DEFAULTS["full"]["head_learning_rate"])
    per_epoch: list[dict[str, Any]] = []
    if "linear_probe" in options:  # LP: the head alone on the frozen encoder, one epoch
        frozen = [p for n, p in net.named_parameters() if not n.startswith("head.")]
        for p in frozen:
            p.requires_grad_(False)
        _epochs(net, text_optimizer(net, lr, head_lr), train, test, 1, seed, label, [])
        for p in frozen:
            p.requires_grad_(True)
    _epochs(net, text_optimizer(net, lr, head_lr), train, test, int(options["epochs"]), seed,
            label, per_epoch)
    return per_epoch


def run(config: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, eps = _parse(config)
    if mode in RECIPES:
        result = run_tuned_dp(config, args) if eps is not None else run_tuned_nonprivate(
            config, args)
    elif mode == "dpfc":
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
        "max_length": args.max_length, "threads": args.threads,
        "device": _device_name(args.device), **result,
    }


def _device_name(device: str | None) -> str:
    """The device the runs trained on, as the results record it (a GPU by its name)."""
    import torch

    if device is None or device == "cpu":
        return "cpu"
    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


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
        if r is None or r["mode"] in RECIPES:
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
    return "\n".join(lines + tuned_table(results))


def tuned_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The rows of the recipes tuned on the validation split (both epsilons)."""
    rows = [r for name in CONFIGS if (r := results.get(name)) is not None
            and r["mode"] in RECIPES]
    if not rows:
        return []
    lines = [
        "### Recipes tuned on the validation split (held-out training movies)", "",
        f"Test accuracy (%) of the chosen configuration, mean of 2 seeds +- half their spread; "
        f"LP-FT's probe spends {LPFT_SHARE:g} of the target alone. eps final: the released run "
        "alone; eps search: the whole search (trials' noisy validation scores, the choice and "
        "the final run), from the ledgers by the tuning accountant. Wall: the whole row "
        "(search and both seeds).", "",
        "| config | target eps | eps final | eps search | trials | chosen | test acc (%) "
        "| per epoch (%) | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "inf" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        final = "-" if not math.isfinite(r["epsilon"]) else f"{r['epsilon']:.3f}"
        search = f"{r['search_epsilon']:.3f}" if r.get("search_epsilon") else "-"
        trials = len(r["trials"]) if "trials" in r else len(r.get("validation", {}))
        chosen = r.get("chosen") or {"learning_rate": r.get("learning_rate")}
        chosen_text = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in chosen.items())
        first = r["per_epoch"][0] if r.get("per_epoch") else []
        epochs = " / ".join(f"{100 * e['test_accuracy']:.1f}" for e in first)
        lines.append(
            f"| {r['config']} | {eps} | {final} | {search} | {trials} | {chosen_text} "
            f"| {100 * r['test_accuracy']:.2f} +- {100 * r.get('spread', 0.0):.2f} "
            f"| {epochs} | {r['seconds'] / 60:.1f} |")
    return [*lines, ""]


def figure(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    colors = {"full": "C0", "lora": "C1", "dpfc": "C2", "lpft": "C3", "bitfit": "C4",
              "lora16all": "C5"}
    for mode, label in (("full", "DP full fine-tuning"), ("lora", "DP LoRA"),
                        ("dpfc", "DP-FC, frozen embeddings"), ("lpft", "DP LP-FT (tuned)"),
                        ("bitfit", "DP bias-only (tuned)"),
                        ("lora16all", "DP LoRA r=16 all linear (tuned)")):
        pts = sorted((r["target_epsilon"], 100 * r["test_accuracy"], 100 * r.get("spread", 0))
                     for r in results.values()
                     if r["mode"] == mode and r["target_epsilon"] is not None)
        if pts:
            e, a, err = zip(*pts, strict=True)
            ax.errorbar(e, a, yerr=err, fmt="o-", color=colors[mode], label=label, capsize=3)
        nonpriv = results.get(f"{mode}-nonprivate")
        if nonpriv is not None:
            ax.axhline(100 * nonpriv["test_accuracy"], color=colors[mode], ls="--",
                       label=f"non-private {mode}")
    if not any(r["mode"] == "dpfc" for r in results.values()):
        e, a = zip(*DPFC_EARLIER.items(), strict=True)
        ax.plot(e, [100 * v for v in a], "s:", color=colors["dpfc"],
                label="DP-FC, frozen embeddings (earlier)")
    ax.set_xscale("log")
    ax.set_xticks(list(EPSILONS), [f"{e:g}" for e in EPSILONS])
    ax.minorticks_off()
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("rotten tomatoes, all-MiniLM-L6-v2")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def epochs_figure(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Test accuracy after each epoch of the tuned recipes' released runs (both seeds), one
    panel per recipe, one colour per epsilon: under-trained curves still rise at the end,
    noise-bound ones are flat or fall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = [r for r in RECIPES if any(x["mode"] == r for x in results.values())]
    if not recipes:
        return
    fig, axes = plt.subplots(1, len(recipes), figsize=(4 * len(recipes), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    colors = {1.0: "C0", 3.0: "C1", 8.0: "C2", None: "k"}
    for ax, recipe in zip(axes, recipes, strict=True):
        for eps in (*EPSILONS, None):
            r = results.get(f"{recipe}-" + ("nonprivate" if eps is None else f"eps{eps:g}"))
            if r is None:
                continue
            label = "non-private" if eps is None else f"epsilon {eps:g}"
            for i, run in enumerate(r.get("per_epoch") or []):
                acc = [100 * e["test_accuracy"] for e in run]
                ax.plot(range(1, len(acc) + 1), acc, "o-" if i == 0 else "s--",
                        color=colors[eps], label=label if i == 0 else None, alpha=0.8)
        ax.set_title(recipe)
        ax.set_xlabel("epoch")
        ax.set_xticks(range(1, int(RECIPES[recipe]["epochs"]) + 1))
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].legend(fontsize=7)
    fig.suptitle("tuned recipes, per epoch (seed 0 solid, seed 1 dashed)", fontsize=9)
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
    parser.add_argument("--device", default=None,
                        help="cpu (default), cuda or cuda:<index>: where every run trains")
    parser.add_argument("--lr-full", type=float, default=None,
                        help="encoder Adam rate of full fine-tuning (default: TEXT_DEFAULTS)")
    parser.add_argument("--lr-lora", type=float, default=None,
                        help="Adam rate of the LoRA factors (default: TEXT_DEFAULTS)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="tuned recipes: expected batch size (default: the recipe's, 256)")
    parser.add_argument("--trials", type=float, default=4.0,
                        help="tuned recipes: mean number of trials of each search")
    parser.add_argument("--distribution", default="geometric",
                        choices=("poisson", "geometric", "logarithmic", "fixed"),
                        help="tuned recipes: distribution of the number of trials")
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
        epochs_figure(results, args.out / "sentiment_epochs.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

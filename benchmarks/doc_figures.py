"""The figures that README.md and docs/*.md quote, computed again from the code.

Accounting only (no training, a few seconds): the demo's epsilon by PLD and by RDP, its
attack-risk bounds, the user-level example's noise multiplier and its example-level reading,
the default user-level batch, and the prefix noise of the tree strategies. Each figure is the
sentence the document quotes, with the numbers filled in by the code that the run would use
(the recipe's defaults, the sampler's event, the accountant). ``tests/test_doc_figures.py``
checks that every sentence is in its document as computed here, so a stale figure fails.

    python benchmarks/doc_figures.py          # each figure's sentence, current or stale
    python benchmarks/doc_figures.py --check  # exit 1 if a document quotes a stale figure
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Figure:
    """One quoted sentence: ``template`` with ``{}`` where the computed numbers go."""

    doc: str
    name: str
    template: str
    compute: Callable[[], tuple[Any, ...]]

    def text(self) -> str:
        return self.template.format(*self.compute())

    def pattern(self) -> re.Pattern[str]:
        """The sentence with any numbers in place of the computed ones (finds a stale one)."""
        parts = [re.escape(p) for p in self.template.split("{}")]
        return re.compile(r"[^\s,;()`]+".join(parts))


def doc_text(doc: str) -> str:
    """A document with every run of white space made one space (sentences wrap)."""
    return " ".join((ROOT / doc).read_text(encoding="utf-8").split())


# --- the demo: `make demo` = `dpfy train mnist --out runs/demo` --------------------------------


@functools.cache
def _demo() -> tuple[Any, ...]:
    """The demo's recipe, run configuration, sampler event and calibrated z (no training)."""
    from dpfy.accounting.calibrate import calibrate_noise_multiplier
    from dpfy.config import RunConfig
    from dpfy.datasets import TRAIN_SIZES
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler
    from dpfy.sampling.kinds import kind as sampler_kind
    from dpfy.training.recipes import default_recipe

    config, recipe = RunConfig(dataset="mnist"), default_recipe()
    sampler = make_sampler(config.sampler_kind, TRAIN_SIZES["mnist"], recipe.batch_size,
                           randomness=Randomness(0))
    method = sampler_kind(sampler.kind).default_accountant  # as the recipe calibrates

    def event(z: float) -> Any:
        return sampler.privacy_event(z, epochs=recipe.epochs)

    z = calibrate_noise_multiplier(event, config.target_epsilon, config.delta, method)
    return config, recipe, event(z), method


def demo_epsilons() -> tuple[str, str]:
    from dpfy import accounting

    config, _, event, method = _demo()
    pld = accounting.epsilon(event, config.delta, method=method).epsilon
    rdp = accounting.epsilon(event, config.delta, method="rdp").epsilon
    return f"{pld:.5f}", f"{rdp:.3f}"


def demo_delta_n() -> tuple[str]:
    from dpfy.datasets import TRAIN_SIZES

    config = _demo()[0]
    return (f"{config.delta * TRAIN_SIZES['mnist']:.3g}",)


def demo_attack_risk() -> tuple[str, ...]:
    from dpfy.accounting.risk import attack_risk

    risk = attack_risk(_demo()[2])
    return tuple(f"{risk.at(a):.2g}" for a in (1e-3, 1e-2, 0.1))


def demo_retrain() -> tuple[Any, ...]:
    config, recipe, _, _ = _demo()
    return (f"{config.target_epsilon:g}", f"{config.delta:g}", config.sampler_kind,
            recipe.epochs, recipe.batch_size, recipe.learning_rate, recipe.clip_norm)


# --- user-level DP: the measured MNIST run and the default batch -------------------------------


def user_level_mnist() -> tuple[str, int, str]:
    """`dpfy train mnist --unit user --users 2000 --cap 10 --train-limit 20000 --epochs 3
    --batch-size 200 --target-epsilon 3`: z, steps, and the report's example-level epsilon."""
    from dpfy.accounting.calibrate import calibrate_noise_multiplier
    from dpfy.accounting.group import group_epsilon
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler

    users, batch, epochs, delta = 2000, 200, 3, 1e-5
    sampler = make_sampler("poisson", users, batch, randomness=Randomness(0), unit="user")

    def event(z: float) -> Any:
        return sampler.privacy_event(z, epochs=epochs)

    z = calibrate_noise_multiplier(event, 3.0, delta, "pld")
    example = group_epsilon(event(z), delta, 2, "pld").epsilon
    return f"{z:.2f}", epochs * int(sampler.steps_per_epoch), f"{example:.1f}"


@functools.cache
def user_level_default_batch() -> tuple[int, int]:
    import numpy as np

    from dpfy.datasets import rotten_tomatoes
    from dpfy.training.text import TEXT_DEFAULTS
    from dpfy.training.users import recipe_batch_size

    movies = len(np.unique(rotten_tomatoes("train").movies))
    return recipe_batch_size(None, TEXT_DEFAULTS["full"]["batch_size"], movies, "movie"), movies


# --- correlated noise: the tree strategies' prefix noise ---------------------------------------


def _tree_rms(steps: int) -> tuple[float, float]:
    """RMS prefix noise per node std over one epoch: efficient tree, plain tree."""
    from dpfy.correlated.tree_efficient import prefix_variances

    plain = sum(bin(t).count("1") for t in range(1, steps + 1)) / steps
    return math.sqrt(float(prefix_variances(steps).mean())), math.sqrt(plain)


def tree_rms(digits: int, *, by_strategy: bool) -> Callable[[], tuple[str, ...]]:
    """Efficient and plain tree at T = 64, then at T = 1024; ``by_strategy``: the efficient
    tree at both, then the plain tree at both."""

    def compute() -> tuple[str, ...]:
        (a, b), (c, d) = _tree_rms(64), _tree_rms(1024)
        return tuple(f"{v:.{digits}f}" for v in ((a, c, b, d) if by_strategy else (a, b, c, d)))

    return compute


@functools.cache
def _compared(dataset_size: int, epochs: int) -> dict[str, Any]:
    from dpfy.run_accounting import compare_mechanisms

    rows = compare_mechanisms(2.0, dataset_size, 10, 1e-5, epochs=epochs)
    return {r.mechanism: r for r in rows}


def tree_compare() -> tuple[str, ...]:
    """At epsilon 2, B = 10: prefix RMSE of the efficient and plain trees at T = 64, 1024 and
    two epochs of 20 steps."""
    out = []
    for size, epochs in ((640, 1), (10_240, 1), (200, 2)):
        rows = _compared(size, epochs)
        out += [f"{rows[m].prefix_rmse:.2f}" for m in ("tree-efficient", "tree")]
    return tuple(out)


def tree_two_epoch_z() -> tuple[str, str]:
    rows = _compared(200, 2)
    return tuple(f"{rows[m].noise_multiplier:.2f}" for m in ("tree-efficient", "tree"))


FIGURES = [
    Figure("README.md", "demo epsilon by PLD and RDP",
           "The calibrated epsilon is {} (PLD; RDP certifies {} for the same run;",
           demo_epsilons),
    Figure("README.md", "demo delta x N", "delta x N = {} (N = 60000)", demo_delta_n),
    Figure("README.md", "demo attack risk",
           "a true-positive rate of at most {}, {} or {} on this run", demo_attack_risk),
    Figure("README.md", "demo re-train line",
           "`dpfy train mnist --target-epsilon {} --delta {} --out runs/demo --sampler {} "
           "--epochs {} --batch-size {} --learning-rate {} --clip-norm {}`", demo_retrain),
    Figure("docs/cli.md", "user-level MNIST run",
           "per user (z = {}, {} steps); the labelled example-level reading of the same run "
           "is epsilon {}.", user_level_mnist),
    Figure("docs/cli.md", "default user-level batch",
           "an epoch has at least 8 steps ({} of the {} movies)", user_level_default_batch),
    Figure("docs/architecture.md", "default user-level batch",
           "at least 8 steps an epoch; {} of the {} movies)", user_level_default_batch),
    Figure("docs/usage.md", "tree prefix noise",
           "prefix noise with an RMS of {} instead of {} (T = 64) and {} instead of {} "
           "(T = 1024)", tree_rms(2, by_strategy=False)),
    Figure("docs/architecture.md", "tree prefix noise",
           "RMS prefix noise per node std, one epoch: {} (T = 64) and {} (T = 1024) against the "
           "plain tree's {} and {};", tree_rms(3, by_strategy=True)),
    Figure("docs/architecture.md", "tree prefix noise at epsilon 2",
           "at epsilon 2 (`compare_mechanisms`, B = 10): {} against {} (T = 64), {} against {} "
           "(T = 1024), and {} against {} for the two-epoch run above.", tree_compare),
    Figure("docs/architecture.md", "two-epoch tree z",
           "(T = 40, period 20, epsilon 2: z {} against {})", tree_two_epoch_z),
]


def check(figure: Figure) -> tuple[str, str | None]:
    """(the computed sentence, the document's stale sentence or None when it is current)."""
    text, doc = figure.text(), doc_text(figure.doc)
    if text in doc:
        return text, None
    found = figure.pattern().search(doc)
    return text, found.group(0) if found else "(the sentence is not in the document)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a figure is stale")
    args = parser.parse_args(argv)
    stale = 0
    for figure in FIGURES:
        text, quoted = check(figure)
        status = "current" if quoted is None else "STALE"
        print(f"{figure.doc}, {figure.name}: {status}\n  computed: {text}")
        if quoted is not None:
            stale += 1
            print(f"  quoted:   {quoted}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())

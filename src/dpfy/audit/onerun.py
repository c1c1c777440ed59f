"""One-run audit of a real ``dpfy train`` run (Steinke, Nasr, Jagielski 2023).

``dpfy train mnist --audit-canaries M`` trains the run with ``M`` canaries: images of uniform
noise in [0, 1] with uniformly random labels, each included in the training set by a secret
fair coin (the secure generator unless the run is seeded). Included canaries are ordinary
training examples: the sampler draws them, the query clips them, and N (the dataset size of
the accounting) counts them. After training, two scores per canary (higher = "looks in"):

* black-box: ``-loss`` of the canary under the released model (what anyone holding the model
  can compute);
* white-box: ``sum_t <u_t, s_t - momentum s_{t-1}>``, where ``u_t`` is the unit direction of
  the canary's gradient at the trained parameters ``theta_t`` (its clipped gradient divided by
  its norm), ``s_t = -(theta_{t+1} - theta_t)`` is the step the optimizer took, and
  ``s_t - momentum s_{t-1}`` is lr times the step's released noisy gradient (heavy-ball SGD):
  summed over every step, because DP-SGD's guarantee covers every iterate and an included
  canary pushes the release along ``u_t`` in each step that samples it.

Both scores are centred within each label (:func:`center_by_label`).

The auditor guesses "in" for the ``k // 2`` highest scores, "out" for the ``k - k // 2`` lowest
and abstains on the rest (the rule is fixed before the run), counts the correct guesses and
applies both analyses of the same counts: the (epsilon, delta) bound of Steinke et al.
(:func:`dpfy.audit.stats.one_run_epsilon`) and the Gaussian f-DP bound of Mahloujifar, Melis,
Chaudhuri 2024 (:mod:`dpfy.audit.fdp`). Two scores are two tests: each bound is computed at
``1 - (1 - confidence) / 2`` (a union bound), so the largest holds at ``confidence``. The
ceiling (all ``k`` guesses right) is stated beside every result.

What it audits is the whole run's claim, not one release. One run with a few hundred canaries
can refute only small epsilons (see the ceiling), and the attack is weak against a noisy run:
a lower bound far below the claim is the expected outcome and says nothing about whether the
claim is loose.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpfy._validate import check_int, check_range
from dpfy.audit.fdp import one_run_gdp_bound
from dpfy.audit.stats import one_run_ceiling, one_run_epsilon
from dpfy.models.modes import evaluating
from dpfy.randomness import Randomness
from dpfy.training.history import ProgressInfo

MEANING = (
    "A one-run audit measures a lower bound from a single training run. Its ceiling (every "
    "guess right) is small, and against a run with real noise the attack guesses little "
    "better than chance, so a bound far below the claimed epsilon is what a correct run is "
    "expected to give; it is not evidence that the claim is loose. A bound above the claim "
    "would show, at the stated confidence, that the run leaks more than the ledger declares."
)


@dataclasses.dataclass(frozen=True)
class Canaries:
    """The canaries of a run and their secret coins.

    Attributes:
      inputs: ``[M, 1, 28, 28]`` uniform-noise images (pixels in [0, 1], then normalised).
      labels: ``[M]`` random labels in [0, num_classes).
      included: ``[M]`` bool, the coins (True: in the training set).
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    included: np.ndarray

    def training_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The included canaries, to append to the training set."""
        keep = torch.from_numpy(self.included)
        return self.inputs[keep], self.labels[keep]


def make_canaries(
    count: int, randomness: Randomness, *, shape: tuple[int, ...] = (1, 28, 28),
    num_classes: int = 10, pixel_stats: tuple[float, float] = (0.0, 1.0),
) -> Canaries:
    """``count`` noise images with random labels and a fair coin each, from ``randomness``;
    pixels uniform in [0, 1], normalised as the dataset's (``(x - mean) / std``)."""
    check_int("count", count, 2)
    size = int(np.prod(shape))
    mean, std = pixel_stats
    pixels = randomness.uniform((count, size)).reshape(count, *shape)
    pixels = ((pixels - mean) / std).astype(np.float32)
    labels = np.minimum((randomness.uniform(count) * num_classes).astype(np.int64),
                        num_classes - 1)
    included = randomness.uniform(count) < 0.5
    return Canaries(torch.from_numpy(pixels), torch.from_numpy(labels), included)


def _per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[M, P]`` flat gradients of the cross-entropy of each (x_i, y_i) at ``model``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[k].reshape(x.shape[0], -1) for k in params], dim=1)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


class WhiteBoxScores:
    """A trainer callback accumulating the white-box scores of all canaries (module docstring).

    Built from the freshly initialised model (a private copy computes the canaries'
    gradients, so the trainer's hooks are never involved); after each step it reads the
    trained parameters, adds ``<u_t, s_t - momentum s_{t-1}>`` per canary, with
    ``s_t = -(theta_{t+1} - theta_t)``, and moves ``u`` to the new parameters. For SGD with
    heavy-ball ``momentum`` (a public hyperparameter of the run) ``s_t - momentum s_{t-1}`` is
    the learning rate times the step's released noisy gradient, so each canary meets the
    release of each step once instead of its echo in every later step.
    """

    def __init__(
        self, model: nn.Module, canaries: Canaries, *, momentum: float = 0.0, chunk: int = 256
    ) -> None:
        check_range("momentum", momentum, 0.0, 1.0, high_open=True)
        self.model = model
        self.momentum = float(momentum)
        self._last_step: torch.Tensor | None = None
        self.shadow = copy.deepcopy(model)
        self.canaries = canaries
        self.chunk = chunk
        self.scores = np.zeros(len(canaries.included))
        self.steps = 0
        self._theta = _flat(model)
        self._units = self._directions()

    def _directions(self) -> torch.Tensor:
        self.shadow.load_state_dict(self.model.state_dict())
        parts = []
        x, y = self.canaries.inputs, self.canaries.labels
        for s in range(0, x.shape[0], self.chunk):
            g = _per_example_grads(self.shadow, x[s : s + self.chunk], y[s : s + self.chunk])
            parts.append(g / g.norm(dim=1, keepdim=True).clamp_min(1e-30))
        return torch.cat(parts)

    def __call__(self, info: ProgressInfo) -> None:
        if info.kind != "step":
            return
        theta = _flat(self.model)
        step = self._theta - theta  # lr x (momentum buffer): the released gradient, mixed
        released = step if self._last_step is None else step - self.momentum * self._last_step
        self.scores += (self._units @ released).double().numpy()
        self._last_step = step
        self._theta = theta
        self._units = self._directions()
        self.steps += 1


def black_box_scores(model: nn.Module, canaries: Canaries) -> np.ndarray:
    """``-loss`` of each canary under ``model`` (eval mode, no gradients)."""
    with evaluating(model), torch.no_grad():
        out = model(canaries.inputs)
        loss = nn.functional.cross_entropy(out, canaries.labels, reduction="none")
    scores: np.ndarray = -loss.double().numpy()
    return scores


def center_by_label(scores: np.ndarray, labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """Each score minus the mean score of the canaries with its label.

    A canary's score also moves with everything its label shares with the data (the other
    examples of that class push the model along much the same direction, included canary or
    not); subtracting the label group's mean removes that common part. A function of the
    released output and the public canary set only, so the one-run analysis still applies.
    """
    s = np.asarray(scores, dtype=np.float64)
    lab = np.asarray(labels)
    out = s.copy()
    for y in np.unique(lab):
        group = lab == y
        out[group] -= s[group].mean()
    return out


def count_correct(scores: np.ndarray, included: np.ndarray, guesses: int) -> int:
    """Guess "in" for the ``guesses // 2`` highest scores and "out" for the
    ``guesses - guesses // 2`` lowest (ties broken by canary index); the number right."""
    m = len(scores)
    check_int("guesses", guesses, 1, m)
    order = np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")
    k_in = guesses // 2
    top = order[m - k_in :] if k_in else order[:0]
    bottom = order[: guesses - k_in]
    return int(included[top].sum() + (~included[bottom]).sum())


def one_run_section(
    scores: dict[str, np.ndarray],
    included: np.ndarray,
    *,
    guesses: int,
    delta: float,
    confidence: float,
    run_epsilon: float,
) -> dict[str, Any]:
    """The Audit section of a run audited in one run: per score both analyses, the ceilings,
    the headline (largest bound over the scores) and the verdict against the run's claim."""
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)
    m = len(included)
    conf_each = 1.0 - (1.0 - confidence) / len(scores)
    ceiling = one_run_ceiling(m, guesses, delta=delta, confidence=conf_each)
    gdp_ceiling = one_run_gdp_bound(m, guesses, guesses, delta=delta, confidence=conf_each)
    rows: list[dict[str, Any]] = []
    for name, s in scores.items():
        v = count_correct(s, included, guesses)
        gdp = one_run_gdp_bound(m, guesses, v, delta=delta, confidence=conf_each)
        rows.append({
            "score": name,
            "correct": v,
            "epsilon_lower": one_run_epsilon(m, guesses, v, delta=delta, confidence=conf_each),
            "fdp_mu_lower": gdp.mu,
            "fdp_epsilon_lower": gdp.epsilon,
        })
    best = max(rows, key=lambda r: (r["epsilon_lower"], r["fdp_epsilon_lower"], r["correct"]))
    best_fdp = max(rows, key=lambda r: r["fdp_epsilon_lower"])
    claim = float(run_epsilon)
    broken = best["epsilon_lower"] > claim
    return {
        "method": "one-run-train",
        "description": (
            f"one-run audit of this training run (Steinke, Nasr, Jagielski 2023): {m} canaries "
            "(uniform-noise images, random labels), each in the training set by a secret fair "
            "coin; black-box score -loss under the released model, white-box score the sum "
            "over steps of the canary's unit gradient direction against the step taken; "
            f"guess in for the top {guesses // 2}, out for the bottom {guesses - guesses // 2}, "
            "abstain on the rest; (epsilon, delta) analysis of Steinke et al. and Gaussian "
            "f-DP analysis (Mahloujifar, Melis, Chaudhuri 2024) of the same counts, each score "
            f"at {100 * conf_each:g} % (union bound over {len(scores)} scores)"
        ),
        "confidence": confidence,
        "trials": m,
        "guesses": guesses,
        "correct": best["correct"],
        "best_score": best["score"],
        "epsilon_lower": best["epsilon_lower"],
        "ceiling": ceiling,
        "fdp_mu_lower": best_fdp["fdp_mu_lower"],
        "fdp_epsilon_lower": best_fdp["fdp_epsilon_lower"],
        "fdp_mu_ceiling": gdp_ceiling.mu,
        "fdp_ceiling": gdp_ceiling.epsilon,
        "scores": rows,
        "included": int(np.sum(included)),
        "audited_claim": claim,
        "audited_release": "the whole training run (every step), as its report states",
        "run_epsilon": claim if math.isfinite(claim) else str(claim),
        "delta": delta,
        "verdict": (
            "VIOLATION: the one-run lower bound exceeds the run's claimed epsilon"
            if broken else "no violation found"
        ),
        "meaning": MEANING,
    }

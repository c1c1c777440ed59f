"""White-box gradient canaries on the real DP-SGD release (Nasr et al. 2023, arXiv 2302.07956).

The auditor controls the gradients: a canary is an example whose gradient is a Dirac of norm
``canary_norm`` (> C, so clipping must act) in one coordinate of one parameter. The model is a
:class:`CanaryModel`: a bias-free ``nn.Linear`` and an ``nn.Embedding`` (two parameter groups,
two norm rules). A one-hot input ``e_a`` with the per-example loss ``s x output[j]`` gives the
Linear weight the gradient ``s e_j e_a^T``; an index ``r`` with loss ``s x output[d_out + j]``
gives the Embedding row ``r`` the gradient ``s e_j``. Every coordinate of both parameters is
one canary's.

One trial of the audit is one release through the real path: :class:`PrivateGradient`
(norm rules, clip weights, clipped sums) and the query's ``add_noise`` (ledger entry written
first, noise from :class:`dpfy.randomness.Randomness`), then ``p.grad``. Trials are vectorised
the way the mechanism allows: in a release each canary is included independently with
probability 1/2, and since the canaries' gradients are orthogonal, the released value of a
canary's coordinate is a "with canary" score if it was included and a "without canary" score
if not (the other canaries never touch that coordinate). For a correct implementation these
scores are independent, N(C, (zC)^2) and N(0, (zC)^2) after scaling by the denominator, so the
Clopper-Pearson bounds of :mod:`dpfy.audit.stats` apply. A broken implementation may couple
coordinates; the one-run method (:func:`one_run_audit`, Steinke et al. 2023) needs no
independence across canaries at all.

What is audited is one release of the query (no subsampling, no composition): its claim is the
epsilon of one Gaussian release with the query's effective noise multiplier z, at delta.
Scores are in units of C (score = released gradient x denominator / C).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from dpfy._validate import check_int, check_positive, check_range, check_seed
from dpfy.audit.stats import (
    ThresholdBound,
    one_run_ceiling,
    one_run_epsilon,
    threshold_epsilon_bound,
)
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.randomness import Randomness
from dpfy.sampling.spec import SampleSpec
from dpfy.training import PrivateGradient

#: ``progress(done, total)`` after each release.
Progress = Callable[[int, int], None]
#: ``query_factory(clip_norm, noise_multiplier) -> query`` (default: GaussianSumQuery).
QueryFactory = Callable[[float, float], object]


class CanaryModel(nn.Module):
    """``cat(Linear(x), Embedding(idx))``: a bias-free Linear ``d_in -> d_out`` and an
    Embedding ``vocab x dim``; ``d_out x d_in + vocab x dim`` coordinates, each a canary's."""

    def __init__(self, d_in: int = 64, d_out: int = 64, vocab: int = 64, dim: int = 64) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.embedding = nn.Embedding(vocab, dim)

    @property
    def num_coordinates(self) -> int:
        return self.linear.weight.numel() + self.embedding.weight.numel()

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear(x), self.embedding(idx)], dim=1)

    def canary_batch(
        self, coords: np.ndarray, norm: float
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Inputs and loss targets of the canaries of flat coordinates ``coords``.

        Flat coordinate c < d_out x d_in is Linear weight ``[c // d_in, c % d_in]``; above,
        Embedding weight ``[(c - L) // dim, (c - L) % dim]``. The loss is
        ``(output * target).sum(1)``, so each canary's gradient is ``norm`` at its coordinate.
        """
        d_out, d_in = self.linear.weight.shape
        vocab, dim = self.embedding.weight.shape
        n_lin = d_out * d_in
        c = torch.as_tensor(coords, dtype=torch.long)
        b = c.numel()
        lin = c < n_lin
        x = torch.zeros(b, d_in)
        idx = torch.zeros(b, dtype=torch.long)
        target = torch.zeros(b, d_out + dim)
        rows = torch.arange(b)
        lc = c[lin]
        x[rows[lin], lc % d_in] = 1.0
        target[rows[lin], lc // d_in] = norm
        ec = c[~lin] - n_lin
        idx[~lin] = ec // dim
        target[rows[~lin], d_out + ec % dim] = norm
        return (x, idx), target


def _dot_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * target).sum(1)


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryScores:
    """Scores (units of C) per parameter: ``{name: (scores_in, scores_out)}``, in trial order."""

    scores: dict[str, tuple[np.ndarray, np.ndarray]]
    releases: int
    noise_multiplier: float


def _flat_grad(model: CanaryModel) -> np.ndarray:
    parts = []
    for p in (model.linear.weight, model.embedding.weight):
        g = p.grad
        parts.append(np.zeros(p.numel()) if g is None else g.detach().double().ravel().numpy())
    return np.concatenate(parts)


def _check_common(clip_norm: float, noise_multiplier: float, seed: int) -> None:
    check_positive("clip_norm", clip_norm, 1e15)
    check_range("noise_multiplier", noise_multiplier, 0.0, 1e6, low_open=True)
    check_seed("seed", seed)


def _release_scores(
    model: CanaryModel,
    pg: PrivateGradient,
    included: np.ndarray,
    coords: np.ndarray,
    canary_norm: float,
    clip_norm: float,
    randomness: Randomness,
    chunk: int,
) -> np.ndarray:
    """One release with the canaries ``coords[included]``; the scores of all ``coords``."""
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("full_batch"))
    chosen = coords[included]
    for start in range(0, max(chosen.size, 1), chunk):
        part = chosen[start : start + chunk]
        if part.size == 0:
            break
        inputs, target = model.canary_batch(part, canary_norm)
        pg.accumulate(inputs, target, _dot_loss)
    pg.release(ledger=ledger, sample_id=sid, randomness=randomness)
    scores: np.ndarray = _flat_grad(model)[coords] * (pg.denominator_ / clip_norm)
    return scores


def canary_scores(
    clip_norm: float,
    noise_multiplier: float,
    *,
    trials: int,
    seed: int = 0,
    model: CanaryModel | None = None,
    canary_norm_factor: float = 4.0,
    query_factory: QueryFactory | None = None,
    progress: Progress | None = None,
    chunk: int = 8192,
) -> CanaryScores:
    """Run releases until ``trials`` canary scores are collected (in + out together).

    Args:
      clip_norm: C of the query, in (0, 1e15].
      noise_multiplier: z of the query, in (0, 1e6].
      trials: number of scores wanted (each release gives one per model coordinate).
      seed: seeds the canaries' inclusion and the release noise (a seeded experiment).
      model: the :class:`CanaryModel` (default: 64 x 64 Linear and 64 x 64 Embedding).
      canary_norm_factor: canary gradient norm / C, >= 1 (above 1 tests the clipping).
      query_factory: builds the query from (C, z); default :class:`GaussianSumQuery`.
      progress: called as ``progress(releases_done, releases_total)``.
      chunk: rows per ``accumulate`` call.
    """
    _check_common(clip_norm, noise_multiplier, seed)
    check_int("trials", trials, 2)
    check_range("canary_norm_factor", canary_norm_factor, 1.0, 1e6)
    model = model if model is not None else CanaryModel()
    factory = query_factory if query_factory is not None else GaussianSumQuery
    query = factory(clip_norm, noise_multiplier)
    m = model.num_coordinates
    releases = max(1, math.ceil(trials / m))
    pg = PrivateGradient(model, query, expected_batch_size=m / 2.0)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    noise = Randomness(seed=seed)
    coords = np.arange(m)
    n_lin = model.linear.weight.numel()
    names = ("linear.weight", "embedding.weight")
    ins: dict[str, list[np.ndarray]] = {n: [] for n in names}
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for r in range(releases):
        included = rng.random(m) < 0.5
        s = _release_scores(
            model, pg, included, coords, canary_norm_factor * clip_norm, clip_norm, noise, chunk
        )
        for name, sl in zip(names, (slice(0, n_lin), slice(n_lin, m)), strict=True):
            ins[name].append(s[sl][included[sl]])
            outs[name].append(s[sl][~included[sl]])
        if progress is not None:
            progress(r + 1, releases)
    scores = {n: (np.concatenate(ins[n]), np.concatenate(outs[n])) for n in names}
    return CanaryScores(scores, releases, float(noise_multiplier))


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryAudit:
    """The white-box canary audit: the largest per-parameter bound and all of them.

    ``epsilon`` holds with probability ``confidence`` (each parameter's bound at
    ``1 - (1 - confidence) / groups``, a union bound). ``ceiling``: the largest bound these
    trial counts could give (every test perfect: TPR_lo from n_in successes, FPR_hi from 0).
    """

    epsilon: float
    confidence: float
    delta: float
    trials: int
    releases: int
    ceiling: float
    mu_lower: float
    per_parameter: dict[str, ThresholdBound]
    method: str = "canary"


def _perfect_ceiling(n_in: int, n_out: int, delta: float, confidence: float) -> float:
    beta = 1.0 - confidence
    tpr_lo = (beta / 2.0) ** (1.0 / n_in)  # Clopper-Pearson lower bound of n_in / n_in
    fpr_hi = 1.0 - (beta / 2.0) ** (1.0 / n_out)  # upper bound of 0 / n_out
    return max(0.0, math.log(max(tpr_lo - delta, 1e-300) / fpr_hi))


def canary_audit(
    clip_norm: float,
    noise_multiplier: float,
    *,
    delta: float,
    trials: int = 200_000,
    confidence: float = 0.95,
    seed: int = 0,
    model: CanaryModel | None = None,
    canary_norm_factor: float = 4.0,
    query_factory: QueryFactory | None = None,
    progress: Progress | None = None,
) -> CanaryAudit:
    """White-box canary audit of one release: an empirical epsilon lower bound.

    Threshold chosen on the first half of each parameter's trials, evaluated on the second
    (:func:`dpfy.audit.stats.threshold_epsilon_bound`, ``selection="split"``).
    """
    check_range("delta", delta, 0.0, 1.0, high_open=True)
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)
    sc = canary_scores(
        clip_norm,
        noise_multiplier,
        trials=trials,
        seed=seed,
        model=model,
        canary_norm_factor=canary_norm_factor,
        query_factory=query_factory,
        progress=progress,
    )
    groups = len(sc.scores)
    conf_each = 1.0 - (1.0 - confidence) / groups
    per = {
        n: threshold_epsilon_bound(s_in, s_out, delta=delta, confidence=conf_each)
        for n, (s_in, s_out) in sc.scores.items()
    }
    best = max(per.values(), key=lambda b: b.epsilon)
    ceiling = min(_perfect_ceiling(b.n_in, b.n_out, delta, conf_each) for b in per.values())
    total = sum(s_in.size + s_out.size for s_in, s_out in sc.scores.values())
    return CanaryAudit(
        epsilon=best.epsilon,
        confidence=confidence,
        delta=delta,
        trials=int(total),
        releases=sc.releases,
        ceiling=ceiling,
        mu_lower=max(b.mu_lower for b in per.values()),
        per_parameter=per,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class OneRunAudit:
    """One-run audit (Steinke et al. 2023): ``guesses`` of ``canaries``, ``correct`` right."""

    epsilon: float
    confidence: float
    delta: float
    canaries: int
    guesses: int
    correct: int
    ceiling: float
    method: str = "one-run"


def one_run_audit(
    clip_norm: float,
    noise_multiplier: float,
    *,
    delta: float,
    canaries: int = 10_000,
    guesses: int = 200,
    confidence: float = 0.95,
    seed: int = 0,
    canary_norm_factor: float = 4.0,
    query_factory: QueryFactory | None = None,
) -> OneRunAudit:
    """One release with ``canaries`` gradient canaries, each included with probability 1/2.

    The auditor guesses "in" for the ``guesses // 2`` highest scores and "out" for the
    ``guesses - guesses // 2`` lowest, abstaining on the rest (a rule fixed before the run,
    using the scores only), and applies :func:`dpfy.audit.stats.one_run_epsilon`, which needs
    no independence between canaries.
    """
    check_range("delta", delta, 0.0, 1.0)
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)
    _check_common(clip_norm, noise_multiplier, seed)
    check_int("canaries", canaries, 2, 10_000_000)
    check_int("guesses", guesses, 1, canaries)
    side = max(8, math.ceil(math.sqrt(canaries / 2.0)))
    model = CanaryModel(side, side, side, side)
    factory = query_factory if query_factory is not None else GaussianSumQuery
    query = factory(clip_norm, noise_multiplier)
    pg = PrivateGradient(model, query, expected_batch_size=canaries / 2.0)  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    coords = np.sort(rng.choice(model.num_coordinates, canaries, replace=False))
    included = rng.random(canaries) < 0.5
    scores = _release_scores(
        model,
        pg,
        included,
        coords,
        canary_norm_factor * clip_norm,
        clip_norm,
        Randomness(seed=seed),
        8192,
    )
    order = np.argsort(scores, kind="stable")
    k_in = guesses // 2
    k_out = guesses - k_in
    top, bottom = order[canaries - k_in :] if k_in else order[:0], order[:k_out]
    correct = int(included[top].sum() + (~included[bottom]).sum())
    eps = one_run_epsilon(canaries, guesses, correct, delta=delta, confidence=confidence)
    ceiling = one_run_ceiling(canaries, guesses, delta=delta, confidence=confidence)
    return OneRunAudit(eps, confidence, delta, canaries, guesses, correct, ceiling)

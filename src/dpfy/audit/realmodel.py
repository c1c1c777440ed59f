"""The noise check on the run's own model: every parameter tensor, at its real size.

The probe replays (:mod:`dpfy.audit.probes`) and the canaries (:mod:`dpfy.audit.canary`) run on
small models, so a fault that only strikes large tensors (a noise skip above some size, a
code path taken for big buffers) is invisible to them. This check releases noise-only steps
(nothing accumulated: the clipped sum is zero, so the released gradient times the expected
batch size E *is* the noise) through :class:`~dpfy.training.PrivateGradient` and
``GaussianSumQuery`` on the run's real model -- the same parameter names, shapes and flat
gradient buffer as the run's steps, and the run's kind of randomness (secure or seeded) -- and
tests each tensor's noise against the standard deviation ``s = z C`` the run's ledger declares.

The test, per tensor with ``n`` values over ``K`` releases: ``T = sum x^2 / s^2`` is
chi-square with ``nK`` degrees of freedom when the noise is right. The tensor fails when ``T``
is outside the two-sided interval of level ``alpha / m`` (Bonferroni over its ``m`` tensors), so
a correct run raises a false alarm with probability at most ``alpha`` (default 1e-6) per audit.
``K`` is chosen so that every tensor has at least ``min_values`` values (default 320, at most
``max_releases`` releases and ``budget`` values in all): then a skipped tensor (``T = 0``) fails
always, and a tensor at half the std (``T ~ chi2(nK) / 4``) passes with the probability
reported as ``half_noise_miss`` (the largest over the tensors; computed, for m = 100 tensors:
0.17 at ``nK = 64``, 2e-7 at 128, 5e-28 at 256, 1e-40 at the default 320).
Noise added twice (``sqrt 2`` times the std) is caught alike from the upper side.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling.spec import SampleSpec

#: Total false-alarm probability of one check on a correct run.
ALPHA = 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class ModelNoiseCheck:
    """What the noise check on a run's model found.

    Attributes:
      findings: breaches, one sentence each (empty: none).
      tensors, values: the trainable tensors checked and their values in all.
      releases: noise-only releases drawn (K).
      std_ratio: per tensor, measured / declared std (1 when correct).
      half_noise_miss: the largest probability, over the tensors, that a tensor at half the
        declared std would pass (the weakest tensor's power, module docstring).
      alpha: the false-alarm probability of the whole check.
      seconds: wall time.
    """

    findings: tuple[str, ...]
    tensors: int
    values: int
    releases: int
    std_ratio: dict[str, float]
    half_noise_miss: float
    alpha: float
    seconds: float


def model_noise_check(
    model: nn.Module,
    *,
    noise_std: float,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    secure: bool = True,
    seed: int = 0,
    min_values: int = 320,
    max_releases: int = 256,
    budget: int = 1 << 24,
    alpha: float = ALPHA,
) -> ModelNoiseCheck:
    """Release noise-only steps of ``GaussianSumQuery(clip_norm, noise_multiplier)`` on
    ``model`` and test every trainable tensor's noise against ``noise_std`` (the std the run's
    ledger declares, ``z C``; module docstring).

    Args:
      model: the run's model (its parameters' values do not matter; they are not changed).
      noise_std, clip_norm, noise_multiplier, expected_batch_size: the run's, from its ledger.
      secure: draw from the secure generator (as a DP release does); False: ``seed``.
      min_values, max_releases, budget: choose K (module docstring).
      alpha: the false-alarm probability of the check.
    """
    from scipy import stats

    from dpfy.queries import GaussianSumQuery
    from dpfy.training import PrivateGradient

    start = time.perf_counter()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model has no trainable parameter: nothing to check")
    sizes = {n: p.numel() for n, p in params.items()}
    total = sum(sizes.values())
    k = max(1, min(max_releases, math.ceil(min_values / min(sizes.values())),
                   max(1, budget // total)))
    saved = {n: p.grad for n, p in params.items()}
    pg = PrivateGradient(model, GaussianSumQuery(clip_norm, noise_multiplier),
                         expected_batch_size=expected_batch_size)
    rng = Randomness.secure_mode() if secure else Randomness(seed)
    ledger = Ledger()
    sums = dict.fromkeys(params, 0.0)
    try:
        for _ in range(k):
            sid = ledger.record_sample(SampleSpec("full_batch"))
            stats_ = pg.release(ledger=ledger, sample_id=sid, randomness=rng)
            for n, p in params.items():
                g = p.grad
                if g is not None:
                    sums[n] += float((g.detach().double() * stats_.denominator).square().sum())
    finally:
        for n, p in params.items():
            p.grad = saved[n]
    m = len(params)
    findings: list[str] = []
    ratios: dict[str, float] = {}
    worst = 0.0
    for n, size in sizes.items():
        dof = size * k
        lo, hi = stats.chi2.ppf(alpha / (2 * m), dof), stats.chi2.isf(alpha / (2 * m), dof)
        t = sums[n] / noise_std**2
        ratios[n] = math.sqrt(t / dof)
        worst = max(worst, float(stats.chi2.sf(4.0 * lo, dof)))
        if not lo <= t <= hi:
            findings.append(
                f"real model: parameter {n!r} ({tuple(params[n].shape)}, {size} values) got "
                f"noise of std {ratios[n]:.4g} x the {noise_std:.6g} the ledger declares "
                f"(chi-square over {dof} values outside [{lo / dof:.3g}, {hi / dof:.3g}] in "
                f"variance, level {alpha:g} over {m} tensors)"
            )
    return ModelNoiseCheck(tuple(findings), m, total, k, ratios, worst, alpha,
                           time.perf_counter() - start)


def run_model(run_dir: Path, meta: dict[str, Any]) -> tuple[nn.Module | None, str]:
    """The model of a ``dpfy train`` image run rebuilt from its recipe (metadata ``model``)
    with the weights of ``model.pt``, and how it was found; ``None`` and why not otherwise
    (text runs, library runs: pass the model to :func:`model_noise_check`)."""
    from dpfy.training.recipes import MODELS, make_model

    name = meta.get("model")
    path = run_dir / "model.pt"
    if meta.get("trainer") == "dpfy.fed.DPFedAvg":
        return None, ("real model: not rebuilt (a federated run: its model is the application's, "
                      "not a dpfy train recipe); dpfy.audit.realmodel.model_noise_check takes "
                      "the model itself")
    if not isinstance(name, str) or name not in MODELS:
        return None, (f"real model: not rebuilt (model {name!r} has no image recipe here); "
                      "dpfy.audit.realmodel.model_noise_check takes the model itself")
    if not path.is_file():
        return None, "real model: not rebuilt (the run directory holds no model.pt)"
    model = make_model(name)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        return None, f"real model: model.pt does not load into {name!r} ({str(err)[:120]})"
    return model, f"real model: {name!r} from model.pt"

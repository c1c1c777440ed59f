"""Gray-box record-and-replay checks of the release path (Cebere et al. 2026, arXiv 2602.17454).

Run one DP-SGD release three times with *identical* randomness (the same seed): on a batch D,
on its neighbour D' (one row removed), and on no data at all (noise only). Whatever the three
releases share is the noise; what differs is what entered it. A correct release satisfies:

1. **Sensitivity**: the part that changes between D and D', measured in units of each
   coordinate's declared noise std, is at most what the ledger declares:
   ``sum_p ||delta_p||^2 / s_p^2 <= 1 / z_eff^2`` (``docs/architecture.md`` 5.4; for one flat
   query this is ``||delta|| <= C``). ``delta = E x (release(D) - release(D'))`` with E the
   expected batch size.
2. **Noise on every parameter, at the declared std**: the noise-only release has, on every
   trainable parameter, a sample std equal to the declared ``s_p / E`` (within a tolerance
   that shrinks with the number of coordinates and seeds).
3. **Fixed denominator**: the signal ``E x (release(D) - release(noise only))`` is the clipped
   sum the slow per-example reference computes (:mod:`dpfy.training.norms.reference`), so the
   noise was divided by the expected batch size whatever the data, and the norm rules and
   clipping did what they declare.
4. **Data-independent control flow**: the noise stream ends in the same state after D and D'
   (the same draws, in the same number), and the released shapes and the step's denominator
   are equal.

:func:`sampler_check` states the matching facts of a sampler: its batches follow the
``SampleSpec`` it records (Poisson batch sizes vary as Binomial(N, q); epoch samplers use each
example once per epoch; fixed-size batches have exactly B distinct examples).

The functions return findings (strings); an empty tuple means no breach was found.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.ledger.records import SumQueryRecord
from dpfy.randomness import Randomness
from dpfy.sampling import make_sampler
from dpfy.sampling.spec import SampleSpec
from dpfy.training import PrivateGradient
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one record-and-replay found.

    Attributes:
      findings: the breaches, one sentence each (empty: none found).
      measured_ratio: ``sqrt(sum_p ||delta_p||^2 / s_p^2)``, the measured sensitivity in noise
        units (at most ``declared_ratio`` when correct).
      declared_ratio: ``1 / z_eff`` from the ledger.
      noise_std_ratio: per parameter, measured / declared noise std (1 when correct).
    """

    findings: tuple[str, ...]
    measured_ratio: float
    declared_ratio: float
    noise_std_ratio: dict[str, float]


def _rows(x: Any, keep: torch.Tensor) -> Any:
    if isinstance(x, torch.Tensor):
        return x[keep]
    if isinstance(x, tuple | list):
        return type(x)(_rows(t, keep) for t in x)
    if isinstance(x, dict):
        return {k: _rows(v, keep) for k, v in x.items()}
    return x


def _release(
    make_model: Callable[[], nn.Module],
    make_query: Callable[[], Any],
    batch: tuple[Any, Any] | None,
    loss_fn: LossFn,
    expected_batch_size: float,
    seed: int,
) -> tuple[dict[str, torch.Tensor], Ledger, dict[str, Any], Any, float]:
    model = make_model()
    query = make_query()
    pg = PrivateGradient(model, query, expected_batch_size=expected_batch_size)
    stds = query.noise_stds() if hasattr(query, "noise_stds") else None
    groups = getattr(query, "groups", None)
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("full_batch"))
    if batch is not None:
        pg.accumulate(batch[0], batch[1], loss_fn)
    rng = Randomness(seed=seed)
    stats = pg.release(ledger=ledger, sample_id=sid, randomness=rng)
    grads = {
        n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()).double()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    per_param: dict[str, float] = {}
    for name in grads:
        if isinstance(stds, int | float):
            per_param[name] = float(stds)
        elif stds is not None and groups is not None:
            owner = next(g for g, ns in groups.items() if name in ns)
            per_param[name] = float(stds[owner])
    state = rng.state_dict()
    return grads, ledger, per_param, state, float(stats.denominator)


def _ledgered_stds(
    ledger: Ledger, stds: dict[str, float], single: bool
) -> tuple[dict[str, float], tuple[float, ...]]:
    """Each parameter's declared noise std, as the *ledger* states it.

    A query with one noise std for every tensor has it from its (one) sum record. Per-group
    queries keep their declared per-group stds; with several sum records (nested, adaptive)
    any std that no record declares is returned. (A joint query records one part in scaled
    units, so its raw per-group stds are taken from the query.)
    """
    recs = [r for r in ledger.entries if isinstance(r, SumQueryRecord)]
    if single and recs:
        return dict.fromkeys(stds, recs[0].noise_std), ()
    if len(recs) <= 1:
        return stds, ()
    declared = [r.noise_std for r in recs]
    missing = tuple(
        s
        for s in sorted(set(stds.values()))
        if not any(math.isclose(s, d, rel_tol=1e-9) for d in declared)
    )
    return stds, missing


def replay_release(
    make_model: Callable[[], nn.Module],
    make_query: Callable[[], Any],
    inputs: Any,
    targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    remove: int = 0,
    expected_batch_size: float | None = None,
    seed: int = 0,
    noise_seeds: int = 8,
    clip_norm: float | None = None,
    rtol: float = 1e-4,
) -> ReplayResult:
    """Record and replay one release on D = (inputs, targets) and D' = D without row ``remove``.

    Args:
      make_model: returns the same freshly initialised model at every call (seed inside).
      make_query: returns a fresh query (adaptive queries carry state).
      inputs, targets, loss_fn: the batch D (batch first) and the per-example loss.
      remove: the row that D' lacks (give it a large gradient to exercise clipping).
      expected_batch_size: the declared denominator E (default: the size of D).
      seed: the noise seed shared by the three releases.
      noise_seeds: further noise-only releases that measure each parameter's noise std.
      clip_norm: a flat clip norm for the reference clipped sum (check 3); ``None`` skips it.
      rtol: relative tolerance of the exact comparisons (float32 arithmetic).
    """
    n = int(targets.shape[0])
    e = float(n if expected_batch_size is None else expected_batch_size)
    keep = torch.ones(n, dtype=torch.bool)
    keep[remove] = False
    d_batch = (inputs, targets)
    dp_batch = (_rows(inputs, keep), targets[keep])
    single = isinstance(make_query().noise_stds(), int | float)
    g_d, ledger, stds, st_d, den_d = _release(make_model, make_query, d_batch, loss_fn, e, seed)
    g_dp, _, _, st_dp, den_dp = _release(make_model, make_query, dp_batch, loss_fn, e, seed)
    g_0, _, _, _, _ = _release(make_model, make_query, None, loss_fn, e, seed)
    findings: list[str] = []
    z = ledger.noise_multipliers().get(0, 0.0)
    stds, unledgered = _ledgered_stds(ledger, stds, single)
    findings.extend(
        f"noise: the query draws noise of std {s!r}, which no ledger record declares"
        for s in unledgered
    )
    declared = 1.0 / z if z > 0 else math.inf
    # 1. sensitivity in noise units
    acc = 0.0
    for name, g in g_d.items():
        delta = (g - g_dp[name]) * e
        s = stds.get(name, 0.0)
        sq = float(delta.square().sum())
        acc += sq / s**2 if s > 0 else (math.inf if sq > 0 else 0.0)
    measured = math.sqrt(acc) if math.isfinite(acc) else math.inf
    if not measured <= declared * (1.0 + rtol) + 1e-9:
        findings.append(
            f"sensitivity: the neighbouring batches moved what entered the noise by {measured:.6g} "
            f"noise stds, above the declared 1/z = {declared:.6g}"
        )
    # 2. noise on every parameter at the declared std
    ratios: dict[str, float] = {}
    samples: dict[str, list[torch.Tensor]] = {k: [v.ravel() * e] for k, v in g_0.items()}
    for k in range(noise_seeds):
        extra, *_ = _release(make_model, make_query, None, loss_fn, e, seed + 1 + k)
        for name, g in extra.items():
            samples[name].append(g.ravel() * e)
    for name, parts in samples.items():
        x = torch.cat(parts)
        declared_std = stds.get(name, 0.0)
        measured_std = float(x.square().mean().sqrt())  # the noise has mean 0
        ratio = measured_std / declared_std if declared_std > 0 else math.inf
        ratios[name] = ratio
        tol = 5.0 / math.sqrt(2.0 * x.numel())  # ~5 standard errors of a std estimate
        if declared_std == 0.0 or not abs(ratio - 1.0) <= tol:
            findings.append(
                f"noise: parameter {name!r} got noise of std {measured_std:.6g}, declared "
                f"{declared_std:.6g} (ratio {ratio:.3g})"
            )
    # 3. fixed denominator and the clipped sum of the reference
    if clip_norm is not None:
        ref = clipped_sum_reference(
            per_example_gradients(make_model(), inputs, targets, loss_fn), clip_norm
        )
        for name, g in g_d.items():
            signal = (g - g_0[name]) * e
            want = ref[name].double()
            err = float((signal - want).norm())
            scale = float(want.norm()) + clip_norm
            if not err <= 1e-3 * scale:
                findings.append(
                    f"clipped sum: parameter {name!r} differs from the per-example reference by "
                    f"{err:.3g} (scale {scale:.3g}): wrong norms, clipping or denominator"
                )
    # 4. data-independent control flow
    if den_d != den_dp or den_d != e:
        findings.append(
            f"denominator: the releases divided by {den_d!r} and {den_dp!r}, expected {e!r}"
        )
    if repr(st_d) != repr(st_dp):
        findings.append("control flow: the noise stream ended in different states on D and D'")
    if any(g_d[k].shape != g_dp[k].shape for k in g_d):
        findings.append("control flow: released shapes differ between D and D'")
    return ReplayResult(tuple(findings), measured, declared, ratios)


def sampler_check(
    kind_name: str,
    *,
    dataset_size: int = 200,
    batch_size: int = 20,
    epochs: int = 50,
    seed: int = 0,
) -> tuple[str, ...]:
    """Check that a sampler's batches follow the ``SampleSpec`` it records.

    ``poisson``: each example in each batch independently with probability q: the batch sizes
    have variance about ``N q (1 - q)`` (a chi-square test at 1e-6 on each side) and the
    inclusion counts of an example over ``T`` steps have variance about ``T q (1 - q)``.
    Epoch kinds (``steps_per_epoch`` in the spec): every example exactly once per epoch.
    ``fixed_size``: every batch has ``batch_size`` distinct examples.
    """
    from scipy import stats

    smp = make_sampler(
        kind_name,
        dataset_size=dataset_size,
        batch_size=batch_size,
        randomness=Randomness(seed=seed),
    )
    spec = smp.sample_spec()
    findings: list[str] = []
    batches = [np.asarray(b) for ep in range(epochs) for b in smp.batches(ep)]
    sizes = np.array([b.size for b in batches], dtype=np.float64)
    if spec.sampler == "poisson":
        q = float(spec.sampling_rate or 0.0)
        t = sizes.size
        var0 = dataset_size * q * (1.0 - q)
        chi = (t - 1) * float(sizes.var(ddof=1)) / var0
        lo, hi = stats.chi2.ppf([1e-6, 1.0 - 1e-6], t - 1)
        if not lo <= chi <= hi:
            findings.append(
                f"poisson: batch sizes have variance {sizes.var(ddof=1):.4g}, expected "
                f"{var0:.4g} for independent inclusion with q={q}"
            )
        counts = np.zeros(dataset_size)
        for b in batches:
            np.add.at(counts, b, 1)
        var1 = t * q * (1.0 - q)
        chi = (dataset_size - 1) * float(counts.var(ddof=1)) / var1
        lo, hi = stats.chi2.ppf([1e-6, 1.0 - 1e-6], dataset_size - 1)
        if not lo <= chi <= hi:
            findings.append(
                f"poisson: inclusion counts over {t} steps have variance "
                f"{counts.var(ddof=1):.4g}, expected {var1:.4g}"
            )
    elif spec.steps_per_epoch is not None:
        per = int(spec.steps_per_epoch)
        for ep in range(epochs):
            used = np.concatenate(batches[ep * per : (ep + 1) * per])
            if np.bincount(used, minlength=dataset_size).max() != 1 or used.size != dataset_size:
                findings.append(f"{spec.sampler}: epoch {ep} does not use every example once")
                break
    if spec.sampler == "fixed_size":
        size = int(spec.batch_size or 0)
        if any(x.size != size or np.unique(x).size != size for x in batches):
            findings.append(f"fixed_size: a batch does not hold {size} distinct examples")
    return tuple(findings)

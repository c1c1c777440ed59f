"""Privacy-parameter planning: which (batch size, noise multiplier, steps) to train with.

``plan(dataset_size, target_epsilon, delta, max_steps=None, max_examples_processed=None)``
recommends a DP-SGD configuration (Poisson sampling, add-or-remove adjacency, one example as the
unit of privacy) that meets ``(target_epsilon, delta)`` under dpfy's accountants, explains the
choice, and lists runner-up options. Every epsilon it prints comes from the accountant
(:func:`dpfy.accounting.epsilon`), never from the TAN approximation, which is shown beside it.

The rule (TAN, Sander et al. 2023, Sec. 3.2-3.4; Ponomareva et al. 2023, Sec. 5.4.1):

1. **Stay out of the privacy wall.** At a fixed budget, epsilon depends (almost) only on
   ``eta = q sqrt(S) / (sqrt(2) z)`` once the noise multiplier ``z >= 2``; below that, part of the
   budget is wasted (the accountant's epsilon rises at constant ``eta``). Candidates whose
   calibrated ``z`` is at least 2 reach the largest signal-to-noise ratio the budget allows.
2. **Then prefer more steps.** With ``eta`` fixed by the budget, the per-step signal-to-noise is
   ``eta / sqrt(S)`` for *any* batch in that regime, while more steps help optimisation (up to a
   saturation the planner cannot know: hence ``max_steps``, default 10,000).
3. **Then spend the least compute.** For a given ``S``, batches larger than the smallest one with
   ``z >= 2`` keep ``eta_step`` (``z`` grows with ``B``) and, per TAN Fig. 4, do not improve
   accuracy; they only cost compute (examples processed ``B S``).

So the recommendation is the largest ``S <= max_steps`` for which the smallest batch with
``z >= 2`` fits the compute budget, with that batch and its calibrated ``z``. If no such
configuration fits the compute, the planner maximises ``eta`` within the compute instead and
says so. The batch search uses integer-order RDP (fast, conservative); each option's noise
multiplier is calibrated by :mod:`dpfy.accounting.calibrate` with the RDP accountant, then
re-calibrated with the PLD accountant when available, and every listed option is verified with
:func:`dpfy.accounting.epsilon`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dpfy import accounting
from dpfy import events as ev
from dpfy._validate import check_int, check_range
from dpfy.accounting import rdp as _rdp
from dpfy.accounting import roots, tan
from dpfy.accounting.calibrate import CalibrationError, calibrate_noise_multiplier
from dpfy.sampling import SampleSpec
from dpfy.sampling.spec import spec_event

__all__ = [
    "plan",
    "Plan",
]

#: Step cap when the caller gives none (TAN's CIFAR-10 reference uses 2,500, ImageNet 72,000).
DEFAULT_MAX_STEPS = 10_000

# Integer orders only: exact binomial sums, fast; fewer orders can only over-state epsilon.
_SEARCH_ORDERS = np.array(
    [float(a) for a in range(2, 65)] + [80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 1024.0]
)
_Z_THRESHOLD = tan.CONSTANT_PRIVACY_NOISE_MULTIPLIER


@dataclasses.dataclass(frozen=True, slots=True)
class PlanOption:
    """One DP-SGD configuration and what the accountant says about it.

    Attributes:
      batch_size: expected (Poisson) batch size ``B``; sampling rate ``q = B / N``.
      noise_multiplier: ``z`` (noise std / clip norm), calibrated to the target.
      steps: number of DP-SGD steps ``S``.
      dataset_size: ``N``.
      epsilon: the accountant's epsilon at the plan's delta (<= target).
      method: the accountant that certified ``epsilon``.
      epsilon_tan: TAN's approximation (a heuristic, shown for comparison).
      label: short name of the option; reason: why it is listed.
      sampler: the sampler kind that will run (``z`` and ``epsilon`` are for its event).
    """

    batch_size: int
    noise_multiplier: float
    steps: int
    dataset_size: int
    epsilon: float
    method: str
    epsilon_tan: float
    label: str
    reason: str
    sampler: str = "poisson"

    @property
    def sampling_rate(self) -> float:
        return self.batch_size / self.dataset_size

    @property
    def eta_step(self) -> float:
        return float(tan.eta_step(self.sampling_rate, self.noise_multiplier))

    @property
    def eta(self) -> float:
        return float(tan.eta(self.sampling_rate, self.noise_multiplier, self.steps))

    @property
    def regime(self) -> tan.Regime:
        return tan.regime(self.noise_multiplier)

    @property
    def examples_processed(self) -> int:
        return self.batch_size * self.steps

    @property
    def epochs(self) -> float:
        return self.examples_processed / self.dataset_size

    def privacy_event(self) -> ev.Event:
        """The event a ledger of this run produces (``steps`` steps of the option's sampler)."""
        make = _sampler_event(self.sampler, self.dataset_size, self.batch_size, self.steps)
        return make(self.noise_multiplier)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "sampler": self.sampler,
            "batch_size": self.batch_size,
            "sampling_rate": self.sampling_rate,
            "noise_multiplier": self.noise_multiplier,
            "steps": self.steps,
            "epochs": self.epochs,
            "examples_processed": self.examples_processed,
            "epsilon": self.epsilon,
            "method": self.method,
            "epsilon_tan": self.epsilon_tan,
            "eta": self.eta,
            "eta_step": self.eta_step,
            "regime": self.regime.value,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A recommendation, the reasoning behind it, and the alternatives considered."""

    dataset_size: int
    target_epsilon: float
    delta: float
    max_steps: int
    max_examples_processed: int | None
    recommendation: PlanOption
    runner_ups: tuple[PlanOption, ...]
    explanation: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset_size": self.dataset_size,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "max_steps": self.max_steps,
            "max_examples_processed": self.max_examples_processed,
            "sampler": self.recommendation.sampler,
            "adjacency": self.recommendation.privacy_event().adjacency_relation.value,
            "unit": "example",
            "recommendation": self.recommendation.to_dict(),
            "runner_ups": [o.to_dict() for o in self.runner_ups],
            "explanation": list(self.explanation),
        }

    def summary(self) -> str:
        """Plain-text table and explanation (what ``dpfy plan`` prints)."""
        head = f"{'option':<28}{'B':>8}{'z':>9}{'steps':>8}{'epochs':>9}{'eps':>8}{'eps_TAN':>9}"
        rows = [head, "-" * len(head)]
        for o in (self.recommendation, *self.runner_ups):
            rows.append(
                f"{o.label[:27]:<28}{o.batch_size:>8d}{o.noise_multiplier:>9.3f}{o.steps:>8d}"
                f"{o.epochs:>9.2f}{o.epsilon:>8.3f}{o.epsilon_tan:>9.3f}"
            )
        return "\n".join(rows + [""] + list(self.explanation))


# --------------------------------------------------------------------------------------------
# Vectorised search helpers (integer-order RDP)
# --------------------------------------------------------------------------------------------


def _event(q: float, z: float, steps: int) -> ev.Event:
    """``steps`` Poisson-sampled steps at rate q (capped at 1): the kind's own event map."""
    return spec_event(SampleSpec("poisson", sampling_rate=min(float(q), 1.0)), float(z), steps)


def _search_eps(
    q: np.ndarray, z: np.ndarray | float, steps: np.ndarray, delta: float
) -> np.ndarray:
    """Integer-order RDP epsilon of ``steps`` Poisson-Gaussian steps (broadcast over q, z, S)."""
    q, z, steps = np.broadcast_arrays(np.asarray(q, float), np.asarray(z, float), steps)
    curve = _rdp.rdp_poisson_gaussian(q, z, _SEARCH_ORDERS)
    eps, _ = _rdp.epsilon_from_rdp(steps[..., None] * curve, _SEARCH_ORDERS, delta)
    return np.asarray(eps, dtype=np.float64)


def _min_batch_for_z(n: int, steps: np.ndarray, target: float, delta: float) -> np.ndarray:
    """Per step count, the smallest integer batch whose calibrated ``z`` is >= 2 (else ``n``).

    Calibrated ``z >= 2`` iff ``eps(q, z=2, S) >= target`` (epsilon falls with ``z``, rises with
    ``q``), so this is a binary search on the batch at ``z = 2``, vectorised over ``steps``
    (:func:`dpfy.accounting.roots.smallest_true_array`).
    """
    reach = _search_eps(np.ones(steps.shape), _Z_THRESHOLD, steps, delta) >= target
    # Where even the full batch stays below the target at z = 2, z < 2 is forced: take n.
    # Batch 0 releases nothing (never reaches); batch n reaches where ``reach`` holds.
    lo = np.where(reach, 1, n).astype(np.int64)
    flat_steps = steps.ravel()

    def reaches(batch: np.ndarray, index: np.ndarray) -> np.ndarray:
        return _search_eps(batch / n, _Z_THRESHOLD, flat_steps[index], delta) >= target

    return roots.smallest_true_array(reaches, lo, np.full(steps.shape, n, dtype=np.int64))


def _rdp_noise_multiplier(q: float, steps: int, target: float, delta: float) -> float:
    """Smallest ``z`` (to relative 1e-4, never below) that the RDP accountant certifies."""
    return calibrate_noise_multiplier(
        lambda z: _event(q, z, steps), target, delta, method="rdp",
        bracket=(1e-3, 1e8), rtol=1e-4,
    )


def _has_pld() -> bool:
    return "pld" in accounting.accountants()


def _tighten_noise_multiplier(
    q: float, steps: int, target: float, delta: float, z_rdp: float
) -> float:
    """Re-calibrate ``z`` with the PLD accountant (tighter than RDP); keep ``z_rdp`` otherwise."""
    if not _has_pld():
        return z_rdp
    try:
        z = calibrate_noise_multiplier(
            lambda x: _event(q, x, steps), target, delta, method="pld",
            bracket=(z_rdp / 4.0, z_rdp * 1.001), rtol=1e-4,
        )
    except CalibrationError:
        return z_rdp
    z = min(float(z), z_rdp)
    # Check the safe side with the accountant the user will run; step up if it disagrees.
    while z < z_rdp and accounting.epsilon(_event(q, z, steps), delta).epsilon > target:
        z = min(z * (1.0 + 1e-4), z_rdp)
    return z


def _pld_min_batch(n: int, steps: int, target: float, delta: float, b_start: int) -> int:
    """Smallest batch (>= ``b_start``) whose PLD-calibrated ``z`` is >= 2, capped at ``n``."""
    from dpfy.accounting import pld as _pld

    def reaches(b: int) -> bool:
        return _pld.pld_epsilon(_event(b / n, _Z_THRESHOLD, steps), delta).epsilon >= target

    lo, hi = b_start - 1, b_start
    while not reaches(hi):  # grow the bracket geometrically: the answer is near b_start
        if hi >= n:
            return n
        lo, hi = hi, min(n, int(math.ceil(hi * 1.25)))
    return roots.smallest_true(reaches, lo + 1, hi)  # reaches(lo) is False, reaches(hi) True


# --------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------


def _sampler_event(
    sampler: str, n: int, batch: int, steps: int
) -> Callable[[float], ev.Event]:
    """``z -> event`` of ``steps`` steps of ``sampler`` (through :func:`spec_event`; batch N if
    the kind has no sampler class, e.g. full batch)."""
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler
    from dpfy.sampling.kinds import kind

    row = kind(sampler)
    if row.sampler is None:
        spec = SampleSpec(sampler=row.name, dataset_size=n, batch_size=n)
        return lambda z: spec_event(spec, z, steps)
    smp = make_sampler(row.name, n, batch, randomness=Randomness(0))
    return lambda z: smp.privacy_event(z, steps=steps)


def _for_sampler(
    options: list[PlanOption], sampler: str, target: float, delta: float
) -> list[PlanOption]:
    """The options re-calibrated for ``sampler``: same steps (and batch, or N for a kind that
    samples nothing), ``z`` calibrated with the kind's accountant and verified."""
    from dpfy.sampling.kinds import kind

    row = kind(sampler)
    out: list[PlanOption] = []
    for o in options:
        b = o.dataset_size if row.sampler is None else o.batch_size
        if any((b, o.steps) == (x.batch_size, x.steps) for x in out):
            continue
        make = _sampler_event(row.name, o.dataset_size, b, o.steps)
        z = calibrate_noise_multiplier(make, target, delta)
        res = accounting.epsilon(make(z), delta)
        if res.epsilon > target * (1.0 + 1e-12):  # cannot happen: z is certified
            raise RuntimeError(f"planning bug: epsilon {res.epsilon} exceeds {target}")
        out.append(
            dataclasses.replace(
                o, batch_size=b, noise_multiplier=float(z), epsilon=float(res.epsilon),
                method=res.method, sampler=row.name,
                epsilon_tan=float(tan.epsilon_tan(b / o.dataset_size, z, o.steps, delta)),
            )
        )
    return out


def _step_grid(min_steps: int, max_steps: int) -> np.ndarray:
    return np.unique(np.round(np.geomspace(min_steps, max_steps, 40)).astype(np.int64))


def _best_batch_and_steps(
    n: int, target: float, delta: float, s_floor: int, s_cap: int, compute: int | None
) -> tuple[int, int, bool]:
    """``(batch, steps, in_regime)``: for every step count in [s_floor, s_cap], the smallest
    batch in the constant-privacy regime (z >= 2); the most steps whose compute ``B x S``
    fits (``in_regime``), else all the compute spent at ``s_floor``."""
    grid = _step_grid(s_floor, s_cap)
    b_min = _min_batch_for_z(n, grid, target, delta)
    fits = b_min * grid <= (compute if compute is not None else np.inf)
    if fits.any():
        j = int(np.flatnonzero(fits).max())
        if j + 1 < grid.size:  # refine between this grid point and the next (compute-bound)
            fine = np.unique(np.linspace(grid[j], grid[j + 1], 24).round().astype(np.int64))
            fine_b = _min_batch_for_z(n, fine, target, delta)
            ok = fine_b * fine <= (compute if compute is not None else np.inf)
            k = int(np.flatnonzero(ok).max())
            s_best, b_best = int(fine[k]), int(fine_b[k])
        else:
            s_best, b_best = int(grid[j]), int(b_min[j])
        in_regime = True
    else:
        # Compute too small for z >= 2 at min_steps: spend it all there (largest eta for it).
        assert compute is not None
        s_best = s_floor
        b_best = int(min(n, max(1, compute // s_floor)))
        in_regime = False

    if in_regime and _has_pld():
        # The PLD accountant is tighter than RDP: the z >= 2 boundary moves to a larger batch.
        b_pld = _pld_min_batch(n, s_best, target, delta, b_best)
        for _ in range(4):  # compute-bound: B_min S grows like sqrt(S), so shrink S to fit
            if compute is None or b_pld * s_best <= compute or s_best <= s_floor:
                break
            shrink = (compute / (b_pld * s_best)) ** 2
            s_best = max(s_floor, int(s_best * shrink * 0.999))
            b_start = int(_min_batch_for_z(n, np.array([s_best]), target, delta)[0])
            b_pld = _pld_min_batch(n, s_best, target, delta, b_start)
        b_best = b_pld if compute is None else max(1, min(b_pld, compute // s_best))
    return b_best, s_best, in_regime


def _candidates(
    n: int, target: float, delta: float, best: tuple[int, int], s_cap: int, compute: int | None
) -> list[tuple[int, int, str, str]]:
    """``(batch, steps, label, reason)``: the pick ``best`` first, then informative
    alternatives around it (within ``s_cap`` steps and the compute)."""
    b_best, s_best = best
    cands: list[tuple[int, int, str, str]] = [
        (b_best, s_best, "recommended", "most steps with z >= 2 inside the compute budget")
    ]

    def add(b: int, s: int, label: str, reason: str) -> None:
        b, s = int(min(max(b, 1), n)), int(max(s, 1))
        if s > s_cap or (compute is not None and b * s > compute):
            return
        if any((b, s) == (c[0], c[1]) for c in cands):
            return
        cands.append((b, s, label, reason))

    add(2 * b_best, s_best, "2x batch, same steps",
        "z doubles, eta_step unchanged: TAN expects no accuracy gain for 2x compute")
    add(b_best // 2, s_best, "half batch, same steps",
        "cheaper, but z falls toward the privacy wall: less signal per step")
    if s_best > 1:
        s_half = max(1, s_best // 2)
        b_half = int(_min_batch_for_z(n, np.array([s_half]), target, delta)[0])
        if _has_pld():
            b_half = _pld_min_batch(n, s_half, target, delta, b_half)
        add(b_half, s_half, "half the steps",
            "batch with z ~ 2 at half the steps: less compute, fewer updates")
    if compute is not None:
        add(compute // s_best, s_best, "all compute, same steps",
            "uses the whole compute budget on a larger batch")
        if s_cap > s_best:
            add(compute // s_cap, s_cap, "all steps allowed",
                "max_steps within the compute budget, below the constant-privacy regime")
    return cands


def _calibrated_options(
    cands: list[tuple[int, int, str, str]], n: int, target: float, delta: float
) -> list[PlanOption]:
    """Every candidate with its z: an RDP search, then PLD (tighter) when available; each
    verified against the target."""
    options: list[PlanOption] = []
    for b, s, label, reason in cands:
        z_rdp = _rdp_noise_multiplier(b / n, s, target, delta)
        z = _tighten_noise_multiplier(b / n, s, target, delta, z_rdp)
        res = accounting.epsilon(_event(b / n, z, s), delta)
        if res.epsilon > target * (1.0 + 1e-12):  # cannot happen: z is certified by a method
            raise RuntimeError(f"planning bug: epsilon {res.epsilon} exceeds {target}")
        options.append(
            PlanOption(
                batch_size=b,
                noise_multiplier=z,
                steps=s,
                dataset_size=n,
                epsilon=float(res.epsilon),
                method=res.method,
                epsilon_tan=float(tan.epsilon_tan(b / n, z, s, delta)),
                label=label,
                reason=reason,
            )
        )
    return options


def plan(
    dataset_size: int,
    target_epsilon: float,
    delta: float,
    max_steps: int | None = None,
    max_examples_processed: int | None = None,
    *,
    min_steps: int | None = None,
    runner_ups: int = 4,
    sampler: str = "poisson",
) -> Plan:
    """Recommend (batch size, noise multiplier, steps) for DP-SGD that meet the privacy budget.

    Args:
      dataset_size: number of training examples ``N`` (the unit of privacy is one example).
      target_epsilon: epsilon budget for the *final training run* (tuning not included; see
        :mod:`dpfy.accounting.tuning`).
      delta: target delta, in (0, 1); should be well below ``1 / N``.
      max_steps: most DP-SGD steps the user will run (default :data:`DEFAULT_MAX_STEPS`).
      max_examples_processed: compute budget in examples through the model, ``B * S``
        (``None``: unlimited).
      min_steps: fewest steps to recommend (default ``ceil(max_steps / 10)``): with less, the
        number of updates rather than the noise limits accuracy. If the compute cannot reach
        ``z >= 2`` at ``min_steps``, the plan spends all of it at ``min_steps`` (``z < 2``,
        said in the explanation).
      runner_ups: how many alternative options to list (at most).
      sampler: the sampler kind that will run (:func:`dpfy.sampling.registered_kinds`). The
        search for batch and steps is the Poisson one above; for another kind every option's
        ``z`` is then calibrated and verified with that kind's own event and accountant (a kind
        that samples nothing, full batch, uses batch N).

    Returns:
      A :class:`Plan`; ``plan.recommendation`` and every runner-up satisfy
      ``dpfy.accounting.epsilon(option.privacy_event(), delta).epsilon <= target_epsilon``.

    Raises:
      ValueError: a parameter out of range.

    Example:
      >>> p = plan(60_000, 3.0, 1e-5, max_steps=2_000, runner_ups=0)
      >>> p.recommendation.steps, p.recommendation.noise_multiplier >= 1.9
      (2000, True)
    """
    check_int("dataset_size", dataset_size)
    check_range("target_epsilon", target_epsilon, 0.0, None, low_open=True, high_open=True)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    if max_steps is not None:
        check_int("max_steps", max_steps)
    if max_examples_processed is not None:
        check_int("max_examples_processed", max_examples_processed)
    check_int("runner_ups", runner_ups, 0)
    from dpfy.sampling.kinds import kind

    sampler = kind(sampler).name  # raises a ValueError listing the kinds
    n = int(dataset_size)
    target = float(target_epsilon)
    s_cap = int(max_steps) if max_steps is not None else DEFAULT_MAX_STEPS
    compute = None if max_examples_processed is None else int(max_examples_processed)
    if compute is not None:
        s_cap = min(s_cap, compute)  # at least one example per step
    if min_steps is not None:
        check_int("min_steps", min_steps)
        s_floor = min(int(min_steps), s_cap)
    else:
        s_floor = max(1, math.ceil(s_cap / 10))
    b_best, s_best, in_regime = _best_batch_and_steps(n, target, delta, s_floor, s_cap, compute)
    cands = _candidates(n, target, delta, (b_best, s_best), s_cap, compute)[: 1 + runner_ups]
    options = _calibrated_options(cands, n, target, delta)
    if sampler != "poisson":
        options = _for_sampler(options, sampler, target, float(delta))
    rec = options[0]
    if not in_regime:
        rec = dataclasses.replace(
            rec, reason="compute too small for z >= 2 at min_steps: all compute at min_steps"
        )
    explanation = _explain(
        rec, n, target, delta, s_cap, s_floor, max_steps, compute, in_regime
    )
    if sampler != "poisson":
        explanation += (
            f"Sampler: {sampler}. Batch and steps come from the Poisson search above; each "
            f"option's z is calibrated for the {sampler} sampler with the {rec.method} "
            "accountant and verified (eps_TAN stays the Poisson approximation).",
        )
    return Plan(
        dataset_size=n,
        target_epsilon=target,
        delta=float(delta),
        max_steps=s_cap,
        max_examples_processed=compute,
        recommendation=rec,
        runner_ups=tuple(options[1:]),
        explanation=explanation,
    )


def _explain(
    rec: PlanOption,
    n: int,
    target: float,
    delta: float,
    s_cap: int,
    s_floor: int,
    max_steps: int | None,
    compute: int | None,
    in_regime: bool,
) -> tuple[str, ...]:
    eta_budget = float(tan.eta_for_epsilon(target, delta))
    lines = [
        f"Budget: epsilon={target:g} at delta={delta:g} for the final training run, "
        f"Poisson sampling, add-or-remove adjacency, one example as the unit of privacy.",
    ]
    if delta >= 1.0 / n:
        lines.append(
            f"Warning: delta={delta:g} is not below 1/N={1.0 / n:.3g}; a delta this large can "
            "allow releasing whole examples. Choose delta well below 1/N."
        )
    lines.append(
        f"TAN: this budget corresponds to a total signal-to-noise eta~{eta_budget:.4f} "
        f"(eps_TAN(eta)={target:g}). With noise multiplier z >= 2 epsilon depends almost only on "
        "eta; below z=0.5 it explodes (the privacy wall)."
    )
    steps_src = (
        f"max_steps={max_steps}" if max_steps is not None
        else f"the default cap of {DEFAULT_MAX_STEPS} steps (set max_steps to change it)"
    )
    if in_regime:
        lines.append(
            f"Steps: {rec.steps}, the most steps allowed by {steps_src}"
            + (f" and compute={compute:,} examples" if compute is not None else "")
            + " for which a batch in the constant-privacy regime fits."
        )
        lines.append(
            f"Batch: {rec.batch_size} (q={rec.sampling_rate:.4g}), the smallest with z >= 2 at "
            f"{rec.steps} steps: larger batches keep eta_step={rec.eta_step:.3g} and only cost "
            f"compute. Compute: {rec.examples_processed:,} examples ({rec.epochs:.1f} epochs)."
        )
        if rec.noise_multiplier < tan.CONSTANT_PRIVACY_NOISE_MULTIPLIER:
            lines.append(
                f"Note: z={rec.noise_multiplier:.3f} is just below 2 because the compute budget "
                "caps the batch once the tighter PLD accountant sets the noise."
            )
    else:
        lines.append(
            f"Compute: {compute:,} examples is too little to reach z >= 2 with at least "
            f"min_steps={s_floor} steps; the pick spends all of it at {rec.steps} steps "
            f"(batch {rec.batch_size}, z={rec.noise_multiplier:.3f}, regime "
            f"{rec.regime.value}): part of the budget is lost to the privacy wall. More compute "
            "(larger batches) or fewer steps would buy signal-to-noise at the same epsilon."
        )
    lines.append(
        f"Noise multiplier: z={rec.noise_multiplier:.4f}, calibrated so the {rec.method} "
        f"accountant gives epsilon={rec.epsilon:.4f} <= {target:g} "
        f"(eps_TAN={rec.epsilon_tan:.4f}, an approximation only)."
    )
    lines.append(
        "Tuning on private data is not included: account it with dpfy.accounting.tuning "
        "(e.g. a random number of trials, Papernot & Steinke 2022)."
    )
    return tuple(lines)


def tan_scaled(dataset_size: int, target_epsilon: float, delta: float,
               steps: int) -> tuple[int, int]:
    """The expected batch size and the epochs of a TAN-scaled run of about ``steps`` steps.

    TAN (Sander et al. 2023) keeps the noise per example, ``z / B``, where the budget puts it and
    grows the batch (and with it ``z``) until ``z >= 2``, out of the privacy wall. This is
    :func:`plan`'s recommendation with ``max_steps=steps`` and no compute cap: the smallest such
    batch for the most steps up to ``steps``. The epochs are the examples it processes over
    ``dataset_size``, rounded (at least 1), so the run takes about that many Poisson steps; its
    noise multiplier is then calibrated to the target for the steps it really takes.
    """
    check_int("steps", steps)
    option = plan(dataset_size, target_epsilon, delta, max_steps=steps, runner_ups=0).recommendation
    epochs = max(1, round(option.batch_size * option.steps / dataset_size))
    return option.batch_size, epochs


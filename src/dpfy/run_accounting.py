"""The privacy of a run before it runs: ``dpfy epsilon``, ``dpfy calibrate`` and ``dpfy plan``.

Library pipelines that account a planned run for the sampler that will really run (never a
ledger: nothing has run yet), calibrate its noise to a target, and recommend a plan with
figures; the CLI calls them as it calls :mod:`dpfy.runs`. Bad input raises a
``ValueError`` with a one-line message naming the parameter.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dpfy._validate import (
    MAX_COUNT,
    check_int,
    check_output_path,
    check_positive,
    check_range,
    check_seed,
)
from dpfy.config import check_budget

__all__ = [
    "account_run",
    "calibrate_run",
    "MonteCarloOptions",
]

if TYPE_CHECKING:
    from dpfy.accounting import Accountant, PrivacyResult
    from dpfy.accounting.risk import AttackRisk
    from dpfy.planning import Plan
    from dpfy.sampling import Sampler


# ---------------------------------------------------------------------------------------------
# plan and account a run before it runs
# ---------------------------------------------------------------------------------------------


def plan_with_figures(
    dataset_size: int,
    target_epsilon: float,
    delta: float,
    *,
    max_steps: int | None = None,
    max_examples_processed: int | None = None,
    plot_dir: str | os.PathLike[str] | None = None,
    sampler: str = "poisson",
) -> tuple[Plan, list[Path]]:
    """:func:`dpfy.planning.plan`, and with ``plot_dir`` its options figure and the privacy
    wall at the target (Sander et al. 2023) written there; (plan, figure paths)."""
    from dpfy.planning import plan

    if plot_dir is not None:
        check_output_path("plot", plot_dir)
    result = plan(
        dataset_size,
        target_epsilon,
        delta,
        max_steps=max_steps,
        max_examples_processed=max_examples_processed,
        sampler=sampler,
    )
    if plot_dir is None:
        return result, []
    from dpfy.report import plots_tan

    folder = Path(plot_dir)
    return result, [
        plots_tan.plan_options(result, folder / "plan_options.png"),
        plots_tan.privacy_wall(
            folder / "privacy_wall.png", target_epsilons=(target_epsilon,), delta=delta
        ),
    ]


@dataclasses.dataclass(frozen=True)
class RunAccounting:
    """The privacy of a planned run, for the sampler that will really run.

    Attributes:
      sampler: the sampler kind (see :data:`dpfy.sampling.factory.SAMPLER_KINDS`).
      dataset_size, batch_size: N and the (expected) batch size B.
      steps: total DP-SGD steps; epochs: passes over the data as given (None: steps given).
      noise_multiplier: noise std / clip norm.
      result: epsilon at delta by the chosen method (``all``: the tightest valid one).
      comparison: with ``method="all"``, every method's result or why it does not apply.
      attack_risk: a membership-inference attacker's TPR bound at FPRs 1e-3, 1e-2, 0.1.
      mechanisms: with ``compare_mechanisms``, every mechanism calibrated to the same target
        (:func:`compare_mechanisms`, whole epochs of ``floor(N / B)`` steps).
    """

    sampler: str
    dataset_size: int
    batch_size: int
    steps: int
    epochs: float | None
    noise_multiplier: float
    result: PrivacyResult
    comparison: dict[str, PrivacyResult | str] | None = None
    attack_risk: AttackRisk | None = None
    mechanisms: tuple[MechanismRow, ...] | None = None

    @property
    def sampling_rate(self) -> float:
        """B / N (the Poisson sampling rate)."""
        return self.batch_size / self.dataset_size


def account_run(
    dataset_size: int,
    batch_size: int,
    noise_multiplier: float,
    delta: float,
    *,
    epochs: float | None = None,
    steps: int | None = None,
    sampler: str = "poisson",
    method: str = "auto",
    max_batch_size: int | None = None,
    monte_carlo: MonteCarloOptions | None = None,
) -> RunAccounting:
    """Epsilon spent by a run of ``epochs`` or ``steps`` (exactly one) with this sampler.

    ``method`` is an accountant name, or ``"all"`` for every method (the tightest in
    ``result``). ``monte_carlo`` configures Monte Carlo accounting (Balls-and-Bins, Chua et al.
    2025): given with ``method="auto"`` and a sample count or seed, it selects it.
    """
    from dpfy import accounting

    check_positive("noise_multiplier", noise_multiplier)
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    smp, epochs, steps = _planned_sampler(
        sampler, dataset_size, batch_size, max_batch_size, epochs, steps
    )
    event = smp.privacy_event(noise_multiplier, epochs=epochs, steps=steps)
    comparison: dict[str, PrivacyResult | str] | None = None
    if method == "all":
        comparison = dict(accounting.compare(event, delta))
        result = accounting.epsilon(event, delta)
    else:
        acc = _accountant(method, monte_carlo)
        result = accounting.epsilon(event, delta, method=acc)
    total = _total_steps(smp, epochs, steps)
    risk = _attack_risk(event, result)
    return RunAccounting(
        smp.kind,
        dataset_size,
        batch_size,
        total,
        epochs,
        noise_multiplier,
        result,
        comparison,
        risk,
    )


def calibrate_run(
    target_epsilon: float,
    dataset_size: int,
    batch_size: int,
    delta: float,
    *,
    epochs: float | None = None,
    steps: int | None = None,
    sampler: str = "poisson",
    method: str = "auto",
    max_batch_size: int | None = None,
    monte_carlo: MonteCarloOptions | None = None,
    compare_mechanisms: bool = False,
) -> RunAccounting:
    """The smallest noise multiplier whose epsilon stays at or below ``target_epsilon``
    (rounded to the safe side), with the epsilon it gives; options as :func:`account_run`.
    ``compare_mechanisms``: also calibrate DP-SGD and the correlated-noise mechanisms for the
    same run (``mechanisms``; see :func:`compare_mechanisms`)."""
    from dpfy import accounting
    from dpfy.accounting.calibrate import calibrate_noise_multiplier

    check_budget(target_epsilon, delta)
    smp, epochs, steps = _planned_sampler(
        sampler, dataset_size, batch_size, max_batch_size, epochs, steps
    )
    acc = _accountant(method, monte_carlo)

    def make_event(z: float) -> Any:
        return smp.privacy_event(z, epochs=epochs, steps=steps)

    z = calibrate_noise_multiplier(make_event, target_epsilon, delta, method=acc)
    result = accounting.epsilon(make_event(z), delta, method=acc)
    total = _total_steps(smp, epochs, steps)
    rows = None
    if compare_mechanisms:
        passes = math.ceil(total / max(dataset_size // batch_size, 1))
        rows = tuple(_compare(target_epsilon, dataset_size, batch_size, delta, epochs=passes))
    return RunAccounting(
        smp.kind, dataset_size, batch_size, total, epochs, z, result, mechanisms=rows
    )


def plan_and_compare(
    dataset_size: int,
    target_epsilon: float,
    delta: float,
    *,
    compare_mechanisms: bool = False,
    **options: Any,
) -> tuple[Plan, list[Path], list[MechanismRow] | None]:
    """:func:`plan_with_figures` (``options`` as there) and, with ``compare_mechanisms``,
    every mechanism calibrated at the recommended batch size for whole epochs covering the
    recommended steps."""
    result, figures = plan_with_figures(dataset_size, target_epsilon, delta, **options)
    if not compare_mechanisms:
        return result, figures, None
    best = result.recommendation
    passes = max(1, math.ceil(best.steps / max(dataset_size // best.batch_size, 1)))
    rows = _compare(target_epsilon, dataset_size, best.batch_size, delta, epochs=passes)
    return result, figures, rows


@dataclasses.dataclass(frozen=True)
class _FullBatchPlan:
    """A planned full-batch run: every example in each of its releases (one per epoch).

    Stands in for a sampler where the kind's row has none; its event is the row's own
    (:mod:`dpfy.sampling.full_batch`).
    """

    kind: str
    dataset_size: int
    steps_per_epoch: int = 1

    @classmethod
    def of(
        cls, kind: str, dataset_size: int, batch_size: int, max_batch_size: int | None
    ) -> _FullBatchPlan:
        from dpfy.sampling.kinds import kind as sampler_kind

        name = sampler_kind(kind).name
        check_int("dataset_size", dataset_size)
        if batch_size != dataset_size:
            raise ValueError(
                f"batch_size must equal dataset_size={dataset_size} for sampler {kind!r} (every "
                f"example in every release), got batch_size={batch_size!r}"
            )
        if max_batch_size is not None:
            raise ValueError(
                f"max_batch_size does not apply to sampler {kind!r} (nothing is sampled), got "
                f"max_batch_size={max_batch_size!r}"
            )
        return cls(name, int(dataset_size))

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> Any:
        """The row's event for the releases of ``epochs`` (rounded up) or ``steps``."""
        from dpfy.sampling import SampleSpec
        from dpfy.sampling.base import epochs_and_steps
        from dpfy.sampling.spec import spec_event

        _, total = epochs_and_steps(epochs, steps, self.steps_per_epoch)
        spec = SampleSpec(
            sampler=self.kind, dataset_size=self.dataset_size, batch_size=self.dataset_size
        )
        return spec_event(spec, noise_multiplier, total)


def _planned_sampler(
    kind: str,
    dataset_size: int,
    batch_size: int,
    max_batch_size: int | None,
    epochs: float | None,
    steps: int | None,
) -> tuple[Sampler | _FullBatchPlan, float | None, int | None]:
    """The sampler (its randomness is never drawn) and the checked (epochs, steps).

    A kind without a sampler class (``full_batch``) is planned from its row alone.
    """
    from dpfy.randomness import Randomness
    from dpfy.sampling import make_sampler
    from dpfy.sampling.kinds import kind as sampler_kind

    smp: Sampler | _FullBatchPlan
    if sampler_kind(kind).sampler is None:
        smp = _FullBatchPlan.of(kind, dataset_size, batch_size, max_batch_size)
    else:
        smp = make_sampler(
            kind,
            dataset_size=dataset_size,
            batch_size=batch_size,
            max_batch_size=max_batch_size,
            randomness=Randomness(0),
        )
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of --epochs or --steps")
    if steps is not None:
        check_int("steps", steps)
    else:
        # finite, and few enough that the run's step count stays a count (<= MAX_COUNT)
        check_positive("epochs", epochs, MAX_COUNT / smp.steps_per_epoch)
    return smp, epochs, steps


def _attack_risk(event: Any, result: PrivacyResult) -> AttackRisk:
    """The attacker's TPR bounds for ``event``; none from a non-provable (estimated) result."""
    from dpfy.accounting.risk import AttackRisk, attack_risk

    if not result.provable:
        return AttackRisk.unavailable(
            f"epsilon is a {result.method} estimate, not a proof: no provable bound on the "
            "attacker"
        )
    return attack_risk(event, method=result.method)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MonteCarloOptions:
    """Monte Carlo accounting of a planned run (Balls-and-Bins, Chua et al. 2025).

    Attributes:
      samples: Monte Carlo samples (None: the accountant's default).
      error_probability: probability in (0, 1) that the reported bound is not an upper bound.
      seed: seed of the Monte Carlo draws (None: fresh randomness).
    """

    samples: int | None = None
    error_probability: float = 1e-3
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.samples is not None:
            check_int("samples", self.samples)
        check_range("error_probability", self.error_probability, 0.0, 1.0,
                    low_open=True, high_open=True)
        if self.seed is not None:
            check_seed("seed", self.seed)

    @property
    def chosen(self) -> bool:
        """Whether a sample count or a seed was given (``method="auto"`` then means MC)."""
        return self.samples is not None or self.seed is not None


def _total_steps(smp: Sampler | _FullBatchPlan, epochs: float | None, steps: int | None) -> int:
    """Steps of the run: ``steps``, or ``epochs`` whole or partial passes (rounded up)."""
    if steps is not None:
        return int(steps)
    assert epochs is not None
    return math.ceil(epochs * smp.steps_per_epoch - 1e-9)


def _accountant(method: str, monte_carlo: MonteCarloOptions | None) -> str | Accountant:
    """A method name, or a configured Monte Carlo accountant when MC options were given."""
    mc = MonteCarloOptions() if monte_carlo is None else monte_carlo
    if method == "monte_carlo" or (method == "auto" and mc.chosen):
        from dpfy.accounting.monte_carlo.accountant import MonteCarloAccountant

        kwargs: dict[str, Any] = {"error_probability": mc.error_probability}
        if mc.samples is not None:
            kwargs["samples"] = mc.samples
        if mc.seed is not None:
            kwargs["seed"] = mc.seed
        return cast("Accountant", MonteCarloAccountant(**kwargs))
    return method


# ---------------------------------------------------------------------------------------------
# mechanisms side by side (DP-SGD vs correlated noise, docs/architecture.md 5.16)
# ---------------------------------------------------------------------------------------------

#: Mechanisms of ``dpfy train --mechanism`` (``dpsgd``: independent noise per step).


@dataclasses.dataclass(frozen=True)
class MechanismRow:
    """One mechanism calibrated to the common target.

    Attributes:
      mechanism, sampler, method: what runs and who accounts it.
      noise_multiplier: z at the target (safe side); epsilon: the accountant's at delta.
      prefix_rmse: root-mean-square noise of the released prefix sums of clipped gradients,
        per clip norm: ``z ||A C^{-1}||_F / sqrt(T)`` (``C = I`` for DP-SGD), what the model's
        trajectory sees (Denisov et al. 2022).
    """

    mechanism: str
    sampler: str
    method: str
    noise_multiplier: float
    epsilon: float
    prefix_rmse: float


def _compare(*args: Any, **kwargs: Any) -> list[MechanismRow]:
    """:func:`compare_mechanisms`, for the callers whose flag of that name shadows it."""
    return compare_mechanisms(*args, **kwargs)


def compare_mechanisms(
    target_epsilon: float,
    dataset_size: int,
    batch_size: int,
    delta: float,
    *,
    epochs: int = 1,
    band: int = 16,
    buffers: int = 4,
) -> list[MechanismRow]:
    """Calibrate every mechanism for the same run (``epochs`` passes of ``floor(N / B)``
    batches): DP-SGD with Poisson sampling, DP-SGD with shuffled batches (the
    no-amplification bound), and BandMF, BLT and tree aggregation (plain, and with the
    efficient estimator of Honaker 2015) with the cyclic order of one secret permutation
    (``MatrixMechanism``, exact GDP).

    Each mechanism is calibrated with the tightest accountant it supports: every applicable
    ``auto`` accountant is calibrated and the smallest z is kept, its accountant named in the
    row's ``method`` (PLD for Poisson DP-SGD: an RDP calibration would charge it about 8 %
    more noise at epsilon 3)."""
    from dpfy import accounting
    from dpfy.accounting.calibrate import calibrate_with_method
    from dpfy.correlated import Cyclic, make_plan
    from dpfy.correlated.strategy import strategy_names
    from dpfy.sampling import SampleSpec
    from dpfy.sampling.spec import spec_event

    check_budget(target_epsilon, delta)
    check_int("dataset_size", dataset_size)
    check_int("batch_size", batch_size, high=dataset_size)
    check_int("epochs", epochs)
    per_epoch = dataset_size // batch_size
    steps = per_epoch * epochs
    check_int("steps", steps, high=20_000)  # the strategies are optimised for T steps
    workload = math.sqrt(steps * (steps + 1) / 2 / steps)  # ||A||_F / sqrt(T)
    rows = []

    def add(name: str, sampler: str, make: Any, err: float) -> None:
        z, method = calibrate_with_method(make, target_epsilon, delta)  # the tightest
        eps = accounting.epsilon(make(z), delta, method=method).epsilon
        rows.append(MechanismRow(name, sampler, method, float(z), float(eps), float(z * err)))

    poisson = SampleSpec("poisson", dataset_size, sampling_rate=batch_size / dataset_size)
    shuffle = SampleSpec(
        "shuffle", dataset_size, batch_size=batch_size, steps_per_epoch=per_epoch
    )
    add("dpsgd", "poisson", lambda z: spec_event(poisson, z, steps), workload)
    add("dpsgd", "shuffle", lambda z: spec_event(shuffle, z, epochs), workload)
    for name in strategy_names():  # every registered strategy
        plan = make_plan(name, steps, Cyclic(per_epoch), band=min(band, per_epoch),
                         buffers=buffers)
        err = math.sqrt(plan.rule.prefix_error(steps) / steps)
        add(name, "cyclic", plan.event, err)
    return rows

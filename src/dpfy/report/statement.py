"""The privacy statement that ships with a model (Ponomareva et al. 2023, Sec. 5.3.3).

A report is built from a ledger alone (plus optional utility figures and run facts): the ledger
says which sampler ran and which noise was really added; the accountants turn that into
(epsilon, delta). Nothing here trusts a number computed by training code.

Fields follow the checklist of Ponomareva et al. 2023: DP setting, data accesses covered,
released output, unit of privacy, adjacency, sampler actually used, accounting method and its
assumptions (and any mismatch), the formal statement (epsilon at delta, delta vs 1/N, the RDP
curve or mu where exact), the privacy tier, every DP hyperparameter, utility, and how to
reproduce. Beyond the checklist, a report names the randomness of the sampler and of the
noise as the ledger recorded them, and its headline (``release``) says whether the run is a DP
release (both secure) or a seeded experiment that anyone with the seed and the data can
reproduce exactly (docs/randomness.md). :mod:`dpfy.report.markdown` renders it;
:mod:`dpfy.report.write` writes it to disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from dpfy import accounting
from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.accounting.group import group_epsilon
from dpfy.accounting.risk import AttackRisk, attack_risk
from dpfy.ledger import Ledger
from dpfy.ledger.hyperparameters import ledger_hyperparameters
from dpfy.ledger.records import NonPrivateRecord
from dpfy.ledger.trust import KeyTrust, assess
from dpfy.report.consistency import (
    check_recorded_epsilon,
    incomplete_statement,
    trust_note,
    unsigned_note,
)
from dpfy.report.markdown import to_markdown
from dpfy.sampling.kinds import column as sampler_column
from dpfy.sampling.kinds import kind as sampler_kind

# Ledger operations that used to live here.
prefix_ledger = Ledger.prefix  # prefix_ledger(ledger, num_samples=None, *, path=None)

#: Every field a report carries (a test checks each is present and consistent with the ledger).
REPORT_FIELDS = (
    "release",
    "sampling_randomness",
    "noise_randomness",
    "dp_setting",
    "data_accesses",
    "released_output",
    "unit_of_privacy",
    "adjacency",
    "sampler",
    "accounting_method",
    "assumptions",
    "epsilon",
    "delta",
    "delta_times_n",
    "formal_statement",
    "privacy_tier",
    "hyperparameters",
    "other_methods",
    "attack_risk",
    "utility",
    "reproduce",
    "ledger_integrity",
)

#: Kind name -> what the report assumes about that sampler (the table in dpfy.sampling.kinds).
_SAMPLER_ASSUMPTIONS = sampler_column("assumptions")

#: What a report says when the ledger's metadata does not name a randomness.
NOT_RECORDED = "not recorded in the ledger"


def release_headline(sampling_randomness: str, noise_randomness: str) -> str:
    """The report's first line: a DP release, a seeded experiment, or unknown randomness.

    ``sampling_randomness`` / ``noise_randomness`` are what the ledger recorded
    (:meth:`dpfy.randomness.Randomness.describe`; ``"none ..."`` where nothing was drawn).
    Any seeded part makes the run a reproducible experiment: with the seed and the data the
    model is re-created bit for bit, so membership is decided with certainty.
    """
    parts = (sampling_randomness, noise_randomness)
    if any(p.startswith("seeded") for p in parts):
        return (
            "Seeded experiment — not a DP release: anyone with the seed and the data can "
            "reproduce the model exactly; the (epsilon, delta) below describes the mechanism only."
        )
    if all(p.startswith(("secure", "none")) for p in parts):
        return (
            "DP release: sampling and noise drawn from the secure generator (AES-256-CTR "
            "keystream keyed from the OS); no seed re-creates this model."
        )
    return (
        "Randomness not recorded in the ledger: whether the sampling and noise were secret "
        "cannot be checked; the (epsilon, delta) below holds only if they were."
    )


def privacy_tier(epsilon: float) -> str:
    """Privacy tier of Ponomareva et al. 2023 (Sec. 5.2): 1 for eps <= 1, 2 for eps <= 10, 3
    otherwise."""
    if epsilon <= 1.0:
        return "Tier 1 (strong formal privacy: epsilon <= 1)"
    if epsilon <= 10.0:
        return "Tier 2 (reasonable formal privacy: epsilon <= 10)"
    return "Tier 3 (weak formal privacy: epsilon > 10)"


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
    """A privacy statement; ``to_markdown`` for people, ``to_dict``/JSON for machines."""

    dp_setting: str
    data_accesses: str
    released_output: str
    unit_of_privacy: str
    adjacency: str
    sampler: dict[str, Any]
    accounting_method: str
    assumptions: tuple[str, ...]
    epsilon: float
    delta: float
    delta_times_n: float | None
    formal_statement: str
    privacy_tier: str
    hyperparameters: dict[str, Any]
    other_methods: dict[str, Any]
    utility: dict[str, Any]
    reproduce: dict[str, Any]
    rdp_curve: dict[str, list[float]] | None = None
    mu: float | None = None
    epsilon_estimate: float | None = None
    epsilon_lower: float | None = None
    error_probability: float | None = None
    figures: dict[str, str] = dataclasses.field(default_factory=dict)
    #: What the ledger's hash chain says (``dpfy.ledger.Verification`` as a dict, plus
    #: ``summary``: one line). See ``docs/ledger.md``.
    ledger_integrity: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Upper bounds on a membership-inference attacker's TPR at FPRs 1e-3, 1e-2 and 0.1
    #: (``dpfy.accounting.risk.AttackRisk.to_dict``): what epsilon means for an attacker.
    attack_risk: dict[str, Any] = dataclasses.field(default_factory=dict)
    release: str = ""
    #: An empirical lower bound beside the claim, written by ``dpfy audit`` (``dpfy.audit.run``):
    #: method, confidence, trials, the bound, the audited claim, the method's ceiling. Empty
    #: when the run was not audited.
    audit: dict[str, Any] = dataclasses.field(default_factory=dict)
    sampling_randomness: str = NOT_RECORDED
    noise_randomness: str = NOT_RECORDED
    #: A user-level run (unit = user, movie, ...): the grouping the ledger recorded (number of
    #: users, cap on examples per user, reduction, subsets) and the example-level reading of
    #: the guarantee (group privacy of size 2, labelled). Empty for an example-level run.
    user_level: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: A ``dpfy train`` run directory: the files safe to publish, where their numbers come
    #: from, and the private diagnostics directory the guarantee does not cover (``None``:
    #: none kept); :func:`dpfy.publication.publishing_section`. Empty elsewhere.
    publishing: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (infinite epsilon as ``"inf"``)."""
        out: dict[str, Any] = _jsonable(dataclasses.asdict(self))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        return to_markdown(self)


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------


def build_report(
    ledger: Ledger,
    *,
    delta: float,
    method: str | accounting.Accountant = "auto",
    utility: Mapping[str, Any] | None = None,
    data_accesses: str | None = None,
    released_output: str | None = None,
    ledger_path: str | None = None,
    reproduce_command: str | None = None,
    trusted_key: str | None = None,
) -> PrivacyReport:
    """Account ``ledger`` at ``delta`` and assemble the checklist of Ponomareva et al. 2023.

    Args:
      ledger: the run's ledger (``Ledger.load(path)``).
      delta: the delta of the formal statement, in (0, 1).
      method: accounting method (``auto`` takes the tightest valid one).
      utility: measured utility figures (e.g. ``{"test_accuracy": 0.981}``); default: the
        ``utility`` / ``test_accuracy`` the run recorded in the ledger's metadata.
      data_accesses / released_output: what the statement covers, in words; default: what the
        run recorded in the ledger's metadata, else the final run and the final model.
      ledger_path / reproduce_command: how a reader re-derives the statement.
      trusted_key: an Ed25519 public key (64 hex digits) the reader holds apart from the
        file: the run's own key or a long-lived key that endorsed it
        (:mod:`dpfy.ledger.trust`). None: the signing key is not checked and the statement
        says so (self-consistency only).

    Raises:
      LedgerIntegrityError: ``trusted_key`` was given and neither signed nor endorsed the
        ledger's key, or the lines account to less than the recorded epsilon.
    """
    check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    meta = ledger.metadata
    if utility is None:
        utility = dict(meta.get("utility", {}))
        for key in ("test_accuracy", "wall_time_seconds"):
            if key in meta:
                utility.setdefault(key, meta[key])
    data_accesses = data_accesses or meta.get("data_accesses") or (
        "the final training run only; hyperparameter tuning runs on the same data are NOT covered"
    )
    released_output = released_output or meta.get("released_output") or "the final model"
    released_output += (
        "; every intermediate model is covered by the same statement, since the accounting "
        "composes every noisy step"
    )
    event = ledger.to_event()
    result = accounting.epsilon(ledger, delta, method)
    check_recorded_epsilon(ledger, result, delta)  # refuses a tail rewritten after the run
    verification = ledger.verification
    trust = assess(verification, meta, trusted_key, source=f"ledger {ledger.path!r}")
    hyper = ledger_hyperparameters(ledger)
    spec = hyper.pop("_spec", {})
    n = spec.get("dataset_size")
    sampler_kind = spec.get("sampler", "none")

    unit = ledger.unit or "example"

    def sampling(kind: str) -> str:
        text = str(_SAMPLER_ASSUMPTIONS.get(kind, kind))
        if unit != "example":  # the sampler drew units (users, movies), not examples
            text = text.replace("examples", f"{unit}s").replace("example", unit)
        return text

    assumptions = [sampling(sampler_kind)]
    stages = list(dict.fromkeys(r.spec for r in ledger.samples))
    if len(stages) > 1:  # e.g. LP-FT: the probe's full batch, then the fine-tuning's sampler
        spec = {**spec, "stages": [stage.to_dict() for stage in stages]}
        assumptions = [f"stage {i + 1} of {len(stages)} ({stage.sampler}): "
                       f"{sampling(stage.sampler)}" for i, stage in enumerate(stages)]
    public_size = public_size_assumption(n, result.adjacency, unit)
    if public_size is not None:
        assumptions.append(public_size)
    assumptions.extend(result.notes)
    others = _other_methods(event, delta, result.method)
    if sampler_kind == "shuffle":
        poisson = _poisson_counterfactual(hyper, n, delta)
        if poisson is not None:
            others["poisson_pld_if_poisson_had_run (NOT valid for this run)"] = poisson

    sampling_randomness = str(meta.get("sampling_randomness", NOT_RECORDED))
    noise_randomness = str(meta.get("noise_randomness", NOT_RECORDED))
    release = release_headline(sampling_randomness, noise_randomness)
    seeded = release.startswith("Seeded")
    mu = _mu(event)
    rdp_curve = _rdp_curve(event)
    risk = (
        attack_risk(event, method=result.method)
        if result.provable
        else AttackRisk.unavailable(f"epsilon is a {result.method} estimate, not a proof")
    )
    statement = _formal_statement(ledger, result, delta, seeded=seeded, n=n,
                                  public_size=public_size is not None, trust=trust)
    reproduce: dict[str, Any] = {
        "ledger": ledger_path,
        "command": reproduce_command
        or (f"dpfy report {ledger_path} --delta {delta:g}" if ledger_path else None),
        "steps_recorded": ledger.iteration,
    }
    config = meta.get("config")  # dpfy train records its RunConfig (dpfy.config)
    if isinstance(config, dict) and config:
        reproduce["config"] = config
    # A run that is not central training (e.g. federated, dpfy.fed) records its own setting
    # and trust model in the ledger's metadata.
    dp_setting = meta.get("dp_setting")
    if not isinstance(dp_setting, str) or not dp_setting:
        dp_setting = (
            "central DP: a trusted curator trains on the raw data; only the model is released"
        )
    return PrivacyReport(
        dp_setting=dp_setting,
        data_accesses=data_accesses,
        released_output=released_output,
        unit_of_privacy=ledger.unit or "example",
        adjacency=result.adjacency,
        sampler=spec,
        accounting_method=result.method,
        assumptions=tuple(assumptions),
        epsilon=result.epsilon,
        delta=delta,
        delta_times_n=(delta * n) if n else None,
        formal_statement=statement,
        privacy_tier=privacy_tier(result.epsilon),
        hyperparameters=hyper,
        other_methods=others,
        utility=dict(utility or {}),
        reproduce=reproduce,
        rdp_curve=rdp_curve,
        mu=mu,
        epsilon_estimate=result.epsilon_estimate,
        epsilon_lower=result.epsilon_lower,
        error_probability=result.error_probability,
        attack_risk=risk.to_dict(),
        ledger_integrity={
            **dataclasses.asdict(verification),
            "complete": verification.complete,
            "summary": f"{verification.describe()}; {trust.describe()}",
            "trust": trust.to_dict(),
        },
        release=release,
        sampling_randomness=sampling_randomness,
        noise_randomness=noise_randomness,
        user_level=_user_level(meta.get("user_level"), ledger, result, delta, n),
    )


def _formal_statement(
    ledger: Ledger, result: accounting.PrivacyResult, delta: float, *, seeded: bool, n: Any,
    public_size: bool, trust: KeyTrust,
) -> str:
    """The report's formal statement: none for a release without noise; else (epsilon, delta)
    under the adjacency and unit, with what the reader must know (a seeded experiment, a
    public data set size, a Monte Carlo confidence, the ledger's signature and completeness,
    a run that ended early)."""
    verification, unit = ledger.verification, ledger.unit or "example"
    nonprivate = [r for r in ledger.entries if isinstance(r, NonPrivateRecord)]
    if nonprivate or math.isinf(result.epsilon):
        statement = (
            "NO differential privacy guarantee: the ledger records a release without noise "
            f"({'; '.join(f'{r.name}: {r.reason}' for r in nonprivate) or 'zero noise'})."
        )
    else:
        confidence = (
            f" with probability at least {1 - result.error_probability:g} over the Monte Carlo "
            "accounting"
            if result.error_probability is not None
            else ""
        )
        subject = (
            "Not a DP release (seeded experiment). With secret randomness, the same mechanism "
            "would satisfy"
            if seeded
            else "The training run satisfies"
        )
        statement = (
            f"{subject} ({result.epsilon:.5g}, {delta:g})-differential privacy "
            f"under {result.adjacency} adjacency at the level of one {ledger.unit or 'example'}"
            + (f", with the {_size_name(unit)} (N = {n}) treated as public"
               if public_size else "")
            + f", accounted with {result.method}{confidence}."
        ) + (unsigned_note(verification) or trust_note(verification, trust))
        statement = incomplete_statement(verification, result.epsilon, delta) or statement
        if (ledger.ended or "").startswith("early"):  # the end record says the plan did not run
            statement += (f" The run ended {ledger.ended}; the statement covers the releases "
                          "made, not the planned run.")
    return statement


def _size_name(unit: str) -> str:
    return "data set size" if unit == "example" else f"number of {unit}s"


def public_size_assumption(n: int | None, adjacency: str, unit: str = "example") -> str | None:
    """What the report assumes about the data set size N, or None where nothing is assumed.

    The ledger's sample entries record N (``dataset_size``) and the report prints it (``delta x
    N``), both exactly. Under add-or-remove adjacency neighbouring data sets differ in size, so an
    exact N is not covered by the (epsilon, delta) statement: the report says that N is treated
    as public, and the statement bounds what the released model reveals about one unit to
    someone who knows N. Under replace-one or zero-out adjacency N is the same for neighbours.
    """
    if n is None or adjacency != ev.Adjacency.ADD_OR_REMOVE:
        return None
    size = _size_name(unit)
    return (
        f"The {size} N = {n} is treated as public: the ledger records it and this report prints "
        f"it exactly, without noise. Under add_or_remove adjacency neighbouring data sets differ "
        f"in size, so N itself is not protected; the (epsilon, delta) statement bounds what the "
        f"released output reveals about any one {unit} to someone who already knows N."
    )


#: Fields of the ``user_level`` metadata a report reads, with their JSON types (N and the
#: configuration; a ledger's other, private grouping facts are never reported).
_USER_LEVEL_FIELDS: dict[str, tuple[type, ...]] = {
    "unit": (str,),
    "num_users": (int,),
    "max_examples_per_user": (int, type(None)),
    "reduction": (str,),
    "subset": (str,),
}


def _user_level(
    facts: Any,
    ledger: Ledger,
    result: accounting.PrivacyResult,
    delta: float,
    n: int | None,
) -> dict[str, Any]:
    """The user-level section of a report, from the ledger's ``user_level`` metadata.

    The example-level figure is k = 2 group privacy of the unit-level accountant
    (``dpfy.accounting.group``): removing one example changes one user's data (remove the
    user, add it back without the example), whatever the cap.
    """
    if facts is None:
        return {}
    if not isinstance(facts, dict):
        raise ValueError(f"ledger metadata user_level must be a JSON object, got {facts!r}")
    out: dict[str, Any] = {}
    for key, types in _USER_LEVEL_FIELDS.items():
        value = facts.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(
                f"ledger metadata user_level.{key} must be of type "
                f"{'/'.join(t.__name__ for t in types)}, got {value!r}"
            )
        out[key] = value
    unit = ledger.unit or "example"
    if out["unit"] != unit or (n is not None and out["num_users"] != n):
        raise ValueError(
            f"ledger metadata user_level ({out['num_users']} {out['unit']}s) disagrees with the "
            f"recorded samples ({n} {unit}s)"
        )
    out["delta_vs_1_over_n"] = (
        f"delta = {delta:g} against 1/N = {1 / out['num_users']:.3g} with N = "
        f"{out['num_users']} {unit}s (delta x N = {delta * out['num_users']:.3g}): "
        + ("below 1/N, as it should be" if delta * out["num_users"] < 1 else "NOT below 1/N")
    )
    if result.adjacency == "replace_one" and math.isfinite(result.epsilon):
        out["example_level"] = {
            "epsilon": result.epsilon,
            "delta": delta,
            "derivation": (
                f"the {unit}-level statement itself: under replace-one adjacency, adding, "
                f"removing or changing one example replaces one {unit}'s data, one step"
            ),
        }
    elif math.isfinite(result.epsilon) and result.provable:
        group = group_epsilon(ledger, delta, 2, result.method)
        why = (
            f"group privacy of size 2 (NOT the {unit}-level statement): adding or removing "
            f"one example changes one {unit}'s data, i.e. removes that {unit} and adds it back "
            f"changed, two {unit}-level steps, whatever the cap; "
        )
        if group.route == "rdp":
            why += (
                f"from the {unit}-level RDP curve by the weak triangle inequality (Mironov "
                "2017, Prop. 11), tighter here than (2 eps, delta (1 + e^eps))"
            )
        else:
            why += (
                f"from the {unit}-level ({group.epsilon_unit:.5g}, {group.delta_unit:.3g}) of "
                f"{group.method} by (2 eps, delta (1 + e^eps)) (Dwork & Roth 2014, Thm. 2.2)"
            )
        out["example_level"] = {"epsilon": group.epsilon, "delta": group.delta,
                                "route": group.route, "derivation": why}
    else:
        out["example_level"] = {"epsilon": math.inf, "delta": delta,
                                "derivation": f"no provable {unit}-level epsilon to start from"}
    return out


def _other_methods(event: ev.Event, delta: float, chosen: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, res in accounting.compare(event, delta).items():
        if isinstance(res, str):
            out[name] = f"not applicable: {res}"
        else:
            entry = {"epsilon": res.epsilon, "provable": res.provable}
            if res.epsilon_lower is not None:
                entry["epsilon_lower"] = res.epsilon_lower
            if res.epsilon_estimate is not None:
                entry["epsilon_estimate"] = res.epsilon_estimate
            out[name] = entry
    return out


def _poisson_counterfactual(hyper: dict[str, Any], n: int | None, delta: float) -> float | None:
    z = hyper.get("noise_multiplier")
    batch = hyper.get("batch_size")
    if not isinstance(z, float) or not n or not batch:
        return None
    event = ev.SelfComposed(ev.PoissonSampled(batch / n, ev.Gaussian(z)), hyper["steps"])
    try:
        return accounting.epsilon(event, delta, method="pld").epsilon
    except (ValueError, KeyError):
        return accounting.epsilon(event, delta, method="rdp").epsilon


def _mu(event: ev.Event) -> float | None:
    try:
        from dpfy.accounting.gaussian import mu_of_event
    except ImportError:  # pragma: no cover - gaussian accountant always present
        return None
    try:
        return float(mu_of_event(event))
    except (ValueError, TypeError):
        return None


def _rdp_curve(event: ev.Event) -> dict[str, list[float]] | None:
    try:
        from dpfy.accounting.rdp import DEFAULT_ORDERS, rdp_of_event
    except ImportError:  # pragma: no cover
        return None
    try:
        values = rdp_of_event(event, DEFAULT_ORDERS)
    except (ValueError, TypeError):
        return None
    return {"orders": [float(a) for a in DEFAULT_ORDERS], "rdp": [float(v) for v in values]}


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def epsilon_history(
    ledger: Ledger, delta: float, *, points: int = 25, methods: tuple[str, ...] = ("rdp", "pld")
) -> tuple[list[int], dict[str, list[float]]]:
    """Epsilon after each of ``points`` evenly spaced steps, per applicable method."""
    total = ledger.iteration
    if total == 0:
        return [], {}
    spec = ledger.samples[0].spec
    row = sampler_kind(spec.sampler)
    methods = row.history_methods or methods
    if row.epoch_structured and spec.steps_per_epoch:
        per = spec.steps_per_epoch  # one point per epoch boundary
        steps = sorted({min(total, per * k) for k in range(1, math.ceil(total / per) + 1)})
    else:
        steps = sorted({max(1, round(total * k / points)) for k in range(1, points + 1)})
    curves: dict[str, list[float]] = {}
    for name in methods:
        values = []
        try:
            for m in steps:
                values.append(accounting.epsilon(ledger.prefix(m), delta, name).epsilon)
        except (ValueError, KeyError):
            continue
        curves[name] = values
    return steps, curves


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value

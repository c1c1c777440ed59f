"""``dpfy audit RUN_DIR``: audit a run's release configuration and add an Audit section.

The run's ledger states the release that was trained (noise multiplier z, clip norm C) and its
report the claim. The audit attacks one release of that configuration on the real code path
(:mod:`dpfy.audit.canary`): what it can refute is the epsilon of *one* Gaussian release at z
without subsampling, the "audited claim" (the run's epsilon adds composition and sampling,
which a one-release audit does not see). It also replays a release of the run's query and
checks the run's sampler (:mod:`dpfy.audit.replay`), and runs the self-tests of the release
paths the run used (:mod:`dpfy.audit.selftests`: several processes, federated rounds,
correlated noise). The result goes into ``report.json``
(field ``audit``) and ``report.md`` (section "Audit").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from dpfy import accounting
from dpfy import events as ev
from dpfy._validate import check_int, check_range, check_seed
from dpfy.audit.canary import CanaryModel, canary_audit, one_run_audit
from dpfy.audit.counts import ledger_count_check, recorded_epsilon_check
from dpfy.audit.fdp import one_run_gdp_bound, one_run_gdp_ceiling
from dpfy.audit.keys import key_check
from dpfy.audit.probes import LayerReplay, replay_layer_types
from dpfy.audit.realmodel import ModelNoiseCheck, model_noise_check, run_model
from dpfy.audit.replay import sampler_check
from dpfy.audit.selftests import (
    SelfTest,
    correlated_selftest,
    distributed_selftest,
    dpsgd_selftest,
    federated_selftest,
    sharded_selftest,
)
from dpfy.ledger import Ledger
from dpfy.ledger.records import MatrixRunRecord, SumQueryRecord
from dpfy.ledger.trust import assess
from dpfy.report.crosscheck import require_consistent
from dpfy.report.statement import PrivacyReport

AuditMethod = Literal["canary", "one-run"]
METHODS: tuple[str, ...] = ("canary", "one-run")
DEFAULT_TRIALS = {"canary": 2_000_000, "one-run": 10_000}

MEANING = (
    "A lower bound above the audited claim shows, at the stated confidence, that the release "
    "leaks more than the ledger declares (a bug). A bound below it only says that this attack "
    "found no violation; it is not a proof of privacy. No bound can exceed the method's "
    "ceiling, so a bound near the ceiling means the test ran out of trials, not out of leakage."
)


def _load(run_dir: Path) -> tuple[Ledger, dict[str, Any]]:
    ledger_path, report_path = run_dir / "ledger.jsonl", run_dir / "report.json"
    if not run_dir.is_dir():
        raise ValueError(f"run_dir must be a run directory, got run_dir={str(run_dir)!r}")
    if not ledger_path.is_file():
        raise ValueError(
            f"run_dir must hold ledger.jsonl (a dpfy run), missing in {str(run_dir)!r}"
        )
    if not report_path.is_file():  # e.g. a federated (Flower) server's directory: ledger only
        raise ValueError(
            f"run_dir {str(run_dir)!r} holds ledger.jsonl but no report.json: write the run's "
            f"report there first (dpfy report {str(ledger_path)!r}); the audit takes its delta "
            "and adds its section to it"
        )
    ledger = Ledger.load(ledger_path)
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{report_path} is not a readable report.json: {err}") from None
    if not isinstance(report, dict):
        raise ValueError(f"{report_path} is not a report (a JSON object)")
    return ledger, report


def _summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``summary.json`` (``dpfy train`` writes it), or ``None`` when absent."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a readable summary.json: {err}") from None
    return data if isinstance(data, dict) else None


def _configuration(ledger: Ledger) -> dict[str, Any]:
    zs = [z for z in ledger.noise_multipliers().values() if z > 0 and math.isfinite(z)]
    # a correlated-noise run: each step's fresh noise z_t ~ N(0, (z C)^2) (docs 5.16)
    zs += [r.noise_multiplier for r in ledger.entries if isinstance(r, MatrixRunRecord)]
    if not zs:
        raise ValueError("the run's ledger records no noisy release: nothing to audit")
    sums = [r for r in ledger.entries if isinstance(r, SumQueryRecord) and r.noise_std > 0]
    meta = ledger.metadata
    clip = meta.get("clip_norm")
    if not isinstance(clip, int | float) or not 0 < clip < math.inf:
        clip = sums[0].sensitivity if sums and sums[0].sensitivity > 0 else 1.0
    samples = ledger.samples
    sampler = samples[0].spec.sampler if samples else None
    ebs = meta.get("expected_batch_size")
    return {
        "noise_multiplier": float(min(zs)),  # the strongest release of the run
        "clip_norm": float(clip),
        "sampler": sampler,
        "expected_batch_size": float(ebs) if isinstance(ebs, int | float) and ebs > 0 else None,
    }


def _self_tests(cfg: dict[str, Any], layer_types: Any, seed: int) -> tuple[list[str], LayerReplay]:
    """Replay one release of the run's query on a probe model of each layer type the run
    recorded (:mod:`dpfy.audit.probes`; a ``Linear`` model when none are recorded); check
    the run's sampler."""
    types = [str(t) for t in layer_types] if isinstance(layer_types, list) else None
    replay = replay_layer_types(
        types,
        clip_norm=cfg["clip_norm"],
        noise_multiplier=cfg["noise_multiplier"],
        expected_batch_size=cfg["expected_batch_size"] or 5.0,
        seed=seed,
    )
    found = list(replay.findings)
    if cfg["sampler"] not in (None, "full_batch"):
        found += sampler_check(cfg["sampler"], seed=seed)
    return found, replay


def _path_tests(ledger: Ledger, cfg: dict[str, Any]) -> list[SelfTest]:
    """The self-tests of the release paths the run used (:mod:`dpfy.audit.selftests`):
    several processes (metadata ``workers``; ``sharded``: FSDP2), DP-FedAvg rounds (metadata
    ``trainer``), correlated noise (a ``matrix_run`` record, with its plan), and otherwise one
    process's DP-SGD steps (fresh noise at every step)."""
    c, z = cfg["clip_norm"], cfg["noise_multiplier"]
    meta = ledger.metadata
    done: list[SelfTest] = []
    workers = meta.get("workers")
    several = isinstance(workers, int) and not isinstance(workers, bool) and workers > 1
    fed = meta.get("trainer") == "dpfy.fed.DPFedAvg"
    matrix = [r for r in ledger.entries if isinstance(r, MatrixRunRecord)]
    if not (several or fed or matrix):
        done.append(dpsgd_selftest(clip_norm=c, noise_multiplier=z))
    if several:
        done.append(distributed_selftest(2, clip_norm=c, noise_multiplier=z))
    if meta.get("sharded") is True:  # FSDP2: each rank noises its own shard
        done.append(sharded_selftest(2, clip_norm=c, noise_multiplier=z))
    if fed:
        done.append(federated_selftest(clip_norm=c, noise_multiplier=z))
    for rec in matrix:
        done.append(correlated_selftest(
            rec.plan, clip_norm=rec.clip_norm, noise_multiplier=rec.noise_multiplier
        ))
    return done


@dataclasses.dataclass(frozen=True, slots=True)
class RunChecks:
    """What the gray-box checks of a run found (every check of ``dpfy audit`` but the attack).

    Attributes:
      findings: breaches, one sentence each, prefixed with the self-test's name where one
        found it (empty: none found).
      tests_run: the checks that ran, in order.
      replayed_layer_types: the layer types replayed on probe models.
      not_replayed_layer_types: layer types the run recorded that have no probe model.
      notes: what a check could not cover, one sentence each (not a breach).
      real_model: the noise check on the run's own model, when it ran.
    """

    findings: tuple[str, ...]
    tests_run: tuple[str, ...]
    replayed_layer_types: tuple[str, ...]
    not_replayed_layer_types: tuple[str, ...]
    notes: tuple[str, ...] = ()
    real_model: ModelNoiseCheck | None = None


def _real_model(ledger: Ledger, cfg: dict[str, Any], model: Any, seed: int
                ) -> ModelNoiseCheck | str:
    """The noise check on ``model`` at the std the run's ledger declares, or why it cannot run."""
    if any(isinstance(r, MatrixRunRecord) for r in ledger.entries):
        return "real model: not run (correlated noise: the noise of a step is not white)"
    sums = [r for r in ledger.entries if isinstance(r, SumQueryRecord) and r.noise_std > 0]
    if not sums or cfg["expected_batch_size"] is None:
        return "real model: not run (no noisy sum or expected batch size recorded)"
    secure = str(ledger.metadata.get("noise_randomness", "")).startswith("secure")
    try:
        return model_noise_check(
            model, noise_std=min(r.noise_std for r in sums), clip_norm=cfg["clip_norm"],
            noise_multiplier=cfg["noise_multiplier"],
            expected_batch_size=cfg["expected_batch_size"], secure=secure, seed=seed,
        )
    except (ValueError, TypeError) as err:  # a model PrivateGradient refuses, no parameter
        return f"real model: not run ({type(err).__name__}: {str(err)[:200]})"


def _real_section(real: ModelNoiseCheck) -> dict[str, Any]:
    """The Audit section's summary of the noise check on the run's own model."""
    return {
        "tensors": real.tensors, "values": real.values, "releases": real.releases,
        "alpha": real.alpha, "half_noise_miss": real.half_noise_miss, "seconds": real.seconds,
        "min_std_ratio": min(real.std_ratio.values()),
        "max_std_ratio": max(real.std_ratio.values()),
    }


def check_run(
    ledger: Ledger, summary: Mapping[str, Any] | None = None, *, seed: int = 0,
    model: Any = None,
) -> RunChecks:
    """The gray-box checks of a run: a replay of its query on its layer types, its sampler
    against its spec, the ledger's step and release counts against the sampler's plan and
    ``summary`` (the run's ``summary.json``; :mod:`dpfy.audit.counts`), the epsilon its writer
    recorded against its lines, its key commitments against the local registry
    (:mod:`dpfy.audit.keys`), the self-tests of its release paths, among them step-to-step
    noise independence, and, given the run's ``model`` (an ``nn.Module``), the noise on each
    of its tensors (:mod:`dpfy.audit.realmodel`).

    Raises:
      ValueError: the ledger records no noisy release.
    """
    cfg = _configuration(ledger)
    found, replay = _self_tests(cfg, ledger.metadata.get("layer_types"), seed)
    found += ledger_count_check(ledger, summary)
    found += recorded_epsilon_check(ledger)
    keys, notes = key_check(ledger.metadata)
    found += keys
    paths = _path_tests(ledger, cfg)
    found += [f"{t.name}: {f}" for t in paths for f in t.findings]
    real = None if model is None else _real_model(ledger, cfg, model, seed)
    if isinstance(real, str):
        notes, real = (*notes, real), None
    elif real is not None:
        found += real.findings
    return RunChecks(
        tuple(found),
        ("replay", "sampler", "ledger counts", "recorded epsilon", "keys",
         *(t.name for t in paths), *(("real model",) if real is not None else ())),
        replay.replayed,
        replay.not_replayed,
        tuple(notes),
        real,
    )


def audit_run(
    run_dir: str | os.PathLike[str],
    *,
    method: AuditMethod = "canary",
    trials: int | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    trusted_key: str | None = None,
    real_model: bool = True,
) -> dict[str, Any]:
    """Audit a run directory's release configuration; write the Audit section; return it.

    Args:
      run_dir: a directory written by ``dpfy train`` (``ledger.jsonl``, ``report.json``).
      method: ``"canary"`` (white-box gradient canaries, many trials) or ``"one-run"``
        (Steinke et al. 2023: canaries in one release, guesses with abstention).
      trials: canary trials (scores), or the number of canaries for one-run; default
        2,000,000 and 10,000.
      confidence: of the lower bound, in (0, 1).
      seed: seeds the audit's canaries and noise (an experiment, never the run's release).
      progress: ``progress(done, total)`` per release (canary method).
      trusted_key: an Ed25519 public key (64 hex digits) held apart from the run: its own
        key or a long-lived key that endorsed it (:mod:`dpfy.ledger.trust`). The section's
        ``ledger_trust`` says which level the ledger reached.
      real_model: run the noise check on the run's own model (:mod:`dpfy.audit.realmodel`;
        image runs of ``dpfy train``, rebuilt from ``model.pt``); the section says why when it
        cannot.

    Raises:
      ValueError: a bad argument or a directory that is not a dpfy run (named).
      LedgerIntegrityError: ``trusted_key`` neither signed nor endorsed the ledger's key.
      RunDirMismatch: a published file of the run directory disagrees with the ledger
        (:mod:`dpfy.report.crosscheck`), named with its field.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {set(METHODS)}, got method={method!r}")
    check_range("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)
    check_seed("seed", seed)
    n = DEFAULT_TRIALS[method] if trials is None else trials
    check_int(
        "trials",
        n,
        2 if method == "canary" else 4,
        100_000_000 if method == "canary" else 1_000_000,
    )
    out = Path(run_dir)
    ledger, report = _load(out)
    trust = assess(ledger.verification, ledger.metadata, trusted_key,
                   source=f"ledger {str(out / 'ledger.jsonl')!r}")
    require_consistent(out, ledger)  # every published figure is the ledger's, or refused
    cfg = _configuration(ledger)
    delta = report.get("delta")
    if not isinstance(delta, int | float) or not 0 < delta < 1:
        raise ValueError(f"the run's report.json has no valid delta, got delta={delta!r}")
    z, c = cfg["noise_multiplier"], cfg["clip_norm"]
    audited = float(accounting.epsilon(ev.Gaussian(z), delta).epsilon)
    start = time.perf_counter()
    section: dict[str, Any] = {"method": method, "confidence": confidence, "seed": seed}
    if method == "canary":
        res = canary_audit(
            c,
            z,
            delta=delta,
            trials=n,
            confidence=confidence,
            seed=seed,
            model=CanaryModel(100, 100, 200, 250),
            progress=progress,
        )
        section.update(
            description=(
                "white-box gradient canaries (Nasr et al. 2023): a Dirac canary gradient of "
                "norm 4C per coordinate of a 60k-parameter Linear+Embedding model, each "
                "included with probability 1/2 per release, through PrivateGradient and "
                "GaussianSumQuery; threshold test on the released coordinate, threshold chosen "
                "on a held-out half, Clopper-Pearson bounds, union bound over the 2 parameters"
            ),
            epsilon_lower=res.epsilon,
            ceiling=res.ceiling,
            trials=res.trials,
            releases=res.releases,
            mu_lower=res.mu_lower,
            per_parameter={k: b.epsilon for k, b in res.per_parameter.items()},
        )
    else:
        guesses = max(2, min(n, round(0.02 * n)))
        one = one_run_audit(
            c, z, delta=delta, canaries=n, guesses=guesses, confidence=confidence, seed=seed
        )
        gdp = one_run_gdp_bound(
            one.canaries, one.guesses, one.correct, delta=delta, confidence=confidence
        )
        gdp_top = one_run_gdp_ceiling(one.canaries, one.guesses, delta=delta,
                                      confidence=confidence)
        section.update(
            description=(
                "one-run audit (Steinke, Nasr, Jagielski 2023): canaries each included with "
                "probability 1/2 in one release, guesses for the highest and lowest scores, "
                "abstention on the rest; needs no independence between canaries. The f-DP "
                "bound (Mahloujifar, Melis, Chaudhuri 2024) reads the same counts against "
                "mu-GDP; one Gaussian release at z is exactly 1/z-GDP"
            ),
            epsilon_lower=one.epsilon,
            ceiling=one.ceiling,
            trials=one.canaries,
            guesses=one.guesses,
            correct=one.correct,
            fdp_mu_lower=gdp.mu,
            fdp_epsilon_lower=gdp.epsilon,
            fdp_mu_ceiling=gdp_top.mu,
            fdp_ceiling=gdp_top.epsilon,
            audited_mu=1.0 / z,
        )
    section.update(
        audited_claim=audited,
        audited_release=f"one Gaussian release, z = {z:.6g}, no subsampling, delta = {delta:g}",
        run_epsilon=report.get("epsilon"),
        noise_multiplier=z,
        clip_norm=c,
    )
    model, why = run_model(out, ledger.metadata) if real_model else (None, "real model: off")
    checks = check_run(ledger, _summary(out), seed=seed, model=model)
    section.update(
        self_tests=list(checks.findings),
        self_tests_run=list(checks.tests_run),
        replayed_layer_types=list(checks.replayed_layer_types),
        not_replayed_layer_types=list(checks.not_replayed_layer_types),
        self_test_notes=[*checks.notes, *(() if model is not None else (why,))],
        real_model=None if checks.real_model is None else _real_section(checks.real_model),
        seconds=time.perf_counter() - start,
    )
    broken = (
        section["epsilon_lower"] > audited
        or section.get("fdp_mu_lower", 0.0) > 1.0 / z
        or bool(section["self_tests"])
    )
    section["verdict"] = (
        "VIOLATION: the measured lower bound exceeds the audited claim or a self-test failed"
        if broken
        else "no violation found"
    )
    section["meaning"] = MEANING
    section["ledger_trust"] = trust.to_dict()
    write_section(out, report, section)
    return section


def write_section(out: Path, report: dict[str, Any], section: dict[str, Any]) -> None:
    """Add the section to report.json and re-render report.md (each file replaced atomically)."""
    fields = {f.name for f in dataclasses.fields(PrivacyReport)}
    data = {k: v for k, v in report.items() if k in fields}
    data["audit"] = section
    if data.get("epsilon") == "inf":  # JSON spelling of an infinite epsilon
        data["epsilon"] = math.inf
    try:
        rep = PrivacyReport(**data)
        md = rep.to_markdown()
    except TypeError as err:
        raise ValueError(f"report.json of {str(out)!r} is not a dpfy report: {err}") from None
    report = {**report, "audit": section}
    for name, text in (
        ("report.json", json.dumps(report, indent=2, default=str)),
        ("report.md", md),
    ):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=out)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, out / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

"""One cross-check of a run directory: every published figure against its ledger.

A run directory publishes numbers beside its ledger: ``report.json`` and ``report.md``, the
trainer's ``summary.json``, ``run.toml`` (the configuration), a model card's ``## Privacy``
section (``README.md``) and the model file. Each is a claim about the ledger, so each is
re-derived from it: the ledger is re-accounted at each file's stated delta and accounting
method, the report is rebuilt and compared field by field, ``report.md`` is re-rendered from
``report.json``, ``summary.json`` is compared with the ledger's records and metadata,
``run.toml`` is resolved to the full configuration and compared with the one the ledger
recorded, and the model file's SHA-256 with the one the ledger's end record holds. Any
difference is a :class:`Mismatch` naming the file and the field; ``dpfy report`` and
``dpfy audit`` refuse a run directory with one (:func:`require_consistent`), so no edited
figure is reported as the ledger's and no edited report is overwritten silently.

Numbers are compared to a relative 1e-9 (the accountants are deterministic; JSON round-trips
floats exactly). Fields that nothing in the ledger determines are checked for what they
claim: a figure path names a file of the directory, the Audit section's noise, clip norm and
audited claim are the ledger's, its verdict follows from its bounds.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dpfy import accounting
from dpfy.ledger import Ledger

#: Relative tolerance of a number against its re-derivation.
RTOL = 1e-9
#: The files a run directory may publish, beside ``ledger.jsonl``.
PUBLISHED = ("report.json", "report.md", "summary.json", "run.toml", "README.md", "model.pt")
#: Report fields with no re-derivation of their own, checked by their own rules below.
_OWN_RULES = ("figures", "publishing", "audit")


class RunDirMismatch(ValueError):
    """A published file of a run directory disagrees with the run's ledger."""


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """One published figure that the ledger does not give.

    Attributes:
      file: the file's name in the run directory.
      field: the field (dotted path; a line of a text file as ``line N``).
      published: what the file says.
      expected: what the ledger gives (or why the field cannot be right).
    """

    file: str
    field: str
    published: Any
    expected: Any

    def describe(self) -> str:
        return (f"{self.file} {self.field}: published {_short(self.published)}, the ledger "
                f"gives {_short(self.expected)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_run_dir(
    run_dir: str | Path, ledger: Ledger, *, other_heads: bool = True
) -> list[Mismatch]:
    """Every published figure of ``run_dir`` that ``ledger`` (its ``ledger.jsonl``, loaded)
    does not give; empty when all agree. A file that is absent is not checked.

    ``other_heads=False``: a ``report.json`` of another chain head (with its ``report.md``)
    is left alone, as ``dpfy report`` keeps it and writes beside it, saying so
    (:func:`dpfy.report.write.report_name`); otherwise its head is a mismatch."""
    out = Path(run_dir)
    found: list[Mismatch] = []
    report = _json(out / "report.json", found)
    if isinstance(report, dict) and not other_heads and _head(report) != ledger.head:
        report = None
    if isinstance(report, dict):
        found += _check_report(out, report, ledger)
        found += _check_markdown(out, report)
    summary = _json(out / "summary.json", found)
    if isinstance(summary, dict):
        found += _check_summary(summary, ledger)
    found += _check_run_toml(out / "run.toml", ledger)
    found += _check_card(out / "README.md", ledger)
    found += _check_files(out, ledger)
    return found


def require_consistent(run_dir: str | Path, ledger: Ledger) -> None:
    """Refuse a run directory whose published files disagree with its ledger.

    Raises:
      RunDirMismatch: one line naming the first mismatch (file and field) and how many
        there are.
    """
    found = check_run_dir(run_dir, ledger)
    if found:
        raise refusal(run_dir, found)


def refusal(run_dir: str | Path, found: list[Mismatch]) -> RunDirMismatch:
    """The one-line error of a run directory with the mismatches ``found`` (not empty)."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return RunDirMismatch(
        f"{Path(run_dir) / found[0].file} disagrees with its ledger: {found[0].describe()}"
        f"{more}; a published file was edited or belongs to another run. Nothing is written"
    )


def _head(report: Mapping[str, Any]) -> Any:
    integrity = report.get("ledger_integrity")
    return integrity.get("head") if isinstance(integrity, dict) else None


# -- helpers ---------------------------------------------------------------------------------


def _json(path: Path, found: list[Mismatch]) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        found.append(Mismatch(path.name, "(whole file)", "unreadable", str(err)))
        return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-300)
    return type(a) is type(b) and a == b


def _diff(file: str, published: Any, expected: Any, where: str = "") -> Iterator[Mismatch]:
    """Every leaf where ``published`` and ``expected`` (JSON values) differ."""
    if isinstance(published, dict) and isinstance(expected, dict):
        for key in sorted(set(published) | set(expected)):
            path = f"{where}.{key}" if where else str(key)
            if key not in expected:
                yield Mismatch(file, path, published[key], "no such field")
            elif key not in published:
                yield Mismatch(file, path, "missing", expected[key])
            else:
                yield from _diff(file, published[key], expected[key], path)
    elif isinstance(published, list) and isinstance(expected, list):
        if len(published) != len(expected):
            yield Mismatch(file, where, f"{len(published)} entries", f"{len(expected)} entries")
            return
        for i, (p, e) in enumerate(zip(published, expected, strict=True)):
            yield from _diff(file, p, e, f"{where}[{i}]")
    elif not _same(published, expected):
        yield Mismatch(file, where, published, expected)


#: Re-derivations already made in this process, by the ledger's content (path, line count
#: and chain head, which commits to every line) and the published delta, method, etc.
_CACHE: dict[tuple[Any, ...], Any] = {}


def _cached(ledger: Ledger, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    full = (ledger.path, ledger.line_count, ledger.head, *key)
    if full not in _CACHE:
        if len(_CACHE) >= 256:
            _CACHE.clear()
        _CACHE[full] = make()
    return _CACHE[full]


def _epsilon(ledger: Ledger, delta: Any, method: Any, samples: int | None = None) -> Any:
    """The ledger's epsilon (of its first ``samples`` samples) at a published delta and
    method, or why there is none."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 < delta < 1:
        return f"no epsilon at delta {delta!r}"
    if not isinstance(method, str):
        return f"no accounting method {method!r}"

    def make() -> Any:
        try:
            target = ledger if samples is None else ledger.prefix(samples)
            return accounting.epsilon(target, float(delta), method).epsilon
        except (ValueError, KeyError) as err:
            return f"no {method} epsilon ({err})"

    return _cached(ledger, ("epsilon", float(delta), method, samples), make)


# -- report.json and report.md ---------------------------------------------------------------


def _rebuilt(ledger: Ledger, delta: float, method: str, ledger_path: str | None,
             trusted_key: str | None) -> dict[str, Any] | str:
    """The report the ledger gives at a published delta, method and trusted key, as JSON
    (or why none can be built)."""
    from dpfy.report.statement import build_report

    def make() -> dict[str, Any] | str:
        try:
            report = build_report(ledger, delta=delta, method=method, ledger_path=ledger_path,
                                  trusted_key=trusted_key)
        except ValueError as err:  # LedgerIntegrityError too: a trust the ledger lacks
            return str(err)
        rebuilt: dict[str, Any] = json.loads(report.to_json())
        return rebuilt

    found: dict[str, Any] | str = _cached(
        ledger, ("report", delta, method, ledger_path, trusted_key), make)
    return found


def _check_report(out: Path, report: dict[str, Any], ledger: Ledger) -> list[Mismatch]:
    name = "report.json"
    delta, method = report.get("delta"), report.get("accounting_method")
    if isinstance(delta, bool) or not isinstance(delta, float | int) or not 0 < delta < 1:
        return [Mismatch(name, "delta", delta, "a delta in (0, 1)")]
    if not isinstance(method, str):
        return [Mismatch(name, "accounting_method", method, "an accounting method")]
    integrity = report.get("ledger_integrity")
    trust = integrity.get("trust") if isinstance(integrity, dict) else None
    trusted = trust.get("trusted_key") if isinstance(trust, dict) else None
    reproduce = report.get("reproduce")
    path = reproduce.get("ledger") if isinstance(reproduce, dict) else None
    found: list[Mismatch] = []
    own = Path(ledger.path or "ledger.jsonl").name
    if not isinstance(path, str) or Path(path).name != own:
        found.append(Mismatch(name, "reproduce.ledger", path, f"a path to {own}"))
        path = None
    known = _epsilon(ledger, delta, method)
    if isinstance(known, str):
        return [*found, Mismatch(name, "accounting_method", method, known)]
    expected = _rebuilt(ledger, float(delta), method, path,
                        trusted if isinstance(trusted, str) else None)
    if isinstance(expected, str):
        return [*found, Mismatch(name, "ledger_integrity.trust.trusted_key", trusted, expected)]
    expected = dict(expected)
    command = ledger.metadata.get("train_command")
    if isinstance(command, str):
        expected["reproduce"] = {**expected["reproduce"], "train_command": command}
    _allow_delta_note(report, expected, ledger)
    for key in _OWN_RULES:
        expected[key] = report.get(key, "missing")
    found += _diff(name, report, expected)
    if found:  # inconsistent at its stated delta and method: name them first where they are
        for key, recorded in (("accounting_method", "accounting"), ("delta", "delta")):
            value = ledger.metadata.get(recorded)  # not the run's own
            if value is not None and not _same(report.get(key), value):
                found.insert(0, Mismatch(name, key, report.get(key), value))
    found += _check_figures(out, report.get("figures"))
    found += _check_publishing(out, report.get("publishing"), ledger)
    found += _check_audit(report.get("audit"), report, ledger)
    return found


def _allow_delta_note(report: dict[str, Any], expected: dict[str, Any], ledger: Ledger) -> None:
    """``dpfy report`` adds one assumption when the ledger records no delta (how it chose
    one); accept it there, nowhere else."""
    published, rebuilt = report.get("assumptions"), expected.get("assumptions")
    if ("delta" in ledger.metadata or not isinstance(published, list)
            or not isinstance(rebuilt, list) or len(published) != len(rebuilt) + 1):
        return
    note = published[-1]
    if isinstance(note, str) and note.startswith("delta: the ledger records no"):
        expected["assumptions"] = [*rebuilt, note]


def _check_figures(out: Path, figures: Any) -> Iterator[Mismatch]:
    if not isinstance(figures, dict):
        yield Mismatch("report.json", "figures", figures, "an object of figure paths")
        return
    for key, rel in figures.items():
        if (not isinstance(rel, str) or rel != f"figures/{key}.png"
                or not (out / rel).is_file()):
            yield Mismatch("report.json", f"figures.{key}", rel,
                           f"figures/{key}.png, a file of the run directory")


def _check_publishing(out: Path, section: Any, ledger: Ledger) -> Iterator[Mismatch]:
    """The Publishing section lists the directory's files (the report's own last)."""
    from dpfy.publication import DERIVED_FROM

    if section == {}:
        return
    if not isinstance(section, dict):
        yield Mismatch("report.json", "publishing", section, "an object")
        return
    config = ledger.metadata.get("config")
    diagnostics = config.get("private_diagnostics") if isinstance(config, dict) else None
    present = sorted(
        p.relative_to(out).as_posix() for p in out.rglob("*")
        if p.is_file() and not _report_output(p.relative_to(out).as_posix())
    )
    expected = {
        "safe_to_publish": [*present, "report.md", "report.json", "figures/"],
        "derived_from": DERIVED_FROM,
        "not_covered": diagnostics,
    }
    yield from _diff("report.json", section, expected, "publishing")


def _report_output(rel: str) -> bool:
    """A file the report itself writes, a hidden one, or a model card added later (checked
    on its own): not in the Publishing list."""
    return (rel.startswith((".", "figures/")) or "/." in rel or rel == "README.md"
            or re.fullmatch(r"report(-[0-9a-f]{1,12}|-nohead)?\.(md|json)", rel) is not None)


def _check_audit(section: Any, report: dict[str, Any], ledger: Ledger) -> Iterator[Mismatch]:
    """An Audit section audits the ledger's own release, and its verdict follows from it.

    The attack's own counts are not in the ledger; what it claims about the run is: the noise
    multiplier and clip norm it attacked are the ledger's, the audited claim is one Gaussian
    release at that noise (``dpfy audit``) or the report's epsilon (the one-run audit of
    ``dpfy train``), and a bound above the claim or a failed self-test is a violation."""
    from dpfy import events as ev

    name = "report.json"
    if section == {}:
        return
    if not isinstance(section, dict):
        yield Mismatch(name, "audit", section, "an object (the Audit section)")
        return
    z = section.get("noise_multiplier")
    if "noise_multiplier" in section:
        from dpfy.ledger.records import MatrixRunRecord

        zs = sorted({*ledger.noise_multipliers().values(), *(  # correlated noise: its run's z
            r.noise_multiplier for r in ledger.entries if isinstance(r, MatrixRunRecord))})
        if not any(_same(z, x) for x in zs):
            yield Mismatch(name, "audit.noise_multiplier", z, zs)
    meta_clip = ledger.metadata.get("clip_norm")
    if "clip_norm" in section and meta_clip is not None \
            and not _same(section["clip_norm"], meta_clip):
        yield Mismatch(name, "audit.clip_norm", section["clip_norm"], meta_clip)
    if "run_epsilon" in section and not _same(section["run_epsilon"], report.get("epsilon")):
        yield Mismatch(name, "audit.run_epsilon", section["run_epsilon"], report.get("epsilon"))
    claim: Any = report.get("epsilon")
    if section.get("method") != "one-run-train":
        delta = report.get("delta")
        if isinstance(z, float) and z > 0 and isinstance(delta, float):
            claim = accounting.epsilon(ev.Gaussian(z), delta).epsilon
        else:
            claim = "one Gaussian release at the audited noise multiplier"
    if not _same(section.get("audited_claim"), claim):
        yield Mismatch(name, "audit.audited_claim", section.get("audited_claim"), claim)
    verdict, lower = section.get("verdict"), section.get("epsilon_lower")
    must = bool(section.get("self_tests")) or (
        isinstance(lower, float) and isinstance(claim, float) and lower > claim)
    if not isinstance(verdict, str) or not (
            verdict.startswith("VIOLATION") or (verdict == "no violation found" and not must)):
        yield Mismatch(name, "audit.verdict", verdict,
                       "VIOLATION" if must else "a verdict that follows from the bounds")


def _check_markdown(out: Path, report: dict[str, Any]) -> list[Mismatch]:
    """``report.md`` is ``report.json`` rendered."""
    from dpfy.report.statement import PrivacyReport

    path = out / "report.md"
    if not path.is_file():
        return []
    fields = {f.name for f in dataclasses.fields(PrivacyReport)}
    data = {k: v for k, v in report.items() if k in fields}
    if data.get("epsilon") == "inf":
        data["epsilon"] = math.inf
    try:
        expected = PrivacyReport(**data).to_markdown()
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        return [Mismatch("report.md", "(whole file)", "not renderable from report.json",
                         str(err))]
    return list(_lines("report.md", path.read_text(encoding="utf-8"), expected))


# -- summary.json, run.toml, the model card and the model file ------------------------------


def _check_summary(summary: dict[str, Any], ledger: Ledger) -> list[Mismatch]:
    """``summary.json`` against the ledger: re-accounted at its delta and method, the rest
    against the records and the metadata the trainer wrote."""
    from dpfy.ledger.hyperparameters import ledger_hyperparameters

    meta = ledger.metadata
    hyper = ledger_hyperparameters(ledger)
    spec = hyper.get("_spec", {})
    delta, method = summary.get("delta"), summary.get("accounting")
    expected: dict[str, Any] = {
        "dataset": meta.get("dataset"),
        "sampler": spec.get("sampler"),
        "model_name": meta.get("model"),
        "test_accuracy": meta.get("test_accuracy"),
        "epsilon": _epsilon(ledger, delta, method),
        "delta": meta.get("delta"),
        "accounting": meta.get("accounting"),
        "noise_multiplier": hyper.get("noise_multiplier"),
        "clip_norm": hyper.get("clip_norm"),
        "batch_size": meta.get("batch_size"),
        "epochs": _epochs(summary.get("epochs"), ledger),
        "steps": ledger.iteration - _leading_samples(ledger),
        "learning_rate": meta.get("learning_rate"),
        "seconds": meta.get("wall_time_seconds"),  # runs that still published their wall time
        "stopped": meta.get("stopped"),
        # accuracies measured on held-out training units (dpfy train --validation): private
        "private_evaluation": bool(config.get("validation", False))
        if isinstance(config := meta.get("config"), dict) else False,
    }
    found: list[Mismatch] = []
    for key in ("model_path", "ledger_path"):
        value = summary.get(key)
        want = "model.pt" if key == "model_path" else Path(ledger.path or "ledger.jsonl").name
        if not (value is None or (isinstance(value, str) and Path(value).name == want)):
            found.append(Mismatch("summary.json", key, value, f"a path to {want}"))
        expected[key] = value
    if "history" in summary:
        expected["history"] = _history(summary["history"], ledger, delta, method)
    # the fields it publishes (one it leaves out claims nothing); one the trainer never
    # writes is named as such
    expected = {k: expected.get(k, "no such field") for k in summary}
    found += _diff("summary.json", summary, expected)
    return found


def _epochs(published: Any, ledger: Ledger) -> Any:
    """The epochs the samples ran; a run stopped by its budget planned more."""
    ran = max((s.epoch for s in ledger.samples), default=-1) + 1
    if ledger.metadata.get("stopped") != "completed" and isinstance(published, int) \
            and not isinstance(published, bool) and published >= ran:
        return published
    return ran


def _history(history: Any, ledger: Ledger, delta: Any, method: Any) -> Any:
    """The public history the ledger gives: per epoch, the trainer's step count at its end,
    the test accuracies the run recorded at that step, and the epsilon of the ledger so far.

    The trainer's samples are the ledger's last run of samples with one spec (an LP-FT
    run's probe samples lead the ledger and count towards its epsilon, not its steps)."""
    if not isinstance(history, dict) or not isinstance(history.get("epochs"), list):
        return "an object with a list of epochs"
    meta = ledger.metadata
    released = _by_step(meta.get("accuracy_by_step")) or {}
    raw = _by_step(meta.get("model_accuracy_by_step"))
    offset = _leading_samples(ledger)
    trained = ledger.samples[offset:]
    epochs: list[Any] = []
    for i, row in enumerate(history["epochs"]):
        steps = sum(1 for s in trained if s.epoch <= i)
        accuracy = released.get(steps)
        if raw is not None:
            model_accuracy = raw.get(steps)
        else:  # a run before the raw model's accuracy was recorded: not checked
            model_accuracy = row.get("model_test_accuracy") if isinstance(row, dict) else None
        epochs.append({
            "epoch": i,
            "steps": steps,
            "test_accuracy": accuracy,
            "model_test_accuracy": model_accuracy,
            "epsilon": _epsilon(ledger, delta, method, offset + steps),
        })
    return {**history, "epochs": epochs}


def _by_step(pairs: Any) -> dict[int, Any] | None:
    """``[[step, accuracy], ...]`` from the ledger's metadata as a dict (None if absent)."""
    if not isinstance(pairs, list):
        return None
    return {int(p[0]): p[1] for p in pairs
            if isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)}


def _leading_samples(ledger: Ledger) -> int:
    """How many samples lead the ledger with a spec other than its last sample's."""
    samples = ledger.samples
    if not samples:
        return 0
    last = samples[-1].spec
    return next((k for k, s in enumerate(samples) if s.spec == last), 0)


def _check_run_toml(path: Path, ledger: Ledger) -> list[Mismatch]:
    """``run.toml`` resolved to the full configuration equals the configuration the ledger
    recorded (resolved the same way)."""
    from dpfy.config import RunConfig, as_launched

    if not path.is_file():
        return []
    meta = ledger.metadata
    recorded = meta.get("config")
    if not isinstance(recorded, dict):
        return [Mismatch("run.toml", "(whole file)", "a configuration",
                         "none: the ledger records no configuration")]
    # validated as in the launch that ran it (a torchrun run's `shard` needs its world size),
    # not in the environment of the process reading it
    workers = meta.get("workers")
    world = (workers if meta.get("launcher") == "torchrun" and isinstance(workers, int)
             and not isinstance(workers, bool) and workers > 1 else 1)
    with as_launched(world):
        try:
            published = RunConfig.from_file(path)
        except ValueError as err:
            return [Mismatch("run.toml", "(whole file)", "not a run configuration", str(err))]
        try:
            expected = RunConfig.from_mapping(recorded, source="the ledger's config")
        except ValueError as err:
            return [Mismatch("run.toml", "(whole file)", "a configuration", str(err))]
    found = []
    for f in dataclasses.fields(RunConfig):
        a, b = getattr(published, f.name), getattr(expected, f.name)
        if not _same(a, b):
            found.append(Mismatch("run.toml", f.name, a, b))
    return found


_CARD_SECTION = re.compile(r"^## Privacy.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
_CARD_EPSILON = re.compile(r"^- Epsilon: (\S+); delta: ([^\s;]+)", re.MULTILINE)
_CARD_METHOD = re.compile(r"^- Method: .*; accounting: ([^\s;]+)", re.MULTILINE)
_CARD_LEDGER = re.compile(r"^- Ledger: `([^`]*)`", re.MULTILINE)


def _check_card(path: Path, ledger: Ledger) -> list[Mismatch]:
    """A model card's ``## Privacy`` section is the section of the report the ledger gives
    at the card's delta and accounting method (:func:`dpfy.report.card.privacy_section`)."""
    from dpfy.report.card import privacy_section
    from dpfy.report.statement import PrivacyReport

    if not path.is_file():
        return []
    found = _CARD_SECTION.search(path.read_text(encoding="utf-8"))
    if found is None:
        return []
    section = found.group(0)
    eps, method, ref = (r.search(section) for r in (_CARD_EPSILON, _CARD_METHOD, _CARD_LEDGER))
    if eps is None or method is None or ref is None:
        return [Mismatch("README.md", "Privacy", "no epsilon, delta, method or ledger line",
                         "the section dpfy writes")]
    try:
        delta = float(eps.group(2))
    except ValueError:
        return [Mismatch("README.md", "delta", eps.group(2), "a number")]
    known = _epsilon(ledger, delta, method.group(1))
    if isinstance(known, str):
        return [Mismatch("README.md", "accounting", method.group(1), known)]
    rebuilt = _rebuilt(ledger, delta, method.group(1), ledger.path, None)
    if isinstance(rebuilt, str):
        return [Mismatch("README.md", "Privacy", "a report", rebuilt)]
    fields = {f.name for f in dataclasses.fields(PrivacyReport)}
    data = {k: v for k, v in rebuilt.items() if k in fields}
    if data.get("epsilon") == "inf":
        data["epsilon"] = math.inf
    expected = privacy_section(PrivacyReport(**data), ref.group(1))
    return list(_lines("README.md", section.rstrip("\n"), expected.rstrip("\n")))


def _lines(file: str, published: str, expected: str) -> Iterator[Mismatch]:
    """The first line where two texts differ (none if equal)."""
    have, want = published.splitlines(), expected.splitlines()
    for i in range(max(len(have), len(want))):
        a = have[i] if i < len(have) else "(end of file)"
        b = want[i] if i < len(want) else "(end of file)"
        if a != b:
            yield Mismatch(file, f"line {i + 1}", a, b)
            return
    if published != expected:
        yield Mismatch(file, "(line ends)", "differs", "the rendered text")


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _end_files(path: str | None) -> dict[str, str] | None:
    """The ``files`` of the ledger file's last end record (name -> SHA-256), or None."""
    if path is None:
        return None
    files = None
    with open(path, "rb") as fh:
        for raw in fh:
            if b'"type":"end"' not in raw:
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("type") == "end":
                files = obj.get("files")
    return files if isinstance(files, dict) else None


def _check_files(out: Path, ledger: Ledger) -> list[Mismatch]:
    """Files whose SHA-256 the ledger's end record holds (the model, where dpfy wrote it)."""
    found = []
    for name, digest in (_end_files(ledger.path) or {}).items():
        path = out / str(name)
        if not path.is_file():
            found.append(Mismatch(str(name), "sha256", "missing", digest))
        elif file_sha256(path) != digest:
            found.append(Mismatch(str(name), "sha256", file_sha256(path), digest))
    return found

"""A ``dpfy train`` run directory: one run writes it, what it holds may be published, and the
private diagnostics go elsewhere.

One writer: :func:`claimed_run_dir` holds an exclusive lock on the directory for the whole run,
so a second ``dpfy train`` on the same ``--out`` is refused at once with one line (and a run
directory that received a ledger meanwhile is refused too).

Everything written into the run directory (``--out``) is derived from the DP releases (the
model and the ledger, and the accounting of the ledger), from public data (the test split:
test accuracy) or from the configuration (``run.toml``, the hyperparameters). The whole
directory may be published; the report's "Publishing" section lists its files.

What a run computes from the private training data without noise is monitoring, not a
release: every step's realised batch size (Poisson sampling draws it at random from the
data), the loss and accuracy on each training batch, an epoch's mean training loss, an
epoch's wall time, the share of training snippets cut to ``max_length``. It is printed on
the operator's terminal while the run goes, and kept on disk only when asked for
(``dpfy train --private-diagnostics DIR``, recorded in the configuration): in a directory
outside the run directory, beside a README that says the guarantee does not cover it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: The file of the private diagnostics (the whole history and the recipe's diagnostics).
DIAGNOSTICS_FILE = "history.json"
#: The warning written beside it.
DIAGNOSTICS_README = "README.txt"
#: Where the run directory's numbers come from (the report's words).
DERIVED_FROM = (
    "the DP releases (the model, the ledger and its accounting), the test split (public "
    "data) and the run's configuration"
)
_WARNING = (
    "PRIVATE DIAGNOSTICS: computed from the private training data without noise (realised "
    "batch sizes, losses and accuracies on training batches, timings). The run's differential "
    "privacy guarantee does NOT cover these files. Do not publish or share them.\n"
)


def check_diagnostics_dir(
    diagnostics: str | os.PathLike[str] | None, out_dir: Path
) -> Path | None:
    """The private diagnostics directory of a run into ``out_dir``, checked before anything is
    written (``None``: none is kept).

    Raises:
      ValueError: the directory is ``out_dir``, lies inside it or holds it (the run directory
        must stay publishable as a whole), or already holds private diagnostics.
    """
    if diagnostics is None:
        return None
    path = Path(diagnostics)
    inside, outside = path.resolve(), out_dir.resolve()
    if inside == outside or outside in inside.parents or inside in outside.parents:
        raise ValueError(
            f"private_diagnostics must be a directory apart from the run directory "
            f"{str(out_dir)!r} (neither inside it nor holding it), got "
            f"private_diagnostics={os.fspath(path)!r}"
        )
    if (path / DIAGNOSTICS_FILE).exists():
        raise ValueError(
            f"private_diagnostics must be a new directory, {path / DIAGNOSTICS_FILE} exists"
        )
    return path


def write_private_diagnostics(directory: Path, run: Mapping[str, Any], out_dir: Path) -> Path:
    """Write ``run`` (the recipe summary's private view: the whole history and the recipe's
    diagnostics) as ``history.json`` into ``directory``, with a README that names it as not
    covered by the guarantee; returns the JSON file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DIAGNOSTICS_README).write_text(
        _WARNING + f"Run directory: {out_dir}\n", encoding="utf-8"
    )
    path = directory / DIAGNOSTICS_FILE
    path.write_text(json.dumps(dict(run), indent=2, default=str) + "\n", encoding="utf-8")
    return path


def publishing_section(out_dir: Path, diagnostics: Path | None) -> dict[str, Any]:
    """The report's "Publishing" section of a run directory whose report is about to be
    written: the files safe to publish (those present, then ``report.md``, ``report.json``
    and ``figures/``), where their numbers come from, and the private diagnostics directory
    (or ``None``) that the guarantee does not cover."""
    present = sorted(
        p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out_dir).parts)
    )
    return {
        "safe_to_publish": [*present, "report.md", "report.json", "figures/"],
        "derived_from": DERIVED_FROM,
        "not_covered": None if diagnostics is None else os.fspath(diagnostics),
    }


@contextlib.contextmanager
def claimed_run_dir(out_dir: Path) -> Iterator[Path]:
    """Hold ``out_dir`` for one run (created if missing) for the block.

    An exclusive, non-blocking ``flock`` on the directory (released when the block ends or the
    process dies; no file is written for it). A directory created here and left empty by a
    refused run is removed.

    Raises:
      ValueError: another run holds the directory, or it holds a ledger by now.
    """
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY)
    before: set[str] | None = None  # what the directory held when this run claimed it
    try:
        try:
            _lock_dir(fd)
        except BlockingIOError:
            raise ValueError(
                f"out must be a run directory that no other run is writing, got "
                f"out={os.fspath(out_dir)!r}: another dpfy train holds it (one run per "
                "directory; wait for it to finish or give another --out)"
            ) from None
        before = {p.name for p in out_dir.iterdir()}
        if (out_dir / "ledger.jsonl").exists():
            raise ValueError(f"out must be a new run directory, {out_dir}/ledger.jsonl exists")
        yield out_dir
    except BaseException as err:
        if before is not None:  # this run held the directory: clear what it left
            note = after_fault(out_dir, before)
            if note:
                err.add_note(note)
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    finally:
        os.close(fd)  # releases the lock


#: Ledger line types that release something computed from the private data.
RELEASE_TYPES = ("sum_query", "non_private", "matrix_run", "matrix_step")


def ledger_releases(path: Path) -> int:
    """Release lines in the ledger file ``path`` (0 when there is none).

    Read without the chain check and without parsing: a line counts when it names a release
    type, a line cut short by a crash included, so a ledger that may have released anything
    is never taken for an empty one.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    marks = tuple(f'"type":"{kind}"'.encode("ascii") for kind in RELEASE_TYPES)
    return sum(1 for line in data.split(b"\n") if any(m in line for m in marks))


def after_fault(out_dir: Path, before: set[str]) -> str:
    """Clear what a run that failed left in ``out_dir`` (which held ``before`` when it began);
    returns what it did, in one sentence, for the error's message.

    * No release in the ledger (the fault came before the first noisy release): every file
      and folder the run created is removed, and so is the run's signing key, so the same
      ``--out`` can be used again. Nothing was released, nothing is lost.
    * Releases in the ledger: the ledger is kept (its releases are spent privacy, counted
      by any report of it) and so is what was written whole; only debris goes (a temporary
      file of :mod:`dpfy._files`, a 0-byte file). The run cannot be continued in place.
    """
    from dpfy._files import TEMPORARY_SUFFIX

    ledger = out_dir / "ledger.jsonl"
    new = [out_dir / name for name in sorted({p.name for p in out_dir.iterdir()} - before)]
    released = ledger_releases(ledger) if ledger.name not in before else 0
    if released == 0:
        if ledger in new:
            _forget_key(ledger)
        for path in new:
            _remove(path)
        return (f"nothing was released and {out_dir} holds nothing from this run: run the "
                "same command again once the cause is fixed")
    for path in new:
        if path.is_file() and (path.suffix == TEMPORARY_SUFFIX or path.stat().st_size == 0):
            _remove(path)
    return (f"the ledger {ledger} keeps the {released} releases made before the fault "
            f"(`dpfy report {ledger}` accounts them); this run cannot continue in {out_dir}: "
            "give a new --out")


def _forget_key(ledger: Path) -> None:
    """Remove the signing key of the ledger's run (read from its header): a run that released
    nothing needs no key."""
    from dpfy.ledger.signing import forget_key, is_hex

    try:
        with ledger.open("rb") as f:
            run_id = json.loads(f.readline()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return
    if is_hex(run_id, 32):
        forget_key(run_id, os.fspath(ledger))


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _lock_dir(fd: int) -> None:
    """``flock(LOCK_EX | LOCK_NB)`` on a directory descriptor (no advisory locks on Windows)."""
    if sys.platform != "win32":
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---------------------------------------------------------------------------------------------
# where each published value comes from
# ---------------------------------------------------------------------------------------------

#: A DP release, or a function of the releases alone (the model, the ledger's noisy-release
#: records and their accounting, hashes of released files).
RELEASE = "release"
#: Public data (the test split, the software), or a fact the statement names as a public
#: assumption: the data set size N (report: "with the data set size (N = ...) treated as
#: public"), and what follows from N and the configuration.
PUBLIC = "public"
#: What the operator chose, or what follows from the options alone (hyperparameters, seeds,
#: file names, the plan, a run key drawn independently of the data).
CONFIGURATION = "configuration"
#: Computed from the private data without noise: never in a published file (the private
#: diagnostics only, ``--private-diagnostics DIR``).
PRIVATE = "private"

#: The provenance of every field a ``dpfy train`` run (and a ``dpfy tune`` trial) writes into
#: a published file, by file and dotted path (``[]`` for list items). A path takes the class
#: of its longest listed prefix; ``tests/test_publication.py`` walks every field of the run
#: types it trains and fails on one that is not listed or is :data:`PRIVATE`.
PROVENANCE: dict[str, dict[str, str]] = {
    "summary.json": {
        "dataset": CONFIGURATION, "sampler": CONFIGURATION, "model_name": CONFIGURATION,
        "delta": CONFIGURATION, "accounting": CONFIGURATION, "clip_norm": CONFIGURATION,
        "batch_size": CONFIGURATION, "epochs": CONFIGURATION, "learning_rate": CONFIGURATION,
        "model_path": CONFIGURATION, "ledger_path": CONFIGURATION,
        "noise_multiplier": CONFIGURATION,  # calibrated from the budget and the plan
        "test_accuracy": PUBLIC,  # the test split; None for a validation split (private)
        "epsilon": RELEASE, "steps": RELEASE, "stopped": RELEASE,  # the budget guard's view
        "history.epochs[].epoch": CONFIGURATION, "history.epochs[].steps": RELEASE,
        "history.epochs[].test_accuracy": PUBLIC,
        "history.epochs[].model_test_accuracy": PUBLIC,
        "history.epochs[].epsilon": RELEASE,
        "seconds": PRIVATE, "history.steps": PRIVATE, "history.epochs[].train_loss": PRIVATE,
        "history.epochs[].seconds": PRIVATE, "diagnostics": PRIVATE,
    },
    "ledger.jsonl": {
        # the file's own lines: a header (the run key: drawn apart from the data), samples
        # (the sampler's plan; dataset_size is N), releases (clip and noise of each
        # release), markers and signatures (of the released lines)
        "header": CONFIGURATION, "resume": RELEASE, "signature": RELEASE,
        "end": RELEASE,  # line counts and the released model's SHA-256
        "sample": CONFIGURATION, "sample.spec.dataset_size": PUBLIC,
        "sum_query": CONFIGURATION, "non_private": CONFIGURATION,
        "matrix_run": CONFIGURATION, "matrix_step": CONFIGURATION,
        "metadata": CONFIGURATION,  # options, hyperparameters, descriptions, run facts
        "metadata.test_accuracy": PUBLIC, "metadata.accuracy_by_step": PUBLIC,
        "metadata.model_accuracy_by_step": PUBLIC,
        "metadata.epsilon": RELEASE, "metadata.stopped": RELEASE,
        "metadata.calibrated": RELEASE,
        "metadata.validation_score": RELEASE,  # a tuning trial's noisy score (a release)
        "metadata.trial_epsilon": RELEASE,
        "metadata.validation_size": PUBLIC,  # N of the score's release, as N above
        "metadata.dataset_size": PUBLIC,
        "metadata.user_level.num_users": PUBLIC,  # N in units of privacy
        "metadata.linear_probe.epsilon_alone": RELEASE,
        "metadata.wall_time_seconds": PRIVATE,
        "metadata.user_level.num_examples": PRIVATE,
        "metadata.user_level.num_examples_used": PRIVATE,
        "metadata.user_level.largest_user": PRIVATE,
        "metadata.user_level.users_capped": PRIVATE,
        "metadata.user_level.layout_sha256": PRIVATE,
    },
    "report.json": {
        # the statement: accounted from the ledger (release), worded from the configuration
        "dp_setting": CONFIGURATION, "data_accesses": CONFIGURATION,
        "released_output": CONFIGURATION, "unit_of_privacy": CONFIGURATION,
        "adjacency": CONFIGURATION, "sampler": CONFIGURATION,
        "sampler.dataset_size": PUBLIC, "sampler.stages[].dataset_size": PUBLIC,
        "accounting_method": CONFIGURATION,
        "assumptions": CONFIGURATION, "delta": CONFIGURATION, "delta_times_n": PUBLIC,
        "epsilon": RELEASE, "formal_statement": RELEASE, "privacy_tier": RELEASE,
        "hyperparameters": RELEASE, "hyperparameters.dataset_size": PUBLIC,
        "other_methods": RELEASE, "rdp_curve": RELEASE, "mu": RELEASE,
        "epsilon_estimate": RELEASE, "epsilon_lower": RELEASE, "error_probability": RELEASE,
        "attack_risk": RELEASE, "ledger_integrity": RELEASE, "release": CONFIGURATION,
        "utility": PUBLIC, "utility.wall_time_seconds": PRIVATE,
        "reproduce": CONFIGURATION, "reproduce.steps_recorded": RELEASE,
        "figures": CONFIGURATION, "publishing": CONFIGURATION,
        "sampling_randomness": CONFIGURATION, "noise_randomness": CONFIGURATION,
        "audit": RELEASE,  # an attack on the released model and the run's own canaries
        "user_level": RELEASE, "user_level.num_users": PUBLIC, "user_level.unit": CONFIGURATION,
    },
    "run.toml": {"": CONFIGURATION},
    # A transformers Trainer's output_dir under dpfy.hf.DPTrainer (and each checkpoint-*/):
    # its model files are the release; what the Trainer logs is filtered (dpfy.hf.trainer).
    "trainer_state.json": {
        "": CONFIGURATION,  # the schedule: steps, epochs, save/eval/logging settings
        "global_step": RELEASE, "epoch": RELEASE,  # the ledger's step count
        "log_history[].grad_norm": RELEASE,  # norm of the noisy averaged gradient
        "log_history[].learning_rate": CONFIGURATION,
        "log_history[].epoch": RELEASE, "log_history[].step": RELEASE,
        # DPTrainer.floating_point_ops is 0 by construction: a count of the tokens of each
        # Poisson batch would follow its realised size
        "log_history[].total_flos": CONFIGURATION, "total_flos": CONFIGURATION,
        # an evaluation split is the user's: public data by the docs' contract
        # (docs/usage.md: evaluate on data whose scores may be published)
        "log_history[].eval_": PUBLIC,
        "log_history[].train_loss": PRIVATE, "log_history[].loss": PRIVATE,
        "log_history[].train_runtime": PRIVATE,
        # 0: DPTrainer refuses include_num_input_tokens_seen (a count of private tokens)
        "num_input_tokens_seen": CONFIGURATION,
        "log_history[].num_input_tokens_seen": PRIVATE,
    },
    # dpfy tune's search directory (beside trials/*/ and final/, themselves run directories)
    "search.json": {  # the plan, drawn from the options and a generator before any data
        "": CONFIGURATION,  # configuration, space, K and the trials' draws, the randomness
        "per_run_epsilon": CONFIGURATION, "planned_total_epsilon": CONFIGURATION,
    },
    "tuning.json": {
        "": CONFIGURATION,  # data set, delta, space, K's law, the score noise, the budget
        "total_epsilon": RELEASE, "total_method": CONFIGURATION,
        "search_epsilon": RELEASE, "search_method": CONFIGURATION,
        "final_epsilon": RELEASE, "all_scores_epsilon": RELEASE,
        "number_of_trials": CONFIGURATION,  # K, drawn before any trial
        "trials[].index": CONFIGURATION, "trials[].params": CONFIGURATION,
        "trials[].score": RELEASE,  # the noisy score (all_scores_epsilon covers them)
        "trials[].epsilon": RELEASE,
        "trials[].seconds": PRIVATE,  # follows the realised batches: never written
        "chosen": RELEASE,  # a function of the noisy scores
        "final_test_accuracy": PUBLIC,
    },
    "privacy_report.json": {},  # the statement: as report.json (filled in below)
    "adapter_config.json": {"": CONFIGURATION},
    "config.json": {"": CONFIGURATION},
    "generation_config.json": {"": CONFIGURATION},
}
PROVENANCE["privacy_report.json"] = PROVENANCE["report.json"]


def provenance(file: str, path: str) -> str | None:
    """The class of the field ``path`` of a published ``file`` (:data:`PROVENANCE`): that of
    its longest listed prefix, or ``None`` when no prefix is listed."""
    table = PROVENANCE.get(file)
    if table is None:
        return None
    parts = path.split(".")
    for n in range(len(parts), -1, -1):
        prefix = ".".join(parts[:n])
        for key in (prefix, prefix.replace("[]", "")):
            if key in table:
                return table[key]
    # a family of keys by prefix: "log_history[].eval_" covers every eval_* metric
    families = [k for k in table if k.endswith("_") and path.startswith(k)]
    return table[max(families, key=len)] if families else None


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a JSON value; list items as ``[]``."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value:
        for item in value:
            yield from _leaves(item, prefix + "[]")
    else:
        yield prefix, value


def published_fields(out_dir: Path) -> Iterator[tuple[str, str, Any]]:
    """``(file, path, value)`` of every field of a run directory's data files: every JSON file
    under it (a file :data:`PROVENANCE` does not list has every field unlisted), ``run.toml``
    and the ledger, whose line paths start with their type."""
    import tomllib

    for file in sorted(out_dir.rglob("*.json")):  # every JSON file, checkpoints included
        yield from ((file.name, p, v) for p, v in _leaves(
            json.loads(file.read_text(encoding="utf-8"))))
    if (out_dir / "run.toml").is_file():
        config = tomllib.loads((out_dir / "run.toml").read_text(encoding="utf-8"))
        yield from (("run.toml", p, v) for p, v in _leaves(config))
    if (out_dir / "ledger.jsonl").is_file():
        for line in (out_dir / "ledger.jsonl").read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            kind = str(record.pop("type"))
            record.pop("prev", None)
            body = record.get("info", record) if kind == "metadata" else record
            for path, value in _leaves(body):
                yield "ledger.jsonl", f"{kind}.{path}" if path else kind, value


def unclassified_fields(out_dir: Path) -> list[str]:
    """The fields of a run directory's published files that :data:`PROVENANCE` does not list
    or lists as :data:`PRIVATE` (``"file: path (why)"``); empty when every value is a
    release, public or configuration."""
    found = []
    for name, path, _ in published_fields(out_dir):
        kind = provenance(name, path)
        if kind is None or kind == PRIVATE:
            found.append(f"{name}: {path} ({'not listed' if kind is None else 'private'})")
    return sorted(set(found))

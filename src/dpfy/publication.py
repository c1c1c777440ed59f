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
    try:
        try:
            _lock_dir(fd)
        except BlockingIOError:
            raise ValueError(
                f"out must be a run directory that no other run is writing, got "
                f"out={os.fspath(out_dir)!r}: another dpfy train holds it (one run per "
                "directory; wait for it to finish or give another --out)"
            ) from None
        if (out_dir / "ledger.jsonl").exists():
            raise ValueError(f"out must be a new run directory, {out_dir}/ledger.jsonl exists")
        yield out_dir
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    finally:
        os.close(fd)  # releases the lock


def _lock_dir(fd: int) -> None:
    """``flock(LOCK_EX | LOCK_NB)`` on a directory descriptor (no advisory locks on Windows)."""
    if sys.platform != "win32":
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

"""How a training run shows its progress: a rich bar on a terminal, plain lines in a log.

Without a terminal (``make demo > log``, CI, ``nohup``) rich draws nothing until the bar stops,
so a run of minutes would print nothing while it trains. There :class:`ProgressLines` prints a
line when the run starts, one about every :data:`INTERVAL_S` seconds and one at the end::

    DP-SGD: step 240/590 (41%), epoch 5, 0:48 elapsed, about 1:10 left, test 0.9612, eps 1.920

A line shows the fields that are safe in a file that outlives the run (test accuracy, the
ledger's epsilon so far), each once known; the training batches' loss and accuracy, which are
not DP releases, stay on the terminal's bar (README, "What make demo produces").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: Seconds between two progress lines when the output is not a terminal.
INTERVAL_S = 30.0


def is_terminal() -> bool:
    """Whether the rich bar can be seen: rich's console (standard output) is a terminal or a
    notebook (rich's rule: ``TTY_COMPATIBLE=1`` or ``FORCE_COLOR`` count as a terminal,
    ``TTY_COMPATIBLE=0`` does not)."""
    from rich.console import Console

    console = Console()
    return bool(console.is_terminal or console.is_jupyter)


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLines:
    """Plain progress lines, for a log: see the module docstring.

    Args:
      label: what runs (``"DP-SGD"``, ``"DP fine-tuning"``).
      total: steps of the whole run; completed: steps already done (a resumed run).
      fields: the names of the fields shown, in their order on the line (others given to
        :meth:`update` are ignored).
      unit: what is counted (``"step"``; ``"image"`` for feature extraction, with no epoch).
      interval: seconds between lines (None: :data:`INTERVAL_S`, read when the run starts).
      stream: where the lines go (None: standard output, as the bar and the run's summary).
      clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        label: str,
        total: int,
        completed: int = 0,
        *,
        fields: tuple[str, ...] = (),
        unit: str = "step",
        interval: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._label, self._total, self._start_step = label, int(total), int(completed)
        self._interval = INTERVAL_S if interval is None else float(interval)
        self._stream, self._clock = stream, clock
        self._fields: dict[str, str] = dict.fromkeys(fields, "-")
        self._step, self._epoch = int(completed), None if unit != "step" else 0
        self._unit = unit
        self._start = self._last = clock()
        self._printed_step = -1
        self._write(
            f"{label}: {self._total} {unit}s"
            + (f" ({self._step} done)" if self._step else "")
            + f"; a progress line every {_clock(self._interval)} (no terminal)"
        )

    def update(self, completed: int, epoch: int | None = None, **fields: str) -> None:
        """Record the state after a step (``epoch``: its 0-based epoch, shown counting from 1);
        print a line if one is due."""
        self._step = int(completed)
        self._epoch = None if epoch is None else int(epoch)
        self._fields.update((k, v) for k, v in fields.items() if k in self._fields)
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._print(now)

    def close(self) -> None:
        """The last line (unless the last state was just printed)."""
        if self._printed_step != self._step:
            self._print(self._clock())

    def _print(self, now: float) -> None:
        elapsed = now - self._start
        done, total = self._step, self._total
        parts = [f"{self._unit} {done}/{total} ({100 * done // max(total, 1)}%)"]
        if self._epoch is not None:
            parts.append(f"epoch {self._epoch + 1}")
        parts.append(f"{_clock(elapsed)} elapsed")
        ran = done - self._start_step
        if 0 < ran and done < total:
            parts.append(f"about {_clock(elapsed / ran * (total - done))} left")
        parts += [f"{k} {v}" for k, v in self._fields.items() if v != "-"]
        self._printed_step = done
        self._write(f"{self._label}: " + ", ".join(parts))

    def _write(self, line: str) -> None:
        print(line, file=self._stream if self._stream is not None else sys.stdout, flush=True)


class ProgressBar:
    """A rich progress bar: epoch, steps, the given fields, elapsed and remaining time
    (``unit`` other than ``"step"``: the label instead of the epoch, as :class:`ProgressLines`)."""

    def __init__(self, label: str, total: int, completed: int = 0, *,
                 fields: tuple[str, ...] = (), unit: str = "step") -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._epochs = unit == "step"
        head = f"[bold]{label}[/bold] epoch {{task.fields[epoch]}}" if self._epochs else label
        self._progress = Progress(
            TextColumn(head),
            BarColumn(),
            MofNCompleteColumn(),
            *(TextColumn(f"{name} {{task.fields[{name}]}}") for name in fields),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        self._progress.start()
        start: dict[str, Any] = dict.fromkeys(fields, "-")
        if self._epochs:
            start["epoch"] = 1
        self._task = self._progress.add_task("train", total=total, completed=completed, **start)

    def update(self, completed: int, epoch: int | None = None, **fields: str) -> None:
        shown: dict[str, Any] = dict(fields)
        if self._epochs and epoch is not None:
            shown["epoch"] = epoch + 1  # counted from 1
        self._progress.update(self._task, completed=completed, **shown)

    def close(self) -> None:
        self._progress.stop()


def progress_display(
    label: str,
    total: int,
    completed: int = 0,
    *,
    fields: tuple[str, ...] = (),
    line_fields: tuple[str, ...] = ("test", "eps"),
    unit: str = "step",
) -> ProgressBar | ProgressLines:
    """A rich bar with ``fields`` on a terminal, else plain lines with those of ``line_fields``
    (module docstring) about every :data:`INTERVAL_S` seconds; ``unit``: what ``total``
    counts (``"step"``, with epochs; ``"image"`` or ``"snippet"`` for feature extraction)."""
    if is_terminal():
        return ProgressBar(label, total, completed, fields=fields, unit=unit)
    return ProgressLines(
        label, total, completed, fields=tuple(f for f in fields if f in line_fields), unit=unit
    )

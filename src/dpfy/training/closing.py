"""Closing a run's ledger on the user's behalf: when the planned epochs are done, when the
script asks for its report, and at interpreter exit.

A ledger file without its end record and signature reads as "open or crash-cut", and every
report of it says "Incomplete ... NOT a differential privacy statement"; yet a script written
for Opacus never calls ``ledger.close()``. :class:`LedgerCloser` closes it for the script and
says in the end record (``EndRecord.ended``) how the run ended:

* ``"as planned: R of P planned releases"`` once every planned logical batch was released;
* ``"early (<why>): R of P planned releases"`` when the report is asked for, or the
  interpreter exits (an uncaught exception, a script that stopped), before the plan ran: the
  report is then complete for the releases made and never reads them as the plan;
* ``"<why>: R releases (no planned end)"`` for a run without planned epochs.

The close is made with ``reopen=True``: whatever the script records afterwards (a second
``make_private`` on the same engine, its metadata) reopens the file with a resume marker, so
the run stays one hash chain, and the next close (at the latest, at exit) ends it again.
A run whose objects are garbage-collected before the end (a script's next run rebinds its
variables, as Opacus' ``--n-runs``) has its ledger closed then. Releases are counted from the
ledger (samples with a release).

Given the run's ``delta`` and accountant, each close first records in the ledger's metadata the
epsilon the writer computed from its *in-memory* records (``epsilon``, ``delta``,
``accounting``), as ``dpfy train`` does at its end. A reader recomputes it from the file's lines
(:func:`dpfy.report.consistency.check_recorded_epsilon`; ``dpfy report`` refuses, ``dpfy audit``
names, a file that accounts to less): a file whose lines overstate the noise, or lost
releases, while the process drew and recorded the right noise, is seen there.
"""

from __future__ import annotations

import atexit
import math
import sys
import weakref
from typing import Any

from dpfy.ledger import Ledger
from dpfy.training.budget import statement

#: The closers of file ledgers still open to a live run (closed at interpreter exit).
_LIVE: weakref.WeakSet[LedgerCloser] = weakref.WeakSet()


def _released(ledger: Ledger) -> int:
    return len(ledger.noise_multipliers())


class LedgerCloser:
    """Closes one run's ledger when its plan is done, on request, when the run's objects are
    released and at interpreter exit.

    Args:
      ledger: the run's ledger.
      planned: logical batches the run plans to release (None: no planned end).
      delta, method: the run's delta and accountant; when both are given, every close records
        the epsilon of the in-memory ledger at ``delta`` (module docstring).

    :meth:`watch` ties it to the object that runs the training: when that object is
    garbage-collected (a script's next run rebinds its variables) the ledger is closed then;
    until then a file ledger is closed at interpreter exit.
    """

    def __init__(self, ledger: Ledger, planned: int | None, *, delta: float | None = None,
                 method: str | None = None) -> None:
        self.ledger = ledger
        self.planned = planned
        self.delta, self.method = delta, method
        self._first = _released(ledger)  # releases before this run (a reused ledger)

    def watch(self, owner: Any) -> None:
        """Close the ledger when ``owner`` is garbage-collected, or at exit before that."""
        finalizer = weakref.finalize(owner, self.close, "the run's objects were released")
        finalizer.atexit = False  # exit is _close_at_exit's, which names an uncaught error
        if self.ledger.path is not None:
            _LIVE.add(self)

    def released(self) -> int:
        """Logical batches this run has released so far."""
        return _released(self.ledger) - self._first

    def done(self) -> bool:
        """Whether every planned release was made (False without a plan)."""
        return self.planned is not None and self.released() >= self.planned

    def close(self, how: str, *, delta: float | None = None) -> None:
        """Close the ledger now, its end record saying how the run ended (module docstring);
        nothing when it is closed already. ``how``: why it is closed now, in words; ``delta``:
        the delta of the report about to be written, for a run that set none (kept for the
        later closes)."""
        if delta is not None:
            self.delta = float(delta)
        ledger = self.ledger
        if ledger.read_only:
            return
        done = self.released()
        if self.planned is None:
            ended = f"{how}: {done} releases (no planned end)"
        elif done >= self.planned:
            ended = f"as planned: {done} of {self.planned} planned releases"
        else:
            ended = f"early ({how}): {done} of {self.planned} planned releases"
        self.record_epsilon()
        ledger.close(ended=ended, reopen=True)

    def record_epsilon(self) -> None:
        """Record the epsilon of the in-memory ledger at the run's delta (nothing without a
        delta and accountant, or before the first release). An accountant that refuses the
        ledger's event records why instead: a close never fails for it."""
        ledger = self.ledger
        if self.delta is None or self.method is None or not ledger.noise_multipliers():
            return
        try:
            result = statement(ledger, self.delta, self.method)
        except Exception as err:  # noqa: BLE001 - the close that follows must happen anyway
            ledger.record_metadata(epsilon_not_recorded=f"{type(err).__name__}: {err}"[:300])
            return
        if not math.isfinite(result.epsilon):  # JSON has no infinity; nothing to check then
            return
        ledger.record_metadata(epsilon=float(result.epsilon), delta=float(self.delta),
                               accounting=result.method)


@atexit.register
def _close_at_exit() -> None:
    error = getattr(sys, "last_value", None)  # set when an uncaught exception ended it
    how = "the interpreter exited" + (
        f" after an uncaught {type(error).__name__}" if error is not None else ""
    )
    for closer in list(_LIVE):
        try:
            closer.close(how)
        except Exception as err:  # at exit: say it, never raise over the script's own error
            print(f"dpfy: could not close the ledger {closer.ledger.path} at exit: {err}",
                  file=sys.stderr)

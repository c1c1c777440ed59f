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
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

from dpfy.ledger import Ledger

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

    :meth:`watch` ties it to the object that runs the training: when that object is
    garbage-collected (a script's next run rebinds its variables) the ledger is closed then;
    until then a file ledger is closed at interpreter exit.
    """

    def __init__(self, ledger: Ledger, planned: int | None) -> None:
        self.ledger = ledger
        self.planned = planned
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

    def close(self, how: str) -> None:
        """Close the ledger now, its end record saying how the run ended (module docstring);
        nothing when it is closed already. ``how``: why it is closed now, in words."""
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
        ledger.close(ended=ended, reopen=True)


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

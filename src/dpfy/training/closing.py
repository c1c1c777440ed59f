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
Releases are counted from the ledger (samples with a release), so the count is right even
after the objects of the run were garbage-collected.
"""

from __future__ import annotations

import atexit
import sys
import weakref

from dpfy.ledger import Ledger


def _released(ledger: Ledger) -> int:
    return len(ledger.noise_multipliers())


class LedgerCloser:
    """Closes one run's ledger when its plan is done, on request, and at interpreter exit.

    Args:
      ledger: the run's ledger (held weakly: a ledger dropped by the script is not kept open).
      planned: logical batches the run plans to release (None: no planned end).

    Only a file ledger is closed at exit: an in-memory one ends with the process anyway.
    """

    def __init__(self, ledger: Ledger, planned: int | None) -> None:
        self._ledger = weakref.ref(ledger)
        self.planned = planned
        self._first = _released(ledger)  # releases before this run (a reused ledger)
        if ledger.path is not None:
            atexit.register(self._at_exit)

    def released(self) -> int:
        """Logical batches this run has released so far (0 once the ledger is gone)."""
        ledger = self._ledger()
        return 0 if ledger is None else _released(ledger) - self._first

    def done(self) -> bool:
        """Whether every planned release was made (False without a plan)."""
        return self.planned is not None and self.released() >= self.planned

    def close(self, how: str) -> None:
        """Close the ledger now, its end record saying how the run ended (module docstring);
        nothing when it is closed already. ``how``: why it is closed now, in words."""
        ledger = self._ledger()
        if ledger is None or ledger.read_only:
            return
        done = self.released()
        if self.planned is None:
            ended = f"{how}: {done} releases (no planned end)"
        elif done >= self.planned:
            ended = f"as planned: {done} of {self.planned} planned releases"
        else:
            ended = f"early ({how}): {done} of {self.planned} planned releases"
        ledger.close(ended=ended, reopen=True)

    def _at_exit(self) -> None:
        error = getattr(sys, "last_value", None)  # set when an uncaught exception ended it
        how = "the interpreter exited" + (
            f" after an uncaught {type(error).__name__}" if error is not None else ""
        )
        try:
            self.close(how)
        except Exception as err:  # at exit: say it, never raise over the script's own error
            ledger = self._ledger()
            where = ledger.path if ledger is not None else "?"
            print(f"dpfy: could not close the ledger {where} at exit: {err}", file=sys.stderr)

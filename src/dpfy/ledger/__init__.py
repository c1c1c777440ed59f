"""The privacy ledger: what a run really released, appended as it happens.

* :mod:`dpfy.ledger.records` -- the record types (sample, sum query, non-private release,
  metadata, file markers), their JSON form and the registry of record types;
* :mod:`dpfy.ledger.ledger` -- :class:`Ledger`: the write-ahead file, the one replay path that
  loading, resuming and copying share, and the mapping of records to a privacy event;
* :mod:`dpfy.ledger.matrix` -- matrix-mechanism (correlated-noise) runs -> one event, with
  the checks of their steps against the recorded schema;
* :mod:`dpfy.ledger.hyperparameters` -- the DP hyperparameters a ledger recorded, for reports;
* :mod:`dpfy.ledger.chain` -- the hash chain over the file's lines and its verification;
* :mod:`dpfy.ledger.signing` -- the run's Ed25519 key and the signature of the chain head;
* :mod:`dpfy.ledger.logfile` -- the locked, append-only file (one writer, clean failures).

The ledger imports neither torch nor the accountants: ``dpfy.accounting.epsilon(ledger, delta)``
turns it into a number. See ``docs/architecture.md`` and ``docs/ledger.md``.
"""

from dpfy.ledger.chain import LedgerFormatError, LedgerIntegrityError, Verification
from dpfy.ledger.ledger import Ledger
from dpfy.ledger.records import Record, register_record

__all__ = [
    "Ledger",
    "Verification",
    "LedgerFormatError",
    "LedgerIntegrityError",
    "register_record",
    "Record",
]

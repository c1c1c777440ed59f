"""The privacy ledger: what a run really released, appended as it happens.

* :mod:`dpfy.ledger.records` -- the record types (sample, sum query, non-private release,
  metadata, file markers), their JSON form and the registry of record types;
* :mod:`dpfy.ledger.ledger` -- :class:`Ledger`: the write-ahead file, the one replay path that
  loading, resuming and copying share, and the mapping of records to a privacy event.

The ledger imports neither torch nor the accountants: ``dpfy.accounting.epsilon(ledger, delta)``
turns it into a number. See ``docs/architecture.md``.
"""

from dpfy.ledger.ledger import (
    SAMPLERS,
    Ledger,
    LedgerFormatError,
    LedgerTruncationWarning,
    effective_noise_multiplier,
    ledger_hyperparameters,
)
from dpfy.ledger.records import (
    HeaderRecord,
    MetadataRecord,
    NonPrivateRecord,
    Record,
    ResumeRecord,
    SampleRecord,
    SumQueryRecord,
    record_from_dict,
    register_record,
)
from dpfy.sampling.spec import SampleSpec

__all__ = [
    "SAMPLERS",
    "SampleSpec",
    "SampleRecord",
    "SumQueryRecord",
    "NonPrivateRecord",
    "MetadataRecord",
    "HeaderRecord",
    "ResumeRecord",
    "Record",
    "record_from_dict",
    "register_record",
    "Ledger",
    "ledger_hyperparameters",
    "LedgerFormatError",
    "LedgerTruncationWarning",
    "effective_noise_multiplier",
]

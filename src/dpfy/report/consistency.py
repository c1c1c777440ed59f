"""What a report may claim given the ledger's integrity, and the ledger's own recorded epsilon.

Two checks stand between a ledger file and the sentence "the run satisfies (eps, delta)-DP":

* **Completeness.** Only a file closed by its writer, with the end record signed by the run's
  key (:attr:`dpfy.ledger.Verification.complete`), describes a finished run. A file that is
  still open, crash-cut, or whose tail (end record or signature) is missing can only give an
  epsilon *so far*: the headline says "Incomplete: epsilon so far ...". A closed file without a
  key (written before dpfy signed its ledgers) is "unsigned": its releases are stated, with the
  warning that a removed tail cannot be detected.
* **The recorded epsilon.** Training records, in the ledger's metadata, the epsilon it
  accounted at the end (``epsilon``, with ``accounting`` and ``delta``). Recomputing it from the
  lines must not give less: a smaller figure means releases were removed or their noise was
  raised after the fact, and the report is refused (:class:`LedgerIntegrityError`). A larger
  figure is an over-count (e.g. lines recovered after a crash) and is safe.

This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dpfy import accounting
from dpfy.ledger import Ledger, LedgerIntegrityError, Verification
from dpfy.ledger.chain import BROKEN, OPEN, UNSIGNED, UNVERIFIED, VERIFIED
from dpfy.ledger.trust import KeyTrust, fingerprint

#: Relative tolerance between the recorded and the recomputed epsilon (same method and delta):
#: both come from the same deterministic accountant, so only float noise separates them.
EPSILON_RTOL = 1e-6

#: Statuses of a file that may have lost releases at its end, and of one without a signature.
_INCOMPLETE = (OPEN,)
_NO_SIGNATURE = (UNSIGNED, UNVERIFIED)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def check_recorded_epsilon(
    ledger: Ledger, result: accounting.PrivacyResult, delta: float
) -> None:
    """Refuse a ledger whose lines account to less than the epsilon its writer recorded.

    Args:
      ledger: the loaded ledger; its metadata may hold ``epsilon`` (the writer's final figure),
        ``accounting`` (the method) and ``delta``.
      result: the report's own accounting of ``ledger`` at ``delta`` (reused when the method
        and delta are the recorded ones).
      delta: the report's delta.

    Raises:
      LedgerIntegrityError: the recomputed epsilon is below the recorded one.
    """
    meta: Mapping[str, Any] = ledger.metadata
    recorded, recorded_delta = _number(meta.get("epsilon")), _number(meta.get("delta"))
    method = meta.get("accounting")
    if recorded is None or recorded_delta is None or not isinstance(method, str):
        return
    if not math.isfinite(recorded) or not 0.0 < recorded_delta < 1.0:
        return
    if method == result.method and recorded_delta == delta:
        recomputed = result.epsilon
    else:
        try:
            recomputed = accounting.epsilon(ledger, recorded_delta, method).epsilon
        except (ValueError, KeyError):  # a method this version does not know: nothing to check
            return
    if recomputed < recorded * (1.0 - EPSILON_RTOL):
        raise LedgerIntegrityError(
            f"ledger {ledger.path!r}: its lines account to epsilon {recomputed:.6g} "
            f"({method}, delta {recorded_delta:g}), below the {recorded:.6g} its writer "
            "recorded: releases were removed or their noise raised after the run. No report "
            "is written"
        )


def incomplete_statement(verification: Verification, epsilon: float, delta: float) -> str | None:
    """The headline of a ledger that may lack its last releases, or of a broken one loaded for
    forensics (None otherwise).

    ``epsilon`` is in the report's accounting at ``delta``; it is a lower bound on what the
    whole run spent when the file is incomplete.
    """
    if verification.status == BROKEN:
        return (
            f"Broken ledger: the edited file accounts to epsilon {epsilon:.5g} at delta "
            f"{delta:g}, but its hash chain breaks at line {verification.broken_line}; this is "
            "NOT a differential privacy statement about the run that wrote it."
        )
    if verification.status in _INCOMPLETE:
        reason = verification.reason or verification.status
        return (
            f"Incomplete: epsilon so far {epsilon:.5g} at delta {delta:g}. The ledger is "
            f"{verification.status} ({reason}); later releases may be missing, so this is NOT "
            "a differential privacy statement about the finished run."
        )
    return None


def unsigned_note(verification: Verification) -> str | None:
    """What a report adds when the ledger carries no signature (None for a signed one)."""
    if verification.status in _NO_SIGNATURE:
        return (
            f" The ledger is {verification.status}: no signature vouches for its end, so "
            "whether releases were removed from its tail cannot be checked."
        )
    return None


def trust_note(verification: Verification, trust: KeyTrust) -> str:
    """What the statement of a closed, signed ledger adds about whose key signed it: verified
    against the key the reader trusts, or intact under a key nobody checked."""
    if verification.status != VERIFIED or trust.run_key is None:
        return ""
    if trust.verified:
        return f" The ledger is {trust.describe()}."
    return (f" The ledger is intact and signed by run key {fingerprint(trust.run_key)}, but that "
            "key was not checked against one you trust: this proves self-consistency only.")


def signature_line(integrity: Mapping[str, Any]) -> str:
    """One line naming the run's public key and the chain head it signed (from a report's
    ``ledger_integrity``), or saying that the ledger is unsigned: keep both apart from the
    ledger file to detect a rewrite later."""
    key, head, line = (integrity.get(k) for k in ("public_key", "signed_head", "signed_lines"))
    if not key:
        return "Ledger signature: none (an unsigned ledger: a rewrite of its tail goes undetected)"
    if not head:
        return f"Ledger signature: NONE holds, although the header names Ed25519 key `{key}`"
    return (f"Ledger signature: Ed25519 public key `{key}` signed chain head `{head}` (line "
            f"{line}); verify with the public key alone")

"""The ledger file's hash chain: hashing lines, checking the chain, the verification result.

Every line after the header carries ``"prev"``: the SHA-256 (hex) of the previous line's exact
bytes (without its ``\\n``), so the chain commits to the content and order of every line before
the last one. ``Ledger.close()`` appends an end record chained like the rest, whose ``count``
is the number of lines before it: a closed file ends with it, and a file without it is still
open, crashed or was truncated. A line cut short by a crash is not chained (its tail is
missing); the resume marker written after it names its hash in ``"cut"`` and chains to the last
complete line. A signed file's header carries the run's Ed25519 public key, and signature
records (after the end record, and at checkpoints) sign the head they follow
(:mod:`dpfy.ledger.signing`); a signature that does not hold breaks the chain. A header that
claims version 1 over lines that carry hashes is a downgrade and breaks it too. What the chain
proves and what it does not: ``docs/ledger.md``.

This module imports neither torch nor the accountants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Any

from dpfy.ledger.signing import signature_holds

VERIFIED = "intact and signed"  # by the header's key: whose key, the reader checks
UNSIGNED = "unsigned"
OPEN = "intact, open or crash-cut"
BROKEN = "broken"
UNVERIFIED = "unverified (no chain)"
IN_MEMORY = "in memory (no file)"


class LedgerFormatError(ValueError):
    """A ledger file is malformed (other than a truncated last line); ``line`` names where."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class LedgerIntegrityError(LedgerFormatError):
    """A ledger file's hash chain is broken: a line was edited, removed, inserted or moved."""


def line_hash(line: bytes) -> str:
    """SHA-256 (hex) of one ledger line's bytes, without the terminating newline."""
    return hashlib.sha256(line).hexdigest()


def new_run_id() -> str:
    """A fresh random run identifier: 16 bytes from the OS CSPRNG, as 32 hex digits."""
    return secrets.token_hex(16)


@dataclasses.dataclass(frozen=True)
class Verification:
    """What the hash chain says about a ledger file.

    Attributes:
      status: ``"intact and signed"`` (chain intact, closed by its writer, the end record signed by
        the header's key), ``"unsigned"`` (chain intact and closed, but no key: a file written
        before dpfy signed its ledgers; its completeness cannot be checked), ``"intact, open
        or crash-cut"`` (chain intact, no signed end record: still being written, crashed, or
        its tail was cut off), ``"broken"``, ``"unverified (no chain)"`` (a version 1 file) or
        ``"in memory (no file)"``.
      lines: lines checked (header and markers included).
      run_id: the header's run identifier (None for version 1 or in memory).
      head: SHA-256 of the last complete line: keep it elsewhere (a report, a checkpoint) to
        detect a rewrite of the whole chain.
      broken_line: first line (1-based) where the chain breaks, else None.
      reason: why it breaks, or what the status means.
      public_key: the run's Ed25519 public key from the header (64 hex digits; None if the
        file is unsigned). Keep it apart from the file: it is what a rewrite cannot forge.
      signed_lines / signed_head: the line (1-based) and chain head that the last valid
        signature covers (None if none does).
    """

    status: str
    lines: int = 0
    run_id: str | None = None
    head: str | None = None
    broken_line: int | None = None
    reason: str = ""
    public_key: str | None = None
    signed_lines: int | None = None
    signed_head: str | None = None

    @property
    def ok(self) -> bool:
        """The chain is intact (closed or not, signed or not)."""
        return self.status in (VERIFIED, OPEN, UNSIGNED)

    @property
    def complete(self) -> bool:
        """The file ends with its writer's end record and its signature: nothing was cut."""
        return self.status == VERIFIED

    def describe(self) -> str:
        """One line for a report."""
        if self.status == BROKEN:
            return f"BROKEN at line {self.broken_line}: {self.reason}"
        if self.status in (VERIFIED, OPEN, UNSIGNED):
            run = f"run {self.run_id[:8]}…, " if self.run_id else ""
            head = f"head {self.head[:12]}…" if self.head else ""
            if self.status == VERIFIED:  # whose key it is, the reader checks (ledger.trust)
                return (f"intact and signed (hash chain over {self.lines} lines, {run}{head}), "
                        f"signed at line {self.signed_lines} by Ed25519 key {self.public_key}")
            text = f"{self.status} (hash chain over {self.lines} lines, {run}{head})"
            return f"{text}: {self.reason}"
        return f"{self.status}: {self.reason}" if self.reason else self.status


class ChainChecker:
    """Checks a ledger file's chain line by line, as the file is parsed.

    ``strict``: raise :class:`LedgerIntegrityError` at the first break; otherwise remember it
    (forensics) and keep checking each line against its predecessor. ``expected_key``: the
    run's Ed25519 public key (64 hex digits) as kept apart from the file; a header naming
    another key (or none) is a break at line 1, since whoever rewrites a whole ledger can
    re-sign it with a key of their own.
    """

    def __init__(
        self, source: str, *, strict: bool = True, expected_key: str | None = None
    ) -> None:
        self.source = source
        self.strict = strict
        self.expected_key = expected_key
        self.version = 0
        self.run_id: str | None = None
        self.public_key: str | None = None
        self.head: str | None = None  # hash of the last complete line
        self.lines = 0
        self.ended = False  # the last record (signatures aside) is an end record
        self.end_line: int | None = None
        self.signed: tuple[int, str] | None = None  # (line, head) of the last valid signature
        self.tail_cut = False  # the last line is cut short
        self._cut: str | None = None  # hash of a cut line awaiting its resume marker
        self.broken_line: int | None = None
        self.reason = ""

    def refuse(self, lineno: int, reason: str) -> None:
        """Line ``lineno`` contradicts the file (e.g. an end record's counts): a break."""
        self._break(lineno, reason)

    def _break(self, lineno: int, reason: str) -> None:
        if self.broken_line is None:
            self.broken_line, self.reason = lineno, reason
        if self.strict:
            raise LedgerIntegrityError(
                f"ledger {self.source!r} line {lineno}: hash chain broken: {reason}. Load it "
                "with Ledger.load(path, verify=False) for forensics; its epsilon is not a "
                "statement about the run that wrote it",
                line=lineno,
            )

    def add(self, lineno: int, raw: bytes, obj: dict[str, Any]) -> None:
        """A complete line (parsed to ``obj``) at 1-based ``lineno``."""
        kind = obj.get("type")
        if lineno == 1:
            version = obj.get("version", 0)
            if isinstance(version, bool) or not isinstance(version, int):
                raise LedgerFormatError(
                    f"ledger {self.source!r} line 1: version must be an integer, got "
                    f"version={version!r}"
                )
            self.version = version
            self.run_id = obj.get("run_id")
            self.public_key = obj.get("public_key")
            if self.expected_key is not None and self.public_key != self.expected_key:
                self._break(lineno, f"the header names signing key {self.public_key!r}, not "
                            f"the key kept apart from the file ({self.expected_key}): the "
                            "ledger was rewritten and re-signed, or is another run's")
            elif self.version < 2 and self.public_key is not None:
                self._break(lineno, f"the header claims version {self.version}, which has no "
                            "hash chain, but names a signing key: a version downgrade")
        elif self.version >= 2:
            self._check(lineno, obj, kind)
        elif "prev" in obj:
            self._break(lineno, f"the header claims version {self.version}, which has no hash "
                        "chain, but this line carries a prev hash: a version downgrade")
        self.head = line_hash(raw)
        self.lines = lineno
        self.ended = kind == "end" or (kind == "signature" and self.ended)
        if kind == "end":
            self.end_line = lineno
        self.tail_cut = False

    def _check(self, lineno: int, obj: dict[str, Any], kind: Any) -> None:
        prev = obj.get("prev")
        if self._cut is not None:
            if kind != "resume" or obj.get("cut") != self._cut:
                self._break(lineno, f"the resume marker does not name the hash of cut line "
                            f"{lineno - 1}")
            self._cut = None
        if prev != self.head:
            self._break(
                lineno,
                "its prev is not the SHA-256 of the line before it (a line at or before "
                f"line {lineno} was edited, inserted, removed or moved)"
                if isinstance(prev, str) else "it carries no prev hash",
            )
        elif kind == "header":
            self._break(lineno, "a second header")
        elif self.ended and kind not in ("resume", "signature"):
            self._break(lineno, "a line after the end record that is not a resume marker")
        elif kind == "signature":
            self._check_signature(lineno, obj)
        elif kind == "end" and obj.get("count") != lineno - 1:
            self._break(
                lineno, f"the end record counts {obj.get('count')!r} lines before it, the file "
                f"holds {lineno - 1}"
            )

    def _check_signature(self, lineno: int, obj: dict[str, Any]) -> None:
        if self.public_key is None or self.run_id is None:
            self._break(lineno, "a signature in a file whose header names no public key")
        elif obj.get("lines") != lineno - 1:
            self._break(lineno, f"the signature covers line {obj.get('lines')!r}, not the line "
                        "before it")
        elif self.head is None or not signature_holds(
            self.public_key, self.run_id, lineno - 1, self.head, obj.get("signature", "")
        ):
            self._break(lineno, "the signature of the chain head does not hold under the "
                        "header's public key (the lines before it were rewritten)")
        else:
            self.signed = (lineno - 1, self.head)

    def cut(self, lineno: int, raw: bytes, *, last: bool) -> None:
        """A line cut short by a crash: the last line, or one a resume marker follows."""
        if last:
            self.tail_cut = True
        else:
            self._cut = line_hash(raw)
        self.lines = lineno

    def result(self) -> Verification:
        """The verification of the lines added so far (see :class:`Verification`)."""
        if self.broken_line is not None:
            return with_signature(
                Verification(BROKEN, self.lines, self.run_id, self.head, self.broken_line,
                             self.reason), self.public_key, self.signed)
        if self.version < 2:
            return Verification(UNVERIFIED, self.lines, None, None, None,
                                f"a version {self.version} ledger, written without a hash chain")
        if self.ended and not self.tail_cut:
            if self.public_key is None:
                return Verification(UNSIGNED, self.lines, self.run_id, self.head, None,
                                    "closed, but written without a signing key: whether its "
                                    "tail was rewritten cannot be checked")
            if self.signed is not None and self.signed[0] == self.end_line:
                return with_signature(Verification(VERIFIED, self.lines, self.run_id, self.head),
                                      self.public_key, self.signed)
            why = "the end record is not signed: its signature line was cut or removed"
        elif self.tail_cut:
            why = "the last line is cut short (crash mid-write)"
        else:
            why = "no end record: the run is still writing, crashed, or its tail was removed"
        return with_signature(Verification(OPEN, self.lines, self.run_id, self.head, None, why),
                              self.public_key, self.signed)


def with_signature(
    verification: Verification, public_key: str | None, signed: tuple[int, str] | None
) -> Verification:
    """``verification`` with the run's public key and the (line, head) its last signature
    covers (``signed``; None if no signature holds)."""
    lines, head = signed if signed is not None else (None, None)
    return dataclasses.replace(verification, public_key=public_key, signed_lines=lines,
                               signed_head=head)

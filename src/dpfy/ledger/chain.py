"""The ledger file's hash chain: hashing lines, checking the chain, the verification result.

Every line after the header carries ``"prev"``: the SHA-256 (hex) of the previous line's exact
bytes (without its ``\\n``), so the chain commits to the content and order of every line before
the last one. ``Ledger.close()`` appends an end record chained like the rest, whose ``count``
is the number of lines before it: a closed file ends with it, and a file without it is still
open, crashed or was truncated. A line cut short by a crash is not chained (its tail is
missing); the resume marker written after it names its hash in ``"cut"`` and chains to the last
complete line. What the chain proves and what it does not: ``docs/ledger.md``.

This module imports neither torch nor the accountants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Any

VERIFIED = "verified"
OPEN = "verified, open or crash-cut"
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
      status: ``"verified"`` (chain intact, closed by its writer), ``"verified, open or
        crash-cut"`` (chain intact, no end record: still being written, crashed, or its tail
        was cut off), ``"broken"``, ``"unverified (no chain)"`` (a version 1 file) or ``"in
        memory (no file)"``.
      lines: lines checked (header and markers included).
      run_id: the header's run identifier (None for version 1 or in memory).
      head: SHA-256 of the last complete line: keep it elsewhere (a report, a checkpoint) to
        detect a rewrite of the whole chain.
      broken_line: first line (1-based) where the chain breaks, else None.
      reason: why it breaks, or what the status means.
    """

    status: str
    lines: int = 0
    run_id: str | None = None
    head: str | None = None
    broken_line: int | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        """The chain is intact (closed or not)."""
        return self.status in (VERIFIED, OPEN)

    def describe(self) -> str:
        """One line for a report."""
        if self.status == BROKEN:
            return f"BROKEN at line {self.broken_line}: {self.reason}"
        if self.status in (VERIFIED, OPEN):
            run = f"run {self.run_id[:8]}…, " if self.run_id else ""
            head = f"head {self.head[:12]}…" if self.head else ""
            text = f"{self.status} (hash chain over {self.lines} lines, {run}{head})"
            return text if self.status == VERIFIED else f"{text}: {self.reason}"
        return f"{self.status}: {self.reason}" if self.reason else self.status


class ChainChecker:
    """Checks a ledger file's chain line by line, as the file is parsed.

    ``strict``: raise :class:`LedgerIntegrityError` at the first break; otherwise remember it
    (forensics) and keep checking each line against its predecessor.
    """

    def __init__(self, source: str, *, strict: bool = True) -> None:
        self.source = source
        self.strict = strict
        self.version = 0
        self.run_id: str | None = None
        self.head: str | None = None  # hash of the last complete line
        self.lines = 0
        self.ended = False  # the last complete line is an end record
        self.tail_cut = False  # the last line is cut short
        self._cut: str | None = None  # hash of a cut line awaiting its resume marker
        self.broken_line: int | None = None
        self.reason = ""

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
            self.version = obj.get("version", 0)
            self.run_id = obj.get("run_id")
        elif self.version >= 2:
            self._check(lineno, obj, kind)
        self.head = line_hash(raw)
        self.lines = lineno
        self.ended = kind == "end"
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
        elif self.ended and kind != "resume":
            self._break(lineno, "a line after the end record that is not a resume marker")
        elif kind == "end" and obj.get("count") != lineno - 1:
            self._break(
                lineno, f"the end record counts {obj.get('count')!r} lines before it, the file "
                f"holds {lineno - 1}"
            )

    def cut(self, lineno: int, raw: bytes, *, last: bool) -> None:
        """A line cut short by a crash: the last line, or one a resume marker follows."""
        if last:
            self.tail_cut = True
        else:
            self._cut = line_hash(raw)
        self.lines = lineno

    def result(self) -> Verification:
        if self.broken_line is not None:
            return Verification(BROKEN, self.lines, self.run_id, self.head, self.broken_line,
                                self.reason)
        if self.version < 2:
            return Verification(UNVERIFIED, self.lines, None, None, None,
                                f"a version {self.version} ledger, written without a hash chain")
        if self.ended and not self.tail_cut:
            return Verification(VERIFIED, self.lines, self.run_id, self.head)
        why = "the last line is cut short (crash mid-write)" if self.tail_cut else (
            "no end record: the run is still writing, crashed, or its tail was removed"
        )
        return Verification(OPEN, self.lines, self.run_id, self.head, None, why)

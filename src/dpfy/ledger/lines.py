"""Reading ledger lines defensively: nesting limits and the recovery of a crash-cut last line.

A ledger is read line by line as untrusted input. :func:`check_nesting` refuses absurdly nested
JSON before the parser recurses into it; the ``recover_*`` helpers read back the
privacy-relevant fields of a sum-query line that a crash cut short, so the release it describes
is still counted (write-ahead: a crash may only over-count). See ``docs/ledger.md``.
"""

from __future__ import annotations

import json
import math
import re
from typing import BinaryIO

from dpfy.ledger.chain import LedgerFormatError, line_hash
from dpfy.ledger.records import ResumeRecord, SumQueryRecord, record_from_dict

#: Deepest JSON nesting a ledger line may have (records nest 3 deep; metadata a little more).
MAX_NESTING = 32
#: Longest ledger line, in bytes (16 MiB: a run's metadata or a correlated-noise plan is far
#: shorter). A longer line is refused as soon as it is seen, without reading the rest of it.
MAX_LINE_BYTES = 16 * 2**20


def read_capped(file: BinaryIO, source: str, cap: int = MAX_LINE_BYTES) -> bytes:
    """The bytes of an opened ledger file, read line by line; each line at most ``cap`` bytes.

    Memory stays within the file's well-formed lines plus one line of ``cap`` bytes: a file of
    one huge line (1 GiB of zeros in a sparse file) is refused after reading ``cap + 1`` bytes.

    Raises:
      LedgerFormatError: a line longer than ``cap`` bytes (its number is named).
    """
    lines: list[bytes] = []
    while True:
        line = file.readline(cap + 1)
        if not line:
            return b"".join(lines)
        body = line[:-1] if line.endswith(b"\n") else line
        if len(body) > cap:
            lineno = len(lines) + 1
            raise LedgerFormatError(
                f"ledger {source!r} line {lineno}: a line must be at most {cap} bytes, got a "
                f"longer one: not a dpfy ledger", lineno
            )
        lines.append(line)


def check_nesting(line: str | bytes) -> None:
    """Refuse a line nested deeper than :data:`MAX_NESTING` before the JSON parser recurses
    into it (a line of 100,000 brackets would otherwise raise ``RecursionError``)."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return
    depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        c = m.group(0)
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise ValueError(f"JSON nested deeper than {MAX_NESTING} levels")
        elif c in "]}":
            depth -= 1


def is_resume_after_truncation(line: bytes) -> bool:
    try:
        check_nesting(line)
        record = record_from_dict(json.loads(line))
    except (ValueError, TypeError, KeyError, RecursionError):
        return False
    return isinstance(record, ResumeRecord) and record.truncated_previous


_NUM = r"(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)[,}]"


def _float_field(line: str, name: str) -> float | None:
    m = re.search(rf'"{name}":{_NUM}', line)
    return float(m.group(1)) if m else None


def int_field(line: str, name: str) -> int | None:
    m = re.search(rf'"{name}":(-?[0-9]+)[,}}]', line)
    return int(m.group(1)) if m else None


def recover_sum_query(line: str) -> SumQueryRecord | None:
    if not line.startswith('{"type":"sum_query"'):
        return None
    sid = int_field(line, "sample_id")
    s = _float_field(line, "sensitivity")
    sigma = _float_field(line, "noise_std")
    if sid is None or s is None or sigma is None:
        return None
    if not (0.0 <= s < math.inf and 0.0 <= sigma < math.inf):
        return None
    return SumQueryRecord(sid, s, sigma, "truncated")


def ends_with(data: bytes, lines: int, head: str | None) -> bool:
    """Whether a ledger file's bytes are exactly ``lines`` whole lines, the last one hashing to
    ``head`` (the file is as its writer left it: nothing appended, nothing cut)."""
    parts = data.split(b"\n")
    return not parts[-1] and len(parts) - 1 == lines and line_hash(parts[-2]) == head

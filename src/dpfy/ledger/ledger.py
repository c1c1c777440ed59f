"""The privacy ledger: an append-only record of what a training run really did.

The training code never computes epsilon. It appends *facts* to a ledger (McMahan et al. 2018,
Sec. 6): which sampler drew each batch (:meth:`Ledger.record_sample`) and, for every noisy sum
released from that batch, the L2 sensitivity and the noise standard deviation actually used
(:meth:`Ledger.record_sum_query`). Afterwards :meth:`Ledger.to_event` turns the ledger into a
:mod:`dpfy.events` tree that any accountant can process, so a bug in hyperparameter logic cannot
make the reported epsilon too small, and a ledger can be re-accounted later with a tighter method:
``dpfy.accounting.epsilon(ledger, delta)`` accepts a ledger (it calls ``to_event()``); this
module never imports the accountants.

Storage is JSON lines: one record per line (``record.to_dict()``; read back by
:func:`record_from_dict`), the first line a header. Loading a file, resuming a checkpoint and
copying a prefix all replay records through one method, ``Ledger._replay``, which checks each
record against the ledger exactly as when it was first recorded. Write-ahead: a sum-query entry
is written, flushed and fsynced *before* :meth:`Ledger.record_sum_query` returns, i.e. before the
caller releases the noisy value it describes. A crash can therefore only leave an entry whose value
was never released (over-count), never a released value without an entry (under-count).

Grouping (McMahan et al. 2018, Sec. 3, Eq. 1): all sum queries of one sample, with
sensitivities S_j and noise stds s_j, are one Gaussian sum query with noise multiplier
``z = (sum_j S_j^2 / s_j^2)^(-1/2)``. A query with ``noise_std = 0`` and ``S > 0`` is
non-private, and a ledger containing a non-private entry has a ``NonPrivate`` sub-event in its
event, which every accountant reports as epsilon = infinity.

Units: sensitivities are the add/remove L2 sensitivity of the released sum in the units of the
sum (for one example's clipped gradient: the clip norm), noise stds are in the same units.

This module imports no torch.

Example:
    >>> from dpfy.ledger import Ledger
    >>> from dpfy.sampling import SampleSpec
    >>> ledger = Ledger()                      # in memory; Ledger("run.jsonl") writes a file
    >>> spec = SampleSpec("poisson", dataset_size=60_000, sampling_rate=0.01)
    >>> for step in range(3):
    ...     sid = ledger.record_sample(spec, step=step)
    ...     ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.1, name="grad")
    >>> ledger.to_event()
    SelfComposed(event=PoissonSampled(sampling_rate=0.01, event=Gaussian(noise_multiplier=1.1)), count=3)
"""  # noqa: E501

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from dpfy import events as ev
from dpfy._validate import check_count, check_finite_nonneg, check_range
from dpfy.ledger import chain, signing
from dpfy.ledger.chain import (
    IN_MEMORY,
    ChainChecker,
    LedgerFormatError,
    LedgerIntegrityError,
    Verification,
    line_hash,
    new_run_id,
    with_signature,
)
from dpfy.ledger.lines import (
    check_nesting,
    ends_with,
    int_field,
    is_resume_after_truncation,
    read_capped,
    recover_sum_query,
)
from dpfy.ledger.logfile import AppendFile
from dpfy.ledger.matrix import matrix_event
from dpfy.ledger.records import (
    FORMAT,
    VERSION,
    AnyRecord,
    EndRecord,
    HeaderRecord,
    MatrixRunRecord,
    MatrixStepRecord,
    MetadataRecord,
    NonPrivateRecord,
    Record,
    ResumeRecord,
    SampleRecord,
    SignatureRecord,
    SumQueryRecord,
    record_from_dict,
)
from dpfy.sampling.kinds import kind
from dpfy.sampling.spec import SampleSpec, spec_event

# Two noise multipliers closer than this (relative) are folded into one run, keeping the smaller.
_Z_RTOL = 1e-12


class LedgerTruncationWarning(UserWarning):
    """A ledger's last line was cut short by a crash; it was read back and counted."""


# --------------------------------------------------------------------------------------------
# Math
# --------------------------------------------------------------------------------------------


def effective_noise_multiplier(
    sensitivities: Sequence[float] | Iterable[float], noise_stds: Sequence[float] | Iterable[float]
) -> float:
    """Noise multiplier of several Gaussian sum queries on one sample, as one query.

    ``z = (sum_j S_j^2 / s_j^2)^(-1/2)`` (McMahan et al. 2018, Sec. 3, Eq. 1).

    Args:
      sensitivities: L2 sensitivities S_j >= 0 of the released sums.
      noise_stds: noise standard deviations s_j >= 0, same units.

    Returns:
      z in (0, inf]; ``inf`` if every S_j is 0 (nothing data-dependent released) and ``0.0`` if
      some query has ``s_j = 0 < S_j`` (non-private).
    """
    total = 0.0
    for s, sigma in zip(sensitivities, noise_stds, strict=True):
        check_range("sensitivity", s, 0.0, math.inf, high_open=True)
        check_range("noise_std", sigma, 0.0, math.inf, high_open=True)
        if s == 0.0:
            continue
        if sigma == 0.0:
            return 0.0
        total += (s / sigma) ** 2
    return math.inf if total == 0.0 else 1.0 / math.sqrt(total)


# --------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------


class Ledger:
    """Append-only privacy ledger, in memory or as a JSON-lines file.

    Args:
      path: file to write; ``None`` keeps the ledger in memory. An existing file is *resumed*:
        its entries are read (a truncated last line is kept and counted) and new entries are
        appended, so restarting a run never forgets what it already released.
      fsync: fsync after every sum-query / non-private entry (durable across an OS crash). With
        ``False`` entries are still flushed to the OS before the call returns (durable across a
        process crash).

    A file ledger holds an exclusive lock on its file until :meth:`close` (or until the
    process dies): a second writer is refused with :class:`LedgerLockedError`. :meth:`close`
    writes the end record that marks the file as complete; a ledger dropped without it reads
    as "intact, open or crash-cut". Every line is hash-chained to the one before it
    (``docs/ledger.md``). A failed write (e.g. a full disk) raises :class:`LedgerWriteError`,
    leaves the file loadable and makes the ledger refuse further appends.

    Thread-safe: one lock serialises appends.

    Raises:
      LedgerLockedError: another writer holds ``path``.
      LedgerIntegrityError: the existing file's hash chain is broken.
      LedgerFormatError: the existing file is malformed, or a version 1 file (no chain).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, fsync: bool = True
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.fsync = bool(fsync)
        self.truncated_lines = 0
        self.read_only = False
        self._ends_truncated = False
        self._entries: list[Record] = []
        self._samples: dict[int, SampleRecord] = {}
        self._ratio: dict[int, float] = {}  # sample -> sum_j S_j^2 / s_j^2 (McMahan Eq. 1)
        self._nonprivate: dict[int, str] = {}  # sample -> first reason it is not private
        self._matrix: dict[str, tuple[MatrixRunRecord, list[MatrixStepRecord]]] = {}
        self._event_cache: tuple[int, ev.Event] | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self._file: AppendFile | None = None
        self._run_id: str | None = None
        self._head: str | None = None  # SHA-256 of the last line written or read
        self._lines = 0  # lines in the file (header, markers and cut lines included)
        self._version = VERSION
        self._closed = False  # closed by close(), with its end record
        self._ended: str | None = None  # how the run ended, as the last end record says
        self._reopen_on_write = False  # close(reopen=True): the next append resumes
        self._verification: Verification | None = None  # set by load()
        self._cut_tail: str | None = None  # hash of a cut last line
        self._releases = 0  # sum queries, non-private releases and matrix steps
        self._public_key: str | None = None  # the run's Ed25519 key (signed files)
        self._key: Any = None  # its private half, while writing (dpfy.ledger.signing)
        self._signed: tuple[int, str] | None = None  # (line, head) of the last signature
        if self.path is not None:
            self._open_for_append(self.path)

    @classmethod
    def from_records(
        cls,
        records: Iterable[AnyRecord],
        path: str | os.PathLike[str] | None = None,
        *,
        fsync: bool = True,
    ) -> Ledger:
        """A ledger holding ``records`` in order, in memory or written to ``path``.

        Every record is checked exactly as when it was first recorded (see :meth:`replay`);
        header and resume markers are skipped. ``path`` names a new file (an existing one is
        resumed and the records appended, which refuses sample ids it already holds).
        """
        ledger = cls(path, fsync=fsync)
        ledger.replay(records)
        return ledger

    # -- writing ----------------------------------------------------------------------------
    def _open_for_append(self, path: str) -> None:
        file = AppendFile(path, fsync=self.fsync)  # locks the file before reading it
        data: bytes | None = None
        try:
            data = file.read()
            if not data:
                self._file = file
                self._run_id = new_run_id()
                self._key, self._public_key = signing.new_key(self._run_id, path)
                header = HeaderRecord(run_id=self._run_id, public_key=self._public_key)
                self._write(header.to_dict(), sync=True)
                return
            self._parse(data, source=path, strict=True)
            if self._version < VERSION:
                raise LedgerFormatError(
                    f"ledger {path!r} is a version {self._version} file, written without a "
                    f"hash chain; dpfy appends only to version {VERSION} ledgers. Load it "
                    "read-only with Ledger.load(path) and start a new ledger file"
                )
            if self._public_key is not None and self._run_id is not None:
                self._key = signing.load_key(self._run_id, path, self._public_key)
            self._file = file
            cut = self._cut_tail if self._ends_truncated and self.truncated_lines else None
            # Terminate a cut (or unterminated) last line in the same write as the marker, so
            # a failed write leaves the file as it was.
            marker = ResumeRecord(cut is not None, cut).to_dict()
            self._write(marker, sync=True, prefix=b"\n" if self._ends_truncated else b"")
        except BaseException:
            if data == b"" and file.size == 0 and os.path.isfile(path):  # nothing reached it
                if self._key is not None and self._run_id is not None:
                    signing.forget_key(self._run_id, path)
                with contextlib.suppress(OSError):
                    os.unlink(path)  # under the lock: no 0-byte file blocks the next try
            file.close()
            self._file = None
            raise

    def _write(self, obj: dict[str, Any], *, sync: bool, prefix: bytes = b"") -> None:
        # sync=False entries (samples, metadata) may stay queued: they release nothing, and
        # the next synced entry writes them first (one file, in order).
        if self._file is None:
            return
        if self._head is not None:  # every line after the header is chained
            obj = {**obj, "prev": self._head}
        line = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii")
        self._file.queue(prefix + line + b"\n")
        self._head = line_hash(line)
        self._lines += 1
        if sync:
            self._file.sync()

    def _sync(self) -> None:
        if self._file is not None:
            self._file.sync()

    def flush(self) -> None:
        """Write (and fsync) queued sample and metadata entries now."""
        with self._lock:
            self._sync()

    def _replay(self, record: AnyRecord, *, write: bool, sync: bool = False) -> None:
        """The one way a record enters the ledger: recording, loading, resuming and copying.

        Checks ``record`` against what the ledger holds (a sample id is new; a release names a
        recorded sample), writes it to the file when ``write`` (``sync``: flush and fsync
        before returning, the write-ahead rule), then indexes it. Header, resume and end
        markers describe the file, not the run: they are dropped. Callers hold the lock (or own the
        ledger alone, while it is being built).
        """
        if isinstance(record, HeaderRecord | ResumeRecord | EndRecord | SignatureRecord):
            return
        if write and self.read_only and self._reopen_on_write:
            self._reopen()
        if write and self.read_only:
            raise RuntimeError(
                "this ledger was loaded read-only; open it with Ledger(path) to append"
            )
        if isinstance(record, SampleRecord):
            if record.sample_id in self._samples:
                raise ValueError(
                    f"sample_id must be a new integer, got sample_id={record.sample_id!r}"
                )
        elif isinstance(record, SumQueryRecord | NonPrivateRecord | MatrixStepRecord):
            if record.sample_id is not None:
                self._check_sample(record.sample_id)
        if isinstance(record, MatrixRunRecord) and record.name in self._matrix:
            raise ValueError(f"matrix run {record.name!r} is already recorded")
        if isinstance(record, MatrixStepRecord) and record.name not in self._matrix:
            raise ValueError(f"matrix step of {record.name!r} before its matrix run record")
        if write and self._file is not None:  # in memory: no line to build
            self._write(record.to_dict(), sync=sync)
        self._add(record)

    def replay(self, records: Iterable[AnyRecord]) -> None:
        """Append existing records in order (a checkpoint's, or another ledger's).

        Each record is checked as in :meth:`record_sample` and friends (records validate their
        own fields; the ledger checks sample ids). A file-backed ledger writes them and makes
        them durable once, at the end: copying a record releases nothing new.

        Raises:
          ValueError: a record reuses a sample id or names a sample this ledger lacks.
        """
        with self._lock:
            try:
                for record in records:
                    self._replay(record, write=True)
            finally:
                self._sync()

    def _add(self, record: Record) -> None:
        self._entries.append(record)
        if isinstance(record, SumQueryRecord | NonPrivateRecord | MatrixStepRecord):
            self._releases += 1
        if isinstance(record, SumQueryRecord):
            sid, sens, std = record.sample_id, record.sensitivity, record.noise_std
            if sens == 0.0:
                pass  # nothing data-dependent released
            elif std == 0.0:
                self._nonprivate.setdefault(
                    sid, f"{record.name or 'sum query'}: released without noise"
                )
            else:
                self._ratio[sid] = self._ratio.get(sid, 0.0) + (sens / std) ** 2
        elif isinstance(record, SampleRecord):
            self._samples[record.sample_id] = record
            self._next_id = max(self._next_id, record.sample_id + 1)
        elif isinstance(record, NonPrivateRecord) and record.sample_id is not None:
            self._nonprivate.setdefault(record.sample_id, f"{record.name}: {record.reason}")
        elif isinstance(record, MatrixRunRecord):
            self._matrix[record.name] = (record, [])
        elif isinstance(record, MatrixStepRecord):
            self._matrix[record.name][1].append(record)

    def record_sample(self, spec: SampleSpec, *, epoch: int = 0, step: int | None = None) -> int:
        """Record that a batch was drawn with ``spec``; returns its ``sample_id``.

        Args:
          spec: the sampler facts.
          epoch: epoch index (>= 0); epoch-structured samplers are accounted per epoch, and
            every distinct epoch counts as a whole one.
          step: step index within the run or epoch (informative).
        """
        if not isinstance(spec, SampleSpec):
            raise ValueError(f"spec must be a dpfy.sampling.SampleSpec, got spec={spec!r}")
        check_count("epoch", epoch)
        if step is not None:
            check_count("step", step)
            step = int(step)
        with self._lock:
            sid = self._next_id
            self._replay(SampleRecord(sid, spec, int(epoch), step), write=True, sync=False)
            return sid

    def record_sum_query(
        self, sample_id: int, *, sensitivity: float, noise_std: float, name: str = ""
    ) -> None:
        """Record (write-ahead) a Gaussian sum released from sample ``sample_id``.

        Returns only after the entry is flushed (and fsynced unless ``fsync=False``): release the
        noisy value *after* this call.

        Args:
          sample_id: id returned by :meth:`record_sample`.
          sensitivity: add/remove L2 sensitivity of the released sum, in [0, inf).
          noise_std: std of the Gaussian noise actually added per coordinate, in [0, inf);
            0 with a positive sensitivity makes the ledger non-private.
          name: label (e.g. the parameter group), informative.
        """
        check_finite_nonneg("sensitivity", sensitivity)
        check_finite_nonneg("noise_std", noise_std)
        with self._lock:
            self._check_sample(sample_id)
            record = SumQueryRecord(int(sample_id), float(sensitivity), float(noise_std), str(name))
            self._replay(record, write=True, sync=True)

    def record_sum_queries(
        self, sample_id: int, queries: Sequence[tuple[float, float, str]]
    ) -> None:
        """Record several sum queries of one sample with a single fsync (write-ahead).

        Same as calling :meth:`record_sum_query` for each ``(sensitivity, noise_std, name)``,
        but all entries are validated first and made durable together before returning.
        """
        records = []
        for item in queries:
            sensitivity, noise_std, name = item
            check_finite_nonneg("sensitivity", sensitivity)
            check_finite_nonneg("noise_std", noise_std)
            records.append((float(sensitivity), float(noise_std), str(name)))
        with self._lock:
            self._check_sample(sample_id)
            for i, (sens, std, name) in enumerate(records):
                last = i == len(records) - 1
                record = SumQueryRecord(int(sample_id), sens, std, name)
                self._replay(record, write=True, sync=last)

    def record_non_private(self, sample_id: int | None, *, name: str, reason: str) -> None:
        """Record (write-ahead) a release without privacy: the ledger's epsilon becomes inf.

        Args:
          sample_id: the sample the release used, or None for a release of the whole dataset.
          name: what was released. reason: why it is not private (shown in reports).
        """
        with self._lock:
            if sample_id is not None:
                self._check_sample(sample_id)
                sample_id = int(sample_id)
            record = NonPrivateRecord(sample_id, str(name), str(reason))
            self._replay(record, write=True, sync=True)

    def record_matrix(self, record: MatrixRunRecord | MatrixStepRecord) -> None:
        """Record (write-ahead) a matrix-mechanism run or one of its steps (5.16): returns
        after the entry is durable; refuses a second run of one name or a step without one."""
        if not isinstance(record, MatrixRunRecord | MatrixStepRecord):
            raise ValueError(f"record must be a matrix run or step record, got {record!r}")
        with self._lock:
            self._replay(record, write=True, sync=True)

    def sample(self, sample_id: int) -> SampleRecord:
        """The sample record of ``sample_id`` (``ValueError`` for an unknown id)."""
        self._check_sample(sample_id)
        return self._samples[sample_id]

    def matrix_run(self, name: str) -> tuple[MatrixRunRecord, int] | None:
        """The matrix run record named ``name`` and its number of steps so far, or None."""
        found = self._matrix.get(name)
        return None if found is None else (found[0], len(found[1]))

    def record_metadata(self, **info: Any) -> None:
        """Record free-form, JSON-serialisable run facts (not privacy-relevant)."""
        try:
            json.dumps(info, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata must be JSON-serialisable, got {info!r}: {err}") from None
        with self._lock:
            self._replay(MetadataRecord(dict(info)), write=True, sync=False)

    def _check_sample(self, sample_id: Any) -> None:
        if isinstance(sample_id, bool) or not isinstance(sample_id, int) or (
            sample_id not in self._samples
        ):
            raise ValueError(
                f"sample_id must be an id returned by record_sample, got sample_id={sample_id!r}"
            )

    def sign(self) -> None:
        """Sign the chain head now (a signature record, fsynced): at a checkpoint, say.

        The signature covers every line so far; a later rewrite of them no longer verifies
        under the header's public key. In memory or for an unsigned file it only writes the
        queued lines (as :meth:`flush`).
        """
        with self._lock:
            self._sign(sync=True)
            self._sync()

    def _sign(self, *, sync: bool) -> None:
        if self._file is None or self._key is None or self._run_id is None:
            return
        lines, head = self._lines, self._head
        assert head is not None
        signature = signing.sign_head(self._key, self._run_id, lines, head)
        self._write(SignatureRecord(lines, signature).to_dict(), sync=sync)
        self._signed = (lines, head)

    def close(self, *, ended: str | None = None, reopen: bool = False,
              files: Mapping[str, str] | None = None) -> None:
        """Write the end record and its signature, fsync, close the file and release its lock;
        appends then raise, or with ``reopen=True`` (a close made by a training loop on the
        user's behalf) reopen the ledger first, writing a resume marker.

        ``ended``: how the run ended, in words, kept in the end record (``EndRecord.ended``).
        ``files``: SHA-256 of each file released beside the ledger (``EndRecord.files``).
        After a failed write nothing more is written (the file reads as open or crash-cut).
        """
        with self._lock:
            file = self._file
            try:
                if file is not None and file.failed is None:
                    end = EndRecord(self._lines, len(self._samples), self._releases, ended, files)
                    self._write(end.to_dict(), sync=False)
                    self._sign(sync=True)
                    self._closed = True
                elif self.path is None and not self.read_only:
                    self._closed = True  # in memory: nothing to write
                self._ended, self._reopen_on_write = ended, bool(reopen)
            finally:
                if file is not None:
                    file.close()
                self._file = None
                self.read_only = True

    def _reopen(self) -> None:
        """Append again after a close (the lock held): the file must end where this ledger left
        it (nobody appended since); a resume marker continues its chain."""
        self._reopen_on_write = False
        if self.path is not None:
            file = AppendFile(self.path, fsync=self.fsync)
            if not ends_with(file.read(), self._lines, self._head):
                file.close()
                raise LedgerIntegrityError(f"ledger {self.path!r} changed after it was closed; "
                                           "nothing more is appended to it")
            self._file = file
            self._write(ResumeRecord().to_dict(), sync=True)
        self.read_only, self._closed, self._ended = False, False, None

    closed = property(lambda self: self._closed, doc="close() ran (no append reopened it since)")
    ended = property(lambda self: self._ended, doc="How the run ended, as its end record says")

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, verify: bool = True, public_key: str | None = None
    ) -> Ledger:
        """Read a ledger file (read-only), checking its hash chain.

        A last line cut short by a crash is read back with a :class:`LedgerTruncationWarning` and
        counted in :attr:`truncated_lines`; if its privacy-relevant fields survived it is also
        accounted (over-count; by write-ahead its value was never released). Anything else
        malformed raises :class:`LedgerFormatError` naming the line. :attr:`verification`
        tells what the chain proves (``docs/ledger.md``).

        Args:
          path: the ledger file.
          verify: raise :class:`LedgerIntegrityError` at the first line where the hash chain
            breaks (default). ``False`` is for forensics only: the ledger loads and
            :attr:`verification` names the break, but its epsilon describes an edited file.
          public_key: the run's Ed25519 public key (64 hex digits) as you kept it (from the
            report or model card of the release): a header naming another key is a break at
            line 1. Without it the header's own key is trusted, which proves the file
            unchanged since it was signed but not who signed it.

        Raises:
          LedgerFormatError: an empty file, or a malformed line.
          LedgerIntegrityError: the hash chain is broken (``verify=True``).
        """
        if public_key is not None and not signing.is_hex(public_key, 64):
            raise ValueError("public_key must be the run's Ed25519 public key as 64 lowercase "
                             f"hex digits, got {public_key!r}")
        ledger = cls(None)
        ledger.path = source = os.fspath(path)
        with open(source, "rb") as f:
            data = read_capped(f, source)  # a huge line is refused before it is read
        ledger._verification = ledger._parse(data, source=source, strict=verify,
                                             expected_key=public_key)
        ledger.read_only = True
        return ledger

    @classmethod
    def verify(cls, path: str | os.PathLike[str]) -> Verification:
        """What the hash chain of the file at ``path`` says (a malformed line is "broken")."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerTruncationWarning)
            try:
                return cls.load(path, verify=False).verification
            except LedgerFormatError as err:
                return Verification("broken", broken_line=err.line, reason=str(err))

    def _parse(
        self, data: bytes, *, source: str, strict: bool, expected_key: str | None = None
    ) -> Verification:
        if not data:
            raise LedgerFormatError(f"ledger {source!r}: empty file: not a dpfy ledger")
        lines = data.split(b"\n")
        self._ends_truncated = lines[-1] != b""
        if not self._ends_truncated:
            lines.pop()
        checker = ChainChecker(source, strict=strict, expected_key=expected_key)
        n = len(lines)
        for i, raw in enumerate(lines):
            lineno = i + 1
            where = f"ledger {source!r} line {lineno}"
            try:
                check_nesting(raw)
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, RecursionError) as err:
                last = i == n - 1 and self._ends_truncated
                marked = i + 1 < n and is_resume_after_truncation(lines[i + 1])
                if i > 0 and (last or marked):
                    checker.cut(lineno, raw, last=last)
                    self._cut_tail = line_hash(raw)
                    self._recover_truncated(raw.decode("utf-8", "replace"), where)
                    continue
                text = raw[:80].decode("utf-8", "replace")
                raise LedgerFormatError(
                    f"{where}: not valid JSON ({err}): {text!r}", line=lineno
                ) from None
            if i == 0 and (obj.get("type") != HeaderRecord.kind or obj.get("format") != FORMAT):
                raise LedgerFormatError(
                    f"{where}: the first line must be a {FORMAT} header, got {obj!r}", line=1
                )
            checker.add(lineno, raw, obj)  # the chain first: an edit is named as such
            try:
                self._replay(record_from_dict(obj), write=False)
            except (ValueError, TypeError, KeyError) as err:
                raise LedgerFormatError(f"{where}: {err}", line=lineno) from None
            if obj.get("type") in (EndRecord.kind, ResumeRecord.kind):
                self._ended = obj.get("ended")  # a resume marker: the run went on
            if obj.get("type") == EndRecord.kind:
                self._check_end(obj, checker, lineno)
        self._run_id, self._head = checker.run_id, checker.head
        self._public_key, self._signed = checker.public_key, checker.signed
        self._lines, self._version = checker.lines, checker.version
        return checker.result()

    def _check_end(self, obj: dict[str, Any], checker: ChainChecker, lineno: int) -> None:
        """An end record's sample and release counts must be those of the lines before it."""
        for name, counted in (("samples", len(self._samples)), ("releases", self._releases)):
            if obj.get(name) is not None and obj[name] != counted:
                checker.refuse(lineno, f"the end record counts {obj[name]!r} {name}, the lines "
                               f"before it hold {counted} (lines were removed or added)")

    def _recover_truncated(self, line: str, where: str) -> None:
        self.truncated_lines += 1
        recovered = recover_sum_query(line)
        counted = "nothing to recover"
        if recovered is not None and recovered.sample_id in self._samples:
            self._replay(recovered, write=False)
            counted = f"recovered and counted {recovered}"
        elif line.startswith('{"type":"non_private"'):
            sid = int_field(line, "sample_id")
            sid = sid if sid in self._samples else None
            marker = NonPrivateRecord(sid, "truncated", "entry cut short by a crash")
            self._replay(marker, write=False)
            counted = "counted as a non-private release"
        warnings.warn(
            f"{where} was cut short (crash mid-write); {counted}. By write-ahead its value was "
            "never released, so the accounting can only over-count.",
            LedgerTruncationWarning,
            stacklevel=3,
        )

    # -- integrity --------------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        """The run identifier in the file's header (None in memory or for version 1 files)."""
        return self._run_id

    @property
    def head(self) -> str | None:
        """SHA-256 of the file's last line (written or read): the chain head."""
        return self._head

    @property
    def line_count(self) -> int:
        """Lines in the file so far (header, markers and cut lines included)."""
        return self._lines

    @property
    def verification(self) -> Verification:
        """What the hash chain says about this ledger's file (see :class:`Verification`).

        A loaded file: the result of checking it; a file being written: OPEN, then VERIFIED.
        """
        if self._verification is not None:
            return self._verification
        if self.path is None or self._run_id is None:
            return Verification(IN_MEMORY)
        if self._closed:
            status = chain.VERIFIED if self._key is not None else chain.UNSIGNED
            why = "" if self._key is not None else "closed, but written without a signing key"
            return with_signature(Verification(status, self._lines, self._run_id, self._head,
                                               None, why), self._public_key, self._signed)
        failed = self._file.failed if self._file is not None else None
        why = failed or ("open for appending" if self._file is not None else "closed without "
                         "its end record")
        return with_signature(Verification(chain.OPEN, self._lines,
                                           self._run_id, self._head, None, why),
                              self._public_key, self._signed)

    def chain_hash_at(self, line: int) -> str | None:
        """SHA-256 of line ``line`` (1-based) of the file as it is now; None if it is shorter.

        A checkpoint records ``(line_count, head)``; the file still holds that prefix iff this
        returns ``head`` for ``line_count`` (the chain makes each line commit to all before it).
        """
        check_range("line", line, 1, None, integer=True)
        if self.path is None:
            return None
        self.flush()
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        if line > len(lines) or (line == len(lines) and not lines[-1]):
            return None
        return line_hash(lines[line - 1])

    # -- views ------------------------------------------------------------------------------
    @property
    def entries(self) -> tuple[Record, ...]:
        """All records in order (header and resume markers excluded)."""
        return tuple(self._entries)

    @property
    def samples(self) -> tuple[SampleRecord, ...]:
        """Sample records in order."""
        return tuple(r for r in self._entries if isinstance(r, SampleRecord))

    @property
    def iteration(self) -> int:
        """Number of samples recorded (training steps so far)."""
        return len(self._samples)

    @property
    def metadata(self) -> dict[str, Any]:
        """All metadata merged in order (later keys win)."""
        out: dict[str, Any] = {}
        for r in self._entries:
            if isinstance(r, MetadataRecord):
                out.update(r.info)
        return out

    @property
    def unit(self) -> str | None:
        """The unit of privacy of the recorded samples (None if nothing was sampled)."""
        units = {r.spec.unit for r in self._samples.values()}
        if len(units) > 1:
            raise ValueError(f"a ledger must use one unit of privacy, got units={sorted(units)}")
        return units.pop() if units else None

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        where = "memory" if self.path is None else repr(self.path)
        return f"Ledger({where}, samples={self.iteration}, entries={len(self)})"

    def noise_multipliers(self) -> dict[int, float]:
        """Effective noise multiplier of every sample with a data-dependent release.

        ``0.0`` marks a non-private sample (a non-private entry, or zero noise with a positive
        sensitivity); samples that released nothing data-dependent are omitted.
        """
        out: dict[int, float] = {}
        for sid in self._samples:
            if sid in self._nonprivate:
                out[sid] = 0.0
            elif sid in self._ratio:
                out[sid] = 1.0 / math.sqrt(self._ratio[sid])
        return out

    def prefix(
        self, num_samples: int | None = None, *, path: str | os.PathLike[str] | None = None
    ) -> Ledger:
        """A copy holding the first ``num_samples`` samples (all: None), in memory or at ``path``.

        Keeps every record before the first sample beyond ``num_samples``: the kept samples,
        their releases and the metadata recorded so far (sample ids unchanged). The copy goes
        through :meth:`from_records`, so it is checked like any replayed ledger.
        """
        if num_samples is not None:
            check_count("num_samples", num_samples)
        return type(self).from_records(_prefix(tuple(self._entries), num_samples), path)

    # -- accounting -------------------------------------------------------------------------
    def to_event(self) -> ev.Event:
        """The privacy event this ledger describes (McMahan et al. 2018, Sec. 3 and 6).

        Mapping (per sample, z = effective noise multiplier of its sum queries):
          * poisson -> ``PoissonSampled(q, Gaussian(z))``; runs of equal (spec, z) folded into
            ``SelfComposed``; with ``max_batch_size`` -> ``TruncatedPoisson``.
          * fixed_size -> ``FixedSizeSampled(batch_size, dataset_size, Gaussian(z))`` (replace_one).
          * full_batch -> ``Gaussian(z)``.
          * balls_and_bins / shuffle / deterministic -> ``BallsAndBins`` / ``Shuffled`` /
            ``Deterministic`` with the smallest z of each epoch (``TruncatedBallsAndBins`` with
            ``max_batch_size``); a partial epoch counts as a
            whole one, and an epoch label holding more than ``steps_per_epoch`` samples counts
            as ceil(samples / steps_per_epoch) epochs (over-count, never under).
          * a non-private release anywhere -> a ``NonPrivate`` sub-event (epsilon = inf).
        Samples that released nothing data-dependent cost nothing. An empty ledger is
        ``Composed(())``.

        Raises:
          ValueError: mixed units of privacy.
        """
        cached = self._event_cache
        if cached is not None and cached[0] == len(self._entries):
            return cached[1]
        event = self._build_event()
        self._event_cache = (len(self._entries), event)
        return event

    def _build_event(self) -> ev.Event:
        _ = self.unit  # one unit of privacy per ledger
        zs = self.noise_multipliers()
        reasons = self._nonprivate
        # Runs in sample order: [key, z, count (+ samples of an epoch label)]; the key is
        # ("step" | "epoch", spec) or ("nonprivate", reason).
        units: list[list[Any]] = []
        epoch_units: dict[tuple[SampleSpec, int], list[Any]] = {}
        epochal: dict[str, bool] = {}
        for rec in self._samples.values():
            spec = rec.spec
            if spec.sampler not in epochal:
                epochal[spec.sampler] = kind(spec.sampler).epoch_structured
            z = zs.get(rec.sample_id)
            if epochal[spec.sampler]:
                unit = epoch_units.get((spec, rec.epoch))
                if unit is None:
                    unit = epoch_units[(spec, rec.epoch)] = [("epoch", spec), math.inf, 0, 0]
                    units.append(unit)
                unit[3] += 1  # samples in this epoch label
                if z is not None and z != 0.0:
                    unit[1] = min(unit[1], z)
            elif z is not None and z != 0.0:
                units.append([("step", spec), z, 1])
            if z == 0.0:
                units.append([("nonprivate", reasons[rec.sample_id]), 0.0, 1])
        runs = _fold_runs(_charge_epochs(units))
        builder = ev.EventBuilder()
        for (tag, payload), z, count in runs:
            if tag == "nonprivate":
                builder.add(ev.NonPrivate(reason=payload), count)
            else:
                builder.add(spec_event(payload, z, count))
        for r in self._entries:
            if isinstance(r, NonPrivateRecord) and r.sample_id is None:
                builder.add(ev.NonPrivate(reason=f"{r.name}: {r.reason}"))
        for run, steps in self._matrix.values():  # one Gaussian per correlated-noise run
            builder.add(matrix_event(run, steps, self._samples))
        return builder.build()


def _charge_epochs(units: list[list[Any]]) -> list[list[Any]]:
    """Epoch runs charge ceil(samples / steps_per_epoch) epochs; epochs without cost drop."""
    flat: list[list[Any]] = []
    for u in units:
        if u[0][0] != "epoch":
            flat.append(list(u))
            continue
        if u[1] == math.inf:
            continue
        per_epoch = u[0][1].steps_per_epoch
        epochs = -(-u[3] // per_epoch)
        if epochs > 1:
            warnings.warn(
                f"{u[3]} samples were recorded under one epoch label with "
                f"steps_per_epoch={per_epoch}; charging {epochs} epochs",
                stacklevel=3,
            )
        flat.append([u[0], u[1], epochs])
    return flat


def _fold_runs(units: list[list[Any]]) -> list[list[Any]]:
    """Fold consecutive runs of the same key and (nearly) the same z, keeping the smaller z."""
    runs: list[list[Any]] = []
    for u in units:
        prev = runs[-1] if runs else None
        if (
            prev is not None
            and prev[0] == u[0]
            and abs(prev[1] - u[1]) <= _Z_RTOL * max(prev[1], u[1])
        ):
            prev[1] = min(prev[1], u[1])
            prev[2] += u[2]
        else:
            runs.append(list(u))
    return runs


def _prefix(entries: Iterable[Record], num_samples: int | None) -> Iterator[Record]:
    kept: set[int] = set()
    for record in entries:
        if isinstance(record, SampleRecord):
            if num_samples is not None and len(kept) >= num_samples:
                return
            kept.add(record.sample_id)
        elif isinstance(record, SumQueryRecord | NonPrivateRecord | MatrixStepRecord):
            if record.sample_id is not None and record.sample_id not in kept:
                continue
        yield record

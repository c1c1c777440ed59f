"""The ledger's file on disk: one locked writer, whole-record appends, clean failures.

* One writer: the file is locked with ``fcntl.flock(LOCK_EX | LOCK_NB)`` while it is open for
  appending. A second writer (another process, or another ``Ledger`` on the same path in this
  process) is refused with :class:`LedgerLockedError`. The operating system releases the lock
  when the file is closed or the process dies. Readers (``Ledger.load``) take no lock.
* Whole records: lines are queued and written with ``os.write`` when the ledger syncs (one
  write per batch of lines), then fsynced.
* Clean failures: if a write or fsync fails (e.g. ``ENOSPC``), the file is truncated back to
  the length it had after the last successful sync, so it never holds a partial record
  followed by more data, and every later append is refused with :class:`LedgerWriteError`:
  the writer cannot know what reached the disk. Truncating never needs free space; if even
  that fails, the partial line is the file's last line, which a reader treats as cut short by
  a crash.

This module imports neither torch nor the accountants (``docs/ledger.md``).
"""

from __future__ import annotations

import errno
import os
import sys


class LedgerLockedError(RuntimeError):
    """Another writer holds the ledger file's lock."""


class LedgerWriteError(OSError):
    """A write to the ledger file failed; the ledger refuses further appends."""


def write_fully(fd: int, data: bytes) -> None:
    """``os.write`` until every byte of ``data`` is written (raises ``OSError`` on failure)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "os.write wrote nothing")
        view = view[n:]


class AppendFile:
    """A ledger file opened for appending under an exclusive lock (see the module docstring).

    Args:
      path: the file (created if missing).
      fsync: fsync after every sync (durable across an OS crash), else only written to the OS.
    """

    def __init__(self, path: str, *, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self.failed: str | None = None
        self._pending: list[bytes] = []
        self._fd: int | None = None  # set first: __del__ runs even if the open below fails
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _lock(self._fd, path)
            self.size = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def read(self) -> bytes:
        """The file's bytes (read under the lock, before anything is appended; a line longer
        than ``dpfy.ledger.lines.MAX_LINE_BYTES`` is refused before it is read)."""
        from dpfy.ledger.lines import read_capped

        with open(self.path, "rb") as f:
            return read_capped(f, self.path)

    def queue(self, data: bytes) -> None:
        """Queue bytes (whole lines) for the next :meth:`sync`."""
        self._check_usable()
        self._pending.append(data)

    def sync(self) -> None:
        """Write the queued lines in one write, then fsync; on failure truncate and refuse."""
        self._check_usable()
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        assert self._fd is not None
        try:
            write_fully(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as err:
            self._fail(err)
        self.size += len(data)

    def _fail(self, err: OSError) -> None:
        assert self._fd is not None
        kept = "the file was cut back to its last complete record"
        try:
            os.ftruncate(self._fd, self.size)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as again:
            kept = f"cutting it back failed too ({again.strerror}); its last line may be partial"
        self.failed = (
            f"writing ledger {self.path!r} failed ({err.strerror or err}); {kept}. The ledger "
            "refuses further appends: it cannot know what reached the disk"
        )
        raise LedgerWriteError(err.errno, self.failed) from err

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise LedgerWriteError(errno.EIO, self.failed)
        if self._fd is None:
            raise RuntimeError(f"ledger file {self.path!r} is closed")

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Close the file (releasing the lock); queued lines that were not synced are lost."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._pending.clear()
            os.close(fd)

    def __del__(self) -> None:
        # A ledger dropped without close() keeps its queued lines and releases the lock (it
        # writes no end record: the file reads as open or crash-cut).
        try:
            if self._fd is not None and self.failed is None:
                self.sync()
        except OSError:
            pass
        finally:
            self.close()


if sys.platform != "win32":
    import fcntl

    def _lock(fd: int, path: str) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LedgerLockedError(
                f"ledger {path!r} is locked: another process (or another open Ledger in this "
                "process) holds it for appending. One ledger file has one writer; close the "
                "other writer, or load the file read-only with Ledger.load"
            ) from None

else:  # pragma: no cover - no advisory locks on Windows

    def _lock(fd: int, path: str) -> None:
        return None

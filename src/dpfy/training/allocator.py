"""The host allocator during training on the CPU: freed memory kept mapped (glibc).

A DP step with book-keeping clipping holds every layer's inputs and output gradients until
all per-example norms are known, frees them while it forms the clipped sums, and allocates
and frees a model-sized accumulator once a step. glibc's ``malloc`` hands a block of 32 MB
or more back to the system as soon as it is freed, and the top of its heap once more than
its trim threshold lies free, so the next step touches the same amount of memory afresh:
every 4 KiB page is a page fault and a zeroing. On MiniLM full fine-tuning (22.7M
parameters, batch 32 x 64 tokens, one thread) that was 44k-122k faults a step, about 9 % of
the DP step's CPU time (``docs/devices.md``, "On the CPU").

:func:`keep_freed_memory` raises glibc's mmap threshold to :data:`MMAP_THRESHOLD` and its trim
threshold to :data:`TRIM_THRESHOLD`, so that freed memory stays mapped for the next step; the
process's peak memory is unchanged (its resident memory between steps stays at that peak).
On leaving the block the thresholds become :data:`AFTER` (what glibc's own adaptive
thresholds reach once a program has freed large blocks; mallopt cannot hand the adaptation
back) and the free memory is returned to the system once (``malloc_trim``). Elsewhere (macOS,
Windows, musl) it does nothing. Blocks may nest (a run inside a user's block): the outermost
sets and restores. Nothing here changes a computed value.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Bytes: no block below this is given its own mapping (and handed back when freed).
MMAP_THRESHOLD = 2**30
#: Bytes: the heap's free top is returned to the system only beyond this (mallopt takes a C
#: int, so this is its largest value).
TRIM_THRESHOLD = 2**31 - 1
#: (mmap, trim) thresholds in bytes after the block: glibc's adaptive maxima on 64-bit
#: systems (``DEFAULT_MMAP_THRESHOLD_MAX`` = 32 MiB, trim twice the mmap threshold).
AFTER = (32 * 2**20, 64 * 2**20)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_LOCK = threading.Lock()
_depth = 0  # open blocks in this process; only the outermost sets and restores


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on (whose ``malloc`` it uses) if it is glibc on
    Linux, else None. Looked up once: the symbols of the running process, no search."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):  # musl and others have no gnu_get_libc_version
        return None
    return libc


def _set(libc: ctypes.CDLL, mmap_threshold: int, trim_threshold: int) -> bool:
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold)) == 1
    )


@contextmanager
def keep_freed_memory() -> Iterator[bool]:
    """Within the block, freed host memory stays mapped for reuse (glibc only).

    Yields whether the thresholds were set (False where the C library is not glibc). The
    setting is the process's: it applies to every thread and library in it, as
    ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` in the environment would.

    Example::

        with dpfy.training.keep_freed_memory():
            trainer.fit()
    """
    global _depth
    libc = _glibc()
    with _LOCK:
        applied = libc is not None and (_depth > 0 or _set(libc, MMAP_THRESHOLD, TRIM_THRESHOLD))
        _depth += applied
    try:
        yield applied
    finally:
        with _LOCK:
            _depth -= applied
            if libc is not None and applied and _depth == 0:
                _set(libc, *AFTER)
                libc.malloc_trim(ctypes.c_size_t(0))

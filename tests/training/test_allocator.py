"""keep_freed_memory: freed host memory stays mapped inside the block (glibc); the thresholds
are set by the outermost block and lowered again when it ends."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from dpfy.training import allocator, keep_freed_memory

GLIBC = allocator._glibc() is not None
BLOCK = 16 * 2**20  # float32 values: 64 MiB, above glibc's 32 MiB mmap ceiling


_CYCLES = """
import json, resource, torch
from dpfy.training import keep_freed_memory

def cycles(n):
    out = []
    for _ in range(n):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(16 * 2**20)  # BLOCK
        t.fill_(1.0)
        del t
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return out

with keep_freed_memory() as applied:
    inside = cycles(9)
print(json.dumps({"applied": applied, "inside": inside}))
"""


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_freed_memory_is_reused_inside_the_block() -> None:
    # a fresh process: the heap a long test session leaves behind places blocks its own way
    out = subprocess.run([sys.executable, "-c", _CYCLES], capture_output=True, text=True,
                         check=True, timeout=120)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    pages = BLOCK * 4 // 4096  # 16,384 pages a fresh 64 MiB tensor faults in
    assert res["applied"]
    # glibc may place the first blocks anew (two fresh mappings at most, seen), then reuses
    # one: most rounds fault in no fresh page (with glibc's defaults every round faults them)
    assert sorted(res["inside"])[4] < pages // 10, res["inside"]


class _FakeLibc:
    """Records the allocator calls :func:`keep_freed_memory` makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def mallopt(self, param: int, value: ctypes.c_int) -> int:
        self.calls.append(("mallopt", param, value.value))
        return 1

    def malloc_trim(self, pad: ctypes.c_size_t) -> int:
        self.calls.append(("malloc_trim", 0, pad.value))
        return 1


def test_the_thresholds_are_raised_then_lowered_and_memory_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    with keep_freed_memory() as applied:
        assert applied
        assert libc.calls == [("mallopt", -3, allocator.MMAP_THRESHOLD),
                              ("mallopt", -1, allocator.TRIM_THRESHOLD)]
    mmap_after, trim_after = allocator.AFTER
    assert libc.calls[2:] == [("mallopt", -3, mmap_after), ("mallopt", -1, trim_after),
                              ("malloc_trim", 0, 0)]


def test_nested_blocks_set_and_restore_once(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    with keep_freed_memory() as outer:
        with keep_freed_memory() as inner:  # e.g. dpfy.runs.train_and_report in a user's block
            assert outer and inner
        assert len(libc.calls) == 2  # the inner block's end restored nothing
    assert [c[0] for c in libc.calls] == ["mallopt"] * 4 + ["malloc_trim"]
    assert allocator._depth == 0


def test_elsewhere_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    with keep_freed_memory() as applied:
        assert applied is False

"""Start a data-parallel run on this machine: N processes joined by a gloo/nccl process group.

:func:`run_local` is what ``dpfy train --workers N`` uses: the calling process becomes rank 0
(it keeps its ledger, report and return value) and ``N - 1`` helper processes are started
(``torch.multiprocessing``), joining the TCP store that this process opened on a localhost
port the OS chose. Every rank runs
``fn(distributed, *args)`` with its :class:`dpfy.training.distributed.Distributed`.

:func:`spawn_workers` starts every rank as a child instead and reports how each one ended (for
tests that kill a rank); the calling process hosts the store, as torchrun's agent does. Under
``torchrun`` use :func:`dpfy.training.distributed.from_env`.

Helpers start fresh, as with the ``spawn`` start method: ``fn`` and ``args`` travel pickled
and nothing of the caller's memory is shared. Where the platform has it (Linux, macOS) they are
forked from a ``forkserver`` process that imported torch and dpfy once, when this process
first launched ranks, and has run nothing since; each helper then takes a copy of the
launching process's environment variables, so it sees what a spawned one would. Importing
torch and dpfy costs seconds of CPU per process, which every helper after the first saves.
Elsewhere (Windows) the start method is ``spawn``.

Failures are reported, never hidden: a helper that raises sends its error to the parent, which
raises :class:`~dpfy.training.distributed.DistributedError` naming the rank and the error. When
rank 0 fails the helpers are stopped at once (they would otherwise wait out the collective
timeout).

A run that succeeds ends in one order on every rank: a barrier (every rank has finished
``fn``), then each helper leaves the process group and tells rank 0 through a semaphore, and
only then does rank 0 destroy its group, which hosts the TCP store the helpers talked to; the
parent finally joins the helper processes. Without that order a helper still tearing down
its gloo connections could find the store gone and end in a C++ ``terminate`` (exit -6),
sometimes, under load.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import (
    TCPStore,  # torch.distributed uses it, without re-exporting it
)

from dpfy._validate import check_int, check_range
from dpfy.training.distributed import (
    DEFAULT_TIMEOUT,
    START_TIMEOUT,
    Distributed,
    DistributedError,
    init_process_group,
)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerExit:
    """How one spawned rank ended: its exit code (``None`` if it had to be stopped) and the
    error it raised (``"TypeName: message"``), or ``None``."""

    rank: int
    exitcode: int | None
    error: str | None


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    backend: str | None,
    args: tuple[Any, ...],
    errors: Any,
    closed: Any,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None and dict(os.environ) != environ:  # forkserver: the caller's variables
        os.environ.clear()
        os.environ.update(environ)
    try:
        d = init_process_group(rank, world_size, master_port=port, backend=backend, timeout=timeout)
        try:
            fn(d, *args)
        except BaseException:
            _shutdown(closed)  # no barrier: the other ranks may never reach it
            raise
        _close(d, closed)
    except BaseException as e:  # reported to the parent, then a non-zero exit
        errors.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None


def _close(d: Distributed, closed: Any) -> None:
    """End a rank's part in the group in one order on every rank (see the module docstring):
    a barrier (every rank has finished ``fn``), then the helper ranks leave the group and
    say so, and only then rank 0, which hosts the TCP store, destroys its own. Tearing the
    store down while a helper still talks to it ends that helper with a C++ ``terminate``."""
    dist.barrier(group=d.group)
    if d.rank == 0:
        for _ in range(d.world_size - 1):  # each helper says it has left
            if not closed.acquire(timeout=d.timeout):
                break  # a helper hung while leaving: its exit code will tell
        _shutdown(None)
    else:
        _shutdown(closed)


def _shutdown(closed: Any) -> None:
    """Leave the process group (if joined); then tell rank 0 through ``closed``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if closed is not None:
        closed.release()


def _listening_store(world_size: int, timeout: float) -> TCPStore:
    """The run's TCP store, listening on a port the OS chose, opened before any rank learns
    the port: a port merely found free (bound and closed again) could be taken by another process
    before rank 0 listens on it (EADDRINUSE, seen with test runs in parallel)."""
    return TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout + START_TIMEOUT),
    )


def _check(world_size: int, timeout: float) -> None:
    check_int("world_size", world_size, 1, 1024)
    check_range("timeout", timeout, 0.0, 86400.0, low_open=True)


def _context() -> Any:
    """``forkserver`` with torch and dpfy imported in the server (see the module docstring),
    or ``spawn`` where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: torch imports it (and sympy) when the first optimizer is built, seconds
    # of CPU that each helper would otherwise spend after joining, under the short timeout
    ctx.set_forkserver_preload([__name__, "torch._dynamo"])  # no effect once the server runs
    return ctx


def _start(
    fn: Callable[..., Any],
    ranks: range,
    world_size: int,
    port: int,
    timeout: float,
    backend: str | None,
    args: tuple[Any, ...],
    extra_env: dict[str, str] | None = None,
) -> tuple[list[Any], Any, Any]:
    ctx = _context()
    errors = ctx.Queue()
    closed = ctx.Semaphore(0)  # released once by each helper rank that has left the group
    environ = {**os.environ, **(extra_env or {})}
    procs = []
    for rank in ranks:
        p = ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, timeout, backend, args, errors, closed, environ),
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs, errors, closed


def _drain(errors: Any) -> dict[int, str]:
    found: dict[int, str] = {}
    while True:
        try:
            rank, message, _ = errors.get(timeout=0.2)
        except (queue.Empty, EOFError, OSError):
            return found
        found[int(rank)] = message


def _stop(procs: list[Any], wait: float) -> None:
    deadline = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5.0)


def _states(procs: list[Any]) -> str:
    """How each helper rank stood when rank 0 gave up waiting for it to join."""
    return "; ".join(
        f"rank {rank}: " + ("still running (not joined)" if p.exitcode is None
                            else f"exit code {p.exitcode} before joining")
        for rank, p in enumerate(procs, start=1)
    )


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str | None = None,
    rank0_args: tuple[Any, ...] | None = None,
) -> Any:
    """Run ``fn(distributed, *args)`` on ``world_size`` local ranks; this process is rank 0.

    ``fn`` and ``args`` must be picklable (a module-level function); ``rank0_args``, if given,
    replace ``args`` on rank 0 (which runs here, so they need not be picklable: callbacks, an
    output directory only rank 0 writes). Returns rank 0's result.

    Raises:
      ValueError: bad arguments (nothing is started).
      DistributedError: a helper rank raised or died (its error is named), or a collective
        failed.
    """
    _check(world_size, timeout)
    store = _listening_store(world_size, timeout)
    port = store.port
    procs, errors, closed = _start(
        fn, range(1, world_size), world_size, port, timeout, backend, args
    )
    try:
        d: Distributed = init_process_group(
            0, world_size, master_port=port, backend=backend, timeout=timeout, store=store
        )
        result = fn(d, *(args if rank0_args is None else rank0_args))
        _close(d, closed)
    except BaseException as e:
        found, states = _drain(errors), _states(procs)
        _stop(procs, 1.0)  # rank 0 failed: the helpers are of no use any more
        _shutdown(None)  # after the helpers: the store they talk to lives here
        found.update(_drain(errors))
        if found:
            lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(found.items()))
            raise DistributedError(f"the distributed run failed: {lines}") from e
        if not dist.is_initialized() and isinstance(e, RuntimeError):  # the join failed
            raise DistributedError(f"the ranks could not join: {states}") from e
        raise
    _stop(procs, timeout + START_TIMEOUT)
    found = _drain(errors)
    failed = {
        p_rank: p.exitcode
        for p_rank, p in zip(range(1, world_size), procs, strict=True)
        if p.exitcode != 0
    }
    if found or failed:
        lines = "; ".join(
            f"rank {r}: {found.get(r, f'exit code {code}')}"
            for r, code in sorted({**failed, **dict.fromkeys(found, 1)}.items())
        )
        raise DistributedError(f"the distributed run failed: {lines}")
    return result


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str | None = None,
    wait: float | None = None,
) -> list[WorkerExit]:
    """Run ``fn(distributed, *args)`` on ``world_size`` spawned ranks; how each one ended.

    ``wait``: seconds to wait for all ranks (default ``timeout`` + start-up grace); a rank
    still running then is stopped and reported with exit code ``None``.
    """
    _check(world_size, timeout)
    # this process hosts the store and every rank joins it as a client, as under torchrun's
    # agent (torch's tcp:// rendezvous reads TORCHELASTIC_USE_AGENT_STORE for that)
    store = _listening_store(world_size, timeout)
    procs, errors, _ = _start(
        fn, range(world_size), world_size, store.port, timeout, backend, args,
        extra_env={"TORCHELASTIC_USE_AGENT_STORE": "True"},
    )
    deadline = time.monotonic() + (timeout + START_TIMEOUT if wait is None else float(wait))
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p.is_alive() for p in procs]
    _stop(procs, 0.0)
    found = _drain(errors)
    return [
        WorkerExit(rank, None if alive[rank] else p.exitcode, found.get(rank))
        for rank, p in enumerate(procs)
    ]

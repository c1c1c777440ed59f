"""Data-parallel DP-SGD over ``torch.distributed``: one logical step, several processes.

One process of the run is a :class:`Distributed` (rank, world size, collective timeout). A
logical DP-SGD step (Abadi et al. 2016) runs as follows (docs/architecture.md, "Distributed
training"):

1. **One global sample.** Rank 0 alone draws the logical batch from the run's sampler (its
   :class:`dpfy.randomness.Randomness`, secure by default) and broadcasts the indices
   (:class:`SharedSampler`); every rank sees the same batch, so the sample is the one the
   ledger's ``SampleSpec`` describes, whatever the number of processes.
2. **A deterministic split.** The global batch is cut into physical chunks of ``P`` rows
   exactly as one process would; rank r takes rows ``[r P/W, (r+1) P/W)`` of every chunk
   (:class:`ShardBatcher`). Every rank runs the same number of forward passes (padding chunks
   where its share ran out), so no collective waits on a rank that has nothing to do and the
   work per step does not depend on the realised batch size beyond what one process shows.
3. **Clip locally, sum globally.** Each rank clips its own examples and accumulates their
   clipped sum; :meth:`Distributed.sum_` all-reduces the sums (SUM) when the step is released.
   Clipping is per example, so the reduced sum is exactly the clipped sum of the global batch.
4. **Noise once, on rank 0.** Rank 0 runs the query's release: it writes the ledger entry
   (write-ahead), draws the noise from its one noise stream with exactly the recorded std and
   adds it; :meth:`Distributed.share_` then broadcasts the noisy sum to the other ranks, which
   write it to ``p.grad``. Drawing on one rank (rather than a share with std / sqrt(W) on each)
   keeps one :class:`~dpfy.randomness.Randomness` stream and a ledger std that is exactly the
   std of the noise that was added, also if a rank's share were lost or its generator faulty.
   Since the other ranks receive the gradient only after rank 0 wrote the ledger, no rank can
   apply a step the ledger does not show (a crash over-counts, never under-counts).
5. **Identical updates.** Every rank applies the same noisy gradient with the same optimizer
   from the same initial weights (:meth:`Distributed.sync_module_`, rank 0's), so the replicas
   stay equal without a further collective.

The other ranks keep an in-memory *mirror* of the ledger (the same sample and release records,
no file), so the budget guard and the monitoring figures reach the same decisions on every rank
without extra communication; only rank 0 writes a ledger file.

``DistributedDataParallel``: its gradient all-reduce is tied to ``AccumulateGrad``, which the
per-example pass never triggers (it takes gradients with respect to module outputs only), and
its forward would prepare a reduction that never comes. The per-example pass therefore runs on
the wrapped ``.module`` (:func:`unwrap`): DDP contributes its initial weight broadcast, dpfy
the reduction of *clipped* sums. Nothing is counted twice and nothing bypasses clipping.

Failures: every collective runs under the timeout given to :func:`init_process_group`
(seconds, not the 30-minute default of ``torch.distributed``); a rank that dies or hangs makes
the others stop with :class:`DistributedError`, naming the collective and the step.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore  # not re-exported by torch.distributed

from dpfy._validate import check_int, check_range
from dpfy.training.torchrun import REQUIRED, torchrun_env

if TYPE_CHECKING:
    from dpfy import events as ev
    from dpfy.ledger import Ledger
    from dpfy.queries import Query
    from dpfy.sampling import Sampler, SampleSpec
    from dpfy.training.data import Batcher, PhysicalBatch


#: Default collective timeout in seconds: long enough for rank 0's end-of-epoch evaluation
#: while the others wait for the next batch, short enough that a dead rank is noticed at once.
DEFAULT_TIMEOUT = 60.0

#: Seconds every rank may take to start (import torch and dpfy) and join the group.
START_TIMEOUT = 120.0


class GradientReducer(Protocol):
    """The seam :class:`dpfy.training.PrivateGradient` calls when several processes share a
    logical step (implemented by :class:`Distributed`).

    ``sum_`` all-reduces (SUM) the clipped sums in place; exactly one process ``releases``
    (writes the ledger, draws the noise) and ``share_`` broadcasts its noisy sum in place to
    the others.
    """

    @property
    def releases(self) -> bool: ...

    @property
    def rank(self) -> int: ...

    def sum_(self, tensors: list[torch.Tensor]) -> None: ...

    def share_(self, tensors: list[torch.Tensor]) -> None: ...

    def sum_numbers(self, values: list[float]) -> list[float]: ...


class DistributedError(RuntimeError):
    """A collective of a distributed run failed: another rank died, hung or stopped."""


@dataclasses.dataclass(frozen=True)
class Distributed:
    """This process's place in a data-parallel DP-SGD run (see the module docstring).

    Build it with :func:`init_process_group` (explicit rank and port) or :func:`from_env`
    (under ``torchrun``). It is the ``reducer`` of :class:`dpfy.training.PrivateGradient`
    and the ``distributed`` argument of :class:`dpfy.training.PrivateTrainer`.

    Attributes:
      rank: this process, in [0, world_size); rank 0 samples, writes the ledger, draws noise.
      world_size: number of processes, >= 1.
      timeout: collective timeout in seconds.
      device: where collective buffers of indices live (``cpu`` for gloo, a GPU for nccl).
      group: the process group of the collectives (``None``: the default group); built with
        the collective ``timeout`` while the default group keeps the longer start-up one.
    """

    rank: int
    world_size: int
    timeout: float
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    group: Any = None

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        check_range("rank", self.rank, 0, self.world_size - 1, integer=True)
        check_range("timeout", self.timeout, 0.0, 86400.0, low_open=True)

    @property
    def releases(self) -> bool:
        """Whether this process releases: draws the sample and the noise, writes the ledger."""
        return self.rank == 0

    # -- collectives -----------------------------------------------------------------------
    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """All-reduce (SUM) the clipped sums in place: every rank then holds the global sum."""
        self._run(
            "all-reduce of the clipped sums",
            lambda: [dist.all_reduce(t, group=self.group) for t in tensors],
        )

    def share_(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast rank 0's noisy sum into ``tensors`` on every other rank (in place)."""
        self._run(
            "broadcast of the noisy gradient",
            lambda: [dist.broadcast(t, 0, group=self.group) for t in tensors],
        )

    def reduce_scatter_(self, out: torch.Tensor, stacked: torch.Tensor) -> None:
        """Reduce (SUM) ``stacked`` (W equal blocks, flat) over all ranks; block r lands in
        ``out`` on rank r (the sharded release, :mod:`dpfy.training.sharded`)."""
        self._run(
            "reduce-scatter of the clipped sums",
            lambda: dist.reduce_scatter_single(out, stacked, group=self.group),
        )

    def mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` of this run's ranks over its process group (with its timeout),
        for ``fully_shard(module, mesh=distributed.mesh())``."""
        from torch.distributed.device_mesh import DeviceMesh

        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None  # a process group exists once this process joined
        return DeviceMesh.from_group(group, self.device.type)

    def sum_numbers(self, values: list[float]) -> list[float]:
        """The sums over all ranks of a few monitoring numbers (losses, counts; float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._run("all-reduce of the step statistics", lambda: dist.all_reduce(t, group=self.group))
        return [float(v) for v in t.tolist()]

    def broadcast_indices(self, indices: np.ndarray | None) -> np.ndarray | None:
        """Rank 0's logical batch (``None``: the epoch ended) on every rank."""
        head = torch.full((1,), -1 if indices is None else len(indices), dtype=torch.int64)
        head = head.to(self.device)
        self._run(
            "broadcast of the sampled batch", lambda: dist.broadcast(head, 0, group=self.group)
        )
        n = int(head.item())
        if n < 0:
            return None
        if self.releases:
            assert indices is not None
            buf = torch.as_tensor(np.asarray(indices, dtype=np.int64)).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.int64, device=self.device)
        if n:
            self._run(
                "broadcast of the sampled batch", lambda: dist.broadcast(buf, 0, group=self.group)
            )
        return buf.cpu().numpy()

    @torch.no_grad()
    def sync_module_(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into every rank's ``module`` (in place).

        An FSDP2 shard (``DTensor``) gets its rows of rank 0's full parameter: the full
        tensor is gathered, broadcast and this rank's shard copied back, one at a time.
        """
        from torch.distributed.tensor import DTensor

        def sync() -> None:
            for t in [p.data for p in module.parameters()] + list(module.buffers()):
                if isinstance(t, DTensor):
                    full = t.full_tensor()
                    dist.broadcast(full, 0, group=self.group)
                    t.to_local().copy_(
                        DTensor.from_local(full, t.device_mesh, run_check=False)
                        .redistribute(t.device_mesh, t.placements)
                        .to_local()
                    )
                else:
                    dist.broadcast(t, 0, group=self.group)

        self._run("broadcast of the initial weights", sync)

    def check_in_sync(self, module: nn.Module) -> None:
        """Raise :class:`DistributedError` unless every rank's weights have rank 0's checksum.

        The checksum (sum and sum of squares, float64) must match exactly; one broadcast, for
        tests and debugging (the step keeps replicas equal).
        """
        with torch.no_grad():
            flat = torch.cat([_full(p).reshape(-1).double() for p in module.parameters()])
            mine = torch.stack([flat.sum(), (flat * flat).sum()]).to(self.device)
            ref = mine.clone()
        self._run(
            "broadcast of a weight checksum", lambda: dist.broadcast(ref, 0, group=self.group)
        )
        if not torch.equal(mine, ref):
            raise DistributedError(
                f"rank {self.rank}: the model's weights differ from rank 0's "
                f"(checksum {mine.tolist()} vs {ref.tolist()})"
            )

    def barrier(self) -> None:
        """Wait for every rank (under the timeout)."""
        self._run("barrier", lambda: dist.barrier(group=self.group))

    def _run(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except RuntimeError as e:  # gloo/nccl errors (DistBackendError is a RuntimeError)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: the {what} failed ({first}): another "
                f"process died, stopped or did not arrive within timeout={self.timeout:g} s. "
                "This process stops; the step was not applied here, and the ledger (rank 0's) "
                "records every release any rank applied"
            ) from e


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: a sharded one (FSDP2 ``DTensor``) gathered from every rank."""
    full = getattr(p.detach(), "full_tensor", None)
    return full() if full is not None else p.detach()


def init_process_group(
    rank: int,
    world_size: int,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    device: torch.device | str | None = None,
    start_timeout: float = START_TIMEOUT,
    store: TCPStore | None = None,
) -> Distributed:
    """Join (or start, as rank 0) a process group over TCP; returns this process's context.

    Joining waits up to ``start_timeout`` seconds for every rank (starting Python and torch
    takes seconds); from then on every collective of the run waits at most ``timeout``.

    Args:
      rank, world_size: this process and the number of processes.
      master_port, master_addr: where rank 0 listens.
      backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPUs); default nccl when ``device`` is a GPU.
      timeout: collective timeout in seconds, in (0, 86400].
      device: the device of the model (default cpu).
      store: rank 0 only: its store, already listening on ``master_port`` (``run_local`` opens
        it on a port the OS chose, so that no other process can take the port between
        choosing it and listening on it). The other ranks join it as usual.

    Raises:
      ValueError: bad arguments (before anything connects).
    """
    check_int("world_size", world_size)
    check_range("rank", rank, 0, world_size - 1, integer=True)
    check_range("master_port", master_port, 1, 65535, integer=True)
    check_range("timeout", timeout, 0.0, 86400.0, low_open=True)
    check_range("start_timeout", start_timeout, 0.0, 86400.0, low_open=True)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    backend = _backend(backend, dev)
    if store is not None and (rank != 0 or store.port != master_port):
        raise ValueError("store: only rank 0 passes its store, listening on master_port")
    _fresh_group_names()
    join = datetime.timedelta(seconds=max(float(timeout), float(start_timeout)))
    if store is None:
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{int(master_port)}",
            rank=int(rank), world_size=int(world_size), timeout=join,
        )
    else:  # the keys under the prefix torch's tcp:// rendezvous gives the other ranks' stores
        store.set_timeout(join)
        dist.init_process_group(
            backend, store=PrefixStore("default_pg", store),
            rank=0, world_size=int(world_size), timeout=join,
        )
    # the run's collectives: every rank is here now, so the short timeout applies from here
    group = dist.new_group(
        list(range(int(world_size))),
        timeout=datetime.timedelta(seconds=float(timeout)),
        backend=backend,
    )
    return Distributed(int(rank), int(world_size), float(timeout), dev, group)


def _fresh_group_names() -> None:
    """Number this process's groups from 0, as a freshly started rank does.

    torch names each new group by a per-process counter, and the ranks' store keys carry that
    name. An earlier attempt in this process that failed to join (no default group left, the
    counter still advanced) would leave rank 0 one name ahead of its fresh helper ranks: each
    side then waits for keys the other never writes, until the start timeout. With no default
    group alive, nothing else uses the counter.
    """
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def from_env(
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    device: torch.device | str | None = None,
    start_timeout: float = START_TIMEOUT,
) -> Distributed:
    """Join the process group of a run launched by ``torchrun`` (one machine or several).

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``
    (:func:`dpfy.training.torchrun.torchrun_env`) and joins as :func:`init_process_group`
    does. Under ``torchrun --rdzv-backend c10d`` the TCP store at ``MASTER_ADDR:MASTER_PORT``
    is the one torchrun's agent already hosts, and every rank joins it as a client. With
    ``backend="nccl"`` the device defaults to GPU ``LOCAL_RANK`` of this machine, which
    becomes the current CUDA device (NCCL needs one GPU per process).

    Args:
      backend: ``"gloo"`` (CPU; the default for a CPU device) or ``"nccl"`` (GPUs).
      timeout: collective timeout in seconds, in (0, 86400]; the same on every rank.
      device: the device of the model (default cpu, or ``cuda:LOCAL_RANK`` under nccl).
      start_timeout: seconds every rank may take to start and join, in (0, 86400]: on a
        cluster, the slowest machine's start-up (imports from a network file system).

    Raises:
      ValueError: the process was not launched (the message says how to launch it), or its
        launcher's environment is incomplete or out of range.
      DistributedError: the group could not be joined (the store unreachable, a rank missing
        after ``start_timeout``, a backend failure); one line naming the address.
    """
    launch = torchrun_env()
    if launch is None:
        raise ValueError(
            f"from_env needs the environment torchrun sets ({', '.join(REQUIRED)}), and this "
            "process has none of it (start the script with `torchrun --nproc-per-node N "
            "script.py`, or use init_process_group(rank, world_size, master_port=...))"
        )
    if device is None and backend == "nccl":
        device = torch.device("cuda", launch.local_rank)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    _backend(backend, dev)  # refused before any device or connection is touched
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # NCCL: one GPU per process, this one
    try:
        return init_process_group(
            launch.rank,
            launch.world_size,
            master_port=launch.master_port,
            master_addr=launch.master_addr,
            backend=backend,
            timeout=timeout,
            device=device,
            start_timeout=start_timeout,
        )
    except RuntimeError as e:  # the store or a peer unreachable (DistStoreError, gloo, nccl)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"rank {launch.rank} of {launch.world_size}: joining the process group at "
            f"{launch.master_addr}:{launch.master_port} ({_backend(backend, dev)}) failed "
            f"({first}); check that every machine runs the same code, reaches that address "
            f"and port, and started within start_timeout={start_timeout:g} s"
        ) from e


def _backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be one of {{gloo, nccl}}, got backend={backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a GPU device, got device={str(device)!r}")
    return backend


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps (the per-example pass runs on it)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def data_parallel_model(
    model: nn.Module, query: Query, reducer: GradientReducer | None
) -> nn.Module:
    """The module the per-example pass runs on; refuses what a data-parallel step cannot do.

    A ``DistributedDataParallel`` needs a reducer (DDP's own all-reduce is never triggered by
    the per-example pass and would bypass clipping) and is unwrapped; with a reducer the query
    must be a stateless :class:`dpfy.queries.QueryBase` (recorded once, broadcast).
    """
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    if reducer is None:
        if ddp:
            raise ValueError(
                "model is a DistributedDataParallel: pass reducer=dpfy.training.distributed"
                ".Distributed(...) so the clipped sums are reduced across processes (DDP's own "
                "all-reduce would bypass clipping and is never triggered by the per-example pass)"
            )
        return model
    from dpfy.queries.base import QueryBase

    if not isinstance(query, QueryBase):
        raise ValueError(
            f"query must be a dpfy.queries.QueryBase with a reducer (its release is recorded "
            f"once and broadcast), got query={query!r}"
        )
    if type(query)._after_release is not QueryBase._after_release:
        raise ValueError(
            f"query must be stateless with a reducer (each process would update its state "
            f"from a release only one process draws), got query={query!r}; adaptive clipping "
            "is not supported across processes"
        )
    return unwrap(model)


def check_mirror_ledger(ledger: object, rank: int) -> None:
    """A non-releasing process keeps an in-memory ledger: only rank 0 writes the file."""
    from dpfy.ledger import Ledger

    if not isinstance(ledger, Ledger) or ledger.path is not None:
        raise ValueError(
            f"ledger must be an in-memory dpfy.ledger.Ledger() on rank {rank}: only the "
            f"releasing process (rank 0) writes the ledger file, got ledger={ledger!r}"
        )


def mirror_release(query: Query, ledger: Ledger, sample_id: int) -> None:
    """Record, in this process's in-memory ledger, the release rank 0 records (no noise)."""
    from dpfy.queries.base import QueryBase

    assert isinstance(query, QueryBase)  # data_parallel_model
    query._write_ahead(ledger, sample_id, query.ledger_entries())


def per_process_batch(max_physical_batch_size: int, world_size: int) -> int:
    """Rows per physical chunk on each process: ``P / W``, refused unless W divides P."""
    check_int("max_physical_batch_size", max_physical_batch_size)
    check_int("world_size", world_size)
    if max_physical_batch_size % world_size:
        raise ValueError(
            f"max_physical_batch_size must be a multiple of the world size {world_size} (each "
            f"physical chunk is split evenly across the processes), got "
            f"max_physical_batch_size={max_physical_batch_size!r}"
        )
    return max_physical_batch_size // world_size


class SharedSampler:
    """A sampler whose batches rank 0 draws and broadcasts (the same batch on every rank).

    Everything but :meth:`batches` is the wrapped sampler's; the other ranks' wrapped sampler
    never draws (its randomness is unused), so a secure run keeps one sampling stream.
    """

    def __init__(self, sampler: Sampler, distributed: Distributed) -> None:
        self.sampler = sampler
        self.distributed = distributed

    kind = property(lambda self: self.sampler.kind)
    dataset_size = property(lambda self: self.sampler.dataset_size)
    steps_per_epoch = property(lambda self: self.sampler.steps_per_epoch)
    expected_batch_size = property(lambda self: self.sampler.expected_batch_size)
    max_batch_size = property(lambda self: self.sampler.max_batch_size)
    randomness = property(lambda self: getattr(self.sampler, "randomness", None))

    def batches(self, epoch: int) -> Iterator[np.ndarray]:
        """The epoch's batches, drawn on rank 0 one at a time (lazily, in step with the loop)."""
        d = self.distributed
        source = iter(self.sampler.batches(epoch)) if d.releases else None
        while True:
            mine = next(source, None) if source is not None else None
            batch = d.broadcast_indices(mine)
            if batch is None:
                return
            yield batch

    def privacy_event(
        self, noise_multiplier: float, *, epochs: float | None = None, steps: int | None = None
    ) -> ev.Event:
        return self.sampler.privacy_event(noise_multiplier, epochs=epochs, steps=steps)

    def sample_spec(self) -> SampleSpec:
        return self.sampler.sample_spec()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def __repr__(self) -> str:
        return repr(self.sampler)


class ShardBatcher:
    """This rank's share of every physical chunk of a logical batch (see the module docstring).

    Args:
      inner: a batcher cutting this rank's rows into chunks of ``P / W`` rows, built with
        ``max_physical_batch_size=P // W`` and no ``max_batch_size`` (e.g.
        :class:`dpfy.training.data.PhysicalBatcher`).
      distributed: this process.
      max_physical_batch_size: P, the rows of one global physical chunk (a multiple of W).
      max_batch_size: the sampler's truncation bound (every step then has
        ``ceil(max_batch_size / P)`` chunks), or ``None``.
    """

    def __init__(
        self,
        inner: Batcher,
        distributed: Distributed,
        *,
        max_physical_batch_size: int,
        max_batch_size: int | None = None,
    ) -> None:
        self.inner = inner
        self.distributed = distributed
        self.rows = per_process_batch(max_physical_batch_size, distributed.world_size)
        self.max_physical_batch_size = int(max_physical_batch_size)
        if max_batch_size is not None:
            check_int("max_batch_size", max_batch_size)
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)

    @property
    def dataset_size(self) -> int:
        return self.inner.dataset_size

    def share(self, indices: np.ndarray) -> tuple[np.ndarray, int]:
        """This rank's rows of ``indices`` and the number of chunks every rank runs."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        n, big, p, r = len(indices), self.max_physical_batch_size, self.rows, self.distributed.rank
        if self.max_batch_size is not None:
            if n > self.max_batch_size:
                raise ValueError(
                    f"batch_size must be in [0, {self.max_batch_size}] (the sampler's "
                    f"max_batch_size), got batch_size={n!r}"
                )
            chunks = math.ceil(self.max_batch_size / big)
        else:
            chunks = max(1, math.ceil(n / big))
        parts = [indices[c * big + r * p : c * big + (r + 1) * p] for c in range(chunks)]
        return np.concatenate(parts) if parts else indices[:0], chunks

    def chunks(self, indices: np.ndarray) -> Iterator[PhysicalBatch]:
        """``chunks`` physical batches of ``P / W`` rows (all-padding ones after the share)."""
        mine, chunks = self.share(indices)
        done = 0
        for chunk in self.inner.chunks(mine):  # ceil(len(mine) / (P/W)) <= chunks of them
            done += 1
            yield chunk
        while done < chunks:  # one all-padding chunk each
            yield from self.inner.chunks(mine[:0])
            done += 1

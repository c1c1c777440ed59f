"""DP-SGD on sharded models (FSDP2, ``torch.distributed.fsdp.fully_shard``).

A model too large for one device is sharded with FSDP2: every trainable parameter is a
``DTensor`` split along dimension 0 over the W ranks (``Shard(0)``, rank r holding rows
``[r c, (r+1) c)`` with ``c = ceil(rows / W)``), and FSDP2 all-gathers a unit's parameters
just before its forward and again before its backward. The logical step is the data-parallel
one of :mod:`dpfy.training.distributed` (one global sample from rank 0, the same deterministic
split, every rank clips its own rows); what changes is where the clipped sum and the noise
live (docs/architecture.md, "Sharded models (FSDP2)"):

1. **Norms need no shard exchange.** dpfy's per-example norms come from the norm rules of
   :mod:`dpfy.training.norms`, which read a layer's *input activations* and *output
   gradients* (ghost norms or book-keeping, Li et al. 2022; Bu et al. 2023), never its
   parameters' values. FSDP2 shards parameters, not activations: during the one backward pass
   to the module outputs, the unit's weights are gathered, so every output gradient is the
   full one, and a rank's per-example squared norms of its own examples are complete, exact
   and local. "Shard by shard" therefore reduces to nothing for these rules: the norm of an
   example's gradient is never split across ranks, so no squared norm needs an all-reduce
   before the clip weights are applied. A layer without a norm rule (the generic
   ``vmap(grad)`` rule calls the module with its own, sharded, parameters) is refused when the
   step is built.
2. **Clipped sums are reduce-scattered.** Each rank accumulates the clipped weighted sum of its
   rows for every parameter at full shape (one gradient-sized buffer, as in a plain
   data-parallel run), then one reduce-scatter (SUM) over all parameters leaves on rank r the
   global clipped sum of *its* shard of every parameter, laid out as FSDP2's ``Shard(0)``.
   Clipping is per example, so this is exactly the shard of the 1-process clipped sum.
3. **Noise once per shard.** Every rank runs the query's release on its own shards: the
   query writes its ledger entry (rank 0 into the ledger file, the others into their
   in-memory mirror) and adds Gaussian noise with exactly the recorded std to every coordinate
   of the shard. Shards are disjoint and cover every coordinate, so each coordinate gets one
   draw: none twice, none skipped. Each rank draws from its own stream: secure randomness is
   keyed from the OS in each process (independent streams); a seeded ``Randomness(seed)`` is
   turned, on rank r > 0, into ``Randomness(seed_r)`` with ``seed_r`` derived from
   ``(seed, r)`` by NumPy's ``SeedSequence`` (:func:`rank_randomness`), so two ranks never
   repeat each other's noise. The std per coordinate is the one a 1-process release records,
   so the ledger, and the epsilon, are those of the 1-process run.
4. **Write-ahead across ranks.** A barrier follows the release: rank 0 reaches it only after
   its ledger write, and no rank sets ``p.grad`` before it, so no rank applies a step the
   ledger file does not show (a crash over-counts, never under-counts).
5. **Sharded update.** ``p.grad`` becomes a ``DTensor`` with the noisy clipped sum of the
   shard divided by the expected batch size; the optimizer steps on shards.

Refused before the first step (``ValueError``): a sharded model without a reducer, a parameter
that is not a ``Shard(0)`` DTensor on a 1-D mesh of the run's W ranks, layers without a norm
rule, ``microbatch_mode="sum"`` (user-level DP), correlated-noise queries and any query that
is not a stateless :class:`dpfy.queries.QueryBase`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from dpfy.ledger import Ledger
    from dpfy.queries import Query
    from dpfy.randomness import Randomness
    from dpfy.training.norms.capture import ModulePlan


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (FSDP2's ``fully_shard``)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # no DTensor can exist yet; importing the package costs over a second
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_model(model: nn.Module, distributed: Any) -> nn.Module:
    """``fully_shard`` every submodule that owns parameters, then the root, over
    ``distributed.mesh()`` (in place; returns ``model``)."""
    from torch.distributed.fsdp import fully_shard

    mesh = distributed.mesh()
    for module in list(model.modules()):
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every shard gathered (a collective: every rank calls it)."""
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """FSDP2's ``Shard(0)`` rows of one rank: ``[start, stop)`` with ``c = ceil(rows / W)``
    rows per rank (the last ranks may hold fewer, or none)."""
    c = math.ceil(rows / world_size)
    start = min(rank * c, rows)
    return start, min(start + c, rows)


def rank_randomness(randomness: Randomness, rank: int) -> Randomness:
    """The noise stream of ``rank``: the given one on rank 0 and whenever it is secure (each
    process keys its own from the OS); a seeded one on rank r > 0 becomes
    ``Randomness(seed_r)``, ``seed_r`` derived from ``(seed, r)`` by ``np.random.SeedSequence``
    (independent of rank 0's stream and of every other rank's)."""
    if rank == 0 or randomness.secure:
        return randomness
    from dpfy.randomness import Randomness

    seed_r = int(np.random.SeedSequence(int(randomness.seed or 0), spawn_key=(rank,))
                 .generate_state(2, np.uint64)[0] >> np.uint64(1))
    return Randomness(seed_r, device_noise=randomness.device_noise)


class ShardedRelease:
    """The release of a sharded step (see the module docstring), used by
    :class:`dpfy.training.PrivateGradient` when the model's parameters are FSDP2 shards.

    Args:
      params: the trainable parameters (``Shard(0)`` DTensors), by name.
      plans: the step's module plans (every one must have a norm rule).
      query: the query (a stateless ``QueryBase``, not correlated noise).
      reducer: this process (a :class:`dpfy.training.distributed.Distributed`).
      microbatch_mode: the step's mode (``"sum"``, user-level DP, is refused).

    Raises:
      ValueError: anything the sharded step does not support (before any collective).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        plans: list[ModulePlan],
        query: Query,
        reducer: Any,
        microbatch_mode: str,
    ) -> None:
        from torch.distributed.tensor import DTensor, Shard

        if reducer is None or not hasattr(reducer, "reduce_scatter_"):
            raise ValueError(
                "a model sharded with fully_shard (DTensor parameters) needs reducer=dpfy."
                "training.distributed.Distributed(...): the clipped sums are reduce-scattered "
                f"across its processes, got reducer={reducer!r}"
            )
        if microbatch_mode == "sum":
            raise ValueError(
                "microbatch_mode='sum' (user-level DP) is not supported on a sharded model; "
                "use examples or average mode, or an unsharded model"
            )
        from dpfy.queries.correlated import CorrelatedNoiseQuery

        if isinstance(query, CorrelatedNoiseQuery):
            raise ValueError(
                "correlated noise is not supported on a sharded model (its noise stream "
                f"spans the whole model), got query={query!r}"
            )
        no_rule = [p.name or "<root>" for p in plans if p.rule is None]
        if no_rule:
            raise ValueError(
                f"module(s) {no_rule} have no per-example norm rule; on a sharded model the "
                "generic vmap(grad) rule would see only this rank's shard of their weights. "
                "Register a norm rule (dpfy.training.norms.register_norm_rule) or leave them "
                "frozen"
            )
        w = int(reducer.world_size)
        for name, p in params.items():
            ok = (
                isinstance(p, DTensor)
                and p.device_mesh.ndim == 1
                and p.device_mesh.size() == w
                and p.device_mesh.get_local_rank() == reducer.rank
                and tuple(p.placements) == (Shard(0),)
            )
            if not ok:
                raise ValueError(
                    f"parameter {name!r} must be sharded by fully_shard on dimension 0 over a "
                    f"1-D mesh of the run's {w} ranks (call fully_shard on every layer and "
                    f"the root, with mesh=distributed.mesh()), got {_describe(p)}"
                )
        self.params = dict(params)
        self.reducer = reducer
        self._streams: weakref.WeakKeyDictionary[Randomness, Randomness] = (
            weakref.WeakKeyDictionary()
        )

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Around a forward and backward pass: FSDP2's own all-gathers and reduce-scatters
        that fail (a rank died or hung) stop this rank with ``DistributedError``."""
        from dpfy.training.distributed import DistributedError

        try:
            yield
        except RuntimeError as e:
            text = str(e)
            backend = isinstance(e, torch.distributed.DistBackendError) or any(
                k in text for k in ("gloo", "NCCL", "Connection reset", "Timed out")
            )
            if isinstance(e, DistributedError) or not backend:
                raise
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            raise DistributedError(
                f"rank {self.reducer.rank} of {self.reducer.world_size}: an FSDP2 collective "
                f"of the forward or backward pass failed ({first}): another process died, "
                f"stopped or did not arrive within timeout={self.reducer.timeout:g} s. This "
                "process stops; the step was not applied here, and the ledger (rank 0's) "
                "records every release any rank applied"
            ) from e

    def stream(self, randomness: Randomness) -> Randomness:
        """This rank's noise stream for ``randomness`` (derived once, then continued)."""
        mine = self._streams.get(randomness)
        if mine is None:
            mine = self._streams[randomness] = rank_randomness(randomness, self.reducer.rank)
        return mine

    def scatter(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of the global sum of every rank's full-shape ``full`` (one
        reduce-scatter, SUM, of all parameters packed as ``[W, sum of padded shard sizes]``)."""
        w, r = int(self.reducer.world_size), int(self.reducer.rank)
        blocks, layout = [], []
        for name, p in self.params.items():
            t = full[name]
            rows = t.shape[0] if t.dim() else 1
            t2 = t.reshape(rows, -1)
            c = math.ceil(rows / w)
            padded = t2.new_zeros(w * c, t2.shape[1])
            padded[:rows] = t2
            blocks.append(padded.reshape(w, -1))
            layout.append((name, c, t2.shape[1], p))
        stacked = torch.cat(blocks, dim=1).contiguous()
        out = stacked.new_empty(stacked.shape[1])
        self.reducer.reduce_scatter_(out, stacked.reshape(-1))
        shards, at = {}, 0
        for name, c, width, p in layout:
            start, stop = shard_rows(p.shape[0] if p.dim() else 1, w, r)
            block = out[at : at + c * width].reshape(c, width)[: stop - start]
            shards[name] = block.reshape(_local_shape(p)).clone()
            at += c * width
        return shards

    def release(
        self,
        full: Mapping[str, torch.Tensor],
        *,
        query: Query,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        scale: float,
    ) -> None:
        """Scatter, noise this rank's shards (query release: ledger first), wait for every
        rank (so rank 0's ledger write precedes every update), then set ``p.grad``."""
        from torch.distributed.tensor import DTensor

        shards = self.scatter(full)
        grads = {n: torch.empty_like(s) for n, s in shards.items()}
        noisy = query.add_noise(
            shards,
            ledger=ledger,
            sample_id=sample_id,
            randomness=self.stream(randomness),
            out=grads,
            scale=scale,
        )
        self.reducer.barrier()  # after rank 0's ledger write, before any rank applies
        for name, p in self.params.items():
            assert isinstance(p, DTensor)
            p.grad = DTensor.from_local(
                noisy[name], p.device_mesh, p.placements, run_check=False, shape=p.shape,
                stride=p.stride(),
            )


def _local_shape(p: torch.Tensor) -> torch.Size:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.shape


def _describe(p: torch.Tensor) -> str:
    placements, mesh = getattr(p, "placements", None), getattr(p, "device_mesh", None)
    if placements is None:
        return f"a plain {type(p).__name__} of shape {tuple(p.shape)}"
    return f"a DTensor with placements {tuple(placements)} on mesh {mesh}"

"""The low-level private-gradient step: drop it into an existing PyTorch training loop.

One logical DP-SGD step (Abadi et al. 2016; Ponomareva et al. 2023, Alg. 1, with gradient
accumulation and Alg. 3 microbatching; ``docs/architecture.md`` section 5.11) is a short chain
of small steps:

1. :meth:`PrivateGradient.accumulate` on each physical chunk of the logical batch: forward,
   one backward pass to the module outputs, per-example squared gradient norms per parameter
   from the registered norm rules (ghost norms, book-keeping), clip weights from the query,
   and the clipped weighted sum added to an accumulator. No per-example gradient is
   materialised where a cheaper rule exists.
2. :meth:`PrivateGradient.release` once per logical step: the query adds Gaussian noise to
   *every* trainable parameter (also ones that got no gradient) and writes its ledger entry
   before returning the noisy sum (write-ahead); the result is divided by the fixed expected
   batch size (never the realised size of a Poisson batch) and written to ``p.grad``. Any
   ``torch.optim`` optimizer then steps (post-processing).

Unit of privacy and adjacency: one row of the inputs (``add_or_remove``); the caller makes a
row one example (or one user's combined data). Weight-0 rows (padding to a fixed shape)
contribute nothing. A row whose per-example gradient is not finite is dropped (weight 0,
still private) and counted.

Microbatching (Ponomareva et al. 2023, Alg. 3):

* ``microbatch_mode="examples"`` (option 1): each example is clipped; ``microbatch_size``
  only splits a chunk into smaller forward/backward passes to bound memory. Same privacy and
  noise as without microbatches.
* ``microbatch_mode="average"`` (option 2): consecutive groups of ``microbatch_size`` rows
  form microbatches; each microbatch's average gradient ``(1/k) sum_i w_i g_i`` (fixed
  divisor k, padding rows count as zero) is clipped to C, the clipped averages are summed,
  noised and divided by the expected number of microbatches ``expected_batch_size / k``.
  Under add-or-remove adjacency one example changes one clipped average by up to 2C, so the
  query must record sensitivity 2C: pass
  ``GaussianSumQuery(C, z, clipped_unit="microbatch_average")`` (the noise std is then
  ``2 z C``; the "2k times more noise" per example of Ponomareva et al. 2023). This
  assumes the assignment of the *other* examples to microbatches does not depend on the
  presence of the changed one (e.g. its row is replaced by padding, or rows are assigned to
  microbatches independently); a partition that shifts every later row when one example is
  added changes many microbatches and has a larger sensitivity.
* ``microbatch_mode="sum"`` (user-level DP, :mod:`dpfy.training.users`): consecutive groups of
  ``microbatch_size`` rows hold one unit of privacy (one user's examples, padded with weight-0
  rows); the *sum* of the group's per-example gradients is clipped to C, the clipped sums are
  summed, noised and divided by ``expected_batch_size / k`` (the expected number of units
  when ``expected_batch_size`` counts k rows per unit). Adding or removing a whole unit adds
  or removes one clipped sum: sensitivity C, a plain ``GaussianSumQuery(C, z)``. Valid only
  when a group is exactly one unit (all of its rows, nobody else's) and the sampler draws
  units: a group mixing several units' rows moves by up to 2C when one of them changes.

Limits: layers must see batch-first inputs (dimension 0 = the example), module outputs must
not be modified in place (``ReLU(inplace=True)``: refused), and activation checkpointing must
be non-reentrant (``use_reentrant=False``). Tied parameters are clipped exactly (the owners'
contributions summed per example); the first chunk checks that every parameter's per-example
gradients were recorded exactly once (``docs/architecture.md``, section 4.2).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from dpfy.ledger import Ledger
    >>> from dpfy.sampling import SampleSpec
    >>> from dpfy.queries import GaussianSumQuery
    >>> from dpfy.randomness import Randomness
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.1), expected_batch_size=16)
    >>> loss_fn = nn.CrossEntropyLoss(reduction="none")
    >>> ledger, rng = Ledger(), Randomness(seed=0)
    >>> sid = ledger.record_sample(SampleSpec("poisson", dataset_size=1000, sampling_rate=0.016))
    >>> stats = pg.accumulate(torch.randn(16, 4), torch.randint(0, 2, (16,)), loss_fn)
    >>> step = pg.release(ledger=ledger, sample_id=sid, randomness=rng)
    >>> opt.step()
    >>> step.num_examples
    16
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dpfy._validate import check_int, check_range
from dpfy.queries.base import check_query
from dpfy.queries.sum import AverageQuery, check_average_sensitivity
from dpfy.training.distributed import (
    GradientReducer,
    check_mirror_ledger,
    data_parallel_model,
    mirror_release,
)
from dpfy.training.norms.attribution import AttributionCheck
from dpfy.training.norms.capture import (
    Fallback,
    LayerCapture,
    ModulePlan,
    capture_layers,
    plan_modules,
    reported_names,
    shared_parameters,
)
from dpfy.training.norms.coverage import TOLERANCE, CoverageGuard
from dpfy.training.norms.fallback import fallback_rule
from dpfy.training.norms.layout import LayoutBook, replays
from dpfy.training.norms.registry import (
    Capture,
    LayerGrads,
    MaterializedGrads,
    OverwritingGrads,
    cross_term,
    overwrites,
)
from dpfy.training.precision import (
    DEFAULT_FP16_LOSS_SCALE,
    Precision,
    autocast_off,
    autocasting,
    check_loss_scale,
    check_master_weights,
    check_precision,
    precision_autocast,
    upcast_captures,
    work_dtype,
)
from dpfy.training.sharded import ShardedRelease, is_sharded
from dpfy.training.validate import validate_module

if TYPE_CHECKING:
    from dpfy.ledger import Ledger
    from dpfy.queries import Query
    from dpfy.randomness import Randomness
    from dpfy.training.chunk import OpenChunk


MicrobatchMode = Literal["examples", "average", "sum"]
#: When :class:`PrivateGradient` checks that every parameter's per-example gradients were
#: recorded exactly once (:mod:`dpfy.training.norms.coverage`): the first chunk, or every one.
CoverageCheck = Literal["first", "every"]
_MODES = ("examples", "average", "sum")


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkStats:
    """What one :meth:`PrivateGradient.accumulate` call saw (not private: for monitoring).

    Attributes:
      loss_sum: sum of the per-example losses over real (weight-1) rows.
      num_examples: number of real rows.
      num_nonfinite: real rows (or microbatches, in average mode) dropped because their
        gradient was not finite.
      norms: per-example (per-microbatch) L2 gradient norms before clipping, float64, when
        requested with ``return_norms=True``; else ``None``.
    """

    loss_sum: float
    num_examples: int
    num_nonfinite: int
    norms: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """Summary of one released logical step.

    Attributes:
      loss_sum, num_examples, num_nonfinite: totals over the step's chunks.
      num_chunks: number of ``accumulate`` calls in the step.
      denominator: the fixed divisor applied to the noisy sum (expected batch size, or the
        expected number of microbatches in average mode).
      noise_multiplier: effective noise multiplier of the release (noise std / sensitivity).
    """

    loss_sum: float
    num_examples: int
    num_nonfinite: int
    num_chunks: int
    denominator: float
    noise_multiplier: float


class PrivateGradient:
    """Per-example clipped, noised gradients for an unmodified ``nn.Module``.

    Args:
      model: the model; it is never wrapped, and no attribute is written on it or its
        Parameters. Hooks exist only inside ``accumulate``.
      query: a :class:`dpfy.queries.Query` (``GaussianSumQuery``, ``NestedQuery``,
        ``JointClipQuery``, ``AdaptiveClipQuery``, ``NoPrivacyQuery``, or any
        :class:`dpfy.queries.QueryBase`) whose group names are the model's parameter names
        (``model.named_parameters()``). Not an ``AverageQuery``: the division by the expected
        batch size happens here. A query declaring ``fused_release = True`` (every
        ``QueryBase``) gets the fused release (``out=``, ``scale=``); any other object with
        ``clip_weights`` and ``add_noise`` gets a plain release and a division pass.
      expected_batch_size: the fixed denominator (q x N for Poisson sampling), > 0.
      microbatch_size: rows per microbatch, or ``None`` (no microbatching).
      microbatch_mode: ``"examples"`` (Ponomareva et al. 2023, Alg. 3 option 1),
        ``"average"`` (option 2) or ``"sum"`` (one unit of privacy per group of
        ``microbatch_size`` rows, its summed gradient clipped: user-level DP).
      fallback_chunk_size: examples per ``vmap`` chunk for layers without a norm rule.
      forward: ``forward(model, inputs) -> outputs`` for inputs the default convention does
        not fit. Default: a mapping calls ``model(**inputs)`` (e.g. a tokenizer's
        ``input_ids`` and ``attention_mask``), a tuple or list ``model(*inputs)``, anything
        else ``model(inputs)``.
      fallback: ``"vmap"`` (layers without a norm rule use the generic ``vmap(grad)`` rule)
        or ``"error"`` (such a layer is refused here, with its name).
      precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the forward of :meth:`accumulate` (and
        :meth:`autocast` for loops that run it themselves) under ``torch.autocast`` in that
        dtype; norms, clip weights, clipped sums and noise stay fp32
        (:mod:`dpfy.training.precision`). Trainable parameters must be fp32 master weights.
      loss_scale: fixed loss scale S in [1, 2**24] of the backward (default 2**8 for fp16,
        else 1); divided out in fp32 before any norm.
      reducer: a :class:`GradientReducer` (a :class:`dpfy.training.distributed.Distributed`)
        when several processes share each logical step: every process accumulates its own
        rows, :meth:`release` sums the clipped sums across processes, the releasing process
        alone writes the ledger and draws the noise, and all receive its noisy sum. The
        query must be a stateless :class:`dpfy.queries.QueryBase`; ``model`` may be a
        ``DistributedDataParallel`` (its ``.module`` is used; DDP's own all-reduce never runs).
      coverage_check: ``"first"`` (the first chunk) or ``"every"`` chunk
        (:mod:`dpfy.training.norms.coverage`); the attribution check's frequency is
        ``attribution.every`` (:mod:`dpfy.training.norms.attribution`).

    Parameters used by several modules (tied input/output embeddings) get the exact
    per-example norm of the *sum* of their contributions (own norms plus cross terms,
    :func:`dpfy.training.norms.registry.cross_term`).

    Raises:
      ValueError: bad arguments, a layer that cannot be clipped per example (see
        :func:`dpfy.training.norms.capture.plan_modules`), or an average-mode query whose recorded
        sensitivity is below twice its clip norm.
    """

    def __init__(
        self,
        model: nn.Module,
        query: Query,
        *,
        expected_batch_size: float,
        microbatch_size: int | None = None,
        microbatch_mode: MicrobatchMode = "examples",
        fallback_chunk_size: int = 32,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        fallback: Fallback = "vmap",
        precision: Precision = "fp32",
        loss_scale: float | None = None,
        reducer: GradientReducer | None = None,
        coverage_check: CoverageCheck = "first",
    ) -> None:
        self.precision: Precision = check_precision(precision)
        if coverage_check not in ("first", "every"):
            raise ValueError(
                "coverage_check must be 'first' or 'every', got "
                f"coverage_check={coverage_check!r}"
            )
        self.coverage_check: CoverageCheck = coverage_check
        model = data_parallel_model(model, query, reducer)
        self.reducer = reducer
        if loss_scale is None:
            loss_scale = DEFAULT_FP16_LOSS_SCALE if precision == "fp16" else 1.0
        self.loss_scale = check_loss_scale(loss_scale)
        check_range(
            "expected_batch_size",
            expected_batch_size,
            0.0,
            math.inf,
            low_open=True,
            high_open=True,
        )
        if microbatch_size is not None:
            check_int("microbatch_size", microbatch_size)
        if microbatch_mode not in _MODES:
            raise ValueError(
                f"microbatch_mode must be one of {set(_MODES)}, "
                f"got microbatch_mode={microbatch_mode!r}"
            )
        check_int("fallback_chunk_size", fallback_chunk_size)
        check_query(query)  # the typed contract (dpfy.queries.Query), then never probed
        if isinstance(query, AverageQuery):
            raise ValueError(
                "query must be a sum query: PrivateGradient divides by expected_batch_size "
                f"itself; pass the inner query of {query!r}"
            )
        self.model = model
        self.query = query
        self.expected_batch_size = float(expected_batch_size)
        self.microbatch_size = None if microbatch_size is None else int(microbatch_size)
        self.microbatch_mode = microbatch_mode
        self.fallback_chunk_size = int(fallback_chunk_size)
        if forward is not None and not callable(forward):
            raise ValueError(
                f"forward must be callable (model, inputs) -> outputs, got {forward!r}"
            )
        self.forward = forward
        if microbatch_mode == "average":
            check_average_sensitivity(query)
        # Layers that cannot be clipped per example are refused here, before anything is
        # recorded (dpfy.training.validate: BatchNorm, lazy parameters, ...).
        validate_module(model)
        self.plans_: list[ModulePlan] = plan_modules(model, fallback=fallback)
        self._shared = shared_parameters(self.plans_)
        self._qnames = [reported_names(plan, self.plans_) for plan in self.plans_]
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        check_master_weights(self._params.items())
        self.param_names_: tuple[str, ...] = tuple(self._params)
        self._sharded = (  # FSDP2 shards: reduce-scatter, noise per shard (training.sharded)
            ShardedRelease(self._params, self.plans_, query, reducer, microbatch_mode)
            if is_sharded(model) else None
        )
        groups = query.groups
        self._owner: dict[str, str] | None = None
        self._group_names: tuple[str, ...] = ()
        if groups is not None:
            self._group_names = tuple(groups)
            self._owner = {n: g for g, ns in groups.items() for n in ns}
            missing = [n for n in self.param_names_ if n not in self._owner]
            if missing:
                raise ValueError(
                    f"trainable parameters {missing} belong to no group of the query; groups "
                    f"cover {sorted(self._owner)}"
                )
        # Fast release, a capability the query declares (Query.fused_release): 1 / denominator
        # is folded into the clip weights and the query writes the noisy gradient straight into
        # the buffers that become ``p.grad`` (no division pass).
        self._fast_release = bool(query.fused_release)
        self._layouts = LayoutBook()
        # off on an FSDP2 rank: its alone forward gathers shards, which every rank must join
        self.attribution = AttributionCheck(self.plans_, self._qnames, model=model,
                                            every=0 if self._sharded is not None else 1)
        self._coverage = CoverageGuard(
            model, self.plans_, self._qnames, self._params,
            every=coverage_check == "every", chunk_size=self.fallback_chunk_size,
            enabled=self._sharded is None,  # an FSDP2 rank holds shards of the gradients
        )
        self._reset()

    # ------------------------------------------------------------------------------------
    def _reset(self) -> None:
        # No model-sized buffer outlives a step: the next step's first chunk allocates the
        # accumulator after its backward pass (so the backward's peak holds none of this
        # object's) and writes it without a zeroing pass (``_dirty``).
        self._buffers: dict[str, torch.Tensor] = {}
        self._acc_flat: torch.Tensor | None = None
        self._dirty = False
        self._active = False
        self._loss_sum = 0.0
        self._examples = 0
        self._nonfinite = 0
        self._chunks = 0

    @property
    def group_size_(self) -> int:
        """Rows per clipped unit: ``microbatch_size`` in average and sum mode, else 1."""
        return (self.microbatch_size or 1) if self.microbatch_mode != "examples" else 1

    @property
    def denominator_(self) -> float:
        """Fixed divisor of the noisy sum (expected number of clipped units)."""
        return self.expected_batch_size / self.group_size_

    def accumulate(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: torch.Tensor | None = None,
        *,
        return_norms: bool = False,
        loss_scale: float | None = None,
    ) -> ChunkStats:
        """Add the clipped per-example gradients of one physical chunk to the accumulator.

        The forward runs under ``torch.autocast`` with ``precision`` bf16/fp16 (or inside the
        caller's own autocast block); the norms, clip weights and clipped sums are still
        computed in fp32 (:mod:`dpfy.training.precision`).

        Args:
          inputs: model input with the batch on dim 0: a tensor (``model(inputs)``), a tuple
            (``model(*inputs)``) or a dict (``model(**inputs)``).
          targets: whatever ``loss_fn`` takes, batch on dim 0.
          loss_fn: ``loss_fn(outputs, targets)`` -> per-example losses of shape [B] (e.g.
            ``nn.CrossEntropyLoss(reduction="none")``).
          weights: [B] tensor of 0/1 (0 = padding row), or ``None`` (all rows real).
          return_norms: also return the per-example norms before clipping.
          loss_scale: S >= 1 (default: the ``loss_scale`` given at construction): the
            backward is seeded with S x weight so that small fp16 gradients do not underflow;
            the output gradients are divided by S in fp32 before any norm, so S never changes
            a clip weight. A row whose scaled gradient overflows is dropped (counted in
            ``num_nonfinite``).

        Returns:
          :class:`ChunkStats` of the chunk.
        """
        loss_scale = check_loss_scale(self.loss_scale if loss_scale is None else loss_scale)
        self._chunks += 1
        k = self.microbatch_size
        if k is not None and self.microbatch_mode == "examples":
            batch = _batch_size(inputs)
            if batch > k:
                parts = [
                    self._accumulate_one(
                        _slice(inputs, s, s + k),
                        _slice(targets, s, s + k),
                        loss_fn,
                        None if weights is None else weights[s : s + k],
                        return_norms,
                        loss_scale,
                    )
                    for s in range(0, batch, k)
                ]
                norms = [p.norms for p in parts if p.norms is not None]
                return ChunkStats(
                    sum(p.loss_sum for p in parts),
                    sum(p.num_examples for p in parts),
                    sum(p.num_nonfinite for p in parts),
                    torch.cat(norms) if return_norms else None,
                )
        return self._accumulate_one(inputs, targets, loss_fn, weights, return_norms, loss_scale)

    def _accumulate_one(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        weights: torch.Tensor | None,
        return_norms: bool,
        loss_scale: float = 1.0,
    ) -> ChunkStats:
        guard = self._sharded.collectives() if self._sharded else contextlib.nullcontext()
        batch = _batch_size(inputs)
        with guard, capture_layers(self.recorded_plans(), batch) as recorder:
            if self._sharded is None:  # FSDP2: a probe's forward would need every rank
                recorder.rerun, recorder.loss_of = replays(
                    self._forward, self.autocast, inputs, targets, loss_fn, batch
                )
            with self.autocast():
                losses = loss_fn(self._forward(inputs), targets)
            return self._accumulate_losses(recorder, losses, weights, return_norms, loss_scale)

    def _forward(self, inputs: Any) -> Any:
        """The model's outputs on ``inputs`` (``forward``, or the mapping/tuple convention)."""
        if self.forward is not None:
            return self.forward(self.model, inputs)
        if isinstance(inputs, Mapping):
            return self.model(**inputs)
        if isinstance(inputs, tuple | list):
            return self.model(*inputs)
        return self.model(inputs)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` in ``precision`` on the parameters' device (fp32: a no-op)."""
        device = next(iter(self._params.values())).device.type if self._params else "cpu"
        return precision_autocast(self.precision, device)

    def recorded_plans(self) -> list[ModulePlan]:
        """The plans recorded in the next chunk (the coverage check may add ancestors)."""
        return self._coverage.hooked()

    def accumulate_recorded(
        self, recorder: LayerCapture, losses: Any, weights: torch.Tensor | None, loss_scale: float
    ) -> ChunkStats:
        """:class:`~dpfy.training.chunk.OpenChunk`'s seam: a chunk whose layers ``recorder``
        captured (hooks on :meth:`recorded_plans`), its backward from ``losses`` and its clipped
        sums added, counted as one ``accumulate`` call."""
        self._chunks += 1
        return self._accumulate_losses(recorder, losses, weights, False, loss_scale)

    def open_chunk(self, batch_size: int | None = None) -> OpenChunk:
        """Record the layers while the caller runs the forward pass itself (hooks until closed).

        For loops that call the model themselves (:func:`dpfy.training.private.make_private`):
        run ``model(...)`` and the per-example loss, then ``chunk.accumulate(losses, weights)``
        (one backward pass to the module outputs, clipped sums added as in
        :meth:`accumulate`); ``close()`` removes the hooks (``accumulate`` closes too).
        ``batch_size``, when known, lets a layer called once on a batch-1 input broadcast over
        the batch (position embeddings) be recorded per example.
        """
        from dpfy.training.chunk import OpenChunk

        return OpenChunk(self, batch_size)

    def _accumulate_losses(
        self,
        recorder: LayerCapture,
        losses: Any,
        weights: torch.Tensor | None,
        return_norms: bool,
        loss_scale: float = 1.0,
    ) -> ChunkStats:
        k = self.group_size_
        self.attribution.begin()
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ValueError(
                "loss_fn must return per-example losses of shape [B] (use reduction='none'), "
                f"got {getattr(losses, 'shape', type(losses))}"
            )
        batch = losses.shape[0]
        if batch % k:
            raise ValueError(
                f"chunk size {batch} must be a multiple of microbatch_size={k} in "
                f"microbatch_mode={self.microbatch_mode!r} (pad with weight-0 rows)"
            )
        weights_ok = None  # device weights: validity read with the chunk's statistics
        half = self.precision != "fp32" or autocasting(losses.device.type)
        # average mode: a group's gradient is its mean (fixed divisor k); sum mode: its sum
        seed = loss_scale / k if self.microbatch_mode == "average" else loss_scale
        if weights is None:
            mask = None
            scale = torch.full_like(losses, seed).detach()
        else:
            mask, weights_ok = _check_weights(weights, batch, losses)
            scale = mask if seed == 1.0 else mask * seed
        if losses.device.type != "meta":  # which dimension is the batch (norms.layout)
            mine = recorder.calls[: len(self.plans_)]  # not the coverage check's ancestors
            self._layouts.settle(self.plans_, mine, batch, self.model, recorder.rerun,
                                 recorder.paused)
        # the working precision's tolerance of the coverage and attribution checks
        tol = TOLERANCE[torch.bfloat16] if half else TOLERANCE.get(losses.dtype, 1e-3)
        guard = self._coverage if self._coverage.due else None
        guard = None if losses.device.type == "meta" else guard  # meta: no values to compare
        checked = guard.params if guard is not None else []
        captures, batch_grads = recorder.backward(losses, scale, checked)
        # The DP arithmetic in fp32 (bf16/fp16 captures upcast, the loss scale divided out),
        # never under autocast: docs/architecture.md, "Mixed precision".
        with torch.no_grad(), autocast_off((losses.device.type,)):
            n = batch // k
            for i, caps in enumerate(captures):  # in place: each bf16 original freed at once
                captures[i] = upcast_captures(caps, loss_scale)
            watched = captures[len(self.plans_):]
            del captures[len(self.plans_):]
            layers = self._layer_grads(captures, batch, k)
            if guard is None:  # the layers hold what the rules need, each freed after its sum
                captures.clear()
            wd = work_dtype(losses.dtype)
            like = losses.new_empty((), dtype=wd)
            if guard is not None:  # read with the chunk's statistics below
                coverage, recorded = guard.measure(layers, batch_grads, n, loss_scale, like)
            if mask is None:
                real = None
            else:
                real = mask if k == 1 else mask.reshape(n, k).amax(1)
            sq = self._squared_norms(layers, n)
            total_sq = torch.stack(list(sq.values())).sum(0) if sq else losses.new_zeros(n)
            nonfinite = 0
            detached = losses.detach()
            if mask is None:
                loss_t, n_real = detached.sum(), batch
            else:
                loss_t = torch.where(mask > 0, detached, 0.0).sum()
            # The chunk's one host read (docs/devices.md): the norms' sum (finite iff every
            # term is), loss sum, real rows, weights' validity and coverage norms, together.
            reads = [total_sq.sum(), loss_t] + ([] if mask is None else [mask.sum()])
            ok_at = len(reads)  # where the weights' validity lands in the read, if read
            if weights_ok is not None:
                reads.append(weights_ok)
            if guard is not None:
                reads.append(coverage)
            host = torch.cat([r.reshape(-1).to(torch.float64) for r in reads]).tolist()
            loss_sum = host[1]
            if mask is not None:
                n_real = int(host[2])
            if weights_ok is not None and not host[ok_at]:
                raise ValueError("weights must be 0 (padding row) or 1 (real row)")
            if guard is not None:

                def promoted() -> tuple[list[float], set[str]]:  # rare: a second read
                    guard.promote(recorded, layers, captures, watched, k)
                    again, seen = guard.measure(layers, batch_grads, n, loss_scale, like)
                    return again.reshape(-1).tolist(), seen

                planned = len(self.plans_)
                guard.settle(host[len(host) - coverage.numel():], recorded, tol, promoted)
                if len(self.plans_) > planned:  # an ancestor took a parameter: norms anew
                    sq = self._squared_norms(layers, n)
                    total_sq = torch.stack(list(sq.values())).sum(0)
                    host[0] = float(total_sq.sum())
            if not math.isfinite(host[0]):
                bad = ~torch.isfinite(total_sq)
                nonfinite = int((bad if real is None else bad & (real > 0)).sum())
                for lg in layers.values():
                    lg.zero_rows(bad)
                inf = torch.full_like(total_sq, math.inf)
                sq = {key: torch.where(bad, inf, v) for key, v in sq.items()}
                total_sq = torch.where(bad, inf, total_sq)
            weights_by_param = self._clip_weights(sq, total_sq, real, n, wd)
            self._add_weighted_sums(layers, weights_by_param, sq)  # empties ``layers``
            for held in (captures, watched, batch_grads):  # before the attribution check
                held.clear()
        if self.attribution.due() and recorder.loss_of is not None and math.isfinite(host[0]):
            self.attribution.run(
                recorder.loss_of, self._params, sq, total_sq, real, mask, k,
                1.0 / k if self.microbatch_mode == "average" else 1.0, tol,
            )
        self._loss_sum += loss_sum
        self._examples += n_real
        self._nonfinite += nonfinite
        norms = total_sq.to(torch.float64).sqrt() if return_norms else None
        return ChunkStats(loss_sum, n_real, nonfinite, norms)

    def _add_weighted_sums(
        self,
        layers: dict[int, LayerGrads],
        weights_by_param: dict[str, torch.Tensor],
        sq: dict[str, torch.Tensor],
    ) -> None:
        """Add each layer's clipped weighted sum to the accumulator.

        The first chunk of a step *writes* the sums where the layer supports it (no zeroing
        pass over the accumulator); every other parameter's buffer is zeroed first.
        """
        if not self._buffers:
            self._acc_flat, self._buffers = _flat_buffers(self._params)
            self._dirty = True
        acc, fresh = self._buffers, self._dirty
        self._dirty, self._active = False, True
        covered: set[str] = set()
        shared = self._shared
        for idx in list(layers):  # each layer's activations and output gradients freed
            lg = layers.pop(idx)  # after its sum, in the order of the plans
            qnames = self._qnames[idx]
            if self.plans_[idx].adoptable and isinstance(lg, MaterializedGrads):
                qnames = {ln: qn for ln, qn in qnames.items() if ln in lg.grads}
            local = {ln: weights_by_param[qn] for ln, qn in qnames.items()}
            dst = {ln: acc[qn] for ln, qn in qnames.items()}
            # a tied parameter's buffer already written by another owner is added to
            first = not shared or covered.isdisjoint(qnames.values())
            if fresh and first and overwrites(type(lg)):
                cast(OverwritingGrads, lg).weighted_sum(local, dst, overwrite=True)
                covered.update(qn for qn in qnames.values() if qn in sq)
                continue
            if fresh:
                for ln, t in dst.items():
                    if qnames[ln] not in covered:
                        t.zero_()
                covered.update(qnames.values())
            lg.weighted_sum(local, dst)
        if fresh and len(covered) < len(acc):
            if not covered and self._acc_flat is not None:
                self._acc_flat.zero_()
            else:
                for name, b in acc.items():
                    if name not in covered:
                        b.zero_()

    def _layer_grads(
        self, captures: list[list[Capture]], batch: int, k: int
    ) -> dict[int, LayerGrads]:
        layers: dict[int, LayerGrads] = {}
        for idx, (plan, caps) in enumerate(zip(self.plans_, captures, strict=True)):
            if not caps:
                continue
            if plan.rule is not None:
                for cap in caps:
                    # batch-first: a recomputing rule's targets (RNN, packed), else input 0
                    first = cap.grad_outputs[0] if plan.recompute is not None else cap.args[0]
                    lead = first.shape[0] if first.dim() > 0 else None
                    if lead != batch:
                        raise ValueError(
                            f"module {plan.name!r} ({type(plan.module).__name__}) got an input "
                            f"of shape {tuple(first.shape)} whose first dimension is not "
                            f"the batch size {batch}; per-example rules need batch-first inputs "
                            "(do not fold other dimensions into the batch)"
                        )
                layers[idx] = plan.rule(plan.module, caps, k)
            else:
                adopt = tuple(ln for ln, j, _ in plan.adoptable if not captures[j])
                try:  # a refusal names the module, not only its class
                    layers[idx] = fallback_rule(plan.module, caps, k, adopt=adopt,
                                                chunk_size=self.fallback_chunk_size)
                except ValueError as err:
                    raise ValueError(f"module {plan.name or '<root>'!r}: {err}") from None
        return layers

    def _squared_norms(self, layers: dict[int, LayerGrads], n: int) -> dict[str, torch.Tensor]:
        sq: dict[str, torch.Tensor] = {}
        for idx, lg in layers.items():
            qnames = self._qnames[idx]
            for name, v in lg.squared_norms().items():
                if v.shape != (n,):
                    raise RuntimeError(
                        f"norm rule of {self.plans_[idx].name!r} returned shape "
                        f"{tuple(v.shape)}, expected ({n},)"
                    )
                qn = qnames[name]
                sq[qn] = sq[qn] + v if qn in sq else v  # tied: the owners' own norms add up
        for name, owners in self._shared.items():
            present = [(i, ln) for i, ln in owners if i in layers]
            for j, (ia, la) in enumerate(present):
                for ib, lb in present[j + 1 :]:
                    cross = cross_term(layers[ia], la, layers[ib], lb)
                    sq[name] = (sq[name] + 2.0 * cross).clamp_(min=0.0)
        return sq

    def _clip_weights(
        self,
        sq: dict[str, torch.Tensor],
        total_sq: torch.Tensor,
        real: torch.Tensor | None,
        n: int,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        """Per-parameter clip weights [n] (0 for padding and non-finite units), in ``dtype``."""
        mask = None if real is None else real.to(torch.float64)
        scale = self._weight_scale
        if self._owner is None:
            w = self.query.clip_weights(total_sq.to(torch.float64).sqrt(), mask=mask)
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"a query without groups must return one Tensor[B], got {w!r}")
            return dict.fromkeys(self.param_names_, _scaled(w, scale, dtype))
        zeros = torch.zeros(n, dtype=torch.float64, device=total_sq.device)
        group_sq: dict[str, torch.Tensor] = {g: zeros for g in self._group_names}
        for name, v in sq.items():
            g = self._owner[name]
            group_sq[g] = group_sq[g] + v.to(torch.float64)
        w = self.query.clip_weights({g: v.sqrt() for g, v in group_sq.items()}, mask=mask)
        if isinstance(w, torch.Tensor):
            return dict.fromkeys(self.param_names_, _scaled(w, scale, dtype))
        wd = {g: _scaled(v, scale, dtype) for g, v in w.items()}
        return {name: wd[self._owner[name]] for name in self.param_names_}

    @property
    def _weight_scale(self) -> float:
        """Factor folded into the clip weights: 1 / denominator on the fast release path."""
        return 1.0 / self.denominator_ if self._fast_release else 1.0

    def release(self, *, ledger: Ledger, sample_id: int, randomness: Randomness) -> StepStats:
        """Noise the accumulated clipped sum once, divide, write ``p.grad``; reset.

        Every trainable parameter receives noise, also if no chunk produced a gradient for it.
        The query records its ledger entry before the noisy values exist outside it.
        ``p.grad`` is a new tensor at every release (the previous one is not touched);
        ``zero_grad(set_to_none=True)`` frees it.

        Args:
          ledger: the run's :class:`dpfy.ledger.Ledger`.
          sample_id: id from ``ledger.record_sample`` for this logical step's batch.
          randomness: the :class:`dpfy.randomness.Randomness` the noise is drawn from.

        Returns:
          :class:`StepStats` of the step.
        """
        params = self._params
        red = self.reducer
        if red is not None and not red.releases:
            check_mirror_ledger(ledger, red.rank)  # before any collective
        if red is not None and not self._active:  # zeros laid out as on the other processes
            self._acc_flat, self._buffers = _flat_buffers(params)
            for b in self._buffers.values():
                b.zero_()
            self._active = True
        if self._active:
            clipped = dict(self._buffers)
        else:  # nothing accumulated this step: the release is noise only
            clipped = {n: torch.zeros_like(p) for n, p in params.items()}
        denom = self.denominator_
        if red is not None:  # the global clipped sum, in place, before anything is recorded
            flat = self._acc_flat
            if self._sharded is None:  # sharded: reduce-scattered in its release
                red.sum_([flat] if flat is not None else list(clipped.values()))
            loss, examples, nonfinite = red.sum_numbers(
                [self._loss_sum, self._examples, self._nonfinite]
            )
            self._loss_sum, self._examples, self._nonfinite = loss, int(examples), int(nonfinite)
        if self._sharded is not None:
            self._sharded.release(clipped, query=self.query, ledger=ledger,
                                  sample_id=sample_id, randomness=randomness, scale=1.0 / denom)
        elif self._fast_release:
            # The accumulator holds clipped sum / denom (folded into the clip weights); the
            # query adds noise scaled alike and writes into new gradient buffers (no division
            # pass) which then become ``p.grad``: views of one flat buffer, so the noise fills
            # it in one fused pass. They are not kept here: once the caller drops the
            # gradients (``zero_grad(set_to_none=True)``), no model-sized buffer outlives the
            # step.
            flat_grads, grads = _flat_buffers(params)
            if red is None or red.releases:
                noisy = self.query.add_noise(
                    clipped,
                    ledger=ledger,
                    sample_id=sample_id,
                    randomness=randomness,
                    out=grads,
                    scale=1.0 / denom,
                )
            else:  # the releasing process records and draws; this one mirrors the record
                mirror_release(self.query, ledger, sample_id)
                noisy = grads
            if red is not None:  # after the ledger write: no process applies an unrecorded step
                red.share_([flat_grads] if flat_grads is not None else list(grads.values()))
            for name in self.param_names_:
                p, g = params[name], noisy[name]
                if p.grad is not g:
                    p.grad = g
        else:  # a user query without ``out=`` and ``scale=``
            noisy = self.query.add_noise(
                clipped, ledger=ledger, sample_id=sample_id, randomness=randomness
            )
            for name in self.param_names_:
                p, g = params[name], noisy[name]
                if g.dtype == p.dtype and g.data_ptr() != clipped[name].data_ptr():
                    p.grad = g.div_(denom)  # the query's fresh output: scale in place
                else:  # never alias the accumulator buffers
                    p.grad = (g / denom).to(p.dtype)
        stats = StepStats(self._loss_sum, self._examples, self._nonfinite, self._chunks, denom,
                          float(self.query.noise_multiplier))
        self._reset()
        return stats

    def clipped_sum(self) -> dict[str, torch.Tensor]:
        """The accumulated clipped sum so far (before noise and division), per parameter."""
        if not self._active:
            return {n: torch.zeros_like(p) for n, p in self._params.items()}
        scale = self._weight_scale
        if scale == 1.0:
            return {n: b.clone() for n, b in self._buffers.items()}
        return {n: b / scale for n, b in self._buffers.items()}

    def reset(self) -> None:
        """Discard the accumulated sum without releasing anything."""
        self._reset()

    def __repr__(self) -> str:
        return (
            f"PrivateGradient(query={self.query!r}, "
            f"expected_batch_size={self.expected_batch_size}, "
            f"microbatch_size={self.microbatch_size}, microbatch_mode={self.microbatch_mode!r}, "
            f"precision={self.precision!r})"
        )


def _flat_buffers(
    params: Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Uninitialised per-parameter buffers; views of one flat tensor when dtype and device agree.

    One flat tensor lets a whole-model operation (zeroing, scaling) be a single kernel call.
    """
    kinds = {(p.dtype, p.device) for p in params.values()}
    if len(kinds) != 1:
        fmt = torch.contiguous_format
        return None, {n: torch.empty_like(p, memory_format=fmt) for n, p in params.items()}
    dtype, device = kinds.pop()
    flat = torch.empty(sum(p.numel() for p in params.values()), dtype=dtype, device=device)
    views, start = {}, 0
    for n, p in params.items():  # as_strided: one call per view, not a slice and a view
        views[n] = flat.as_strided(p.shape, _contiguous_strides(p.shape), start)
        start += p.numel()
    return flat, views


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """Strides, in elements, of a contiguous (row-major) tensor of ``shape`` (as torch's)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


def _scaled(w: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Clip weights times ``scale`` (in float64), in the working dtype."""
    return (w if scale == 1.0 else w * scale).to(dtype)


def _check_weights(
    weights: torch.Tensor, batch: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``weights`` on ``like``'s device and dtype, checked to be 0 or 1.

    Weights given on the CPU (a loader's) are checked there, before the copy: no device read.
    Weights already on another device return, second, a 0-dim "all valid" tensor for the
    caller to read with its other statistics (and to raise on before anything is written).
    """
    w = torch.as_tensor(weights)
    if w.shape != (batch,):
        raise ValueError(f"weights must have shape ({batch},), got {tuple(w.shape)}")
    valid = ((w == 0) | (w == 1)).all()
    if w.device.type == "cpu":
        if not bool(valid):
            raise ValueError("weights must be 0 (padding row) or 1 (real row)")
        return w.to(like.device, like.dtype), None
    return w.to(like.device, like.dtype), valid


def _batch_size(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0]
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.shape[0]
    raise ValueError("inputs must contain a tensor with the batch on dim 0")


def _slice(x: Any, start: int, stop: int) -> Any:
    return tree_map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) else t, x)

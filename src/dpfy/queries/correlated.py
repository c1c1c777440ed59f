"""The correlated-noise (DP-FTRL / matrix-factorization) release of a training step.

:class:`CorrelatedNoiseQuery` clips like :class:`~dpfy.queries.GaussianSumQuery` but adds to
step ``t``'s clipped sum the correlated noise ``(C^{-1} z)_t`` of a
:class:`~dpfy.correlated.plan.CorrelatedPlan`, with ``z_t ~ N(0, (z C)^2 I)`` drawn fresh
from the run's :class:`~dpfy.randomness.Randomness` (secure by default). The model then sees
the prefix sums ``A x + A C^{-1} z = B (C x + z)``: a post-processing of the one Gaussian
release ``C x + z`` (Denisov et al. 2022; Choquette-Choo et al. 2023). Each strategy's
registered object builds its one noise stream (:meth:`dpfy.correlated.strategy.Strategy.stream`,
in the strategy's module); over all parameters as one flat vector of ``P`` values they keep:

* BandMF (band ``b``): the last ``b - 1`` noises, ``w_t = z_t - sum_{k<b} c_k w_{t-k}``
  (``c_0 = 1``): ``O(b x P)`` memory;
* BLT (``d`` buffers): ``w_t = z_t + sum_i omega_i s_i``, then ``s_i <- theta_i s_i + z_t``
  (McMahan et al. 2024): ``O(d x P)``;
* tree aggregation: the node noise of each level of the current binary decomposition,
  ``w_t = z_t - sum_{l < low(t + 1)} node_l`` (Kairouz et al. 2021): ``O(log T x P)``;
* the efficient tree (``"tree-efficient"``, Honaker 2015): ``low(t + 1) + 1`` fresh node
  noises per step (the nodes ending at ``t + 1``, level 0 first), folded bottom-up into the
  estimate ``h <- v_l z + (1 - v_l) (h + est_{l-1})``; ``w_t = h - sum_{l < low} est_l``,
  then ``est_low = h``: ``O(log T x P)`` (:mod:`dpfy.correlated.tree_efficient`).

Write-ahead: before the first release the ledger gets the run record (plan, clip norm, z and
sensitivity), before every release a step record; the ledger resolves them to one
:class:`dpfy.events.MatrixMechanism` (:mod:`dpfy.ledger.matrix`). A batch whose sampler does
not implement the plan's schema is refused before anything is written. The stream state
(:meth:`CorrelatedNoiseQuery.state_dict`) holds past noise: it is as secret as the noise
itself and belongs only in a private checkpoint.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.correlated.strategy import NoiseStream
from dpfy.ledger import Ledger
from dpfy.ledger.matrix import check_schema_spec
from dpfy.ledger.records import MatrixRunRecord, MatrixStepRecord
from dpfy.queries._tree import (
    Norms,
    Tensors,
    clip_weights_from_norms,
    flat_norm,
    flatten,
    unflatten_like,
)
from dpfy.queries.base import (
    LedgerEntry,
    QueryBase,
    _output_buffers,
    check_clipped_sum,
    check_release_args,
)
from dpfy.randomness import (
    Randomness,
    _flat_span,  # the same flat-buffer test as the fused noise path
)
from dpfy.sampling.spec import SampleSpec


def state_rows(plan: CorrelatedPlan) -> int:
    """Parameter-sized vectors of noise state a plan's stream keeps: BandMF ``band - 1``,
    BLT ``buffers``, the trees one per level (``floor(log2 T) + 1``)."""
    return plan.rule.state_rows(plan.steps)


def stream_bytes(plan: CorrelatedPlan, parameters: int, bytes_per_value: int = 4) -> int:
    """Bytes a run's noise stream allocates: the state plus the fresh draw ``z_t`` and the
    output ``w_t`` (``(state_rows + 2) x parameters x bytes_per_value``)."""
    return (state_rows(plan) + 2) * int(parameters) * int(bytes_per_value)


def available_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` (CUDA: the driver's free memory; CPU: Linux's ``MemAvailable``,
    which counts reclaimable page cache, else the free physical pages), or None where that
    is unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_stream_memory(
    plan: CorrelatedPlan, parameters: int, limit_bytes: int, bytes_per_value: int = 4
) -> None:
    """Refuse (``ValueError``, before any step) a plan whose noise stream would not fit in
    ``limit_bytes``, with the figure and, for BandMF and BLT, the largest band that fits."""
    need = stream_bytes(plan, parameters, bytes_per_value)
    if need <= limit_bytes:
        return
    per_row = int(parameters) * int(bytes_per_value)
    rows_fit = limit_bytes // per_row - 2
    option = plan.rule.largest_fitting(rows_fit)
    hint = ""
    if option is not None:
        name, best = option
        hint = (f"; {name} must be at most {best} here" if best >= 1 else
                "; not even the smallest state fits")
    raise ValueError(
        f"the {plan.strategy} noise state needs {need / 2**20:.1f} MiB "
        f"((state vectors {state_rows(plan)} + 2) x {parameters} parameters x "
        f"{bytes_per_value} bytes), above the {limit_bytes / 2**20:.1f} MiB available{hint}"
    )


def open_stream(plan: CorrelatedPlan, size: int, like: torch.Tensor) -> NoiseStream:
    """The plan's noise stream over ``size`` values on ``like``'s device and dtype: the one
    its strategy object builds (:meth:`dpfy.correlated.strategy.Strategy.stream`)."""
    return plan.rule.stream(plan.steps, size, like, torch)


class CorrelatedNoiseQuery(QueryBase):
    """Flat clipping to ``clip_norm`` and the correlated noise of ``plan`` on each step's sum.

    Args:
      plan: strategy, steps ``T`` and participation schema (:func:`dpfy.correlated.make_plan`).
      clip_norm: L2 bound C of one example's contribution to one step.
      noise_multiplier: z: ``z_t ~ N(0, (z C)^2 I)``; the run is ``mu = sensitivity / z`` GDP.
      name: ledger label of the run (one run per name and ledger).
    """

    groups = None

    def __init__(
        self,
        plan: CorrelatedPlan,
        clip_norm: float,
        noise_multiplier: float,
        *,
        name: str = "gradient",
    ) -> None:
        if not isinstance(plan, CorrelatedPlan):
            raise ValueError(f"plan must be a dpfy.correlated.CorrelatedPlan, got {plan!r}")
        check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
        check_range(
            "noise_multiplier", noise_multiplier, 0.0, math.inf, low_open=True, high_open=True
        )
        self.plan = plan
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.name = name
        self.noise_std = self.noise_multiplier * self.clip_norm
        self._stream: NoiseStream | None = None
        self._layout: list[tuple[str, tuple[int, ...]]] | None = None
        self._z: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None  # a loaded state, applied at first use
        self.steps_done = 0

    # -- what the query declares ------------------------------------------------------------
    def ledger_entries(self) -> tuple[LedgerEntry, ...]:
        """Per step: clip norm C and the std of the fresh strategy noise ``z_t``."""
        return (LedgerEntry(self.name, self.clip_norm, self.noise_std),)

    def noise_stds(self) -> float:
        return self.noise_std

    def clip_weights(self, norms: Norms, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        return clip_weights_from_norms(flat_norm(norms), self.clip_norm, mask)

    # -- the release ------------------------------------------------------------------------
    def add_noise(
        self,
        clipped_sum: Tensors,
        *,
        ledger: Ledger,
        sample_id: int,
        randomness: Randomness,
        out: Tensors | None = None,
        scale: float = 1.0,
    ) -> dict[str, Any]:
        """Check the batch against the schema, record (write-ahead), add ``scale x w_t``."""
        check_release_args(ledger, randomness, scale)
        flat = flatten(clipped_sum)
        check_clipped_sum(flat)
        layout = [(n, tuple(v.shape)) for n, v in flat.items()]
        if self._layout is not None and layout != self._layout:
            raise ValueError("clipped_sum must have the same tensors at every step")
        dst = _output_buffers(flat, out)
        t = self.steps_done
        if t >= self.plan.steps:
            raise ValueError(
                f"the correlated-noise plan covers steps={self.plan.steps}; step {t} is beyond"
            )
        rec = ledger.sample(sample_id)
        check_schema_spec(self.plan.schema, rec.spec, index=t, epoch=rec.epoch)
        self._write_ahead_run(ledger, t)
        ledger.record_matrix(
            MatrixStepRecord(sample_id, self.name, t, self.clip_norm, self.noise_std)
        )
        if self._stream is None:
            self._start(flat, layout)
        assert self._stream is not None and self._z is not None
        randomness.normal_([self._z], [self.noise_std])
        z = self._z

        def refill() -> None:
            randomness.normal_([z], [self.noise_std])

        device = self._z.device
        src_span = _flat_span(list(flat.values()), device)
        dst_span = _flat_span([dst[n] for n in flat], device)
        if src_span is not None and dst_span is not None:  # a flat gradient buffer: one pass

            def add(a: int, b: int, w: torch.Tensor) -> None:
                torch.add(src_span[a:b], w, alpha=scale, out=dst_span[a:b])

            self._stream.next(self._z, add=add, refill=refill)
        else:
            w = self._stream.next(self._z, refill=refill)
            start = 0
            for n, src in flat.items():
                k = src.numel()
                torch.add(src, w[start : start + k].view(src.shape), alpha=scale, out=dst[n])
                start += k
        self.steps_done = t + 1
        return unflatten_like(dst, clipped_sum)

    def _write_ahead_run(self, ledger: Ledger, t: int) -> None:
        found = ledger.matrix_run(self.name)
        if found is None:
            if t != 0:
                raise ValueError(
                    f"the query is at step {t} but the ledger holds no matrix run "
                    f"{self.name!r}: resume with the run's own ledger"
                )
            ledger.record_matrix(
                MatrixRunRecord(
                    self.name, self.plan, self.clip_norm, self.noise_multiplier,
                    self.plan.sensitivity,
                )
            )
            return
        run, done = found
        same = (
            run.plan == self.plan
            and run.clip_norm == self.clip_norm
            and run.noise_multiplier == self.noise_multiplier
        )
        if not same or done != t:
            raise ValueError(
                f"the ledger's matrix run {self.name!r} ({done} steps, {run.plan.strategy}, "
                f"z={run.noise_multiplier}) is not this query's ({t} steps, "
                f"{self.plan.strategy}, z={self.noise_multiplier})"
            )

    def _start(self, flat: Mapping[str, torch.Tensor], layout: list[Any]) -> None:
        first = next(iter(flat.values()))
        size = sum(v.numel() for v in flat.values())
        self._layout = layout
        self._z = torch.empty(size, dtype=first.dtype, device=first.device)
        self._stream = open_stream(self.plan, size, self._z)
        if self._pending is not None:
            self._stream.load_state_dict(self._pending)
            self._pending = None

    # -- checkpoints (secret: the state holds past noise) -----------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"plan": self.plan.to_dict(), "steps_done": self.steps_done}
        if self._stream is not None:
            state["stream"] = self._stream.state_dict()
        elif self._pending is not None:
            state["stream"] = self._pending
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if CorrelatedPlan.from_dict(state["plan"]) != self.plan:
            raise ValueError("the checkpoint's correlated-noise plan is not this query's")
        self.steps_done = int(state["steps_done"])
        stream = state.get("stream")
        if stream is not None and self._stream is not None:
            self._stream.load_state_dict(stream)
        else:
            self._pending = None if stream is None else dict(stream)

    def __repr__(self) -> str:
        return (
            f"CorrelatedNoiseQuery({self.plan.strategy}, steps={self.plan.steps}, "
            f"clip_norm={self.clip_norm}, noise_multiplier={self.noise_multiplier})"
        )


def correlated_event(
    plan: CorrelatedPlan,
    ledger: Ledger,
    noise_multiplier: float,
    spec: SampleSpec,
    *,
    name: str = "gradient",
    steps: int | None = None,
) -> ev.Event:
    """What the next ``steps`` steps of the run cost beyond ``ledger``: the whole run's
    ``MatrixMechanism`` before its run record exists, nothing once it does (the record
    charges all ``T`` steps at once), refused past ``T`` or for a sampler (``spec``) that
    does not implement the plan's schema."""
    check_schema_spec(plan.schema, spec)
    found = ledger.matrix_run(name)
    if found is None:
        return plan.event(noise_multiplier, spec.adjacency_value)
    done = found[1]
    if steps is not None and done + steps > plan.steps:
        raise ValueError(
            f"steps must be at most {plan.steps - done} (the plan covers steps={plan.steps}, "
            f"{done} done), got steps={steps}"
        )
    return ev.Composed(())


def correlated_query(
    plan: CorrelatedPlan, clip_norm: float, noise_multiplier: float, spec: SampleSpec,
    total_steps: int, *, parameters: int | None = None, device: torch.device | None = None,
    limit_bytes: int | None = None,
) -> CorrelatedNoiseQuery:
    """The trainer's query for a correlated run, refusing (``ValueError``, before any step) a
    sampler that does not implement ``plan.schema``, a run longer than ``plan.steps``, or a
    noise stream for ``parameters`` float32 values that would not fit in ``limit_bytes``
    (default: 90 % of the free memory of ``device``, when that is known)."""
    check_schema_spec(plan.schema, spec)
    if parameters is not None:
        if limit_bytes is None and device is not None:
            free = available_memory(device)
            limit_bytes = None if free is None else int(0.9 * free)
        if limit_bytes is not None:
            check_stream_memory(plan, parameters, limit_bytes)
    if total_steps > plan.steps:
        raise ValueError(
            f"steps must be at most the plan's steps={plan.steps}, got {total_steps} planned "
            "steps (epochs x steps_per_epoch)"
        )
    return CorrelatedNoiseQuery(plan, clip_norm, noise_multiplier, name="gradient")

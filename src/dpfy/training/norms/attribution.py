"""The attribution check: one example's gradient computed alone against what the rules gave it.

The coverage check (:mod:`dpfy.training.norms.coverage`) proves that the recorded per-example
gradients *sum* to the batch gradient. It cannot see a gradient given to the wrong example:
rows exchanged between examples still sum right, yet one example may then move the clipped sum
by more than the clip norm. This check closes that gap on the chunks it runs on. It picks one
real unit ``j`` of the chunk at random (an example, or the ``k`` rows of a microbatch or user
group), runs the model's forward and the caller's loss again on that unit's rows alone, takes
the gradient of its loss with respect to every trainable parameter, and compares each
parameter's norm with the per-example norm the rules reported for unit ``j`` (the norm that
decides its clip weight). A parameter whose norms differ by more than the working precision's
tolerance (relative 1e-3 in fp32, 5e-2 under bf16/fp16 autocast, with a floor of 1e-2 times
that of the larger of the unit's whole gradient norm and the chunk's median per-unit norm)
refuses the step before its release, naming the parameter and its module. The median in the
floor matters for a unit whose gradient is many orders below its neighbours' (a softmax
saturated on a well-learnt example: norms of 1e-20 next to 1e-1 were seen, whose batch and
alone computations differ in their third digit by rounding): the clipped sum is formed in the
working precision at its neighbours' scale, where such a unit, attributed to any example,
moves nothing. The message carries no number computed from the
data (no norm, no batch size, no index).

Randomness. The alone pass runs with the random streams forked, so a seeded run draws the same
numbers with the check on or off. A model with dropout or other randomness in training mode
(``nn.Dropout`` or ``F.dropout`` alike) cannot be compared: its masks for one example differ
between a batch pass and an alone pass. The first check in a given set of module modes
(train/eval of every submodule) therefore does the alone pass twice under two different seeds;
if the gradients differ, the model is stochastic, and the check stands down while those modes
last (:attr:`AttributionCheck.stochastic`; an all-zero gradient settles nothing; the layout probe of
:mod:`dpfy.training.norms.layout` still runs, in ``eval`` mode). Modules that change buffers in
forward (``spectral_norm``'s power iteration, BatchNorm's running statistics) would change
them again in the alone pass; the generic rule refuses the first and ``check_module`` the
second, before the check could run.

Cost: one forward and backward on ``k`` rows (one example) per checked chunk -- about ``1 / B``
of the step plus the fixed cost of a forward call -- and a parameter-sized gradient, reduced to
its norms and freed at once (the learning pass compares the two seeds' gradients through three
float64 numbers per parameter, so it too holds one parameter-sized set at a time). ``every``
sets the frequency (every chunk by default; 0 turns it off) and ``budget`` the share of the
engine's own time the checks may take (5 % by default; ``None``: no limit). A loss that cannot
be recomputed on one example's rows (:func:`recomputable`) is not checked. A loss built from
the batch rather than from fresh outputs (``dpfy.opacus``' hooks mode: a surrogate read off
the user's backward) recomputes the chosen rows itself (:class:`RowsLoss`).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dpfy.training.norms import wide
from dpfy.training.precision import work_dtype

#: The caller's per-example losses of the given rows of the chunk, from a fresh forward pass.
LossOf = Callable[[torch.Tensor], torch.Tensor]

#: Rounding floor, relative to the larger of the unit's whole gradient norm (the coverage
#: check's floor) and the chunk's median per-unit norm (the scale the sum is formed at).
ABSOLUTE = 1e-2

#: Chunks between two checks by default (0: off): every chunk, within the time budget.
DEFAULT_EVERY = 1

#: By default the check may take this share of the run's time (a chunk is skipped while the
#: checks so far took more); ``None`` checks every ``every``-th chunk whatever it costs.
DEFAULT_BUDGET: float | None = 0.05

_PICK = random.SystemRandom()  # which unit is checked: never the training streams


def recomputable(loss_fn: object) -> bool:
    """Whether ``loss_fn(outputs, targets)`` can be recomputed on a subset of the rows. A loss
    read off something other than the outputs (``dpfy.opacus``' surrogate, built from the
    gradient the user's own backward left on them) declares ``recomputable = False``; the
    check then stands down for that loop."""
    return getattr(loss_fn, "recomputable", True) is not False


@runtime_checkable
class RowsLoss(Protocol):
    """A per-example loss that recomputes some rows of its last batch from a fresh forward pass
    over those rows only (``outputs``), instead of from ``(outputs, targets)``: ``rows`` are the
    indices in that batch. Returns the per-example losses ``[len(rows)]``."""

    def losses_of_rows(self, outputs: Any, rows: torch.Tensor) -> torch.Tensor: ...


class AttributionCheckWarning(UserWarning):
    """The attribution check could not run on this loop and is off for the run."""


class AttributionError(ValueError):
    """A per-example gradient was given to the wrong example: the step is refused."""


class AttributionCheck:
    """Runs the check every ``every`` chunks (0: never); see the module docstring.

    Built by ``PrivateGradient`` over its plans and their parameters' model names (for the
    message); ``every`` may be set at any time (``make_private``'s ``PrivateOptions``).
    """

    def __init__(
        self, plans: Sequence[Any] = (), qualified: Sequence[Mapping[str, str]] = (),
        every: int = DEFAULT_EVERY, model: nn.Module | None = None,
        budget: float | None = DEFAULT_BUDGET,
    ) -> None:
        self.every = int(every)
        self.budget = budget
        self.chunks = 0
        self.runs = 0  # chunks checked
        self._spent = 0.0  # seconds in the check
        self._worked = 0.0  # seconds in the chunks' own backward, norms and clipping
        self._began: float | None = None
        self._model = model
        # stochastic or not, learnt per set of module modes (train/eval of every submodule):
        # a model whose dropout is switched on later in the run is learnt again then
        self._verdicts: dict[tuple[bool, ...], bool] = {}
        self._owners = {
            qn: f"module {plan.name or '<root>'!r} ({type(plan.module).__name__})"
            for plan, names in zip(plans, qualified, strict=True)
            for qn in names.values()
        }

    def _modes(self) -> tuple[bool, ...]:
        return () if self._model is None else tuple(m.training for m in self._model.modules())

    @property
    def stochastic(self) -> bool | None:
        """Whether the model gives one example different gradients under two random seeds, in
        its current modes (``None``: not learnt yet). A stochastic model is not checked."""
        return self._verdicts.get(self._modes())

    def begin(self) -> None:
        """A chunk's own work (its backward, norms and clipping) starts: the budget's clock."""
        self._began = time.perf_counter()

    def due(self) -> bool:
        """Whether the chunk whose work just ended is checked (counts it and its time).

        Every ``every``-th chunk, and under a ``budget`` only while the checks so far took at
        most that share of the chunks' own work (the first due chunk always). The work timed
        is the engine's part of a step only -- not the forward, the optimizer or the data --
        so the check's share of a whole step is below the budget."""
        if self._began is not None:
            self._worked += time.perf_counter() - self._began
            self._began = None
        self.chunks += 1
        if self.every <= 0 or (self.chunks - 1) % self.every:
            return False
        if self.budget is not None and self.runs and not self._spent <= self.budget * self._worked:
            return False  # over budget: the modules' modes (``stochastic``) are not read
        return not self.stochastic

    def run(
        self,
        loss_of: LossOf,
        params: Mapping[str, torch.Tensor],
        squared: Mapping[str, torch.Tensor],
        totals: torch.Tensor,
        real: torch.Tensor | None,
        mask: torch.Tensor | None,
        group_size: int,
        unit_scale: float,
        tolerance: float,
    ) -> None:
        """Check one random real unit; raises :class:`AttributionError` on a mismatch.

        Args:
          loss_of: per-example losses of the given rows, from a fresh forward pass.
          params: the trainable parameters, by name.
          squared: per parameter, the squared per-unit norms the rules reported ([n]).
          totals: [n] their sum over the parameters (each unit's squared norm, as clipped).
          real: [n] 1 for real units, 0 for padding (``None``: all real).
          mask: [B] the rows' weights (0 for a padding row inside a unit; ``None``: all 1).
          group_size: rows per unit.
          unit_scale: what a unit's summed loss is multiplied by (1/k in average mode).
          tolerance: relative tolerance of the working precision.
        """
        start = time.perf_counter()
        try:
            self._check(
                loss_of, params, squared, totals, real, mask, group_size, unit_scale, tolerance
            )
        finally:
            self.runs += 1
            self._spent += time.perf_counter() - start

    def _check(
        self,
        loss_of: LossOf,
        params: Mapping[str, torch.Tensor],
        squared: Mapping[str, torch.Tensor],
        totals: torch.Tensor,
        real: torch.Tensor | None,
        mask: torch.Tensor | None,
        group_size: int,
        unit_scale: float,
        tolerance: float,
    ) -> None:
        n = next(iter(squared.values())).shape[0] if squared else 0
        units = list(range(n)) if real is None else torch.nonzero(real > 0).flatten().tolist()
        if not units:
            return
        j = _PICK.choice(units)
        device = next(iter(params.values())).device
        rows = torch.arange(j * group_size, (j + 1) * group_size, device=device)
        weights = None if mask is None else mask.index_select(0, rows.to(mask.device))
        modes = self._modes()
        learn = modes not in self._verdicts
        try:  # each pass's gradients are summarised and freed before the next pass
            mine_t, seen = self._alone(loss_of, params, rows, weights, unit_scale,
                                       1 if learn else None)
            if learn:
                _, again = self._alone(loss_of, params, rows, weights, unit_scale, seed=2)
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            # the forward or the loss does not run on one unit's rows alone (a loss that
            # closes over per-batch state): the check stands down for the run, saying so
            self.every = 0
            warnings.warn(
                "the attribution check cannot run the forward pass and loss on one example's "
                f"rows alone (they raised {type(err).__name__}; the message is not shown, as it "
                "may hold sizes of the private batch); it is off for this run. A loss_fn that "
                "needs the whole batch can say so with loss_fn.recomputable = False",
                AttributionCheckWarning,
                stacklevel=2,
            )
            return
        if learn:
            if _differ(seen, again):
                self._verdicts[modes] = True
                return
            # equal gradients that are all zero (a zero-initialised head) say nothing about
            # the model's randomness: the verdict waits for a chunk with a gradient
            if bool((seen[:, 2] > 0).any()):
                self._verdicts[modes] = False
        names = list(params)
        zero = mine_t.new_zeros(())
        # norms in each tensor's own precision (fp32 at least: the tolerance is 1e-3 there,
        # tighter in float64), one host read for both sides
        both = torch.cat([
            mine_t,
            torch.stack([_working(squared[n][j]).clamp(min=0).sqrt().double() if n in squared
                         else zero for n in names] + [_median_unit_norm(totals, real)]),
        ]).tolist()
        mine, theirs = both[: len(names)], both[len(names):-1]
        floor = ABSOLUTE * tolerance * max(math.sqrt(sum(v * v for v in mine)), both[-1])
        wrong = [
            name
            for name, a, b in zip(names, mine, theirs, strict=True)
            if not abs(a - b) <= tolerance * max(a, b) + floor
        ]
        if wrong:
            shown = ", ".join(
                f"{name!r} of {self._owners.get(name, 'the model')}" for name in wrong[:4]
            )
            more = f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""
            raise AttributionError(
                "per-example gradients were given to the wrong examples, so nothing was "
                f"released: the gradient of one example computed alone differs from the one "
                f"the per-example rules recorded for it, for parameter(s) {shown}{more}. "
                "Likely causes: an operation that mixes the examples of a batch (statistics "
                "over the batch dimension), a tensor whose batch dimension is not the first, "
                "or a loss term computed outside the model's forward call. Make the forward act "
                "on each example alone (batch dimension first), or report the model if it does"
            )

    @staticmethod
    def _alone(
        loss_of: LossOf,
        params: Mapping[str, torch.Tensor],
        rows: torch.Tensor,
        weights: torch.Tensor | None,
        unit_scale: float,
        seed: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit's gradient computed alone, summarised per parameter and freed: its norms
        ([P] float64, in each gradient's precision widened to fp32 at least) and, under a
        ``seed``, its fingerprints (:func:`wide.fingerprint`, [P, 3]; empty without one). One
        parameter-sized set of gradients is alive at a time."""
        devices = sorted({p.device.index for p in params.values()
                          if p.device.type == "cuda" and p.device.index is not None})
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            if seed is not None:  # the generators of the devices in use only:
                # torch.manual_seed also queues every other backend's, at ~1 ms a call
                torch.default_generator.manual_seed(seed)
                for d in devices:
                    torch.cuda.default_generators[d].manual_seed(seed)
            losses = loss_of(rows).float()
            if losses.shape != rows.shape:  # a loss over the whole chunk's rows, broadcast
                raise ValueError("the loss does not give one value per row of the unit")
            if weights is not None:  # padding rows of the unit count for nothing, as in the step
                losses = losses * weights.to(losses.device, losses.dtype)
            loss = losses.sum() * unit_scale
            grads: list[torch.Tensor | None] = list(
                torch.autograd.grad(loss, list(params.values()), allow_unused=True))
        f64 = torch.float64
        zero = torch.zeros((), dtype=f64, device=next(iter(params.values())).device)
        norms, prints = [], []
        for i, g in enumerate(grads):
            grads[i] = None  # freed as soon as it is summarised
            norms.append(zero if g is None else
                         torch.linalg.vector_norm(_working(g.detach())).double())
            if seed is not None:
                prints.append(zero.expand(3) if g is None else wide.fingerprint(g.detach()))
        return torch.stack(norms), torch.stack(prints) if prints else zero.new_empty((0, 3))


def _working(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the DP arithmetic's dtype (bf16/fp16 widened to fp32: ``work_dtype``)."""
    return t.to(work_dtype(t.dtype))


#: Relative tolerance of two alone passes' agreement (the model is deterministic).
_SAME = 1e-6


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two passes' fingerprints ([P, 3] of :func:`wide.fingerprint`: L2 norm, sum and
    L1 norm per parameter) tell their gradients apart beyond ``_SAME``.

    Two gradients equal elementwise within relative ``r`` (``allclose``) have norms within
    ``r`` times the larger L2 norm and sums within ``r`` times the larger L1 norm, so a
    deterministic model is never called stochastic; a dropout mask drawn anew changes the norm
    far beyond ``r``."""
    l2 = torch.maximum(a[:, 0], b[:, 0])
    l1 = torch.maximum(a[:, 2], b[:, 2])
    apart = ((a[:, 0] - b[:, 0]).abs() > _SAME * l2) | ((a[:, 1] - b[:, 1]).abs() > _SAME * l1)
    return bool(apart.any())


def _median_unit_norm(totals: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The median over the chunk's real units of their whole gradient norm (float64, 0-d), from
    their squared norms ([n]): the scale of the attribution floor."""
    total = totals.double().clamp(min=0)
    if real is not None:
        total = total[real.to(total.device) > 0]
    return total.median().sqrt() if total.numel() else total.new_zeros(())

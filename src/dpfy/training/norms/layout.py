"""Which dimension of a recorded call is the batch: decided by permuting the examples.

The norm rules read a module call per example: a registered rule takes dimension 0 of its input
as the batch, the generic rule maps ``vmap`` over every tensor argument that is per example and
passes the others whole. Judged from sizes alone, both readings fail exactly when a size
coincides with the batch size ``B``: a time-major input ``[T, B, d]`` with ``T == B`` looks
batch-first, and a tensor shared by every example (a codebook, a mask, a rotary table) with
``B`` rows looks per example. Either way each example's gradient takes rows of another one,
and one example can move the clipped sum by more than the clip norm.

So the batch dimension is decided from what the batch *does*, not from its size. Reordering the
examples of the batch (``inputs[perm]``) reorders every per-example tensor of the forward pass
along its batch dimension and leaves every shared tensor as it is. :class:`LayoutBook` runs the
model's forward twice more on the same chunk -- in the original order and with the examples
rotated by one -- without autograd, with dropout and other train-mode randomness off
(``model.eval()``, restored after) and the random number generators forked, records the
arguments of the calls it must decide, and compares:

* a registered rule's input with ``B`` in another dimension too (``[B, B, d]``, ids ``[B, B]``)
  is batch-first when the rotated run rotates its dimension 0; if it rotates another dimension
  instead, the call is refused with the module's name (use ``batch_first=True``);
* a generic-rule argument with ``B`` rows is per example when the rotated run rotates its rows
  and shared when it is unchanged; an argument whose first dimension is not ``B`` is shared.

A decision is pinned per module and call index for the rest of the run, so the probe costs two
forward passes without gradients on the first chunk that raises a question, and nothing on the
others (under Poisson sampling a later chunk whose size coincides reuses the pinned answer).
Values are compared to a relative 1e-4 (batched kernels may round differently per batch
order). Where the probe cannot tell -- an argument whose rows are identical across the batch
(an expanded mask) is read as per example, which is what its rows are; a registered rule's
input constant along both candidate dimensions keeps the size-based reading -- the answer is
pinned all the same, so no call is probed twice. Without a forward pass to run again (an
``open_chunk`` caller that calls submodules instead of the model, an FSDP2-sharded model
whose forward needs every rank, or a forward that raises when rerun) the size-based reading
is used, as before this check existed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpfy.models.modes import evaluating

#: A forward pass of the chunk with its examples reordered by ``perm`` (``None``: as given).
Rerun = Callable[[torch.Tensor | None], Any]

#: Relative tolerance of the comparison (batched kernels round differently per order).
RTOL = 1e-4


def permute_batch(x: Any, perm: torch.Tensor | None, batch: int) -> Any:
    """``x`` with every tensor whose first dimension is ``batch`` indexed by ``perm`` (rows
    reordered, or a subset of rows: the attribution check's one example).

    The model's own inputs are batch-first by the API's contract (``PrivateGradient.accumulate``
    and ``make_private``'s loader); anything else is passed as it is.
    """
    if perm is None:
        return x
    if isinstance(x, torch.Tensor):  # the common case, without flattening a tree
        return x.index_select(0, perm.to(x.device)) if x.dim() > 0 and x.shape[0] == batch else x
    leaves, spec = tree_flatten(x)
    out = [
        t.index_select(0, perm.to(t.device))
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
        else t
        for t in leaves
    ]
    return tree_unflatten(out, spec)


def replays(
    forward: Callable[[Any], Any],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    batch: int,
) -> tuple[Rerun, Callable[[torch.Tensor], torch.Tensor] | None]:
    """The chunk's forward on reordered rows (the layout probe) and the caller's per-example
    losses of some rows (the attribution check; ``None`` without a loss, or for one that is
    not :func:`~dpfy.training.norms.attribution.recomputable`)."""
    from dpfy.training.norms.attribution import RowsLoss, recomputable

    def rerun(perm: torch.Tensor | None) -> Any:
        with autocast():
            return forward(permute_batch(inputs, perm, batch))

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        assert loss_fn is not None
        with autocast():
            if isinstance(loss_fn, RowsLoss):  # a loss that knows the batch's rows itself
                return loss_fn.losses_of_rows(rerun(rows), rows)
            return loss_fn(rerun(rows), permute_batch(targets, rows, batch))

    return rerun, loss_of if loss_fn is not None and recomputable(loss_fn) else None


def _leaves(args: Any, kwargs: Any) -> list[Any]:
    return tree_flatten((args, kwargs))[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool((a - b).abs().max() <= RTOL * scale + 1e-30) if a.numel() else True


def _rotated(x: torch.Tensor, dim: int, perm: torch.Tensor) -> torch.Tensor:
    return x.index_select(dim, perm.to(x.device))


class LayoutBook:
    """The batch dimension of every call a rule reads, pinned per ``(plan, call index)``.

    ``rule_layout[(i, c)]`` is ``True`` once call ``c`` of plan ``i`` (a registered rule) was
    shown batch-first; ``generic[(i, c)]`` holds, for a generic-rule call, one flag per tensor
    leaf of ``(args, kwargs)``: per example (``True``) or shared (``False``).
    """

    def __init__(self) -> None:
        self.rule_layout: dict[tuple[int, int], bool] = {}
        self.generic: dict[tuple[int, int], tuple[bool, ...]] = {}
        self.unavailable = False  # a rerun raised once: the size-based reading from then on

    def settle(
        self,
        plans: Sequence[Any],
        calls: Sequence[Sequence[Any]],
        batch: int,
        model: nn.Module,
        rerun: Rerun | None,
        deactivate: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        """Decide the open questions of this chunk's recorded ``calls`` (one list per plan).

        Sets ``call.batched`` (generic calls: per-leaf flags) and raises ``ValueError``
        naming the module for a registered rule whose input is not batch-first.
        """
        if batch <= 1 or self.unavailable:
            return  # one row: every reading is the same
        rule_q: list[tuple[int, int]] = []
        generic_q: list[tuple[int, int]] = []
        for i, plan in enumerate(plans):
            for c, call in enumerate(calls[i]):
                key = (i, c)
                if plan.rule is not None:
                    if plan.recompute is not None or call.widened or key in self.rule_layout:
                        continue
                    x = call.args[0]
                    if x.dim() >= 2 and x.shape[0] == batch and batch in x.shape[1:]:
                        rule_q.append(key)
                    continue
                pinned = self.generic.get(key)
                leaves = _leaves(call.args, call.kwargs)
                tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
                if pinned is not None and len(pinned) == len(tensors):
                    call.batched = pinned
                elif any(t.dim() > 0 and t.shape[0] == batch for t in tensors):
                    generic_q.append(key)
        if not rule_q and not generic_q:
            return
        wanted = sorted({i for i, _ in rule_q + generic_q})
        if rerun is None:
            return  # no forward pass to run again: the size-based reading
        seen = self._probe(plans, wanted, model, rerun, deactivate, batch)
        if seen is None:
            self.unavailable = True
            return
        base, rotated, perm = seen
        for i, c in rule_q:
            self._decide_rule(plans[i], i, c, base, rotated, perm, batch)
        for i, c in generic_q:
            flags = self._decide_generic(i, c, base, rotated, perm, batch)
            if flags is None:  # undecided: the size-based reading, pinned (docstring)
                tensors = [t for t in _leaves(calls[i][c].args, calls[i][c].kwargs)
                           if isinstance(t, torch.Tensor)]
                flags = tuple(t.dim() > 0 and t.shape[0] == batch for t in tensors)
            self.generic[(i, c)] = flags
            calls[i][c].batched = flags

    def _probe(
        self,
        plans: Sequence[Any],
        wanted: list[int],
        model: nn.Module,
        rerun: Rerun,
        deactivate: Callable[[], contextlib.AbstractContextManager[Any]],
        batch: int,
    ) -> tuple[dict[int, list[list[Any]]], dict[int, list[list[Any]]], torch.Tensor] | None:
        perm = torch.roll(torch.arange(batch), 1)  # example j takes row j - 1: no fixed point
        runs: list[dict[int, list[list[Any]]]] = []
        for order in (None, perm):
            seen: dict[int, list[list[Any]]] = {i: [] for i in wanted}
            with _recording(plans, wanted, seen), _quiet(model), deactivate():
                try:
                    rerun(order)
                except Exception:  # noqa: BLE001 - an undecidable probe is not an error
                    return None
            runs.append(seen)
        return runs[0], runs[1], perm

    def _decide_rule(
        self, plan: Any, i: int, c: int, base: dict[int, list[list[Any]]],
        rotated: dict[int, list[list[Any]]], perm: torch.Tensor, batch: int,
    ) -> None:
        self.rule_layout[(i, c)] = True  # pinned whatever the answer (module docstring)
        b, r = base[i], rotated[i]
        if c >= len(b) or c >= len(r) or not b[c] or not r[c]:
            return
        x, y = b[c][0], r[c][0]
        first = _close(_rotated(x, 0, perm), y)
        others = [d for d in range(1, x.dim())
                  if x.shape[d] == batch and _close(_rotated(x, d, perm), y)]
        if others and not first:
            raise ValueError(
                f"module {plan.name or '<root>'!r} ({type(plan.module).__name__}) got an input "
                f"of shape {tuple(x.shape)} whose batch dimension is {others[0]}, not 0 (a "
                "time-major or sequence-first layout); per-example rules need batch-first "
                "inputs: use batch_first=True or move the batch to dimension 0 before the call"
            )

    @staticmethod
    def _decide_generic(
        i: int, c: int, base: dict[int, list[list[Any]]], rotated: dict[int, list[list[Any]]],
        perm: torch.Tensor, batch: int,
    ) -> tuple[bool, ...] | None:
        b, r = base[i], rotated[i]
        if c >= len(b) or c >= len(r) or len(b[c]) != len(r[c]):
            return None
        flags: list[bool] = []
        for x, y in zip(b[c], r[c], strict=True):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                return None
            if x.dim() == 0 or x.shape[0] != batch:
                flags.append(False)
                continue
            per_example = _close(_rotated(x, 0, perm), y)
            if not per_example and not _close(x, y):
                return None  # neither: the forward mixes the examples; the coverage check's
            flags.append(per_example)  # identical rows (an expanded mask): per example
        return tuple(flags)


@contextlib.contextmanager
def _recording(
    plans: Sequence[Any], wanted: list[int], seen: dict[int, list[list[Any]]]
) -> Iterator[None]:
    """Forward hooks that keep the tensor leaves of each call of the ``wanted`` plans."""
    handles = []

    def hook_for(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            seen[i].append([t for t in _leaves(args, kwargs) if isinstance(t, torch.Tensor)])
        return hook

    try:
        for i in wanted:
            handles.append(plans[i].module.register_forward_hook(hook_for(i), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _quiet(model: nn.Module) -> Iterator[None]:
    """No autograd, train-mode randomness off (eval), the RNG streams left as they were."""
    devices = sorted({p.device.index for p in model.parameters()
                      if p.device.type == "cuda" and p.device.index is not None})
    with evaluating(model), torch.no_grad(), torch.random.fork_rng(devices=devices):
        yield

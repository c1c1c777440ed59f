"""Per-example losses for an Opacus-style loop that backpropagates one reduced loss.

An Opacus loop (``grad_sample_mode="hooks"``, the default) computes one scalar loss from the
model's outputs with the user's own criterion and calls ``loss.backward()``; Opacus reads each
example's gradient off that backward, scaled by the batch size when the loss is a mean. dpfy's
step (:mod:`dpfy.training.step`) instead wants a vector of per-example losses ``[B]`` to run its
own backward. :class:`OutputGradients` builds one from the user's backward without changing
the model:

1. While a physical batch of B rows is out, a forward hook on the *root* module hands the loop a
   detached copy ``o'`` of every differentiable output ``o`` (the model's own ``o`` stays in the
   graph that dpfy's layer hooks record). The user's ``loss.backward()`` then stops at ``o'``:
   it costs the loss part only, writes no ``p.grad``, and leaves ``g = dL/do'`` there.
2. At ``optimizer.step()``, :meth:`OutputGradients.per_example_losses` returns the surrogate
   ``l_i = f * <o[i], g[i]>`` (a sum over the non-batch dimensions), with f = B for
   ``loss_reduction="mean"`` and 1 for ``"sum"``. Its gradient with respect to ``o[i]`` is
   ``f g[i]``, so dpfy's backward from ``l`` sends exactly ``f dL/do`` through the model:
   each example's gradient is the one Opacus would compute, and dpfy clips, sums and noises
   it as for any per-example loss. An output whose first dimension is not the batch (a loss
   the model computes itself, e.g. a transformers ``outputs.loss``) cannot be cut per row:
   its term ``f <o, g>`` goes to row 0, which dpfy's loader keeps real whenever the batch has
   a real row (padding rows come last), and its gradient reaches every row's layers through
   the model as before.

A loss term computed from the parameters themselves rather than from the model's outputs (a weight
penalty added to the loss, or a second call of a submodule outside ``model(batch)``) reaches the
parameters' ``.grad`` directly in the user's backward, bypassing the detached outputs. It has no
per-example gradient that dpfy could clip, and Opacus drops it silently when it overwrites
``.grad`` with the noisy sum. Here it is refused at ``optimizer.step()``, naming the parameters: a
hook on every trainable parameter notes any gradient accumulated while a batch is out. (A weight
penalty that reads no data belongs in the optimizer, e.g. ``weight_decay``: it is applied after the
release.)

The attribution check (:mod:`dpfy.training.norms.attribution`) reruns the model on one example
alone and differentiates ``f * <o_alone, g[i]>`` with the same ``g`` (:meth:`OutputGradients.
losses_of_rows`): without mixing between examples that is the example's own gradient, so a model
that mixes examples in its forward (centring over the batch, say) is refused before the release.

Assumption (Opacus makes the same one): the backpropagated loss is a mean (or a sum, with
``loss_reduction="sum"``) over the rows of the batch of terms that each depend on one row only,
as cross-entropy, MSE or a token-mean language-model loss per row are. A loss that couples
rows (normalised over the batch, contrastive within the batch) has no per-example gradient, and
neither Opacus nor this module can bound one example's influence on it. Use
``grad_sample_mode="ghost"`` with a ``criterion`` to have dpfy compute the per-example losses
itself.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

Reduction = Literal["mean", "sum"]


class OutputGradients:
    """The per-example losses of one Opacus-style loop over ``model`` (module docstring).

    Args:
      model: the user's model (never wrapped; one forward hook on it while a batch is out).
      reduction: how the backpropagated loss reduces over the rows: ``"mean"`` or ``"sum"``.
    """

    def __init__(self, model: nn.Module, reduction: Reduction) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"loss_reduction must be one of {{mean, sum}}, got loss_reduction={reduction!r}"
            )
        self.model = model
        self.reduction: Reduction = reduction
        self._rows = 0
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handle: RemovableHandle | None = None
        self._param_hooks: list[RemovableHandle] = []
        self._reached: list[str] = []
        #: the last batch's output gradients (None where an output got none), kept for
        #: :meth:`losses_of_rows`; None when an output had no row per example
        self._alone: list[torch.Tensor | None] | None = None
        self._factor = 1.0

    def open(self, rows: int) -> None:
        """A physical batch of ``rows`` rows is out: detach the model's outputs from now on."""
        self.close()
        self._rows = int(rows)
        self._handle = self.model.register_forward_hook(self._detach_outputs)
        self._reached, self._alone = [], None
        self._param_hooks = [
            p.register_post_accumulate_grad_hook(self._note_direct(name))  # type: ignore[no-untyped-call]
            for name, p in self.model.named_parameters()
            if p.requires_grad
        ]

    def close(self) -> None:
        """Remove the hooks and forget the batch's outputs."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for hook in self._param_hooks:
            hook.remove()
        self._param_hooks = []
        self._pairs = []

    def _note_direct(self, name: str) -> Any:
        def note(_param: torch.Tensor) -> None:
            self._reached.append(name)

        return note

    def _detach_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        leaves, spec = tree_flatten(output)
        handed = []
        for o in leaves:
            if _differentiable(o):
                leaf = o.detach().requires_grad_()
                self._pairs.append((o, leaf))
                handed.append(leaf)
            else:
                handed.append(o)
        return tree_unflatten(handed, spec)

    @property
    def recomputable(self) -> bool:
        """Whether the attribution check (:mod:`dpfy.training.norms.attribution`) can rerun the
        last batch's surrogate on some of its rows (:meth:`losses_of_rows`): every output that
        received a gradient had one row per example. A loss the model computed over the whole
        batch (``outputs.loss``) cannot be cut per row, and the check stands down."""
        return self._alone is not None

    def losses_of_rows(self, outputs: Any, rows: torch.Tensor) -> torch.Tensor:
        """The surrogate of the last batch on a fresh forward pass over its ``rows`` only:
        ``f * <o_alone[r], g[rows[r]]>``, with the output gradients ``g`` the user's backward
        left and the same factor ``f``. Without mixing between examples, its gradient is the
        per-example gradient of each of those rows; with mixing, it is not, and the check
        refuses the step."""
        grads = self._alone
        if grads is None:
            raise RuntimeError("the last batch's surrogate cannot be cut per row")
        leaves = [o for o in tree_flatten(outputs)[0] if _differentiable(o)]
        if len(leaves) != len(grads):
            raise RuntimeError(
                f"the model's forward on some rows gave {len(leaves)} differentiable outputs, "
                f"its forward on the batch {len(grads)}"
            )
        total: torch.Tensor | None = None
        for o, g in zip(leaves, grads, strict=True):
            if g is None:
                continue
            part = _row_products(o, g.index_select(0, rows.to(g.device)), len(rows))
            total = part if total is None else total + part
        if total is None:
            raise RuntimeError("no output of the last batch received a gradient")
        return total * self._factor

    def __call__(self, outputs: Any = None, targets: Any = None) -> torch.Tensor:
        """:meth:`per_example_losses`: the object serves as ``make_private``'s ``loss_fn``."""
        return self.per_example_losses(outputs, targets)

    def per_example_losses(self, _outputs: Any = None, _targets: Any = None) -> torch.Tensor:
        """The surrogate losses ``[B]`` of the batch's forward passes (module docstring).

        Takes and ignores ``(outputs, targets)`` so that it serves as the ``loss_fn`` of
        :func:`dpfy.training.make_private`. Closes the batch.

        Raises:
          ValueError: the user's backward reached a parameter directly (module docstring).
          RuntimeError: no output of the batch received a gradient (``optimizer.step()``
            without ``loss.backward()``, or a loss not computed from the model's outputs).
        """
        pairs, rows, reached = self._pairs, self._rows, sorted(set(self._reached))
        self.close()
        if reached:
            more = f" and {len(reached) - 3} more" if len(reached) > 3 else ""
            shown = ", ".join(reached[:3]) + more
            raise ValueError(
                f"loss.backward() reached parameter(s) {shown} directly, not through the model's "
                "outputs: a loss term computed from the parameters outside model(batch) (a weight "
                "penalty, a second call of a submodule) has no per-example gradient and would be "
                "dropped from the private step; use the optimizer's weight_decay for a penalty "
                "that reads no data, or compute the term inside the model's forward"
            )
        f = float(rows) if self.reduction == "mean" else 1.0
        terms: torch.Tensor | None = None
        whole: torch.Tensor | None = None
        kept: list[torch.Tensor | None] = []
        for o, leaf in pairs:
            g = leaf.grad
            kept.append(None if g is None else g.detach())
            if g is None:
                continue
            if o.dim() >= 1 and o.shape[0] == rows:
                part = _row_products(o, g, rows) * f
                terms = part if terms is None else terms + part
            else:
                part = _row_products(o.reshape(1, -1), g.reshape(1, -1), 1)[0] * f
                whole = part if whole is None else whole + part
        self._alone, self._factor = (kept, f) if whole is None else (None, f)
        if terms is None and whole is None:
            raise RuntimeError(
                "optimizer.step() found no gradient on the model's outputs for this batch: "
                "call loss.backward() on a loss computed from the outputs of model(batch) "
                "before optimizer.step()"
            )
        if terms is None:
            assert whole is not None
            terms = torch.zeros(rows, dtype=whole.dtype, device=whole.device)
        if whole is not None:
            first = torch.zeros_like(terms)
            first[0] = 1.0
            terms = terms + first * whole
        return terms


def _differentiable(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()


def _row_products(o: torch.Tensor, g: torch.Tensor, rows: int) -> torch.Tensor:
    """``<o[i], g[i]>`` over the non-batch dimensions, in at least fp32 (fp64 stays fp64)."""
    dtype = torch.promote_types(o.dtype, torch.float32)
    return (o.to(dtype) * g.to(dtype)).reshape(rows, -1).sum(1)

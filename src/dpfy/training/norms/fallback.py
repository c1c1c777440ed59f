"""Generic rule for any module without a registered one: ``torch.func.vmap(grad)``.

For a module m called on batch-first inputs x with output gradient g (the gradient of the
summed loss w.r.t. m's output), example n's gradient of m's *own* parameters (``recurse=False``;
children have their own rules) is ``grad_theta <m_theta(x_n), g_n>``. It is computed with
``functional_call`` over those parameters only, vectorised with ``vmap`` in chunks of
``chunk_size`` examples to bound memory. Which tensor inputs are per example (mapped over
their first dimension) and which are shared by the batch is decided by reordering the
examples (:mod:`dpfy.training.norms.layout`); where that could not be decided, every tensor
input whose first dimension is the batch size is taken as per example. Every tensor output is
batch-first, and the module is deterministic (``vmap`` refuses random operations such as
dropout inside it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpfy.training.norms.registry import (
    Capture,
    MaterializedGrads,
    fold_rows,
    layer_label,
    own_parameters,
    parametrization_subtree,
    rewriting_hooks,
    tensor_sum,
)


def fallback_rule(
    module: nn.Module,
    captures: list[Capture],
    group_size: int,
    *,
    chunk_size: int = 32,
    adopt: tuple[str, ...] = (),
) -> MaterializedGrads:
    """Per-example gradients of ``module``'s direct trainable parameters by vmap(grad).

    A parametrized module's own parameters include its parametrizations' (the tensors its
    weight is computed from, :func:`~dpfy.training.norms.registry.own_parameters`).
    ``adopt``: names (relative to ``module``) of descendants' parameters to differentiate as
    well -- those of descendants not called in this chunk, which the module's own forward may
    use directly (``F.linear(x, self.child.weight)``); an unused one gets zero gradients.

    Raises:
      ValueError: ``torch.func`` refuses the call (random numbers such as dropout, an
        ``autograd.Function`` without a vmap rule); the message says why and what to do.
    """
    # a parametrized module's own parameters include its parametrizations' (registry.py)
    params = {name: p.detach() for name, p in own_parameters(module) if p.requires_grad}
    for name in adopt:
        params[name] = module.get_parameter(name).detach()
    total: dict[str, torch.Tensor] | None = None
    for cap in captures:
        leaves, spec = tree_flatten((cap.args, cap.kwargs))
        if cap.batched is not None:  # decided by reordering the examples (norms.layout)
            flags = iter(cap.batched)
            dims = [
                (0 if next(flags) else None) if isinstance(x, torch.Tensor) else None
                for x in leaves
            ]
            batch = next((x.shape[0] for x, d in zip(leaves, dims, strict=True) if d == 0), None)
        else:
            batch = next(
                (x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None
            )
            dims = [_batch_dim(x, batch) for x in leaves]
        if batch is None:
            raise ValueError(f"{type(module).__name__}: no batched tensor input to vmap over")

        in_args, in_kwargs = tree_unflatten(dims, spec)
        for g in cap.grad_outputs:
            if g.dim() == 0 or g.shape[0] != batch:
                raise ValueError(
                    f"{type(module).__name__} has an output that is not batch-first (shape "
                    f"{tuple(g.shape)}, batch {batch}); the generic per-example rule needs "
                    "batch-first outputs (e.g. batch_first=True) or a registered norm rule"
                )

        def inner(
            p: dict[str, torch.Tensor],
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            gouts: tuple[torch.Tensor, ...],
            in_args: Any = in_args,
            in_kwargs: Any = in_kwargs,
        ) -> torch.Tensor:
            args = tree_map(_unsqueeze, args, in_args)
            kwargs = tree_map(_unsqueeze, kwargs, in_kwargs)
            out = functional_call(module, p, args, kwargs)
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            return tensor_sum((o * g.unsqueeze(0)).sum() for o, g in zip(outs, gouts, strict=True))

        # torch.nn.utils.weight_norm's pre-hook sets `module.weight` on each call: inside the
        # transforms to a wrapped tensor that must not outlive them
        saved = {h.name: getattr(module, h.name) for h in rewriting_hooks(module)}
        try:
            per_ex = vmap(
                grad(inner), in_dims=(None, in_args, in_kwargs, 0), chunk_size=chunk_size
            )(params, cap.args, cap.kwargs, tuple(cap.grad_outputs))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # refused by torch.func: say why and what to do
            raise ValueError(_cannot_transform(module, err)) from err
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
        if total is None:
            total = dict(per_ex)
        else:
            total = {k: total[k] + v for k, v in per_ex.items()}
    assert total is not None
    return MaterializedGrads({k: fold_rows(v, group_size) for k, v in total.items()})


def _cannot_transform(module: nn.Module, err: RuntimeError) -> str:
    """Why torch.func refused ``module``'s call, and the fix (the step adds the module path)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "random" in text:
        why = (
            "it draws random numbers (dropout inside the module), and its per-example "
            "gradients come from recomputing the call, which cannot draw the numbers the "
            "forward pass drew"
        )
        fix = (
            "apply the dropout outside this module (e.g. an nn.Dropout on its input or output "
            "in the parent module), or set its probability to 0"
        )
    elif "autograd.Function" in text or "vmap support" in text:
        why = (
            "it calls an autograd.Function that torch.func cannot transform (one with a "
            "non-static forward, or without setup_context and a vmap rule)"
        )
        fix = (
            "give the Function a static forward, a setup_context and generate_vmap_rule = True "
            "or a vmap staticmethod (PyTorch's notes 'Extending torch.func with "
            "autograd.Function')"
        )
    else:
        why, fix = "torch.func cannot transform its call", "change the call so that it can"
    if parametrization_subtree(module) is not None:
        fix += (
            "; or remove its parametrization before training (torch.nn.utils.parametrize."
            "remove_parametrizations)"
        )
    return (
        f"{layer_label(module)} is handled by the generic rule (torch.func vmap(grad) over the "
        f"module's call), but {why}: {text}. Fix: {fix}; or register a norm rule for "
        f"{type(module).__name__} (dpfy.training.norms.register_norm_rule); or freeze its "
        "parameters (module.requires_grad_(False))"
    )


def _batch_dim(x: Any, batch: int | None) -> int | None:
    return 0 if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else None


def _unsqueeze(x: Any, dim: int | None) -> Any:
    return x.unsqueeze(0) if dim == 0 else x

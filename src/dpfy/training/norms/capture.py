"""Forward hooks that record what each module saw, inside a context manager that removes them.

:func:`plan_modules` lists the modules that own trainable parameters (their *direct*
parameters; children are planned on their own) with the norm rule for each (``None``: the
generic vmap rule). :func:`capture_layers` registers one forward hook per planned module for
the duration of a ``with`` block and always removes them; the model and its Parameters are
never wrapped or written to. After the forward pass, :meth:`LayerCapture.backward` asks
autograd for the gradients of the (scaled) per-example losses w.r.t. the recorded module
outputs only -- not w.r.t. the parameters, so the parameter-gradient GEMMs of an ordinary
backward pass are skipped; the rules then build per-example norms and clipped sums from
inputs and output gradients ("book-keeping": one backward pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dpfy.training.norms.registry import (
    Capture,
    NormRule,
    norm_rule_for,
    unsupported_reason,
)

__all__ = [
    "Fallback",
    "ModulePlan",
    "LayerCapture",
    "plan_modules",
    "shared_parameters",
    "capture_layers",
]

#: A forward hook registered with ``with_kwargs=True``: (module, args, kwargs, output).
_ForwardHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ModulePlan:
    """A module owning trainable parameters and the rule that will handle them.

    Attributes:
      name: qualified module name in the model ("" for the root).
      module: the module.
      rule: registered norm rule, or ``None`` for the generic vmap(grad) rule.
      param_names: local names of its trainable direct parameters.
      names: the same parameters' names as ``model.named_parameters()`` reports them (for a
        parameter shared with another module -- tied weights -- the first owner's name).
    """

    name: str
    module: nn.Module
    rule: NormRule | None
    param_names: tuple[str, ...]
    names: tuple[str, ...] = ()

    def qualified(self, local: str) -> str:
        """Name of local parameter ``local`` as in ``model.named_parameters()``."""
        if self.names:
            return self.names[self.param_names.index(local)]
        return f"{self.name}.{local}" if self.name else local


#: What to do with a trainable module that has no registered norm rule.
Fallback = Literal["vmap", "error"]


def plan_modules(model: nn.Module, *, fallback: Fallback = "vmap") -> list[ModulePlan]:
    """Modules of ``model`` owning trainable parameters, with their norm rules.

    Decided once, when the step is built: every trainable module gets its registered rule,
    or (``fallback="vmap"``) the generic ``vmap(grad)`` rule; with ``fallback="error"`` a
    module without a rule is refused here, never in the middle of training. A parameter
    used by several modules (tied weights, e.g. the input embedding and the LM head of a
    language model) is planned under each owner with its one canonical name; the step adds
    the owners' contributions per example (see :func:`shared_parameters`).

    Raises:
      ValueError: a trainable module of a type that cannot be clipped per example
        (:func:`dpfy.training.norms.register_unsupported`), or without a rule when
        ``fallback="error"``; the message names the module and what to do.
    """
    if fallback not in ("vmap", "error"):
        raise ValueError(f"fallback must be 'vmap' or 'error', got fallback={fallback!r}")
    canonical = {id(p): n for n, p in model.named_parameters()}
    plans: list[ModulePlan] = []
    missing: list[str] = []
    for mname, module in model.named_modules():
        local = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not local:
            continue
        label = f"{mname or '<root>'!r} ({type(module).__name__})"
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"module {label} cannot be trained with DP-SGD: {reason}")
        rule = norm_rule_for(module)
        if rule is None and fallback == "error":
            missing.append(label)
        names = tuple(canonical[id(p)] for _, p in local)
        plans.append(ModulePlan(mname, module, rule, tuple(n for n, _ in local), names))
    if missing:
        raise ValueError(
            f"no per-example norm rule for the trainable module(s) {', '.join(missing)}; "
            "register one (dpfy.training.norms.register_norm_rule, checked against "
            "dpfy.training.norms.reference), freeze their parameters (requires_grad=False), or "
            "allow the generic vmap(grad) rule (fallback='vmap')"
        )
    return plans


def shared_parameters(plans: list[ModulePlan]) -> dict[str, list[tuple[int, str]]]:
    """Parameters owned by more than one planned module: ``{name: [(plan index, local)]}``."""
    owners: dict[str, list[tuple[int, str]]] = {}
    for i, plan in enumerate(plans):
        for local in plan.param_names:
            owners.setdefault(plan.qualified(local), []).append((i, local))
    return {n: o for n, o in owners.items() if len(o) > 1}


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


@dataclasses.dataclass(slots=True)
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    versions: list[int]
    spec: Any
    extra: Any = None


class LayerCapture:
    """Recorder of module calls; use through :func:`capture_layers`."""

    def __init__(self, plans: list[ModulePlan], batch_size: int | None = None) -> None:
        self.plans = plans
        self.calls: list[list[_Call]] = [[] for _ in plans]
        self.active = True
        self.batch_size = batch_size

    def _hook(self, index: int) -> _ForwardHook:
        plan = self.plans[index]

        calls = self.calls[index]
        on_forward = getattr(plan.rule, "on_forward", None)

        def rule_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            # registered layers: one tensor input, one tensor output (fast path)
            if not self.active:
                return None
            if not output.requires_grad:
                _check_grad_mode(plan)
                return None
            x = args[0] if args else kwargs["input"]
            batch = self.batch_size
            if batch is not None and batch != 1 and x.dim() > 0 and x.shape[0] == 1:
                # A call shared by the whole batch whose output is broadcast later (position
                # embeddings of ids [1, T]): registered layers act row by row, so the output
                # on the expanded input is the expanded output; handing *that* on gives each
                # example its own output gradient.
                x = x.expand(batch, *x.shape[1:])
                output = output.expand(batch, *output.shape[1:])
                extra = None if on_forward is None else on_forward(module, x, output)
                calls.append(_Call((x.detach(),), {}, [output], [output._version], None, extra))
                return output
            extra = None if on_forward is None else on_forward(module, x, output)
            calls.append(_Call((x.detach(),), {}, [output], [output._version], None, extra))
            return None

        def generic_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            if not self.active:
                return
            if not torch.is_grad_enabled():
                _check_grad_mode(plan)
                return
            leaves, spec = tree_flatten(output)
            outs = [o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point()]
            if not any(o.requires_grad for o in outs):
                return
            calls.append(
                _Call(
                    tree_map(_detach, args),
                    tree_map(_detach, kwargs),
                    outs,
                    [o._version for o in outs],
                    spec,
                )
            )

        hook = rule_hook if plan.rule is not None else generic_hook
        # Under torch.compile the hook must see the real output tensor, the one autograd.grad
        # differentiates for: a traced hook would record a graph-internal value, so it is a
        # graph break (docs/devices.md). torch.compile imports torch._dynamo; without it no
        # compiled code runs, and eager users are spared its import (seconds).
        if "torch._dynamo" not in sys.modules:
            return hook
        return cast(_ForwardHook, torch.compiler.disable(hook, recursive=True))  # type: ignore[no-untyped-call]

    def backward(self, losses: torch.Tensor, scale: torch.Tensor) -> list[list[Capture]]:
        """Gradients of ``sum_i scale_i * losses_i`` w.r.t. every recorded module output.

        Returns, per plan, one :class:`Capture` per recorded call. Raises ``ValueError`` if a
        recorded output was modified in place after the module returned it (its gradient
        would then be the one of the modified value).
        """
        self.active = False  # nothing run during backward (e.g. recomputation) is recorded
        targets: list[torch.Tensor] = []
        for plan, calls in zip(self.plans, self.calls, strict=True):
            for call in calls:
                for o, v in zip(call.outputs, call.versions, strict=True):
                    if o._version != v:
                        raise ValueError(
                            f"the output of module {plan.name or '<root>'!r} "
                            f"({type(plan.module).__name__}) was modified in place after the "
                            "forward call (e.g. ReLU(inplace=True) or `out += x`); per-example "
                            "gradients need the unmodified output: use an out-of-place operation"
                        )
                    if o.requires_grad:
                        targets.append(o)
        grads = iter(
            torch.autograd.grad(
                losses, targets, grad_outputs=scale, allow_unused=True, materialize_grads=True
            )
            if targets
            else ()
        )
        result: list[list[Capture]] = []
        for calls in self.calls:
            caps = []
            for call in calls:
                gouts = tuple(
                    next(grads) if o.requires_grad else torch.zeros_like(o) for o in call.outputs
                )
                caps.append(Capture(call.args, call.kwargs, gouts, call.spec, call.extra))
            result.append(caps)
        for calls in self.calls:
            calls.clear()
        return result


def _check_grad_mode(plan: ModulePlan) -> None:
    """Refuse a trainable module run without autograd inside the step (it would get no
    gradient, silently): reentrant activation checkpointing runs its segments so."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            f"module {plan.name or '<root>'!r} ({type(plan.module).__name__}) ran with gradients "
            "disabled during the private step, so its per-example gradients cannot be "
            "recorded; with activation checkpointing use the non-reentrant variant "
            "(torch.utils.checkpoint(..., use_reentrant=False); transformers: "
            "model.gradient_checkpointing_enable() or gradient_checkpointing_kwargs="
            "{'use_reentrant': False})"
        )


@contextlib.contextmanager
def capture_layers(
    plans: list[ModulePlan], batch_size: int | None = None
) -> Iterator[LayerCapture]:
    """Record the calls of the planned modules inside the block; hooks are always removed.

    ``batch_size`` (when known) lets a registered layer called once on a batch-1 input whose
    output is broadcast over the batch (position embeddings) be recorded per example.
    """
    recorder = LayerCapture(plans, batch_size)
    handles = []
    try:
        for i, plan in enumerate(plans):
            handles.append(
                plan.module.register_forward_hook(recorder._hook(i), with_kwargs=True)
            )
        yield recorder
    finally:
        for h in handles:
            h.remove()
        recorder.active = False

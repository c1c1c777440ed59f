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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dpfy.training.norms.registry import Capture, NormRule, norm_rule_for

__all__ = ["ModulePlan", "LayerCapture", "plan_modules", "capture_layers"]

#: A forward hook registered with ``with_kwargs=True``: (module, args, kwargs, output).
_ForwardHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]


@dataclasses.dataclass(frozen=True, slots=True)
class ModulePlan:
    """A module owning trainable parameters and the rule that will handle them.

    Attributes:
      name: qualified module name in the model ("" for the root).
      module: the module.
      rule: registered norm rule, or ``None`` for the generic vmap(grad) rule.
      param_names: local names of its trainable direct parameters.
    """

    name: str
    module: nn.Module
    rule: NormRule | None
    param_names: tuple[str, ...]

    def qualified(self, local: str) -> str:
        """Qualified parameter name as in ``model.named_parameters()``."""
        return f"{self.name}.{local}" if self.name else local


def plan_modules(model: nn.Module) -> list[ModulePlan]:
    """Modules of ``model`` owning trainable parameters, with their norm rules.

    Raises:
      ValueError: a trainable Parameter is owned by two modules (tied weights), whose
        per-example gradient is a sum over modules that the per-layer rules cannot see.
    """
    plans: list[ModulePlan] = []
    owner: dict[int, str] = {}
    for mname, module in model.named_modules():
        local = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not local:
            continue
        for n, p in local:
            qn = f"{mname}.{n}" if mname else n
            if id(p) in owner:
                raise ValueError(
                    f"parameter {qn!r} is the same tensor as {owner[id(p)]!r} (tied weights); "
                    "per-example clipping of tied parameters is not supported -- untie them or "
                    "freeze one copy"
                )
            owner[id(p)] = qn
        plans.append(ModulePlan(mname, module, norm_rule_for(module), tuple(n for n, _ in local)))
    return plans


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

    def __init__(self, plans: list[ModulePlan]) -> None:
        self.plans = plans
        self.calls: list[list[_Call]] = [[] for _ in plans]
        self.active = True

    def _hook(self, index: int) -> _ForwardHook:
        plan = self.plans[index]

        calls = self.calls[index]
        on_forward = getattr(plan.rule, "on_forward", None)

        def rule_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            # registered layers: one tensor input, one tensor output (fast path)
            if not self.active or not output.requires_grad:
                return
            x = args[0] if args else kwargs["input"]
            extra = None if on_forward is None else on_forward(module, x, output)
            calls.append(_Call((x.detach(),), {}, [output], [output._version], None, extra))

        def generic_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            if not self.active or not torch.is_grad_enabled():
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

        return rule_hook if plan.rule is not None else generic_hook

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


@contextlib.contextmanager
def capture_layers(plans: list[ModulePlan]) -> Iterator[LayerCapture]:
    """Record the calls of the planned modules inside the block; hooks are always removed."""
    recorder = LayerCapture(plans)
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

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
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpfy.training.norms.attribution import LossOf
from dpfy.training.norms.layout import Rerun
from dpfy.training.norms.registry import (
    Capture,
    NormRule,
    Recompute,
    covers_subtree,
    layer_label,
    norm_rule_for,
    own_parameters,
    parametrization_subtree,
    recompute_for,
    unsupported,
)

#: A forward hook registered with ``with_kwargs=True``: (module, args, kwargs, output).
_ForwardHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ModulePlan:
    """A module owning trainable parameters and the rule that will handle them.

    Attributes:
      name: qualified module name in the model ("" for the root).
      module: the module.
      rule: registered norm rule, or ``None`` for the generic vmap(grad) rule.
      param_names: local names of its trainable direct parameters (with a rule that covers
        its subtree, also its descendants', e.g. ``"out_proj.weight"``).
      names: the same parameters' names as ``model.named_parameters()`` reports them (for a
        parameter shared with another module -- tied weights -- the first owner's name).
      recompute: the rule's recompute hook (:class:`~dpfy.training.norms.registry.Recomputed`).
      adoptable: generic rule only: ``(local name, plan index, the owner's local name)`` of
        each trainable parameter of a descendant module planned on its own. A descendant
        that is not called in a chunk may still have its parameters used by this module's
        forward (``F.linear(x, self.child.weight)``); the generic rule then differentiates
        them too (zero if unused).
    """

    name: str
    module: nn.Module
    rule: NormRule | None
    param_names: tuple[str, ...]
    names: tuple[str, ...] = ()
    recompute: Recompute | None = None
    adoptable: tuple[tuple[str, int, str], ...] = ()

    def qualified(self, local: str) -> str:
        """Name of local parameter ``local`` as in ``model.named_parameters()``."""
        if self.names and local in self.param_names:
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
        (:func:`dpfy.training.norms.registry.register_unsupported`), or without a rule when
        ``fallback="error"``; the message names the module and what to do.
    """
    if fallback not in ("vmap", "error"):
        raise ValueError(f"fallback must be 'vmap' or 'error', got fallback={fallback!r}")
    canonical = {id(p): n for n, p in model.named_parameters()}
    plans: list[ModulePlan] = []
    missing: list[str] = []
    inside: list[str] = []  # modules whose rule covers their subtree
    for mname, module in model.named_modules():
        if any(_within(mname, top) for top in inside):
            continue
        rule = norm_rule_for(module)
        subtree = rule is not None and covers_subtree(module)
        # a parametrized module's own parameters include its parametrizations' (the tensors
        # its weight is computed from); the generic rule differentiates them through its call
        owned = module.named_parameters(recurse=True) if subtree else own_parameters(module)
        local = [(n, p) for n, p in owned if p.requires_grad]
        if subtree:
            inside.append(mname)
        held = parametrization_subtree(module)
        if held is not None:
            inside.append(f"{mname}.{held}" if mname else held)
        if not local:
            continue
        label = f"{mname or '<root>'!r} ({layer_label(module)})"
        refusal = unsupported(module)
        if refusal is not None:
            raise ValueError(
                f"module {label} cannot be trained with DP-SGD: {refusal[0]} Fix: {refusal[1]}"
            )
        if rule is None and fallback == "error":
            missing.append(label)
        names = tuple(canonical[id(p)] for _, p in local)
        plans.append(
            ModulePlan(
                mname, module, rule, tuple(n for n, _ in local), names,
                recompute_for(module) if rule is not None else None,
            )
        )
    if missing:
        raise ValueError(
            f"no per-example norm rule for the trainable module(s) {', '.join(missing)}; "
            "register one (dpfy.training.norms.register_norm_rule, checked against "
            "dpfy.training.norms.reference), freeze their parameters (requires_grad=False), or "
            "allow the generic vmap(grad) rule (fallback='vmap')"
        )
    return [_with_adoptable(plan, plans) if plan.rule is None else plan for plan in plans]


def reported_names(plan: ModulePlan, plans: list[ModulePlan]) -> dict[str, str]:
    """Local -> model names of every parameter ``plan``'s layer may report: its own and, for
    the generic rule, the descendants' it may adopt (named as their owners name them)."""
    own = {local: plan.qualified(local) for local in plan.param_names}
    return own | {local: plans[j].qualified(theirs) for local, j, theirs in plan.adoptable}


def _within(name: str, top: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``top`` ("" is the root)."""
    return name != top and (top == "" or name.startswith(top + "."))


def _with_adoptable(plan: ModulePlan, plans: list[ModulePlan]) -> ModulePlan:
    """``plan`` with the descendants' parameters its generic rule may have to differentiate."""
    adopt: list[tuple[str, int, str]] = []
    cut = len(plan.name) + 1 if plan.name else 0
    for j, other in enumerate(plans):
        if other is plan or not _within(other.name, plan.name):
            continue
        rel = other.name[cut:]
        adopt.extend((f"{rel}.{local}", j, local) for local in other.param_names)
    return dataclasses.replace(plan, adoptable=tuple(adopt)) if adopt else plan


#: Containers whose ``forward`` (if any) only calls their children: never a parameter's user.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def watch_plans(model: nn.Module, plans: list[ModulePlan]) -> list[ModulePlan]:
    """Generic plans, without parameters of their own, for every ancestor of a planned module.

    Recorded during the coverage check only: when a parameter's module is never called (its
    parent used the parameter directly), the smallest recorded ancestor that was called is
    where the parameter's per-example gradient can be taken (its generic rule, adopting the
    parameter). Containers that only call their children are left out.
    """
    planned = {plan.name for plan in plans}
    watched: list[ModulePlan] = []
    for mname, module in model.named_modules():
        if mname in planned or isinstance(module, _CONTAINERS):
            continue
        if not any(_within(p, mname) for p in planned):
            continue
        shell = ModulePlan(mname, module, None, ())
        watched.append(_with_adoptable(shell, plans))
    return watched


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
    widened: bool = False  # a batch-1 call read as shared by the batch (see rule_hook)
    batched: tuple[bool, ...] | None = None  # generic calls: per-example tensor leaves (layout)


class LayerCapture:
    """Recorder of module calls; use through :func:`capture_layers`."""

    def __init__(self, plans: list[ModulePlan], batch_size: int | None = None) -> None:
        self.plans = plans
        self.calls: list[list[_Call]] = [[] for _ in plans]
        self.active = True
        self.batch_size = batch_size
        #: plans with a call that ran with autograd off, so recorded nothing (_without_grad)
        self.skipped: set[int] = set()
        #: the chunk's forward again with its examples reordered (:mod:`.layout`), if known
        self.rerun: Rerun | None = None
        #: the caller's per-example losses of some rows from a fresh forward (attribution)
        self.loss_of: LossOf | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded inside the block (a probe's extra forward passes)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def _without_grad(self, index: int) -> bool:
        """Whether plan ``index``'s call ran with autograd off; then nothing is recorded.

        Such a call adds nothing to any gradient, in the step as in a loop over the examples
        (a frozen target network, statistics under ``torch.no_grad()``), unless its module is
        run again with autograd on during the backward pass, as reentrant activation
        checkpointing does, whose gradient would escape the rules. That is refused: here when
        the call runs inside an ``autograd.Function``'s forward (:func:`_check_grad_mode`),
        and in :meth:`backward` for a module re-run with autograd on.
        """
        if torch.is_grad_enabled():
            return False
        _check_grad_mode(self.plans[index])
        self.skipped.add(index)
        return True

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
                self._without_grad(index)
                return None
            x = args[0] if args else kwargs["input"]
            batch = self.batch_size
            if batch is not None and batch != 1 and x.dim() > 0 and x.shape[0] == 1:
                # A call shared by the whole batch whose output is broadcast later (position
                # embeddings of ids [1, T]): registered layers act row by row, so the output
                # on the expanded input is the expanded output; handing *that* on gives each
                # example its own output gradient.
                # That reading holds for one such call; a second batch-1 call of the module in
                # the same forward is what a per-example loop written in ``forward`` makes
                # (``layer(x[i:i + 1])`` for each i), where widening would hand every example
                # the rows of another one: refused before any backward or release.
                if any(c.widened for c in calls):
                    raise ValueError(
                        f"module {plan.name or '<root>'!r} ({type(module).__name__}) was called "
                        "more than once on a batch-1 input in one forward pass, as a per-example "
                        "loop in forward() does (layer(x[i:i+1]) for each i); its calls cannot be "
                        "attributed to examples. Call it once on the whole batch (vectorise the "
                        "loop), or, for an input shared by every example such as position ids, "
                        "expand it to the batch first (ids.expand(batch_size, -1))"
                    )
                x = x.expand(batch, *x.shape[1:])
                output = output.expand(batch, *output.shape[1:])
                extra = None if on_forward is None else on_forward(module, x, output)
                calls.append(
                    _Call((x.detach(),), {}, [output], [output._version], None, extra, True)
                )
                return output
            extra = None if on_forward is None else on_forward(module, x, output)
            calls.append(_Call((x.detach(),), {}, [output], [output._version], None, extra))
            return None

        def generic_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            if not self.active:
                return None
            if self._without_grad(index):
                return None
            leaves, spec = tree_flatten(output)
            if not any(_differentiable(o) for o in leaves):
                return None
            # Each output is handed on as a view of itself: the gradient recorded for it is then
            # the one from the rest of the model only. Without the views, an output computed
            # from another output of the same call (an LSTM cell's h' from its c') would carry
            # the path through that other output, counted a second time when the generic rule
            # differentiates the whole call (docs/architecture.md, 4.2, "Rules, the generic
            # method and the coverage check").
            leaves = [o.view_as(o) if _differentiable(o) else o for o in leaves]
            outs = [o for o in leaves if _differentiable(o)]
            calls.append(
                _Call(
                    tree_map(_detach, args),
                    tree_map(_detach, kwargs),
                    outs,
                    [o._version for o in outs],
                    spec,
                )
            )
            return tree_unflatten(leaves, spec)

        def recompute_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            if not self.active:
                return None
            if self._without_grad(index):
                return None
            assert plan.recompute is not None
            redone = plan.recompute(module, args, kwargs, output)
            if redone is None:
                return None
            targets = list(redone.targets)
            calls.append(
                _Call(
                    tree_map(_detach, args),
                    tree_map(_detach, kwargs),
                    targets,
                    [t._version for t in targets],
                    None,
                    redone.extra,
                )
            )
            return redone.output

        if plan.recompute is not None:
            hook: _ForwardHook = recompute_hook
        else:
            hook = rule_hook if plan.rule is not None else generic_hook
        # Under torch.compile the hook must see the real output tensor, the one autograd.grad
        # differentiates for: a traced hook would record a graph-internal value, so it is a
        # graph break (docs/devices.md). torch.compile imports torch._dynamo; without it no
        # compiled code runs, and eager users are spared its import (seconds).
        if "torch._dynamo" not in sys.modules:
            return hook
        return cast(_ForwardHook, functools.partial(_opaque_call(), hook))

    def backward(
        self,
        losses: torch.Tensor,
        scale: torch.Tensor,
        params: Sequence[torch.Tensor] = (),
    ) -> tuple[list[list[Capture]], list[torch.Tensor | None]]:
        """Gradients of ``sum_i scale_i * losses_i`` w.r.t. every recorded module output.

        Returns, per plan, one :class:`Capture` per recorded call, and the batch gradients of
        ``params`` (``None`` where a parameter got none) from the same backward pass (the
        coverage check compares them with the per-example sums). Raises ``ValueError`` if a
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
        n_targets = len(targets)
        wanted = targets + [p for p in params if p.requires_grad]
        if self.skipped and not losses.requires_grad:
            raise ValueError(
                "the per-example losses carry no gradient: the forward pass ran with autograd "
                f"off (modules {self._names(self.skipped)}); run the private step with "
                "gradients enabled (not inside torch.no_grad() or torch.inference_mode())"
            )
        with self._reruns() as rerun:
            everything = (
                torch.autograd.grad(losses, wanted, grad_outputs=scale, allow_unused=True)
                if wanted
                else ()
            )
        if rerun:
            raise ValueError(
                f"module(s) {self._names(rerun)} ran with autograd off in the forward pass and "
                "again with autograd on during the backward pass, as reentrant activation "
                "checkpointing does: their gradients come from calls that cannot be recorded, "
                "so nothing was released. Fix: use the non-reentrant variant "
                "(torch.utils.checkpoint.checkpoint(..., use_reentrant=False)), or do not call "
                "these modules under torch.no_grad() when they are to be trained"
            )
        batch_grads = iter(everything[n_targets:])
        param_grads = [next(batch_grads) if p.requires_grad else None for p in params]
        grads = iter(
            g if g is not None else torch.zeros_like(t)
            for g, t in zip(everything[:n_targets], targets, strict=True)
        )
        result: list[list[Capture]] = []
        for calls in self.calls:
            caps = []
            for call in calls:
                gouts = tuple(
                    next(grads) if o.requires_grad else torch.zeros_like(o) for o in call.outputs
                )
                caps.append(
                    Capture(call.args, call.kwargs, gouts, call.spec, call.extra, call.batched)
                )
            result.append(caps)
        for calls in self.calls:
            calls.clear()
        return result, param_grads

    @contextlib.contextmanager
    def _reruns(self) -> Iterator[set[int]]:
        """The skipped plans (:meth:`_without_grad`) whose module runs with autograd on inside
        the block (the backward pass).

        Non-reentrant checkpointing re-runs, during the backward pass, calls that were
        recorded with autograd on; a module re-run there after a call with autograd off is
        what reentrant checkpointing (done by hand outside an ``autograd.Function``) does.
        The coverage check cannot see it: that gradient is accumulated into ``.grad`` by the
        re-run's own backward, not returned by this pass's ``autograd.grad``. A module both
        checkpointed (non-reentrant) and called elsewhere under ``torch.no_grad()`` is
        refused too (the safe side). Such a re-run's backward writes ``.grad`` of the
        module's parameters; those are put back as they were, so a refusal writes nothing.
        """
        seen: set[int] = set()
        watch = {id(self.plans[i].module): i for i in self.skipped}
        if not watch:
            yield seen
            return
        params = {id(p): p for i in self.skipped for p in self.plans[i].module.parameters()}
        grads = [(p, None if p.grad is None else p.grad.clone()) for p in params.values()]

        def pre_hook(module: nn.Module, args: Any) -> None:
            index = watch.get(id(module))
            if index is not None and torch.is_grad_enabled():
                seen.add(index)

        handle = nn.modules.module.register_module_forward_pre_hook(pre_hook)
        try:
            yield seen
        finally:
            handle.remove()
            if seen:
                for p, g in grads:
                    p.grad = g

    def _names(self, indices: set[int], most: int = 3) -> str:
        """``'a' (Linear), 'b' (Conv2d) and 2 more``."""
        named = [
            f"{self.plans[i].name or '<root>'!r} ({type(self.plans[i].module).__name__})"
            for i in sorted(indices)
        ]
        more = f" and {len(named) - most} more" if len(named) > most else ""
        return ", ".join(named[:most]) + more


def _call_hook(hook: _ForwardHook, *args: Any) -> Any:
    """``hook(*args)``: the trampoline :func:`_opaque_call` hides from ``torch.compile``."""
    return hook(*args)


@functools.cache
def _opaque_call() -> Callable[..., Any]:
    """:func:`_call_hook` under ``torch.compiler.disable(recursive=True)``: a graph break
    whose callee (the hook it is given, and all it calls) runs eagerly.

    Made once per process (cached): ``torch.compiler.disable`` builds a new wrapper at every
    call (about 10 us each), which a wrapper per hook per chunk would pay on every step.
    """
    opaque: Callable[..., Any] = torch.compiler.disable(_call_hook, recursive=True)  # type: ignore[no-untyped-call]
    return opaque


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad


def _check_grad_mode(plan: ModulePlan) -> None:
    """Refuse a trainable module run with autograd off inside an ``autograd.Function``'s
    forward: reentrant activation checkpointing runs its segments so and computes their
    gradients in the Function's backward by running them again, where nothing is recorded.

    ``torch.no_grad()`` turns reverse-mode autograd off and leaves forward-mode AD on (its
    documentation: "This API does not apply to forward-mode AD"); ``Function.apply`` runs the
    forward with both off (``tests/training/test_refusals.py`` fails if that changes), and so
    does ``torch.inference_mode()``, whose tensors can carry no gradient at all. A call with
    only reverse mode off is the user's ``torch.no_grad()``: it adds nothing to the gradient
    and is accepted (:meth:`LayerCapture._without_grad`).
    """
    from torch.autograd.forward_ad import _is_fwd_grad_enabled

    if _is_fwd_grad_enabled() or torch.is_inference_mode_enabled():
        return
    raise ValueError(
        f"module {plan.name or '<root>'!r} ({type(plan.module).__name__}) ran with gradients "
        "disabled inside an autograd.Function's forward during the private step, as "
        "reentrant activation checkpointing runs it, so its gradient would be computed where "
        "it cannot be recorded; with activation checkpointing use the non-reentrant variant "
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

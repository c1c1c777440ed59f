"""Registry of per-layer norm rules, and the objects the rules return.

A *norm rule* turns what one module saw during a forward/backward pass -- its inputs and the
gradient of the summed loss with respect to its outputs -- into a :class:`LayerGrads`: an object
that reports each example's squared gradient norm for every trainable parameter of the module
and, given one clip weight per example, the clipped weighted sum ``sum_i w_i grad_i`` of the
parameter gradients. Rules are registered by *exact* module type (a subclass may override
``forward``, so it falls back to the generic rule until someone registers it).

Unit of "example": row ``i`` of the batch, or, with ``group_size`` k > 1, the k consecutive
rows ``[j*k, (j+1)*k)`` whose gradients are summed before taking the norm (microbatches).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn


@dataclasses.dataclass(frozen=True, slots=True)
class Capture:
    """One call of a module: detached inputs and the gradients w.r.t. its tensor outputs.

    Attributes:
      args: positional inputs of the call (tensors detached).
      kwargs: keyword inputs of the call (tensors detached).
      grad_outputs: gradient of the (scaled) summed loss w.r.t. each tensor output, in the
        order of the flattened outputs; zeros where an output did not reach the loss.
      output_spec: pytree spec of the outputs (used by the generic fallback rule).
      extra: what the rule's optional ``on_forward(module, input, output)`` returned during
        the forward pass (e.g. statistics autograd saved), else ``None``.
      batched: for the generic rule, one flag per tensor leaf of ``(args, kwargs)``: per
        example (mapped over) or shared by the batch, as :mod:`dpfy.training.norms.layout`
        decided; ``None``: not decided (a leaf with the batch size as first dimension is
        then taken as per example).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad_outputs: tuple[torch.Tensor, ...]
    output_spec: Any = None
    extra: Any = None
    batched: tuple[bool, ...] | None = None


class LayerGrads(Protocol):
    """Per-example gradient information of one module's trainable parameters."""

    def squared_norms(self) -> dict[str, torch.Tensor]:
        """Squared L2 norm of each example's gradient, per local parameter name, shape [N]."""
        ...

    def zero_rows(self, rows: torch.Tensor) -> None:
        """Zero the contribution of the examples where the bool mask ``rows`` [N] is True."""
        ...

    def weighted_sum(
        self, weights: dict[str, torch.Tensor], out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``sum_i weights[name][i] * grad_i`` per local parameter name, in its shape.

        With ``out`` (``{name: tensor of the parameter's shape}``) the sums are *added* into
        those tensors in place (gradient accumulation without new allocations); returns
        ``out``. An implementation may also accept a keyword ``overwrite=True``: then it
        *writes* the sums into ``out``, ignoring the old contents (even NaN), for every
        parameter its ``squared_norms`` reports; this saves zeroing the accumulator.
        """
        ...


class OverwritingGrads(Protocol):
    """LayerGrads whose ``weighted_sum`` also takes ``overwrite=`` (see :class:`LayerGrads`)."""

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]: ...


@functools.cache
def overwrites(kind: type[LayerGrads]) -> bool:
    """Whether a LayerGrads type's ``weighted_sum`` takes ``overwrite=`` (see the protocol)."""
    try:
        return "overwrite" in inspect.signature(kind.weighted_sum).parameters
    except (TypeError, ValueError):
        return False


NormRule = Callable[[nn.Module, list[Capture], int], LayerGrads]
_RULES: dict[type[nn.Module], NormRule] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class Recomputed:
    """A module call recomputed so that the tensors a rule needs are on the autograd path.

    Attributes:
      output: what the model sees instead of the module's own output: the same structure and
        values (up to rounding; random operations such as dropout drawn anew), computed
        differentiably from the call's inputs and the module's parameters.
      targets: intermediate tensors of that computation (e.g. the pre-activations of an RNN's
        gates, the projections of an attention layer) whose gradients the rule needs; they
        reach the rule as :attr:`Capture.grad_outputs`, in this order (zeros where a target
        did not reach the loss).
      extra: anything else the rule needs (detached), as :attr:`Capture.extra`.
    """

    output: Any
    targets: tuple[torch.Tensor, ...]
    extra: Any = None


#: ``recompute(module, args, kwargs, output) -> Recomputed | None``: called in the forward hook
#: of a module whose rule needs gradients of tensors *inside* the call (``args``/``kwargs`` as
#: the module got them, not detached); ``None``: nothing to record for this call.
Recompute = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], "Recomputed | None"]
_RECOMPUTE: dict[type[nn.Module], Recompute] = {}
_SUBTREE: set[type[nn.Module]] = set()

_M = TypeVar("_M", bound=nn.Module)
_G = TypeVar("_G", bound=LayerGrads)
#: A rule as written for its module types: ``RuleFor[nn.Linear, LinearForm]``.
RuleFor = Callable[[_M, list[Capture], int], _G]


def register_norm_rule(
    *module_types: type[_M],
    replace: bool = False,
    recompute: Recompute | None = None,
    subtree: bool = False,
) -> Callable[[RuleFor[_M, _G]], RuleFor[_M, _G]]:
    """Decorator registering ``rule(module, captures, group_size) -> LayerGrads`` for the types.

    A rule may carry an attribute ``on_forward(module, input, output) -> Any``, called in the
    forward hook; its result reaches the rule as :attr:`Capture.extra`.

    Args:
      recompute: for a layer whose parameter gradients need tensors inside the call (fused
        recurrent kernels, attention): the forward hook returns ``recompute(...).output`` in
        place of the module's output, and the rule gets the gradients of its ``targets``
        (see :class:`Recomputed`). Without it the rule gets the gradients of the outputs.
      subtree: the rule covers the trainable parameters of the module's whole subtree
        (local names such as ``"out_proj.weight"``); its descendants are not planned on their
        own (``nn.MultiheadAttention`` uses ``out_proj``'s weight without calling it).

    Raises:
      ValueError: a rule is already registered for one of the types and ``replace`` is false
        (nothing is registered then): a second rule would silently change how that layer's
        per-example norms are computed.
    """
    if not module_types:
        raise ValueError("register_norm_rule needs at least one module type")
    taken = [t for t in module_types if t in _RULES]
    if taken and not replace:
        names = ", ".join(t.__qualname__ for t in taken)
        raise ValueError(
            f"a norm rule is already registered for {names}; pass replace=True to replace it"
        )

    def deco(rule: RuleFor[_M, _G]) -> RuleFor[_M, _G]:
        # Sound: norm_rule_for dispatches on the exact type, so a rule stored under one of
        # ``module_types`` is only ever called with a module of that type.
        generic = cast(NormRule, rule)
        for t in module_types:
            _RULES[t] = generic
            _RECOMPUTE.pop(t, None)
            _SUBTREE.discard(t)
            if recompute is not None:
                _RECOMPUTE[t] = recompute
            if subtree:
                _SUBTREE.add(t)
        return rule

    return deco


_BY_NAME: dict[str, NormRule] = {}


def register_norm_rule_by_name(
    *qualified_names: str,
) -> Callable[[RuleFor[_M, _G]], RuleFor[_M, _G]]:
    """Decorator registering a rule for classes named ``"package.module.ClassName"``.

    For layers of optional libraries (``transformers``' ``Conv1D`` and its many per-model
    RMSNorm copies): nothing is imported; a module whose exact class has that qualified name
    gets the rule (and its type is then registered as by :func:`register_norm_rule`).
    """

    def deco(rule: RuleFor[_M, _G]) -> RuleFor[_M, _G]:
        for name in qualified_names:
            _BY_NAME[name] = cast(NormRule, rule)
        return rule

    return deco


def norm_rule_for(module: nn.Module) -> NormRule | None:
    """The registered rule for ``type(module)`` (exact type), or ``None``.

    A module sharded by FSDP2's ``fully_shard`` has a generated class ``FSDP<Name>`` whose
    bases are ``(FSDPModule, Name)``; its rule is the one of ``Name`` (the layer's arithmetic
    is unchanged: FSDP2 only gathers the parameters around the forward and backward).

    A module whose weight a forward pre-hook recomputes from other parameters before each call
    (``torch.nn.utils.weight_norm``, the API before parametrizations) has none: a rule reads
    ``module.weight`` as the parameter, and its parameters are ``weight_g`` and ``weight_v``;
    the generic rule differentiates those through the hook.
    """
    if rewriting_hooks(module):
        return None
    kind = _unsharded_type(type(module))
    rule = _RULES.get(kind)
    if rule is None and _BY_NAME:
        rule = _BY_NAME.get(f"{kind.__module__}.{kind.__qualname__}")
        if rule is not None:
            _RULES[kind] = rule
    return rule


def recompute_for(module: nn.Module) -> Recompute | None:
    """The ``recompute`` registered with the rule of ``type(module)`` (exact type), or ``None``."""
    return _RECOMPUTE.get(_unsharded_type(type(module)))


def covers_subtree(module: nn.Module) -> bool:
    """Whether the rule of ``type(module)`` covers its whole subtree's parameters."""
    return _unsharded_type(type(module)) in _SUBTREE


def _unsharded_type(kind: type[nn.Module]) -> type[nn.Module]:
    """The layer class under FSDP2's generated ``FSDP<Name>`` class (else ``kind`` itself)."""
    bases = kind.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and kind.__name__ == (
        "FSDP" + bases[1].__name__
    ):
        return bases[1]
    return kind


def layer_type_names(modules: Iterable[nn.Module]) -> tuple[str, ...]:
    """Qualified class names (``"module.ClassName"``, FSDP2's generated classes unwrapped) of
    ``modules``, sorted and without repeats: the layer types whose norm rules a step uses. The
    ledger's run facts record them as ``layer_types``; ``dpfy audit`` replays a release of each
    (:mod:`dpfy.audit.probes`)."""
    kinds = {_unsharded_type(type(m)) for m in modules}
    return tuple(sorted(f"{k.__module__}.{k.__qualname__}" for k in kinds))


def registered_types() -> tuple[type[nn.Module], ...]:
    """Module types with a registered norm rule (those registered by name once seen)."""
    return tuple(_RULES)


_UNSUPPORTED: dict[type | str, tuple[str, str]] = {}

#: The fix of a refusal registered without one.
_FREEZE = "freeze its parameters (module.requires_grad_(False)) or replace the layer."


def register_unsupported(*kinds: type | str, reason: str, fix: str = "") -> None:
    """Mark layers whose trainable parameters cannot be clipped per example at all (e.g.
    BatchNorm mixes the examples of a batch).

    Args:
      kinds: module types (and their subclasses); qualified class names
        ``"package.module.ClassName"`` of optional libraries (nothing is imported); or the
        types of parametrizations (``torch.nn.utils.parametrize``) and of forward pre-hooks
        that rewrite a parameter before each call (``torch.nn.utils.spectral_norm``'s), which
        refuse every module they act on.
      reason: why (when no ``fix`` is given, it should also say what to do).
      fix: what to do about it.

    :func:`dpfy.training.check_module` reports such a trainable module as an error and
    :func:`dpfy.training.norms.capture.plan_modules` refuses it when the step is built, both naming
    the module, ``reason`` and ``fix``.
    """
    for kind in kinds:
        _UNSUPPORTED[kind] = (reason, fix)


def unsupported(module: nn.Module) -> tuple[str, str] | None:
    """``(reason, fix)`` when ``module``'s trainable parameters cannot be handled, else ``None``."""
    for kind in type(module).__mro__:
        found = _UNSUPPORTED.get(kind) or _UNSUPPORTED.get(f"{kind.__module__}.{kind.__qualname__}")
        if found is not None:
            return found[0], found[1] or _FREEZE
    for _, parametrization in _parametrizations(module):
        found = _UNSUPPORTED.get(type(parametrization))
        if found is not None:
            return found[0], found[1] or _FREEZE
    for hook in rewriting_hooks(module):
        found = _UNSUPPORTED.get(type(hook))
        if found is not None:
            return found[0], found[1] or _FREEZE
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module``'s trainable parameters cannot be handled and what to do, or ``None``."""
    found = unsupported(module)
    return None if found is None else f"{found[0]} Fix: {found[1]}"


# ---- parametrized modules --------------------------------------------------------------
# ``torch.nn.utils.parametrize`` swaps a module's class for a generated subclass
# (``ParametrizedLinear``) whose ``weight`` is a property computing the tensor from the
# parameters under ``module.parametrizations.weight`` (``original`` or ``original0``,
# ``original1``..., and those of the parametrization modules themselves). No rule is
# registered for the generated class, so the generic rule handles the module, differentiating
# its call with respect to those parameters: they are the module's own.


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s direct parameters and, if it is parametrized, its parametrizations' (the
    tensors each parametrized weight is computed from), by local name."""
    own = list(module.named_parameters(recurse=False))
    holder = getattr(module, "parametrizations", None)
    if _is_parametrized(module) and isinstance(holder, nn.Module):
        own += list(holder.named_parameters(prefix="parametrizations"))
    return own


def parametrization_subtree(module: nn.Module) -> str | None:
    """Local name of the submodule holding ``module``'s parametrizations (its parameters are
    ``module``'s own, see :func:`own_parameters`), or ``None``."""
    return "parametrizations" if _is_parametrized(module) else None


def layer_label(module: nn.Module) -> str:
    """The layer's class name, with what reparametrizes its parameters: ``"Linear with a
    weight_norm parametrization of 'weight'"``, ``"Linear with torch.nn.utils.weight_norm"``."""
    if _is_parametrized(module):
        from torch.nn.utils import parametrize

        base = parametrize.type_before_parametrizations(module).__name__
        kinds = ", ".join(
            f"{_article(name)} {name} parametrization of {t!r}"
            for t, name in ((t, _parametrization_name(p)) for t, p in _parametrizations(module))
        )
        return f"{base} with {kinds}"
    hooks = rewriting_hooks(module)
    if hooks:
        names = ", ".join(f"torch.nn.utils.{_snake(type(h).__name__)}" for h in hooks)
        return f"{type(module).__name__} with {names}"
    return _unsharded_type(type(module)).__name__


def _is_parametrized(module: nn.Module) -> bool:
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(module)


def _parametrizations(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(tensor name, parametrization module)`` of each parametrization of ``module``."""
    if not _is_parametrized(module):
        return []
    holder = cast(nn.ModuleDict, module.parametrizations)
    return [(name, p) for name, chain in holder.items() for p in cast(nn.ModuleList, chain)]


def rewriting_hooks(module: nn.Module) -> list[Any]:
    """Forward pre-hooks of ``torch.nn.utils.weight_norm`` / ``spectral_norm`` (the API before
    parametrizations): each sets ``module.<name>`` from other parameters before every call."""
    if not module._forward_pre_hooks:
        return []
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return [
        h for h in module._forward_pre_hooks.values() if isinstance(h, WeightNorm | SpectralNorm)
    ]


def _parametrization_name(parametrization: nn.Module) -> str:
    """``weight_norm`` for torch's ``_WeightNorm`` (as its constructor is called), else the
    class name."""
    kind = type(parametrization)
    if kind.__module__.startswith("torch."):
        return _snake(kind.__name__.lstrip("_"))
    return kind.__name__


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


#: ``cross(lg_a, name_a, lg_b, name_b) -> [N]``: per-example inner products
#: ``<grad_a_n, grad_b_n>`` of two modules' contributions to one shared (tied) parameter.
CrossTerm = Callable[[Any, str, Any, str], torch.Tensor]
_CROSS: dict[tuple[type, type], CrossTerm] = {}


def register_cross_term(
    type_a: type, type_b: type
) -> Callable[[CrossTerm], CrossTerm]:
    """Decorator registering the cross term of two :class:`LayerGrads` types (either order).

    A parameter used by several modules (tied weights) has per-example gradient
    ``sum_m grad_m``; its squared norm is ``sum_m ||grad_m||^2 + 2 sum_{m<m'} <grad_m,
    grad_m'>``. A cross term computes ``<grad_m, grad_m'>`` per example without the
    per-example gradients where it can; without one, both are materialised
    (:func:`cross_term`).
    """

    def deco(fn: CrossTerm) -> CrossTerm:
        _CROSS[(type_a, type_b)] = fn
        return fn

    return deco


def cross_term(a: LayerGrads, name_a: str, b: LayerGrads, name_b: str) -> torch.Tensor:
    """``<grad_a_n, grad_b_n>`` per example for one parameter shared by two modules."""
    fn = _CROSS.get((type(a), type(b)))
    if fn is not None:
        return fn(a, name_a, b, name_b)
    fn = _CROSS.get((type(b), type(a)))
    if fn is not None:
        return fn(b, name_b, a, name_a)
    da, db = _dense(a, name_a), _dense(b, name_b)
    return (da.reshape(da.shape[0], -1) * db.reshape(db.shape[0], -1)).sum(1)


def _dense(lg: LayerGrads, name: str) -> torch.Tensor:
    dense = getattr(lg, "per_example", None)
    if dense is None:
        raise NotImplementedError(
            f"{type(lg).__name__} neither materialises per-example gradients (a "
            "`per_example(name)` method) nor has a registered cross term "
            "(register_cross_term), so a parameter it shares with another module cannot be "
            "clipped per example"
        )
    out: torch.Tensor = dense(name)
    return out


def tensor_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of tensors without the copy that ``sum(...)`` (which starts at 0) makes."""
    it = iter(tensors)
    total = next(it)
    for t in it:
        total = total + t
    return total


def fold_rows(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum consecutive groups of ``group_size`` rows: [B, ...] -> [B // group_size, ...]."""
    if group_size == 1:
        return x
    return x.reshape(x.shape[0] // group_size, group_size, *x.shape[1:]).sum(1)


class MaterializedGrads:
    """LayerGrads from explicit per-example gradients ``{name: [N, *param_shape]}``."""

    __slots__ = ("grads",)

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        self.grads = grads

    def squared_norms(self) -> dict[str, torch.Tensor]:
        return {
            k: torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()
            for k, g in self.grads.items()
        }

    def zero_rows(self, rows: torch.Tensor) -> None:
        for k, g in self.grads.items():
            keep = (~rows).reshape(-1, *([1] * (g.dim() - 1)))
            self.grads[k] = torch.where(keep, g, torch.zeros((), dtype=g.dtype))

    def per_example(self, name: str) -> torch.Tensor:
        """Per-example gradients of parameter ``name``: [N, *shape]."""
        return self.grads[name]

    def weighted_sum(
        self,
        weights: dict[str, torch.Tensor],
        out: dict[str, torch.Tensor] | None = None,
        *,
        overwrite: bool = False,
    ) -> dict[str, torch.Tensor]:
        res: dict[str, torch.Tensor] = {} if out is None else out
        for k, g in self.grads.items():
            w = weights[k].to(g.dtype)
            flat = g.reshape(g.shape[0], -1)
            if out is None:
                res[k] = torch.mv(flat.t(), w).reshape(g.shape[1:])
            else:
                out[k].view(-1).addmv_(flat.t(), w, beta=0.0 if overwrite else 1.0)
        return res

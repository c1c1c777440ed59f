"""Module validation: find every layer that breaks per-example privacy, and offer the fix.

DP-SGD bounds each example's influence by clipping its own gradient. A layer whose forward pass
mixes examples of one batch (BatchNorm normalises each example with the *batch* mean and
variance) or that changes state from the data outside the gradient (running statistics,
in-place weight renormalisation) lets one example influence the others' outputs or the released
model without passing through clipping and noise (Ponomareva et al. 2023, Table 5). Such layers
are errors, as are the layers refused by :func:`dpfy.training.norms.registry.
register_unsupported` (spectral normalisation, Opacus' recurrent layers). Layers without a fast
per-example norm rule still work through the ``vmap(grad)`` fallback (a parametrized module
through its parametrizations); they are reported as notes because they are slower.

:func:`check_module` returns every problem at once, :func:`validate_module` raises one error that
lists them all, and :func:`fix_module` returns a fixed *copy* (BatchNorm -> GroupNorm, running
statistics off, Embedding renormalisation and sparse gradients off); the input is never changed.

Per-layer checks live in a registry keyed by layer type (as Opacus registers its module
validators): :func:`register_module_check` adds a check for a type and its subclasses, and
every check registered for a class in ``type(module).__mro__`` runs, most specific first. A
second registration for the same type is refused unless ``replace=True``. The built-in checks
(BatchNorm, InstanceNorm with running statistics, Embedding options) are registered together at
the end of this module. Model-level problems (no trainable parameter, lazy or tied parameters)
and the notes on layers without a fast norm rule are checked for every module.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterable

import torch
from torch import nn

_BatchNorm = nn.modules.batchnorm._BatchNorm  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones
_InstanceNorm = nn.modules.instancenorm._InstanceNorm


class Severity(enum.StrEnum):
    """``error``: not private as is; ``note``: private, but worth knowing (e.g. slower path)."""

    ERROR = "error"
    NOTE = "note"


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleIssue:
    """One problem found in a model.

    Attributes:
      path: dotted name of the module in the model (``""`` for the root).
      module_type: class name of the module.
      severity: :class:`Severity`.
      reason: why the layer is a problem for differential privacy (or speed).
      fix: what to do about it (``fix_module`` applies the fixes it names).
    """

    path: str
    module_type: str
    severity: Severity
    reason: str
    fix: str

    def __str__(self) -> str:
        where = repr(self.path) if self.path else "<root>"
        return (
            f"[{self.severity}] module {where} ({self.module_type}): {self.reason} "
            f"Fix: {self.fix}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What a per-layer check reports about one module (``check_module`` adds where it is).

    Attributes:
      reason: why the layer is a problem for differential privacy (or speed).
      fix: what to do about it.
      severity: :class:`Severity` (default: an error).
    """

    reason: str
    fix: str
    severity: Severity = Severity.ERROR


#: A per-layer check: ``check(module) -> findings`` (empty when the module is fine).
ModuleCheck = Callable[[nn.Module], Iterable[Finding]]
_CHECKS: dict[type[nn.Module], ModuleCheck] = {}


def register_module_check(
    *module_types: type[nn.Module], replace: bool = False
) -> Callable[[ModuleCheck], ModuleCheck]:
    """Decorator registering ``check(module) -> Iterable[Finding]`` for the types (and subclasses).

    Raises:
      ValueError: a check is already registered for one of the types and ``replace`` is false
        (nothing is registered then).
    """
    if not module_types:
        raise ValueError("register_module_check needs at least one module type")
    taken = [t for t in module_types if t in _CHECKS]
    if taken and not replace:
        names = ", ".join(t.__qualname__ for t in taken)
        raise ValueError(
            f"a module check is already registered for {names}; pass replace=True to replace it"
        )

    def deco(check: ModuleCheck) -> ModuleCheck:
        for t in module_types:
            _CHECKS[t] = check
        return check

    return deco


def module_checks_for(module: nn.Module) -> tuple[ModuleCheck, ...]:
    """The checks registered for the classes of ``type(module).__mro__``, most specific first."""
    return tuple(_CHECKS[t] for t in type(module).__mro__ if t in _CHECKS)


class UnsupportedModuleError(ValueError):
    """The model contains layers that are not private under DP-SGD; ``.issues`` lists them all."""

    def __init__(self, issues: Iterable[ModuleIssue]) -> None:
        self.issues = tuple(issues)
        errors = [i for i in self.issues if i.severity is Severity.ERROR]
        lines = "\n".join(f"  - {i}" for i in errors)
        super().__init__(
            f"the model has {len(errors)} layer problem(s) that break per-example privacy:\n"
            f"{lines}\n"
            "dpfy.training.fix_module(model) returns a fixed copy (BatchNorm -> GroupNorm, ...)."
        )


def _group_count(channels: int, max_groups: int) -> int:
    """Largest divisor of ``channels`` not above ``max_groups``."""
    for g in range(min(max_groups, channels), 0, -1):
        if channels % g == 0:
            return g
    return 1


def _fast_layers() -> tuple[type[nn.Module], ...]:
    """Types with a registered norm rule (exact type match, as the engine dispatches)."""
    import dpfy.training.norms  # noqa: F401  (registers the rules)
    from dpfy.training.norms.registry import registered_types

    return registered_types()


def _has_rule(module: nn.Module, fast: tuple[type[nn.Module], ...], engine: bool) -> bool:
    from dpfy.training.norms.registry import norm_rule_for, rewriting_hooks

    if rewriting_hooks(module):  # torch.nn.utils.weight_norm: no rule reads weight_g, weight_v
        return False
    if type(module) in fast:
        return True
    # rules registered by class name
    return engine and norm_rule_for(module) is not None


def _covers_subtree(module: nn.Module) -> bool:
    from dpfy.training.norms.registry import covers_subtree

    return covers_subtree(module)


def _own_trainable(module: nn.Module) -> bool:
    from dpfy.training.norms.registry import own_parameters  # with its parametrizations'

    return any(p.requires_grad for _, p in own_parameters(module))


class ModuleReport(list[ModuleIssue]):
    """:func:`check_module`'s answer: the issues (a list), and in :attr:`deferred` the checks
    that need data and did not run (empty when a sample batch was given)."""

    deferred: tuple[str, ...] = ()


def check_module(
    model: nn.Module,
    example_batch: object = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    fast_layers: tuple[type[nn.Module], ...] | None = None,
) -> ModuleReport:
    """Every privacy problem (errors) and fallback layer (notes) in ``model``, in module order.

    Args:
      model: the network to train with DP-SGD.
      example_batch: ``(inputs, targets)``, a sample batch. With one, the first step's
        run-time checks run too (:mod:`dpfy.training.dry_run`: on a copy of the model, nothing
        released or written), and their refusal, if any, is an error here with the same
        message: the verdict is the first real step's on that batch. Without one, those
        checks are named in the report's ``deferred`` and happen at the first step.
      loss_fn: per-example losses for the sample batch (default cross-entropy).
      fast_layers: layer types the fast per-example norm engine handles (exact types; default:
        the engine's registry); other layers with trainable parameters are reported as notes
        (they run on the ``vmap(grad)`` fallback).

    Returns:
      A :class:`ModuleReport` (a list of :class:`ModuleIssue`); empty when the model is ready
      for private training.
    """
    from dpfy.training.dry_run import RUN_TIME_CHECKS, first_step_issues

    issues = ModuleReport(_static_issues(model, fast_layers))
    if example_batch is None:
        issues.deferred = RUN_TIME_CHECKS
    elif not any(i.severity is Severity.ERROR for i in issues):
        issues.extend(
            ModuleIssue("", type(model).__name__, Severity.ERROR, reason,
                        "the message says what to change.")
            for reason in first_step_issues(model, example_batch, loss_fn)
        )
    return issues


def _static_issues(
    model: nn.Module, fast_layers: tuple[type[nn.Module], ...] | None
) -> list[ModuleIssue]:
    fast = _fast_layers() if fast_layers is None else tuple(fast_layers)
    issues: list[ModuleIssue] = []
    if not any(p.requires_grad for p in model.parameters()):
        issues.append(
            ModuleIssue(
                "",
                type(model).__name__,
                Severity.ERROR,
                "the model has no trainable parameters, so there is nothing to train privately.",
                "set requires_grad=True on the parameters to train.",
            )
        )
    checkpointed = _reentrant_checkpointing(model)
    if checkpointed is not None:
        issues.append(
            ModuleIssue(
                checkpointed[0],
                checkpointed[1],
                Severity.ERROR,
                "reentrant activation checkpointing runs its segments without autograd in "
                "the forward pass, so their per-example gradients cannot be recorded.",
                "use the non-reentrant variant: model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}) (transformers), "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (PyTorch).",
            )
        )
    from dpfy.training.norms.registry import layer_label, parametrization_subtree, unsupported

    covered: list[str] = []  # modules whose norm rule covers their whole subtree
    held: list[str] = []  # the parametrizations of parametrized modules: their owner's
    for path, module in model.named_modules(remove_duplicate=False):
        if any(path == top or path.startswith(top + ".") for top in held):
            continue
        name = layer_label(module)
        inside = any(path.startswith(top + ".") or top == "" for top in covered)
        if not inside and fast_layers is None and _covers_subtree(module):
            covered.append(path)
        holder = parametrization_subtree(module)
        if holder is not None:
            held.append(f"{path}.{holder}" if path else holder)
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                issues.append(
                    ModuleIssue(
                        path,
                        name,
                        Severity.ERROR,
                        f"lazy parameter {pname!r} is not initialised yet, so its per-example "
                        "gradient and noise shape are unknown.",
                        "run one forward pass on a dummy batch (or use the non-lazy layer).",
                    )
                )
                continue
        found = [f for check in module_checks_for(module) for f in check(module)]
        trainable = _own_trainable(module) and not inside
        refusal = unsupported(module) if trainable else None  # register_unsupported
        if refusal is not None:
            found.append(Finding(*refusal))
        issues.extend(ModuleIssue(path, name, f.severity, f.reason, f.fix) for f in found)
        refused = any(f.severity is Severity.ERROR for f in found)
        if trainable and not _has_rule(module, fast, fast_layers is None) and not refused:
            issues.append(ModuleIssue(path, name, Severity.NOTE, _generic_note(module), _FASTER))
    return issues


_FASTER = "nothing required; use a layer with a rule for speed."


def _generic_note(module: nn.Module) -> str:
    from dpfy.training.norms.registry import parametrization_subtree

    what = (
        "no per-example norm rule reads a parametrized weight"
        if parametrization_subtree(module) is not None
        else "no dedicated per-example norm rule for this layer type"
    )
    return (
        f"{what}; its per-example gradients come from the generic rule (torch.func "
        "vmap(grad) over the module's call, chunked): exact, but slower. A call torch.func "
        "cannot transform (dropout inside the module, an autograd.Function without a vmap "
        "rule) is refused in the first chunk, before anything is released."
    )


# --------------------------------------------------------------------------------------------
# Built-in per-layer checks (Ponomareva et al. 2023, Sec. 5.5.1 and Table 5)
# --------------------------------------------------------------------------------------------


def _reentrant_checkpointing(model: nn.Module) -> tuple[str, str] | None:
    """``(path, type name)`` of the first module with ``transformers`` activation checkpointing
    on in the reentrant variant (``use_reentrant`` True or left to torch's default, True), else
    None. The non-reentrant variant records the first forward pass and recomputes inside
    backward, where dpfy's hooks are inactive, so it is exact (tests/training/
    test_checkpointing.py)."""
    import torch.utils.checkpoint

    for path, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        func = getattr(module, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", None)
        bare = func is torch.utils.checkpoint.checkpoint  # torch's default: reentrant
        reentrant = isinstance(keywords, dict) and keywords.get("use_reentrant", True) is not False
        if bare or reentrant:
            return path, type(module).__name__
    return None


def _batch_norm_check(module: nn.Module) -> tuple[Finding, ...]:
    return (
        Finding(
            "BatchNorm normalises each example with the mean and variance of the whole "
            "batch, so one example changes every other example's output and gradient "
            "(clipping no longer bounds its influence), and its running statistics are "
            "released without noise.",
            "replace it with GroupNorm (per-example statistics); fix_module does this.",
        ),
    )


def _instance_norm_check(module: nn.Module) -> tuple[Finding, ...]:
    if not module.track_running_stats:
        return ()
    return (
        Finding(
            "track_running_stats=True averages statistics over the training examples "
            "into buffers that are released with the model without clipping or noise.",
            "use track_running_stats=False; fix_module does this.",
        ),
    )


def _embedding_check(module: nn.Module) -> tuple[Finding, ...]:
    """The first problem of an Embedding / EmbeddingBag (``fix_module`` fixes them all)."""
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return (
            Finding(
                "max_norm renormalises the looked-up rows of the weight in place during the "
                "forward pass, a data-dependent change that bypasses clipping and noise.",
                "use max_norm=None; fix_module does this.",
            ),
        )
    if module.scale_grad_by_freq:
        return (
            Finding(
                "scale_grad_by_freq=True divides each row's gradient by how often the row "
                "occurs in the whole batch, so one example changes the others' gradients.",
                "use scale_grad_by_freq=False; fix_module does this.",
            ),
        )
    if module.sparse:
        return (
            Finding(
                "sparse=True produces sparse gradients, but DP-SGD must add noise to every "
                "row, including rows the batch did not touch.",
                "use sparse=False; fix_module does this.",
            ),
        )
    return ()


def _adaptive_softmax_check(module: nn.Module) -> tuple[Finding, ...]:
    if not any(p.requires_grad for p in module.parameters()):
        return ()
    return (
        Finding(
            "AdaptiveLogSoftmaxWithLoss runs each tail cluster only on the rows whose target "
            "falls in it, so its layers never see the whole batch with one row per example, "
            "and its loss output is a batch mean.",
            "use an nn.Linear head with nn.CrossEntropyLoss(reduction='none'), or freeze its "
            "parameters (requires_grad=False).",
        ),
    )


def _data_parallel_check(module: nn.Module) -> tuple[Finding, ...]:
    return (
        Finding(
            "nn.DataParallel copies the model onto each device inside every forward pass, "
            "so per-example gradients would be recorded on short-lived replicas.",
            "train on one device, or use DistributedDataParallel through dpfy's distributed "
            "training (dpfy.training.distributed, `dpfy train --workers N`).",
        ),
    )


def _sequence_first_check(module: nn.Module) -> tuple[Finding, ...]:
    attn = getattr(module, "self_attn", None)
    first = getattr(attn, "batch_first", getattr(module, "batch_first", True))
    if first is not False:
        return ()
    return (
        Finding(
            "with batch_first=False its feed-forward and normalisation layers see [sequence, "
            "batch, ...] inputs, and per-example rules need the example on dimension 0.",
            "construct it with batch_first=True and feed [batch, sequence, features].",
        ),
    )


register_module_check(nn.AdaptiveLogSoftmaxWithLoss)(_adaptive_softmax_check)
register_module_check(
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.Transformer
)(_sequence_first_check)
register_module_check(nn.DataParallel)(_data_parallel_check)
register_module_check(_BatchNorm)(_batch_norm_check)
register_module_check(_InstanceNorm)(_instance_norm_check)
register_module_check(nn.Embedding, nn.EmbeddingBag)(_embedding_check)


def validate_module(
    model: nn.Module, *, fast_layers: tuple[type[nn.Module], ...] | None = None
) -> list[ModuleIssue]:
    """Raise if ``model`` has any privacy error; otherwise return the notes.

    Raises:
      UnsupportedModuleError: lists every error (not only the first) with its reason and fix.
    """
    issues = check_module(model, fast_layers=fast_layers)
    if any(i.severity is Severity.ERROR for i in issues):
        raise UnsupportedModuleError(issues)
    return issues


def fix_module(model: nn.Module, *, max_groups: int = 32) -> nn.Module:
    """A fixed deep copy of ``model``; the input is not modified.

    * BatchNorm{1,2,3}d / SyncBatchNorm -> GroupNorm over the same channels with the largest
      group count dividing the channels that is at most ``max_groups`` (affine and eps kept;
      the affine weight and bias are copied, running statistics dropped).
    * InstanceNorm with running statistics -> the same layer with ``track_running_stats=False``.
    * Embedding with ``max_norm``, ``sparse`` or ``scale_grad_by_freq`` -> ``max_norm=None``,
      ``sparse=False``, ``scale_grad_by_freq=False``.

    Problems without an automatic fix (lazy or missing parameters) remain; run
    :func:`validate_module` on the result.
    """
    if max_groups < 1:
        raise ValueError(f"max_groups must be in [1, inf), got max_groups={max_groups!r}")
    fixed = copy.deepcopy(model)
    if isinstance(fixed, _BatchNorm):
        return _replace(fixed, max_groups)
    for parent in list(fixed.modules()):
        for child_name, child in list(parent.named_children()):
            new = _replace(child, max_groups)
            if new is not child:
                setattr(parent, child_name, new)
    return fixed


def _replace(module: nn.Module, max_groups: int) -> nn.Module:
    if isinstance(module, _BatchNorm):
        channels = module.num_features
        gn = nn.GroupNorm(
            _group_count(channels, max_groups), channels, eps=module.eps, affine=module.affine
        )
        if module.affine:
            gn = gn.to(device=module.weight.device, dtype=module.weight.dtype)
            with torch.no_grad():
                gn.weight.copy_(module.weight)
                gn.bias.copy_(module.bias)
            gn.weight.requires_grad_(module.weight.requires_grad)
            gn.bias.requires_grad_(module.bias.requires_grad)
        return gn
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        module.track_running_stats = False
        module.running_mean = None
        module.running_var = None
        module.num_batches_tracked = None
    if isinstance(module, nn.Embedding):
        module.max_norm = None
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        module.sparse = False
        module.scale_grad_by_freq = False
    return module

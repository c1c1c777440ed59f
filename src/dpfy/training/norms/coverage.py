"""The coverage contract: every trainable parameter's per-example gradients recorded exactly once.

The norm rules build each example's gradient from what they recorded of a module's calls. A
parameter used where no rule looks -- a parent calling ``F.linear(x, self.child.weight)``
instead of ``self.child(x)`` (``nn.MultiheadAttention`` does so with ``out_proj``), or a path
counted twice -- would then be clipped and summed wrongly, and train on noise or on a biased
gradient while the privacy accounting stays valid (each norm is taken over the vectors that
are summed). The check compares, for every trainable parameter, the sum over the batch of the
recorded per-example gradients (clip weights 1) with the batch gradient autograd computes in
the same backward pass. They agree whenever each example's contribution was recorded once;
a missing call gives 0 against a non-zero gradient, a doubled path twice the gradient.

It runs on the first physical chunk of a run (before any noisy release is written) and, as a
debugging aid, on every chunk (``PrivateGradient(coverage_check="every")``). It costs one
model-sized set of parameter gradients in that chunk's backward pass; its norms are read with
the chunk's other statistics, in its one host read (``docs/devices.md``). A parameter no call
recorded is first offered to its smallest called ancestor (:class:`CoverageGuard`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch import nn

from dpfy.training.norms import wide
from dpfy.training.norms.capture import ModulePlan, reported_names, watch_plans
from dpfy.training.norms.fallback import fallback_rule
from dpfy.training.norms.registry import Capture, LayerGrads

#: Relative tolerance ``||recorded - batch|| / ||batch||`` per parameter, by working dtype.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-8,
    torch.float32: 1e-3,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


#: A parameter's discrepancy below ``ABSOLUTE * tolerance`` times the norm of the whole
#: model's batch gradient is rounding, whatever its own gradient's size.
ABSOLUTE = 1e-2


class CoverageError(ValueError):
    """Some trainable parameter's per-example gradients were not recorded exactly once."""


def recorded_sums(
    layers: Mapping[int, LayerGrads],
    qualified: list[dict[str, str]],
    n: int,
    like: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``{parameter name: sum over units of its recorded per-example gradients}``.

    ``qualified[i]`` maps plan ``i``'s local parameter names to the model's names; a
    parameter recorded by several modules (tied weights) sums their contributions.
    """
    ones = torch.ones(n, dtype=like.dtype, device=like.device)
    out: dict[str, torch.Tensor] = {}
    for idx, lg in layers.items():
        names = qualified[idx]
        sums = lg.weighted_sum(dict.fromkeys(names, ones))
        for local, value in sums.items():
            qn = names[local]
            out[qn] = out[qn] + value if qn in out else value
    return out


def measure(
    recorded: Mapping[str, torch.Tensor],
    batch_grads: Mapping[str, torch.Tensor | None],
) -> torch.Tensor:
    """``[P, 3]`` float64 on the device: per parameter (in ``batch_grads`` order) the norms of
    the batch gradient, of the recorded sum and of their difference (0 where absent).

    Read with the chunk's other statistics in its one host read (``docs/devices.md``).
    """
    rows = []
    f64 = torch.float64
    for name, ref in batch_grads.items():
        got = recorded.get(name)
        # Norms accumulated in float64 block by block (no float64 copy of a gradient, nor a
        # parameter-sized difference); the difference in the working dtype: one rounding of
        # it, far inside the tolerance.
        zero = ref if ref is not None else got
        z = torch.zeros((), dtype=f64, device=None if zero is None else zero.device)
        r = z if ref is None else wide.norm(ref)
        g = z if got is None else wide.norm(got)
        if ref is None or got is None:
            d = r if got is None else g
        else:
            d = wide.difference_norm(got, ref)
        rows.append(torch.stack([r, g, d]))
    return torch.stack(rows)


def coverage_problems(
    model: nn.Module,
    names: list[str],
    norms: list[float],
    recorded: set[str],
    *,
    tolerance: float,
) -> list[str]:
    """One line per parameter whose recorded per-example gradients do not sum to its gradient.

    Args:
      model: the model (to name each parameter's module and class).
      names: the trainable parameters, in the order of :func:`measure`'s rows.
      norms: :func:`measure`'s values read to the host, flattened.
      recorded: the parameters some rule recorded.
      tolerance: relative tolerance (see :data:`TOLERANCE`); a parameter passes when
        ``||recorded - batch|| <= tolerance * max(||recorded||, ||batch||) + ABSOLUTE *
        tolerance * ||whole model's batch gradient||``.
    """
    rows = [norms[3 * i : 3 * i + 3] for i in range(len(names))]
    # Rounding of a gradient that is exactly zero in exact arithmetic (a key bias under
    # softmax) is judged against the whole model's gradient, not against itself.
    floor = ABSOLUTE * tolerance * math.sqrt(sum(r[0] * r[0] for r in rows))
    problems = []
    for name, (ref_norm, got_norm, err) in zip(names, rows, strict=True):
        if name not in recorded:
            if ref_norm > floor:
                problems.append(
                    f"{_where(model, name)} received a gradient, but no per-example "
                    "contribution was recorded for it: its module was not called, so another "
                    "module used the parameter directly (e.g. a parent's torch.nn.functional "
                    "call on `self.child.weight`). Fix: call the module instead, or register a "
                    "norm rule for the parent that covers its subtree (dpfy.training.norms."
                    "register_norm_rule(..., subtree=True)), or freeze the parameter"
                )
            continue
        if not math.isfinite(err) or err > tolerance * max(ref_norm, got_norm) + floor:
            ratio = got_norm / ref_norm if ref_norm > 0 else math.inf
            rel = err / max(ref_norm, got_norm, 1e-300)
            problems.append(
                f"{_where(model, name)}: its recorded per-example gradients sum to "
                f"{ratio:.3g} x its batch gradient in norm (relative difference {rel:.2g}); it "
                "is used outside its module's own forward call as well as inside (a parent's "
                "torch.nn.functional call on it, or its output's gradient counted twice). Fix: "
                "use the parameter only through its module, or register a norm rule that "
                "covers the module using it (register_norm_rule(..., subtree=True))"
            )
    return problems


class CoverageGuard:
    """The coverage check of one :class:`~dpfy.training.step.PrivateGradient`.

    Args:
      model: the (unwrapped) model.
      plans: the step's module plans; promoted ancestors are appended to it (shared list).
      qualified: per plan, local -> model parameter names (shared list, appended alike).
      params: the trainable parameters by name.
      every: check every chunk (else the first one that has finite gradients).
      chunk_size: ``vmap`` chunk of the generic rule.
      enabled: ``False`` turns the check off (an FSDP2-sharded model).
    """

    def __init__(
        self,
        model: nn.Module,
        plans: list[ModulePlan],
        qualified: list[dict[str, str]],
        params: Mapping[str, torch.Tensor],
        *,
        every: bool,
        chunk_size: int,
        enabled: bool = True,
    ) -> None:
        self.model, self.plans, self.qualified = model, plans, qualified
        self.names = list(params)
        self.params = list(params.values())
        self.every, self.chunk_size = every, chunk_size
        self.due = enabled
        self.watch = watch_plans(model, plans)

    def hooked(self) -> list[ModulePlan]:
        """The plans to record in the next chunk (with the check due, also the ancestors)."""
        return self.plans + self.watch if self.due and self.watch else self.plans

    def measure(
        self,
        layers: Mapping[int, LayerGrads],
        batch_grads: list[torch.Tensor | None],
        n: int,
        loss_scale: float,
        like: torch.Tensor,
    ) -> tuple[torch.Tensor, set[str]]:
        """Device norms to read with the chunk's statistics, and the recorded parameters.

        A parameter's recorded sum (:func:`recorded_sums`, layer by layer) is measured and
        freed as soon as every layer that may report it is done: one layer's sums are held at
        a time, not the whole model's (a tied parameter waits for all of its owners).
        """
        ref = {  # no copy of a model-sized gradient where nothing is to be divided out
            name: None if g is None else g.to(like.dtype) if loss_scale == 1 else
            g.to(like.dtype) / loss_scale
            for name, g in zip(self.names, batch_grads, strict=True)
        }
        left = Counter(qn for idx in layers for qn in self.qualified[idx].values())
        partial: dict[str, torch.Tensor] = {}
        rows: dict[str, torch.Tensor] = {}
        recorded: set[str] = set()
        for idx, lg in layers.items():
            sums = recorded_sums({idx: lg}, self.qualified, n, like)
            recorded.update(sums)
            for qn, value in sums.items():
                partial[qn] = partial[qn] + value if qn in partial else value
            for qn in self.qualified[idx].values():
                left[qn] -= 1
                if not left[qn] and qn in partial:
                    got = partial.pop(qn)
                    if qn in ref:
                        rows[qn] = measure({qn: got}, {qn: ref[qn]})[0]
        return torch.stack([
            rows[name] if name in rows else measure({}, {name: ref[name]})[0]
            for name in ref
        ]), recorded

    def settle(
        self,
        norms: list[float],
        recorded: set[str],
        tolerance: float,
        retry: Callable[[], tuple[list[float], set[str]]],
    ) -> None:
        """Judge the chunk from the host values of :meth:`measure`.

        A parameter no call recorded is first given to its smallest called ancestor
        (``retry`` promotes and measures again; see :meth:`promote`). A chunk whose gradients
        are not finite is judged on a later one.

        Raises:
          CoverageError: names each parameter still wrong, its module and class, and the fix.
        """
        if not all(math.isfinite(v) for v in norms):
            return
        problems = coverage_problems(self.model, self.names, norms, recorded, tolerance=tolerance)
        if problems and any(name not in recorded for name in self.names) and self.watch:
            norms, recorded = retry()
            problems = coverage_problems(
                self.model, self.names, norms, recorded, tolerance=tolerance
            )
        if problems:
            raise CoverageError(
                "per-example gradients would be wrong for this model, so nothing was "
                "released:\n  - " + "\n  - ".join(problems)
            )
        if not self.every:
            self.due = False

    def promote(
        self,
        recorded: set[str],
        layers: dict[int, LayerGrads],
        captures: list[list[Capture]],
        watched: list[list[Capture]],
        group_size: int,
    ) -> None:
        """Plan the smallest called ancestor of each parameter that no call recorded.

        Its generic rule differentiates the parameter through the ancestor's whole call; the
        ancestor stays planned for the rest of the run. Adds the layer to ``layers`` (and its
        captures to ``captures``) for the current chunk. An ancestor the generic rule cannot
        run on is skipped (the parameter is then refused).
        """
        lost = set(self.names) - recorded
        order = sorted(range(len(self.watch)), key=lambda i: -self.watch[i].name.count("."))
        added = False
        for i in order:
            plan, caps = self.watch[i], watched[i]
            if not caps or not lost:
                continue
            take = {
                ln: self.plans[j].qualified(own)
                for ln, j, own in plan.adoptable
                if not captures[j] and self.plans[j].qualified(own) in lost
            }
            if not take:
                continue
            try:
                grads = fallback_rule(
                    plan.module, caps, group_size, chunk_size=self.chunk_size, adopt=tuple(take)
                )
            except Exception:  # noqa: BLE001 - the ancestor cannot be vmapped: refuse it
                continue
            lost -= set(take.values())
            layers[len(self.plans)] = grads
            self.plans.append(plan)
            self.qualified.append(reported_names(plan, self.plans))
            captures.append(caps)
            added = True
        if added:
            self.watch = watch_plans(self.model, self.plans)


def _where(model: nn.Module, name: str) -> str:
    """``parameter 'a.b.weight' of module 'a.b' (Linear)``."""
    path = name.rpartition(".")[0]
    try:
        kind = type(model.get_submodule(path)).__name__
    except AttributeError:
        kind = "?"
    return f"parameter {name!r} of module {path or '<root>'!r} ({kind})"

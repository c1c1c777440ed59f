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
model-sized set of parameter gradients in that chunk's backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from dpfy.training.norms.registry import LayerGrads

__all__ = ["coverage_problems", "recorded_sums", "CoverageError", "TOLERANCE"]

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


def coverage_problems(
    model: nn.Module,
    recorded: Mapping[str, torch.Tensor],
    batch_grads: Mapping[str, torch.Tensor | None],
    *,
    tolerance: float,
) -> list[str]:
    """One line per parameter whose recorded per-example gradients do not sum to its gradient.

    Args:
      model: the model (to name each parameter's module and class).
      recorded: :func:`recorded_sums`.
      batch_grads: autograd's gradient of the same weighted loss per trainable parameter
        (``None``: the parameter did not reach the loss), in the same scale as ``recorded``.
      tolerance: relative tolerance (see :data:`TOLERANCE`); a parameter passes when
        ``||recorded - batch|| <= tolerance * max(||recorded||, ||batch||) + ABSOLUTE *
        tolerance * ||whole model's batch gradient||``.
    """
    norms = {
        name: 0.0 if g is None else float(torch.linalg.vector_norm(g.double()))
        for name, g in batch_grads.items()
    }
    # Rounding of a gradient that is exactly zero in exact arithmetic (a key bias under
    # softmax) is judged against the whole model's gradient, not against itself.
    floor = ABSOLUTE * tolerance * math.sqrt(sum(v * v for v in norms.values()))
    problems = []
    for name, ref in batch_grads.items():
        got = recorded.get(name)
        ref_norm = norms[name]
        got_norm = 0.0 if got is None else float(torch.linalg.vector_norm(got.double()))
        if ref is None and got is None:
            continue
        if got is None:
            if ref_norm <= floor:
                continue
            problems.append(
                f"{_where(model, name)} received a gradient, but no per-example contribution "
                "was recorded for it: its module was not called, so another module used the "
                "parameter directly (e.g. a parent's torch.nn.functional call on "
                "`self.child.weight`). Fix: call the module instead, or register a norm rule "
                "for the parent that covers its subtree (dpfy.training.norms.register_norm_rule"
                "(..., subtree=True)), or freeze the parameter"
            )
            continue
        diff = got.double() - (0.0 if ref is None else ref.double())
        err = float(torch.linalg.vector_norm(diff))
        rel = err / max(ref_norm, got_norm, 1e-300)
        if not math.isfinite(err) or err > tolerance * max(ref_norm, got_norm) + floor:
            ratio = got_norm / ref_norm if ref_norm > 0 else math.inf
            problems.append(
                f"{_where(model, name)}: its recorded per-example gradients sum to "
                f"{ratio:.3g} x its batch gradient in norm (relative difference {rel:.2g}); it "
                "is used outside its module's own forward call as well as inside (a parent's "
                "torch.nn.functional call on it, or its output's gradient counted twice). Fix: "
                "use the parameter only through its module, or register a norm rule that "
                "covers the module using it (register_norm_rule(..., subtree=True))"
            )
    return problems


def _where(model: nn.Module, name: str) -> str:
    """``parameter 'a.b.weight' of module 'a.b' (Linear)``."""
    path = name.rpartition(".")[0]
    try:
        kind = type(model.get_submodule(path)).__name__
    except AttributeError:
        kind = "?"
    return f"parameter {name!r} of module {path or '<root>'!r} ({kind})"

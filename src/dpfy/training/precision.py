"""Mixed precision in the DP step: what runs in low precision, what is kept in fp32.

``docs/architecture.md`` (section "Mixed precision") has the table; in short:

* The forward and the backward to the module outputs may run under ``torch.autocast``
  (``bf16`` or ``fp16``): the layer hooks then record low-precision activations and output
  gradients.
* Everything the privacy guarantee rests on is computed in fp32 (or the parameters' dtype if
  wider): the recorded tensors are upcast before any norm rule sees them
  (:func:`upcast_captures`), with autocast disabled (:func:`autocast_off`), so per-example
  squared norms, clip weights, the clipped-sum contractions, the accumulator and the noise are
  fp32. The upcast is exact (every bf16/fp16 number is an fp32 number); the remaining error
  against an fp32 run is the rounding of the low-precision forward and backward themselves.
* fp16 needs a loss scale S (small output gradients underflow in fp16): the backward is seeded
  with ``S x weight`` and the recorded output gradients are divided by S in fp32 before the
  rules run, so S never reaches a norm or a clip weight (a power of two: the division is exact).
  A row whose scaled gradient overflowed is not finite and is dropped (weight 0; counted in
  ``ChunkStats.num_nonfinite``), so a release never contains inf or NaN.
* The scale is fixed for a run (a public hyperparameter). A dynamic scaler
  (``torch.amp.GradScaler``'s backoff and skipped steps) reacts to whether *some* example of
  the batch overflowed: one bit of the private data per step that the noise does not cover,
  which would then steer which rows later steps drop. dpfy therefore neither skips a step nor
  adapts the scale from overflow: every release is recorded in the ledger and applied.
* Trainable parameters must be fp32 (or fp64) master weights: a noisy update ``lr x g`` added
  to a bf16/fp16 weight is rounded to the weight's 8 (11) bit mantissa and mostly vanishes
  (:func:`check_master_weights` refuses such parameters, naming them and the fix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_map

from dpfy.config import PRECISIONS
from dpfy.training.norms.registry import Capture

#: Precision of the forward and backward pass (the names: :data:`dpfy.config.PRECISIONS`).
Precision = Literal["fp32", "bf16", "fp16"]
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: Default fixed loss scale under fp16: 2**8. Per-example cross-entropy output gradients are
#: at most 1 at the logits, so S * 1 stays far below fp16's maximum (65504) in the layers
#: above, while gradients down to about 2**-32 (instead of 2**-24) survive the backward.
DEFAULT_FP16_LOSS_SCALE = 2.0**8


def check_precision(precision: object) -> Precision:
    """``precision`` if it is one of ``"fp32"``, ``"bf16"``, ``"fp16"``; else ValueError."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {{fp32, bf16, fp16}}, got precision={precision!r}"
        )
    return precision  # type: ignore[return-value]


def check_loss_scale(loss_scale: object) -> float:
    """A finite loss scale in [1, 2**24] (a power of two keeps the unscaling exact)."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
        raise TypeError(f"loss_scale must be a number, got loss_scale={loss_scale!r}")
    s = float(loss_scale)
    if not 1.0 <= s <= 2.0**24:
        raise ValueError(f"loss_scale must be in [1, 2**24], got loss_scale={loss_scale!r}")
    return s


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None`` for fp32: no autocast)."""
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def precision_autocast(
    precision: Precision, device_type: str = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast(device_type, dtype)`` for bf16/fp16; a no-op context for fp32."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def check_master_weights(params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse trainable bf16/fp16 parameters (no fp32 master copy); see the module docstring.

    Raises:
      ValueError: naming the first such parameter, its dtype and the fix.
    """
    for name, p in params:
        if p.dtype in LOW_PRECISION:
            raise ValueError(
                f"trainable parameter {name!r} is {p.dtype}: the Gaussian noise of DP-SGD, "
                "added through the update lr x (noisy gradient), is rounded away on a weight "
                "with an 8 (bf16) or 11 (fp16) bit mantissa; keep fp32 master weights "
                "(model.float(), or load with torch_dtype=torch.float32) and run the forward "
                "in low precision with precision='bf16' (or 'fp16'), i.e. torch.autocast"
            )


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the DP arithmetic uses for tensors of ``dtype``: fp32 for bf16/fp16."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@contextlib.contextmanager
def autocast_off(device_types: Iterable[str] = ("cpu",)) -> Iterator[None]:
    """Disable autocast on ``device_types`` inside the block (the DP arithmetic runs in the
    dtypes of its inputs, never silently in bf16/fp16)."""
    with contextlib.ExitStack() as stack:
        for dt in dict.fromkeys(device_types):
            # a device type without autocast (meta, used to test the step reads no value)
            if torch.amp.is_autocast_available(dt) and torch.is_autocast_enabled(dt):
                stack.enter_context(torch.autocast(device_type=dt, enabled=False))
        yield


def _up(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION:
        return x.to(torch.float32)
    return x


def _unscale(g: torch.Tensor, inv: float) -> torch.Tensor:
    if g.dtype in LOW_PRECISION:
        return g.to(torch.float32).mul_(inv)
    return g * inv if inv != 1.0 else g


def upcast_captures(captures: list[Capture], loss_scale: float = 1.0) -> list[Capture]:
    """The captures with bf16/fp16 tensors upcast to fp32 and output gradients divided by
    ``loss_scale`` (in fp32, after the upcast: an fp16 value times 1/S cannot underflow there).

    Captures without low-precision tensors and with ``loss_scale == 1`` are returned as they
    are (the fp32 path allocates nothing).
    """
    inv = 1.0 / loss_scale
    out: list[Capture] = []
    for cap in captures:
        low = any(g.dtype in LOW_PRECISION for g in cap.grad_outputs) or any(
            isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION for a in cap.args
        )
        if not low and inv == 1.0 and not cap.kwargs:
            out.append(cap)
            continue
        out.append(
            Capture(
                tree_map(_up, cap.args),
                tree_map(_up, cap.kwargs),
                tuple(_unscale(g, inv) for g in cap.grad_outputs),
                cap.output_spec,
                cap.extra,
                cap.batched,
            )
        )
    return out


def autocasting(device_type: str) -> bool:
    """Whether autocast is on for the device type (``False`` where it has none: ``meta``)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False

"""Clip functions: how a per-example norm becomes that example's weight in the clipped sum.

Every mode maps the norm ``n_i = ||g_i||`` of one clipped unit to a weight ``w_i >= 0`` with
``w_i n_i <= C``, so one unit still moves the weighted sum by at most C (replaced: 2C) and the
query's recorded sensitivity is unchanged:

* ``"flat"``: ``w = min(1, C / n)`` (Abadi et al. 2016; McMahan et al. 2018, Sec. 2). Examples
  with ``n <= C`` pass unchanged; C is a knob that trades bias against noise.
* ``"automatic"``: ``w = C / (n + gamma)`` with a small stability constant ``gamma > 0``
  (Bu et al. 2023, "Automatic clipping: differentially private deep learning made easier and
  stronger", AUTO-S; Yang et al. 2022's DP-NSGD, "Normalized/Clipped SGD with Perturbation for
  Differentially Private Non-Convex Optimization", has the same form with their regulariser r
  in place of gamma). Every gradient is
  normalised, ``w n = C n / (n + gamma) < C``, so C only scales the clipped sum: with SGD,
  ``(C, lr)`` and ``(1, C lr)`` take the same steps on the same noise draws (the noise std is
  z C), and the clip norm stops being a knob to tune. ``gamma`` is in the units of the
  gradient norms: it keeps the weight of a near-zero gradient finite (C / gamma) and decides
  how strongly gradients much smaller than it are shrunk.

A weight is 0 for padding rows (``mask`` 0) and for non-finite norms, so no NaN or infinity
enters the sum; a negative norm is refused on the CPU (elsewhere the check would need a host
synchronisation, and the weight is 0 instead; ``docs/devices.md``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from dpfy._validate import check_range
from dpfy.queries._tree import check_mask, clip_weights_from_norms

#: The clip functions, by name (``dpfy.config`` holds the same tuple for ``dpfy train``).
ClippingMode = Literal["flat", "automatic"]
CLIPPING_MODES: tuple[ClippingMode, ...] = ("flat", "automatic")
#: Bu et al. 2023's stability constant for AUTO-S (their experiments use 0.01).
DEFAULT_STABILITY = 0.01


def check_clipping(
    clipping: object, stability: object, stability_name: str = "clip_stability"
) -> ClippingMode:
    """``clipping`` as a :data:`ClippingMode`; ``ValueError`` naming the bad parameter.

    ``stability`` (gamma, named ``stability_name`` in the message) must be a finite number
    > 0 (it is unused by ``"flat"`` but still checked, so a bad value is never carried).
    """
    if clipping not in CLIPPING_MODES:
        raise ValueError(
            f"clipping must be one of {{{', '.join(CLIPPING_MODES)}}}, got clipping={clipping!r}"
        )
    check_range(stability_name, stability, 0.0, math.inf, low_open=True, high_open=True)
    return clipping


def automatic_clip_weights(
    norms: torch.Tensor, clip_norm: float, stability: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``C / (norm + gamma)`` per unit (float64); 0 for padding or non-finite norms."""
    norms = torch.as_tensor(norms).to(torch.float64)
    if norms.device.type == "cpu" and bool((norms < 0).any()):
        raise ValueError(f"norms must be in [0, inf], got a norm of {float(norms.min())!r}")
    finite = torch.isfinite(norms) & (norms >= 0)  # NaN, inf and (off the CPU) negative: 0
    safe = torch.where(finite, norms, torch.zeros_like(norms))
    zero = torch.zeros_like(norms)
    w = torch.where(finite, clip_norm / (safe + stability), zero)
    # C / (n + gamma) rounds up at times (by far most at subnormal weights, n near the float64
    # maximum): one step down to 0 then keeps w n <= C (up to the product's own rounding)
    w = torch.where(w * safe > clip_norm, torch.nextafter(w, zero), w)
    return w if mask is None else w * check_mask(mask, w)


def clip_weights_for(
    clipping: ClippingMode,
    norms: torch.Tensor,
    clip_norm: float,
    stability: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weights of ``clipping`` (see the module docstring) for flat norms ``[B]``."""
    if clipping == "automatic":
        return automatic_clip_weights(norms, clip_norm, stability, mask)
    return clip_weights_from_norms(norms, clip_norm, mask)


def describe_clipping(clipping: ClippingMode, stability: float) -> str:
    """One line for the ledger's metadata and the report: which clip function ran."""
    if clipping == "automatic":
        return (f"automatic: g * C / (||g|| + {stability:g}) (Bu et al. 2023, AUTO-S); "
                "every norm below C, the clip norm only scales the step")
    return "flat: g * min(1, C / ||g||)"

"""PyTorch DP-SGD: per-example clipping, noise, ledger entries (DESIGN.md section 5).

The low-level step is :class:`PrivateGradient` (``accumulate`` per physical chunk,
``release`` once per logical step); per-layer norm rules live in :mod:`dpfy.training.norms`.
"""

from dpfy.training.step import ChunkStats, MicrobatchMode, PrivateGradient, StepStats

__all__ = ["ChunkStats", "MicrobatchMode", "PrivateGradient", "StepStats"]

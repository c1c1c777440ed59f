"""PyTorch DP-SGD: per-example clipping, noise, ledger entries (docs/architecture.md, 5.11).

The low-level step is :class:`PrivateGradient` (``accumulate`` per physical chunk,
``release`` once per logical step); per-layer norm rules live in :mod:`dpfy.training.norms`.
"""

from dpfy.training.checkpoint import load_checkpoint, save_checkpoint
from dpfy.training.chunk import OpenChunk
from dpfy.training.data import PhysicalBatch, PhysicalBatcher, accumulate_logical_batch
from dpfy.training.loader import DatasetBatcher, PrivateBatchSampler
from dpfy.training.private import (
    PrivateCriterion,
    PrivateLoader,
    PrivateLoss,
    PrivateOptimizer,
    PrivateOptions,
    make_private,
)
from dpfy.training.step import ChunkStats, MicrobatchMode, PrivateGradient, StepStats
from dpfy.training.trainer import (
    BudgetExceededError,
    BudgetGuard,
    History,
    PrivateTrainer,
    ProgressInfo,
    TrainerOptions,
    TrainResult,
)
from dpfy.training.validate import (
    ModuleIssue,
    UnsupportedModuleError,
    check_module,
    fix_module,
    validate_module,
)

__all__ = ["ChunkStats", "MicrobatchMode", "OpenChunk", "PrivateGradient", "StepStats"]
__all__ += [
    "BudgetExceededError",
    "BudgetGuard",
    "DatasetBatcher",
    "History",
    "ModuleIssue",
    "PhysicalBatch",
    "PhysicalBatcher",
    "PrivateBatchSampler",
    "PrivateCriterion",
    "PrivateLoader",
    "PrivateLoss",
    "PrivateOptimizer",
    "PrivateOptions",
    "PrivateTrainer",
    "ProgressInfo",
    "TrainResult",
    "TrainerOptions",
    "UnsupportedModuleError",
    "accumulate_logical_batch",
    "check_module",
    "fix_module",
    "load_checkpoint",
    "make_private",
    "save_checkpoint",
    "validate_module",
]

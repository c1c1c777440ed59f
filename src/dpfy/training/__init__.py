"""PyTorch DP-SGD: per-example clipping, noise, ledger entries (docs/architecture.md, 5.11).

The low-level step is :class:`PrivateGradient` (``accumulate`` per physical chunk,
``release`` once per logical step); per-layer norm rules live in :mod:`dpfy.training.norms`.
"""

from dpfy.training.allocator import keep_freed_memory
from dpfy.training.budget import BudgetExceededError, BudgetGuard
from dpfy.training.checkpoint import load_checkpoint, save_checkpoint
from dpfy.training.history import TrainResult
from dpfy.training.private import (
    PrivateCriterion,
    PrivateLoader,
    PrivateOptimizer,
    PrivateOptions,
    make_private,
)
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import PrivateTrainer, TrainerOptions
from dpfy.training.validate import (
    ModuleIssue,
    UnsupportedModuleError,
    check_module,
    fix_module,
    validate_module,
)

__all__ = [
    "make_private",
    "PrivateOptions",
    "PrivateLoader",
    "PrivateOptimizer",
    "PrivateCriterion",
    "PrivateGradient",
    "PrivateTrainer",
    "TrainerOptions",
    "TrainResult",
    "BudgetGuard",
    "BudgetExceededError",
    "check_module",
    "validate_module",
    "fix_module",
    "UnsupportedModuleError",
    "ModuleIssue",
    "save_checkpoint",
    "load_checkpoint",
    "keep_freed_memory",
]

"""Opacus' ``opacus.utils`` paths: ``dpfy.opacus.utils.batch_memory_manager``."""

from dpfy.opacus.utils import batch_memory_manager  # noqa: F401  (the path tutorials import)

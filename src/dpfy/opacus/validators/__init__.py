"""``from dpfy.opacus.validators import ModuleValidator``, as from ``opacus.validators``."""

from dpfy.opacus.validators.module_validator import ModuleValidator

__all__ = ["ModuleValidator"]

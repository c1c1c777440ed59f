"""``ModuleValidator``: Opacus' model checks and fixes, answered by dpfy's.

``validate`` lists what :func:`dpfy.training.check_module` finds to be an error (layers that
mix examples, running statistics, lazy or tied parameters...), one
:class:`dpfy.training.UnsupportedModuleError` per problem as Opacus returns one error per
problem; ``fix`` returns :func:`dpfy.training.fix_module`'s fixed copy (BatchNorm -> GroupNorm
with at most 32 groups, as Opacus). Layers Opacus has to replace (``nn.LSTM`` -> ``DPLSTM``,
``nn.MultiheadAttention`` -> ``DPMultiheadAttention``) need no fix here: dpfy clips them
exactly as they are.
"""

from __future__ import annotations

from torch import nn

from dpfy.training import UnsupportedModuleError, check_module, fix_module


class ModuleValidator:
    """Opacus' ``ModuleValidator`` over dpfy's module checks (module docstring)."""

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[UnsupportedModuleError]:
        """Every problem of ``module``, one error each; ``strict=True`` raises them together.

        Notes (layers that train through the slower generic rule) are not problems.

        Raises:
          UnsupportedModuleError: with ``strict=True``, listing every problem.
        """
        errors = [i for i in check_module(module) if i.severity == "error"]
        if strict and errors:
            raise UnsupportedModuleError(errors)
        return [UnsupportedModuleError([issue]) for issue in errors]

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether ``module`` trains privately as is."""
        return not cls.validate(module, strict=False)

    @classmethod
    def fix(cls, module: nn.Module, *, max_groups: int = 32) -> nn.Module:
        """A fixed deep copy of ``module`` (``module`` itself is not changed)."""
        return fix_module(module, max_groups=max_groups)

    @classmethod
    def fix_and_validate(cls, module: nn.Module, *, max_groups: int = 32) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``."""
        fixed = cls.fix(module, max_groups=max_groups)
        cls.validate(fixed, strict=True)
        return fixed

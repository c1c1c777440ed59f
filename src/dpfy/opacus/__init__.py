"""Opacus' public surface on dpfy: port a script by changing ``from opacus import ...`` to
``from dpfy.opacus import ...``.

* ``dpfy.opacus.PrivacyEngine`` (:mod:`dpfy.opacus.privacy_engine`): ``make_private``,
  ``make_private_with_epsilon``, ``get_epsilon``, ``accountant``; dpfy's sampler, ledger,
  secure randomness and report underneath.
* ``dpfy.opacus.utils.batch_memory_manager.BatchMemoryManager``,
  ``dpfy.opacus.validators.ModuleValidator``, ``dpfy.opacus.layers.DPLSTM`` (and ``DPGRU``,
  ``DPRNN``, ``DPMultiheadAttention``): the same import paths as Opacus'.

What differs from Opacus, and why, is in :mod:`dpfy.opacus.privacy_engine` (refusals),
:mod:`dpfy.opacus.accountant` (which accountant answers) and :mod:`dpfy.opacus.outputs` (how
each example's gradient is read off the loop's own ``loss.backward()``).
"""

from dpfy.opacus import layers, utils, validators  # noqa: F401  (Opacus' import paths)
from dpfy.opacus.privacy_engine import PrivacyEngine

__all__ = ["PrivacyEngine"]

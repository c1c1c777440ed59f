"""Opacus' public surface on dpfy: port a script by changing ``from opacus import ...`` to
``from dpfy.opacus import ...``.

* ``dpfy.opacus.PrivacyEngine`` (:mod:`dpfy.opacus.privacy_engine`): ``make_private``,
  ``make_private_with_epsilon``, ``get_epsilon``, ``accountant``, ``write_report``; dpfy's
  sampler, ledger, secure randomness and report underneath.
* ``dpfy.opacus.utils.batch_memory_manager.BatchMemoryManager``,
  ``dpfy.opacus.validators.ModuleValidator``, ``dpfy.opacus.layers.DPLSTM`` (and ``DPGRU``,
  ``DPRNN``, ``DPMultiheadAttention``): the same import paths as Opacus'.
* ``dpfy.opacus.accountants`` (``RDPAccountant``, ``PRVAccountant``, ``GaussianAccountant``,
  ``get_noise_multiplier`` in ``.utils``, ``compute_rdp`` and ``get_privacy_spent`` in
  ``.analysis.rdp``): stand-alone accountants on dpfy's accounting
  (:mod:`dpfy.opacus._accountants`).
* Every other public name of Opacus 1.6 imports from the same path under ``dpfy.opacus`` or
  is refused with an ``ImportError`` of one line naming what to use instead
  (:mod:`dpfy.opacus._surface`; the table is ``docs/opacus_names.md``).

What differs from Opacus, and why, is in :mod:`dpfy.opacus.privacy_engine` (refusals),
:mod:`dpfy.opacus.accountant` (which accountant answers) and :mod:`dpfy.opacus.outputs` (how
each example's gradient is read off the loop's own ``loss.backward()``).
"""

from dpfy.opacus import _surface, layers, utils, validators  # noqa: F401  (Opacus' paths)
from dpfy.opacus.privacy_engine import PrivacyEngine

__version__ = _surface.OPACUS_VERSION
__all__ = ["PrivacyEngine"]
__getattr__ = _surface._getattr_for("opacus", _surface.SURFACE["opacus"], None)
_surface.install()

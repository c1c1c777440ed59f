"""dpfy: differentially private ML that tells the truth about the guarantee.

``import dpfy`` needs only NumPy and SciPy; PyTorch is imported by ``dpfy.training`` and
``dpfy.features`` only.
"""

from dpfy import events

__all__ = ["events", "__version__"]
__version__ = "0.1.0"

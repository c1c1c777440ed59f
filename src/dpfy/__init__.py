"""dpfy: differentially private ML that tells the truth about the guarantee.

``import dpfy`` needs only NumPy and SciPy; PyTorch is imported by ``dpfy.training`` and
``dpfy.features`` only.
"""

from typing import Any

from dpfy import events

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``dpfy.make_private`` (:mod:`dpfy.training.private`), imported on first use (torch)."""
    if name == "make_private":
        from dpfy.training.private import make_private

        return make_private
    raise AttributeError(f"module 'dpfy' has no attribute {name!r}")

__all__ = [
    "events",
    "make_private",
    "__version__",
]

"""Privacy accounting (NumPy/SciPy only; importing this package never imports torch).

Entry points: :func:`epsilon`, :func:`delta`, :func:`compare` over :mod:`dpfy.events` trees or
anything with a ``to_event()`` method (:class:`EventSource`, e.g. a ledger).
Each accounting method lives in its own module and registers itself here.
"""

from dpfy.accounting import (
    gaussian,  # noqa: F401  (registers the 'gaussian' accountant)
    monte_carlo,  # noqa: F401  (registers the 'monte_carlo' accountant)
    pld,  # noqa: F401  (registers the 'pld' accountant)
    random_allocation,  # noqa: F401  (registers the 'random_allocation' accountant)
    rdp,  # noqa: F401  (registers the 'rdp' accountant)
    shuffle,  # noqa: F401  (registers the 'shuffle' accountant)
    tuning,  # noqa: F401  (registers the 'rdp_tuning' accountant: RepeatAndSelect)
)
from dpfy.accounting._api import (
    Accountant,
    CalibrationSearch,
    EventSource,
    PrivacyResult,
    SearchesForCalibration,
    UnsupportedEventError,
    accountants,
    compare,
    delta,
    epsilon,
    register_accountant,
)
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.accounting.group import GroupPrivacy, group_privacy

__all__ = [
    "Accountant",
    "CalibrationSearch",
    "EventSource",
    "GroupPrivacy",
    "PrivacyResult",
    "SearchesForCalibration",
    "UnsupportedEventError",
    "accountants",
    "calibrate_noise_multiplier",
    "compare",
    "delta",
    "epsilon",
    "group_privacy",
    "register_accountant",
]

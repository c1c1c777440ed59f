"""Privacy accounting (NumPy/SciPy only; importing this package never imports torch).

Entry points: :func:`epsilon`, :func:`delta`, :func:`compare` over :mod:`dpfy.events` trees or
anything with a ``to_event()`` method (:class:`EventSource`, e.g. a ledger).
Each accounting method lives in its own module and registers itself here.
"""

from dpfy.accounting import (
    balls_and_bins,  # noqa: F401  (registers the 'monte_carlo' accountant)
    gaussian,  # noqa: F401  (registers the 'gaussian' accountant)
    pld,  # noqa: F401  (registers the 'pld' accountant)
    random_allocation,  # noqa: F401  (registers the 'random_allocation' accountant)
    rdp,  # noqa: F401  (registers the 'rdp' accountant)
    shuffle,  # noqa: F401  (registers the 'shuffle' accountant)
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
    contains_non_private,
    delta,
    epsilon,
    register_accountant,
    untruncated,
)
from dpfy.accounting.group import GroupPrivacy, group_epsilon, group_privacy

__all__ = [
    "Accountant",
    "CalibrationSearch",
    "EventSource",
    "GroupPrivacy",
    "group_epsilon",
    "group_privacy",
    "PrivacyResult",
    "SearchesForCalibration",
    "UnsupportedEventError",
    "accountants",
    "compare",
    "contains_non_private",
    "delta",
    "epsilon",
    "register_accountant",
    "untruncated",
]

from dpfy.accounting import tuning  # noqa: E402,F401  (registers "rdp_tuning": RepeatAndSelect)

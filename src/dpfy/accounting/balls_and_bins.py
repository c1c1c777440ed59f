"""Monte Carlo accounting of Balls-and-Bins sampling: the former single-module home of
:mod:`dpfy.accounting.monte_carlo`, kept so that existing imports keep working.

Importing it registers the ``monte_carlo`` accountant (through the package).
"""

from dpfy.accounting.monte_carlo import (
    NO_AMPLIFICATION_NOTE,
    Epoch,
    Method,
    MonteCarloAccountant,
    MonteCarloEstimate,
    balls_and_bins_delta,
    balls_and_bins_epsilon,
    block_log_sums,
    default_orders,
    default_samples,
    epochs_of_event,
    kl_upper_bound,
    lower_bound_delta,
    lower_bound_epsilon,
    monte_carlo_delta,
    monte_carlo_epsilon,
)
from dpfy.accounting.monte_carlo.sum_tails import SumTails as _SumTails
from dpfy.accounting.monte_carlo.tilted import add_log_mgf as _add_log_mgf

__all__ = [
    "Epoch",
    "MonteCarloEstimate",
    "MonteCarloAccountant",
    "epochs_of_event",
    "kl_upper_bound",
    "lower_bound_delta",
    "lower_bound_epsilon",
    "monte_carlo_delta",
    "monte_carlo_epsilon",
    "balls_and_bins_delta",
    "balls_and_bins_epsilon",
    "default_orders",
    "default_samples",
    "block_log_sums",
]

# Also importable as before (not part of __all__): the Method literal, the note text, and the
# two internals the tests exercise directly.
_COMPAT = (NO_AMPLIFICATION_NOTE, Method, _SumTails, _add_log_mgf)

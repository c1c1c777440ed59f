"""Monte Carlo accounting of Balls-and-Bins sampling (Chua et al. 2025), split by concept.

* :mod:`.epochs` -- :class:`Epoch` and its extraction from event trees.
* :mod:`.confidence` -- KL (Chernoff-Hoeffding) upper confidence bounds.
* :mod:`.lower_bound` -- the certain max-bit lower bound (via :mod:`dpfy.accounting.lower_bounds`).
* :mod:`.base` -- jobs, job results and the :class:`LossEstimator` protocol.
* samplers and estimators: :mod:`.plain`, :mod:`.importance`, :mod:`.order_statistics`
  (with :mod:`.empirical`), :mod:`.conditional` (with :mod:`.sum_tails`), :mod:`.tilted`,
  :mod:`.hybrid`; :mod:`.methods` chooses and builds one.
* :mod:`.runner` -- seeding, chunking, executor and progress bar.
* :mod:`.accountant` -- :class:`MonteCarloAccountant` (registered as ``monte_carlo``) and the
  public functions.
"""

from dpfy.accounting.monte_carlo.accountant import (
    NO_AMPLIFICATION_NOTE,
    MonteCarloAccountant,
    MonteCarloEstimate,
    balls_and_bins_delta,
    balls_and_bins_epsilon,
    monte_carlo_delta,
    monte_carlo_epsilon,
)
from dpfy.accounting.monte_carlo.base import LossEstimator
from dpfy.accounting.monte_carlo.confidence import kl_upper_bound
from dpfy.accounting.monte_carlo.epochs import Epoch, epochs_of_event
from dpfy.accounting.monte_carlo.lower_bound import lower_bound_delta, lower_bound_epsilon
from dpfy.accounting.monte_carlo.methods import Method, default_samples
from dpfy.accounting.monte_carlo.order_statistics import block_log_sums, default_orders

__all__ = [
    "NO_AMPLIFICATION_NOTE",
    "Epoch",
    "LossEstimator",
    "Method",
    "MonteCarloAccountant",
    "MonteCarloEstimate",
    "balls_and_bins_delta",
    "balls_and_bins_epsilon",
    "block_log_sums",
    "default_orders",
    "default_samples",
    "epochs_of_event",
    "kl_upper_bound",
    "lower_bound_delta",
    "lower_bound_epsilon",
    "monte_carlo_delta",
    "monte_carlo_epsilon",
]

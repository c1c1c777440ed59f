"""Monte Carlo accounting of Balls-and-Bins sampling (Chua et al. 2025), split by concept.

* :mod:`.epochs` -- :class:`Epoch` and its extraction from event trees.
* :mod:`.confidence` -- KL (Chernoff-Hoeffding) upper confidence bounds.
* :mod:`.lower_bound` -- the certain max-bit lower bound (via :mod:`dpfy.accounting.lower_bounds`).
* :mod:`.base` -- jobs, job results and the :class:`LossEstimator` protocol.
* samplers and estimators: :mod:`.plain`, :mod:`.importance`, :mod:`.order_statistics`
  (with :mod:`.empirical`), :mod:`.conditional` (with :mod:`.sum_tails`), :mod:`.tilted`,
  :mod:`.hybrid`; :mod:`.methods` chooses and builds one.
* :mod:`.runner` -- seeding, chunking, executor and progress bar.
* :mod:`.accountant` -- :class:`MonteCarloAccountant` (registered as ``monte_carlo``) and its
  functions.

None of it is public API: use ``dpfy.accounting.epsilon(event, method="monte_carlo")``.
"""

from dpfy.accounting.monte_carlo import accountant  # noqa: F401  (registers 'monte_carlo')

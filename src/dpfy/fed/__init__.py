"""Federated learning with client-level DP: DP-FedAvg on dpfy's queries, on Flower or in-process.

McMahan et al. 2018; Ponomareva et al. 2023, Alg. 2; adaptive clipping of Andrew et al. 2021.
The unit of privacy is one client. Modules, one concept each:

* :mod:`~dpfy.fed.cohort` -- which clients take part in a round (Poisson or fixed-size over the
  population; the ledger records the sampler that ran, with ``unit="client"``);
* :mod:`~dpfy.fed.server` -- one round without any transport: clip, sum, record, noise once,
  divide by the expected cohort size; the trust model of server- and client-side clipping;
* :mod:`~dpfy.fed.client` -- the client's local training, its delta and client-side clipping;
* :mod:`~dpfy.fed.simulation` -- the in-process fast path (same code, no Flower);
* :mod:`~dpfy.fed.flower` -- the Flower strategy wrapper and client app (needs the ``fed``
  extra; not imported here, so ``dpfy.fed`` works without Flower).
"""

from dpfy.fed.cohort import CohortSampler
from dpfy.fed.server import DPFedAvg, client_update_query
from dpfy.fed.simulation import run_in_process

__all__ = [
    "DPFedAvg",
    "CohortSampler",
    "client_update_query",
    "run_in_process",
]

"""Which clients take part in a round: Poisson or fixed-size sampling over a public population.

DP-FedAvg (McMahan et al. 2018, Alg. 1; Ponomareva et al. 2023, Alg. 2) draws each round's
cohort from a population of ``num_clients`` clients. The unit of privacy is one client (all of
its data), so the cohort sampler plays the part of the batch sampler of DP-SGD, and accounting
follows the sampler that actually ran:

* ``"poisson"``: every client joins every round independently with probability q (expected
  cohort q N); accounted as Poisson subsampling, add-or-remove adjacency of one client.
* ``"fixed_size"``: exactly ``clients_per_round`` distinct clients, uniformly without
  replacement; accounted as sampling without replacement, replace-one adjacency (the number
  of clients is public).

The draws come from dpfy's own samplers (:mod:`dpfy.sampling`) over client indices
``0..N-1``; the ledger entry is the sampler's :class:`~dpfy.sampling.SampleSpec` with
``unit="client"``. Randomness is the secure generator unless a seeded one is passed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from dpfy._validate import check_int, check_range
from dpfy.randomness import Randomness
from dpfy.sampling import SampleSpec
from dpfy.sampling.fixed_size import FixedSizeSampler
from dpfy.sampling.poisson import PoissonSampler

#: The unit of privacy every federated ledger records.
CLIENT_UNIT = "client"

CohortKind = Literal["poisson", "fixed_size"]


class CohortSampler:
    """Draws the clients of each round and states the ledger entry describing the draw.

    Args:
      num_clients: size N of the (public, fixed) client population, >= 1.
      kind: ``"poisson"`` (give ``sampling_rate``) or ``"fixed_size"`` (give
        ``clients_per_round``).
      sampling_rate: q in (0, 1] for Poisson sampling.
      clients_per_round: cohort size in [1, N] for fixed-size sampling.
      randomness: sampling randomness (default: the secure generator).

    Attributes:
      expected_size: the expected cohort size (q N, or the fixed size): the fixed denominator
        of the averaged update (never the realised cohort size, which is private under
        Poisson sampling).
    """

    def __init__(
        self,
        num_clients: int,
        kind: CohortKind = "poisson",
        *,
        sampling_rate: float | None = None,
        clients_per_round: int | None = None,
        randomness: Randomness | None = None,
    ) -> None:
        check_int("num_clients", num_clients)
        self.num_clients = int(num_clients)
        self.randomness = randomness if randomness is not None else Randomness.secure_mode()
        self.kind: CohortKind = kind
        self._sampler: PoissonSampler | FixedSizeSampler
        if kind == "poisson":
            if sampling_rate is None or clients_per_round is not None:
                raise ValueError(
                    "kind='poisson' takes sampling_rate (in (0, 1]) and no clients_per_round, "
                    f"got sampling_rate={sampling_rate!r}, clients_per_round={clients_per_round!r}"
                )
            check_range("sampling_rate", sampling_rate, 0.0, 1.0, low_open=True)
            self._sampler = PoissonSampler(
                self.num_clients, float(sampling_rate), steps_per_epoch=1,
                randomness=self.randomness,
            )
        elif kind == "fixed_size":
            if clients_per_round is None or sampling_rate is not None:
                raise ValueError(
                    "kind='fixed_size' takes clients_per_round (in [1, num_clients]) and no "
                    f"sampling_rate, got clients_per_round={clients_per_round!r}, "
                    f"sampling_rate={sampling_rate!r}"
                )
            check_range("clients_per_round", clients_per_round, 1, self.num_clients, integer=True)
            self._sampler = FixedSizeSampler(
                self.num_clients, int(clients_per_round), steps_per_epoch=1,
                randomness=self.randomness,
            )
        else:
            raise ValueError(f"kind must be one of {{poisson, fixed_size}}, got kind={kind!r}")
        self.expected_size = float(self._sampler.expected_batch_size)

    def draw(self) -> np.ndarray:
        """The next cohort: sorted client indices in ``[0, num_clients)`` (may be empty under
        Poisson sampling)."""
        return next(iter(self._sampler.batches(0)))

    def sample_spec(self) -> SampleSpec:
        """The ledger entry of one draw: the sampler's spec with ``unit="client"``."""
        return dataclasses.replace(self._sampler.sample_spec(), unit=CLIENT_UNIT)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state (the seeded generator's state; nothing for secure randomness)."""
        return {"kind": self.kind, "sampler": self._sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"state kind must be {self.kind!r}, got kind={state.get('kind')!r}")
        self._sampler.load_state_dict(state["sampler"])

    def __repr__(self) -> str:
        return (
            f"CohortSampler(num_clients={self.num_clients}, kind={self.kind!r}, "
            f"expected_size={self.expected_size:g})"
        )

"""DP-FedAvg rounds on dpfy's queries: sample clients, clip, sum, noise once, record, release.

McMahan, Ramage, Talwar, Zhang 2018 ("Learning differentially private recurrent language
models", Alg. 1 with uniform client weights); Ponomareva et al. 2023, Alg. 2. One round:

1. :meth:`DPFedAvg.begin_round` draws the cohort (:class:`~dpfy.fed.cohort.CohortSampler`) and
   records the draw in the ledger (a ``SampleSpec`` with ``unit="client"``);
2. each sampled client trains locally from the current global model and reports its model
   delta (:mod:`dpfy.fed.client`); clients that drop out contribute nothing;
3. :meth:`DPFedAvg.finish_round` clips every delta to ``C`` in L2 (all tensors as one vector),
   sums, and releases the sum through a dpfy query: the ledger entry (sensitivity C, noise
   std z C) is written *before* the noise is drawn, and the noise is added once per round on
   the server. The noisy sum is divided by the *expected* cohort size (q N, or the fixed
   size), never the realised one, and the caller applies the mean delta to the global model
   (post-processing).

Clipping is fixed (:class:`~dpfy.queries.GaussianSumQuery`) or adaptive
(:class:`~dpfy.queries.AdaptiveClipQuery`, Andrew et al. 2021: the clip norm follows a
target quantile of the client update norms; the noisy count of unclipped clients is a second
Gaussian part of the same release, so the round's effective noise multiplier stays the
requested z).

Where clipping runs, and whom the client must trust (stated in the ledger and the report):

* ``clipping="server"``: clients send raw deltas; the server clips. The server sees every
  unclipped update in the clear; the guarantee protects clients against everyone who sees
  the released global models, not against the server.
* ``clipping="client"``: clients clip their own delta to the clip norm the server sends and
  report whether it was unclipped (one bit, for adaptive clipping); the server checks the
  bound by clipping again (a client that did not clip is clipped here, so the sensitivity
  holds whatever clients send) and adds the noise. The server still sees clipped updates in
  the clear unless a secure aggregation protocol hides them; noise is added centrally, so the
  guarantee again holds against observers of the released models, not against the server.

Adjacency: add or remove one client (Poisson cohorts) or replace one client (fixed-size
cohorts); the unit of privacy is the client, i.e. all of its data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from dpfy._validate import check_range
from dpfy.fed.cohort import CohortSampler
from dpfy.ledger import Ledger
from dpfy.queries import AdaptiveClipQuery, GaussianSumQuery
from dpfy.queries._tree import clip_weights_from_norms
from dpfy.randomness import Randomness

ClippingSite = Literal["server", "client"]

#: What the report states about who sees what, per clipping site.
TRUST_MODELS: dict[str, str] = {
    "server": (
        "server-side clipping: clients send raw model deltas; the server clips, sums and adds "
        "the Gaussian noise once per round. The server sees every client's unclipped update in "
        "the clear and must be trusted; the guarantee holds against everyone who sees the "
        "released global models"
    ),
    "client": (
        "client-side clipping: each client clips its own model delta to the clip norm the "
        "server sends; the server re-clips (so a client that did not clip cannot raise the "
        "sensitivity), sums and adds the Gaussian noise once per round. The server sees the "
        "clipped updates in the clear unless secure aggregation hides them, and must be "
        "trusted to add the noise; the guarantee holds against everyone who sees the released "
        "global models"
    ),
}

#: The report's DP setting for a federated ledger.
FED_DP_SETTING = (
    "federated learning with central (server-added) DP, user-level: the unit of privacy is one "
    "client and all of its data (DP-FedAvg, McMahan et al. 2018; Ponomareva et al. 2023, "
    "Alg. 2); trust model: {trust}"
)

Update = Mapping[str, torch.Tensor]
ClientQuery = GaussianSumQuery | AdaptiveClipQuery


def client_update_query(
    clip_norm: float,
    noise_multiplier: float,
    *,
    adaptive: bool = False,
    expected_clients: float | None = None,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_noise_std: float | None = None,
) -> ClientQuery:
    """The query of one round: fixed clipping, or adaptive clipping (Andrew et al. 2021).

    Args:
      clip_norm: (initial) clip norm C of one client's model delta, L2 over all tensors.
      noise_multiplier: z, noise std / sensitivity of the whole round's release.
      adaptive: follow ``target_quantile`` of the update norms (needs ``expected_clients``).
      expected_clients: expected cohort size (the denominator of the unclipped fraction).
      target_quantile, learning_rate, count_noise_std: see :class:`~dpfy.queries.AdaptiveClipQuery`.
    """
    if not adaptive:
        return GaussianSumQuery(clip_norm, noise_multiplier, name="client_update")
    if expected_clients is None:
        raise ValueError("adaptive clipping needs expected_clients (the expected cohort size)")
    return AdaptiveClipQuery(
        clip_norm, noise_multiplier, expected_clients, target_quantile=target_quantile,
        learning_rate=learning_rate, count_noise_std=count_noise_std, name="client_update",
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Round:
    """One round in progress: its number (from 1), the ledger's sample id, the cohort and the
    clip norm the clients of this round must use (client-side clipping)."""

    number: int
    sample_id: int
    cohort: tuple[int, ...]
    clip_norm: float


class DPFedAvg:
    """The server side of DP-FedAvg, without any transport (Flower or in-process).

    Args:
      cohort: the client sampler (its population size N is the public number of clients).
      query: the round's release (:func:`client_update_query`); its noise multiplier is the
        round's z.
      ledger: where every round is recorded before its result exists.
      clipping: ``"server"`` or ``"client"`` (see the module docstring).
      randomness: noise randomness (default: the secure generator).
    """

    def __init__(
        self,
        cohort: CohortSampler,
        query: ClientQuery,
        ledger: Ledger,
        *,
        clipping: ClippingSite = "server",
        randomness: Randomness | None = None,
    ) -> None:
        if not isinstance(cohort, CohortSampler):
            raise ValueError(f"cohort must be a dpfy.fed.CohortSampler, got cohort={cohort!r}")
        if not isinstance(query, GaussianSumQuery | AdaptiveClipQuery):
            raise ValueError(
                "query must be a GaussianSumQuery or AdaptiveClipQuery (see "
                f"dpfy.fed.client_update_query), got query={query!r}"
            )
        if isinstance(query, GaussianSumQuery) and query.clipped_unit != "example":
            raise ValueError(
                "query must clip each client's delta as one unit, got "
                f"clipped_unit={query.clipped_unit!r}"
            )
        if not isinstance(ledger, Ledger):
            raise ValueError(f"ledger must be a dpfy.ledger.Ledger, got ledger={ledger!r}")
        if clipping not in TRUST_MODELS:
            raise ValueError(f"clipping must be one of {{server, client}}, got {clipping!r}")
        self.cohort = cohort
        self.query = query
        self.ledger = ledger
        self.clipping: ClippingSite = clipping
        self.randomness = randomness if randomness is not None else Randomness.secure_mode()
        self.rounds_done = 0
        self.last_dropped = 0  # cohort clients without a usable delta in the last round
        self._open: Round | None = None

    @property
    def open_round(self) -> Round | None:
        """The round begun and not yet finished (None between rounds)."""
        return self._open

    @property
    def noise_multiplier(self) -> float:
        """The effective noise multiplier z of one round's release."""
        return float(self.query.noise_multiplier)

    def describe(self) -> dict[str, Any]:
        """The run facts the ledger's metadata records (the report reads them)."""
        adaptive = isinstance(self.query, AdaptiveClipQuery)
        return {
            "trainer": "dpfy.fed.DPFedAvg",
            "dp_setting": FED_DP_SETTING.format(trust=TRUST_MODELS[self.clipping]),
            "trust_model": TRUST_MODELS[self.clipping],
            "clipping_site": self.clipping,
            "clipping": "adaptive (Andrew et al. 2021)" if adaptive else "fixed",
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": float(self.query.clip_norm),
            "num_clients": self.cohort.num_clients,
            "cohort_sampler": self.cohort.kind,
            "expected_clients_per_round": self.cohort.expected_size,
            "sampling_randomness": self.cohort.randomness.describe(),
            "noise_randomness": self.randomness.describe(),
            "released_output": "the global model after every round",
            "data_accesses": "every round of the federated run (local training on each sampled "
            "client); federated evaluation metrics and hyperparameter tuning are NOT covered",
        }

    # -- a round ------------------------------------------------------------------------------
    def begin_round(self) -> Round:
        """Draw the cohort and record the draw; returns the round to run."""
        if self._open is not None:
            raise RuntimeError(f"round {self._open.number} is still open; finish it first")
        if self.ledger.iteration == 0 and self.rounds_done == 0:
            self.ledger.record_metadata(**self.describe())
        cohort = tuple(int(i) for i in self.cohort.draw())
        sid = self.ledger.record_sample(self.cohort.sample_spec(), step=self.rounds_done)
        self._open = Round(self.rounds_done + 1, sid, cohort, float(self.query.clip_norm))
        return self._open

    def finish_round(
        self,
        template: Update,
        updates: Mapping[int, Update],
        *,
        unclipped: Mapping[int, bool] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Clip, sum, record and noise the round's client deltas; returns the mean delta.

        Args:
          template: the global model's tensors (names, shapes, dtypes of every delta).
          updates: client index -> its model delta (only clients of the cohort; missing
            clients dropped out and contribute zero).
          unclipped: client-side clipping with an adaptive query: client index -> whether
            the client's delta was within the clip norm before it clipped.

        Returns:
          ``(sum of clipped deltas + N(0, (z C)^2)) / expected cohort size`` per tensor.
        """
        rnd = self._open
        if rnd is None:
            raise RuntimeError("no round is open; call begin_round() first")
        names = list(template)
        foreign = sorted(set(updates) - set(rnd.cohort))
        if foreign:
            raise ValueError(
                f"updates must come from the round's cohort, got clients {foreign[:5]} that "
                f"were not sampled in round {rnd.number}"
            )
        # A delta with a non-finite value is dropped (the client contributes zero, as if it
        # had dropped out): a client's own choice to be absent is within the sensitivity.
        clients = [c for c in sorted(updates) if _check_update(c, updates[c], template)]
        self.last_dropped = len(rnd.cohort) - len(clients)
        stacked = {
            n: torch.stack([updates[c][n].detach().to(template[n].dtype) for c in clients])
            if clients
            else template[n].new_zeros((0, *template[n].shape))
            for n in names
        }
        flat = torch.cat(
            [stacked[n].reshape(len(clients), template[n].numel()) for n in names], dim=1
        )
        norms = torch.linalg.vector_norm(flat.double(), dim=1)
        clip = float(self.query.clip_norm)
        weights = clip_weights_from_norms(norms, clip)  # server-side clip (also re-clips)
        if self.clipping == "client" and isinstance(self.query, AdaptiveClipQuery):
            if unclipped is None or not set(clients) <= set(unclipped):
                raise ValueError(
                    "client-side adaptive clipping needs unclipped[client] for every reporting "
                    "client (whether its delta was within the clip norm before clipping)"
                )
            bits = torch.tensor([bool(unclipped[c]) for c in clients], dtype=torch.bool)
            # The query counts norms <= C as unclipped: C for a client that reported it was
            # unclipped, 2C otherwise (the query's weights are not used: ``weights`` is).
            self.query.clip_weights(torch.where(bits, clip, 2.0 * clip).double())
        else:
            self.query.clip_weights(norms)  # accumulates the adaptive count (if any)
        clipped_sum = {
            n: torch.einsum("b,b...->...", weights.to(t.dtype), t) for n, t in stacked.items()
        }
        noisy = self.query.add_noise(
            clipped_sum, ledger=self.ledger, sample_id=rnd.sample_id, randomness=self.randomness
        )
        self._open = None
        self.rounds_done += 1
        return {n: noisy[n] / self.cohort.expected_size for n in names}

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Rounds done, the cohort sampler, the noise stream (seeded) and the adaptive clip
        norm; the caller checkpoints the ledger (``dpfy.training.checkpoint.ledger_state``)."""
        if self._open is not None:
            raise RuntimeError(f"round {self._open.number} is open; checkpoint between rounds")
        state: dict[str, Any] = {
            "rounds_done": self.rounds_done,
            "cohort": self.cohort.state_dict(),
            "noise_randomness": None if self.randomness.secure else self.randomness.state_dict(),
        }
        if isinstance(self.query, AdaptiveClipQuery):
            state["query"] = self.query.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_range("rounds_done", state["rounds_done"], 0, math.inf, integer=True)
        self.rounds_done = int(state["rounds_done"])
        self.cohort.load_state_dict(dict(state["cohort"]))
        if state.get("noise_randomness") is not None and not self.randomness.secure:
            self.randomness.load_state_dict(state["noise_randomness"])
        if isinstance(self.query, AdaptiveClipQuery) and "query" in state:
            self.query.load_state_dict(state["query"])


def _check_update(client: int, update: Update, template: Update) -> bool:
    """Names and shapes must match the model (``ValueError``); False for a non-finite delta."""
    if not isinstance(update, Mapping) or set(update) != set(template):
        got = sorted(update) if isinstance(update, Mapping) else type(update).__name__
        raise ValueError(
            f"update of client {client} must have the tensors {sorted(template)}, got {got}"
        )
    for n, t in template.items():
        u = update[n]
        if not isinstance(u, torch.Tensor) or u.shape != t.shape:
            shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(
                f"update of client {client}: {n!r} must be a tensor of shape {tuple(t.shape)}, "
                f"got {shape}"
            )
    return all(bool(torch.isfinite(update[n]).all()) for n in template)



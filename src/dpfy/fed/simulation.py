"""DP-FedAvg in one process, without Flower: the fast path for tests and benchmarks.

The same server (:class:`~dpfy.fed.server.DPFedAvg`) and client code
(:func:`~dpfy.fed.client.local_update`, :func:`~dpfy.fed.client.clip_update`) as the Flower
strategy (:mod:`dpfy.fed.flower`); only the transport differs: sampled clients are trained one
after another in this process on one shared model object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dpfy._validate import check_int, check_range
from dpfy.fed.client import apply_delta, clip_update, load_tensors, local_update, model_tensors
from dpfy.fed.server import DPFedAvg

ClientData = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LocalTraining:
    """Hyperparameters of a client's local SGD (public; McMahan et al. 2018, Alg. 1)."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.1

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs)
        check_int("batch_size", self.batch_size)
        check_range("lr", self.lr, 0.0, 1e15, low_open=True)


def run_in_process(
    server: DPFedAvg,
    model: nn.Module,
    clients: Sequence[ClientData],
    rounds: int,
    *,
    local: LocalTraining | None = None,
    server_lr: float = 1.0,
    evaluate: Callable[[int, nn.Module], dict[str, Any]] | None = None,
    after_round: Callable[[int, nn.Module], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``rounds`` rounds of DP-FedAvg on ``model`` (updated in place).

    Args:
      server: the round logic (cohort sampler, query, ledger, clipping site).
      model: the global model; its trainable parameters are the released state.
      clients: client i's ``(x, y)``; ``len(clients)`` must equal the server's population.
      rounds: number of rounds, >= 1.
      local: local training hyperparameters.
      server_lr: step applied to the noisy mean delta (1: plain FedAvg).
      evaluate: ``(round, model) -> metrics`` after each round (on public/held-out data).
      after_round: called after each round (checkpointing).

    Returns:
      One dict per round: ``round``, ``cohort_size`` (not private: for diagnostics only),
      ``clip_norm`` and the ``evaluate`` metrics.
    """
    check_int("rounds", rounds)
    check_range("server_lr", server_lr, 0.0, 1e15, low_open=True)
    if len(clients) != server.cohort.num_clients:
        raise ValueError(
            f"clients must hold the server's {server.cohort.num_clients} clients, "
            f"got {len(clients)}"
        )
    local = local or LocalTraining()
    history = []
    for _ in range(int(rounds)):
        rnd = server.begin_round()
        start = model_tensors(model)
        updates, unclipped = {}, {}
        for c in rnd.cohort:
            load_tensors(model, start)
            x, y = clients[c]
            delta = local_update(
                model, x, y, epochs=local.epochs, batch_size=local.batch_size, lr=local.lr
            )
            if server.clipping == "client":
                delta, unclipped[c] = clip_update(delta, rnd.clip_norm)
            updates[c] = delta
        mean = server.finish_round(start, updates, unclipped=unclipped or None)
        load_tensors(model, apply_delta(start, mean, server_lr))
        row: dict[str, Any] = {
            "round": rnd.number, "cohort_size": len(rnd.cohort), "clip_norm": rnd.clip_norm
        }
        if evaluate is not None:
            row.update(evaluate(rnd.number, model))
        history.append(row)
        if after_round is not None:
            after_round(rnd.number, model)
    return history

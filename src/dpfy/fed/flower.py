"""DP-FedAvg on Flower: a strategy wrapper for any Flower strategy, and the matching client.

:class:`DPStrategy` wraps a Flower (message API) strategy such as
``flwr.serverapp.strategy.FedAvg``. The privacy-relevant steps are dpfy's, on the server:

* **sampling**: each round's cohort is drawn by dpfy (:class:`~dpfy.fed.cohort.CohortSampler`,
  Poisson or fixed-size over the N connected nodes) and recorded in the ledger; the wrapped
  strategy is handed a grid that shows only the cohort, and must address all of it (its own
  sampling is switched off: ``fraction_train=1.0``, ``min_train_nodes=0``,
  ``min_available_nodes=0``), so what is accounted is what ran;
* **release**: clipping, the sum, the ledger entry and the noise are
  :meth:`~dpfy.fed.server.DPFedAvg.finish_round`; the ledger entry is written before the noise
  is drawn and before the wrapped strategy sees anything;
* **post-processing**: the wrapped strategy's ``aggregate_train`` receives one reply holding
  ``global + noisy mean delta`` and turns it into the next global model (FedAvg takes it as
  is; FedAvgM, FedAdam and friends apply their server optimizer). Client metrics are not
  passed on: they were computed on client data without noise.

A strategy that already adds noise (Flower's ``DifferentialPrivacy*`` wrappers) is refused when
the wrapper is built, before the first round. With ``checkpoint=`` the wrapper saves the global
model, the round count, the sampler and adaptive-clipping state and the ledger's position after
every round; a server restarted with the same checkpoint and ledger file continues the same
ledger (:mod:`dpfy.training.checkpoint`). The wrapped strategy's own state (e.g. server
optimizer moments) is not saved.

:func:`make_client_app` builds the ``ClientApp``: local SGD from the global model
(:func:`~dpfy.fed.client.local_update`), and in the client-side clipping variant the client's
own clipping (:func:`~dpfy.fed.client.clip_update`) to the clip norm the server sends.

Flower is optional: importing this module without it raises an ``ImportError`` naming the
``fed`` extra.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

try:
    from flwr.app import (
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MessageType,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "dpfy.fed.flower needs Flower: install the fed extra, pip install 'dpfy[fed]' "
        f"(flwr[simulation]==1.42.0); import failed with: {err}"
    ) from err

from dpfy.fed.client import clip_update, load_tensors, local_update
from dpfy.fed.server import DPFedAvg
from dpfy.fed.simulation import LocalTraining
from dpfy.queries import AdaptiveClipQuery
from dpfy.training.checkpoint import (
    ledger_state,
    load_checkpoint,
    restore_ledger,
    save_checkpoint,
)

#: Config keys the server sends and the metric key the client answers with.
CLIP_NORM_KEY = "dpfy-clip-norm"
CLIPPING_KEY = "dpfy-clipping"
UNCLIPPED_KEY = "dpfy-unclipped"

#: Strategy attributes that must switch the wrapped strategy's own client sampling off.
_NO_OWN_SAMPLING = {"fraction_train": 1.0, "min_train_nodes": 0, "min_available_nodes": 0}


def _noisy_strategy(strategy: object) -> str | None:
    """The name of a noise-adding strategy in the wrapping chain of ``strategy``, if any."""
    seen: set[int] = set()
    current: object | None = strategy
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if name.startswith("DifferentialPrivacy") or name.startswith("DPFedAvg"):
            return name
        if isinstance(current, DPStrategy):
            return "dpfy.fed.flower.DPStrategy"
        current = getattr(current, "strategy", None) or getattr(current, "inner", None)
    return None


class _CohortGrid:
    """A grid that shows the wrapped strategy only this round's cohort (everything else is the
    real grid's)."""

    def __init__(self, grid: Grid, cohort: list[int]) -> None:
        self._grid, self._cohort = grid, list(cohort)

    def get_node_ids(self) -> list[int]:
        return list(self._cohort)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class DPStrategy(Strategy):
    """Client-level DP for any Flower strategy: dpfy samples, clips, noises and records.

    Args:
      strategy: the wrapped Flower strategy (e.g. ``FedAvg(fraction_train=1.0,
        min_train_nodes=0, min_available_nodes=0, fraction_evaluate=0.0)``).
      server: the round logic (cohort sampler over the N clients, query, ledger, clipping site).
      checkpoint: file to save after every round and to resume from when it exists.
      wait_for_nodes: seconds to wait for all N nodes to connect before the first round.
      federated_evaluation: pass evaluation rounds to the wrapped strategy (metrics computed on
        client data, released without noise: NOT covered by the guarantee; default off).

    Raises:
      ValueError: the wrapped strategy adds noise itself (Flower's ``DifferentialPrivacy*``
        wrappers), or samples clients itself.
    """

    def __init__(
        self,
        strategy: Strategy,
        server: DPFedAvg,
        *,
        checkpoint: str | os.PathLike[str] | None = None,
        wait_for_nodes: float = 120.0,
        federated_evaluation: bool = False,
    ) -> None:
        noisy = _noisy_strategy(strategy)
        if noisy is not None:
            raise ValueError(
                f"strategy must not add noise itself, got {noisy}: DPStrategy clips, adds the "
                "noise once per round and records it in the ledger; wrap the plain strategy "
                "(e.g. FedAvg) instead, or the noise would be added twice and half of it "
                "unaccounted"
            )
        if not isinstance(strategy, Strategy):
            raise ValueError(
                "strategy must be a Flower message-API strategy "
                f"(flwr.serverapp.strategy.Strategy), got {type(strategy).__name__}"
            )
        wrong = {
            k: getattr(strategy, k) for k, v in _NO_OWN_SAMPLING.items()
            if hasattr(strategy, k) and getattr(strategy, k) != v
        }
        if wrong:
            want = ", ".join(f"{k}={v!r}" for k, v in _NO_OWN_SAMPLING.items())
            raise ValueError(
                f"the wrapped strategy must not sample clients itself (dpfy samples and "
                f"accounts them): build it with {want}, got {wrong}"
            )
        if not isinstance(server, DPFedAvg):
            raise ValueError(f"server must be a dpfy.fed.DPFedAvg, got server={server!r}")
        self.strategy = strategy
        self.server = server
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.wait_for_nodes = float(wait_for_nodes)
        self.federated_evaluation = bool(federated_evaluation)
        self.array_key = str(getattr(strategy, "arrayrecord_key", "arrays"))
        self.weight_key = str(getattr(strategy, "weighted_by_key", "num-examples"))
        self.resumed_arrays: ArrayRecord | None = None
        self._nodes: list[int] | None = None
        self._start: dict[str, torch.Tensor] | None = None
        self._sent: list[Message] = []
        if self.checkpoint is not None and self.checkpoint.exists():
            self._resume(self.checkpoint)
        if federated_evaluation:
            server.ledger.record_metadata(
                federated_evaluation="client-side evaluation metrics are released without "
                "noise and are NOT covered by the guarantee"
            )

    # -- resuming -----------------------------------------------------------------------------
    def _resume(self, path: Path) -> None:
        state = load_checkpoint(path)
        if state.get("kind") != "dpfy-fed":
            raise ValueError(f"{path} is not a dpfy federated checkpoint")
        restore_ledger(self.server.ledger, state["ledger"])
        self.server.load_state_dict(state["server"])
        self.resumed_arrays = ArrayRecord(dict(state["arrays"]))

    def initial_arrays(self, fresh: ArrayRecord) -> ArrayRecord:
        """The model to start from: the checkpoint's when resuming, else ``fresh``."""
        return self.resumed_arrays if self.resumed_arrays is not None else fresh

    def remaining_rounds(self, total: int) -> int:
        """Rounds still to run of a ``total``-round run (after a restart: fewer)."""
        return max(0, int(total) - self.server.rounds_done)

    def _save(self, arrays: ArrayRecord) -> None:
        if self.checkpoint is None:
            return
        save_checkpoint(
            self.checkpoint,
            {
                "kind": "dpfy-fed",
                "arrays": {k: v.detach().clone() for k, v in arrays.to_torch_state_dict().items()},
                "server": self.server.state_dict(),
                "ledger": ledger_state(self.server.ledger),
            },
        )

    # -- training -----------------------------------------------------------------------------
    def _population(self, grid: Grid) -> list[int]:
        n = self.server.cohort.num_clients
        deadline = time.monotonic() + self.wait_for_nodes
        while True:
            nodes = sorted(int(i) for i in grid.get_node_ids())
            if len(nodes) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if len(nodes) != n:
            raise RuntimeError(
                f"the run is accounted for a population of num_clients={n} clients, but "
                f"{len(nodes)} nodes are connected"
            )
        return nodes

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Draw and record the cohort (dpfy), then let the wrapped strategy address it."""
        self._nodes = self._population(grid)
        rnd = self.server.begin_round()
        cohort = [self._nodes[i] for i in rnd.cohort]
        self._start = {k: v.detach().clone() for k, v in arrays.to_torch_state_dict().items()}
        config[CLIP_NORM_KEY] = float(rnd.clip_norm)
        config[CLIPPING_KEY] = self.server.clipping
        view = cast(Grid, _CohortGrid(grid, cohort))
        messages = list(self.strategy.configure_train(rnd.number, arrays, config, view))
        sent_to = sorted(int(m.metadata.dst_node_id) for m in messages)
        if sent_to != sorted(cohort):
            raise RuntimeError(
                f"the wrapped strategy addressed {len(sent_to)} nodes, the dpfy cohort of round "
                f"{rnd.number} has {len(cohort)}: it must send to exactly the cohort it is "
                "shown (fraction_train=1.0)"
            )
        self._sent = messages
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, record, noise (dpfy); the wrapped strategy post-processes the result."""
        assert self._start is not None and self._nodes is not None
        rnd = self.server.open_round
        if rnd is None:
            raise RuntimeError("aggregate_train without configure_train")
        index = {node: i for i, node in enumerate(self._nodes)}
        updates: dict[int, dict[str, torch.Tensor]] = {}
        unclipped: dict[int, bool] = {}
        for msg in replies:
            client = index.get(int(msg.metadata.src_node_id))
            if msg.has_error() or client is None or client not in rnd.cohort:
                continue  # a dropped or unknown client contributes nothing
            delta = self._delta(msg)
            if delta is None:
                continue
            updates[client] = delta
            metrics = msg.content.metric_records
            bits = [m.get(UNCLIPPED_KEY) for m in metrics.values()]
            unclipped[client] = any(isinstance(b, int | float) and b > 0.5 for b in bits)
        adaptive_client = self.server.clipping == "client" and isinstance(
            self.server.query, AdaptiveClipQuery
        )
        mean = self.server.finish_round(
            self._start, updates, unclipped=unclipped if adaptive_client else None
        )
        proposal = {n: self._start[n] + mean[n] for n in self._start}
        reply = Message(
            RecordDict(
                {
                    self.array_key: ArrayRecord(proposal),
                    "metrics": MetricRecord({self.weight_key: 1}),
                }
            ),
            reply_to=self._sent[0] if self._sent else self._placeholder(),
        )
        arrays, _ = self.strategy.aggregate_train(rnd.number, [reply])
        if arrays is None:
            raise RuntimeError("the wrapped strategy returned no model from the noisy mean")
        self._save(arrays)
        public = MetricRecord(
            {
                "dpfy-round": rnd.number,
                "dpfy-noise-multiplier": self.server.noise_multiplier,
                "dpfy-next-clip-norm": float(self.server.query.clip_norm),
            }
        )
        return arrays, public

    def _delta(self, msg: Message) -> dict[str, torch.Tensor] | None:
        assert self._start is not None
        records = msg.content.array_records
        if self.array_key not in records:
            return None
        got = records[self.array_key].to_torch_state_dict()
        if set(got) != set(self._start) or any(
            got[k].shape != self._start[k].shape for k in got
        ):
            return None  # a malformed reply is a dropped client
        return {k: got[k].to(self._start[k].dtype) - self._start[k] for k in self._start}

    def _placeholder(self) -> Message:
        assert self._nodes is not None
        return Message(RecordDict(), dst_node_id=self._nodes[0], message_type=MessageType.TRAIN)

    # -- evaluation and logging ----------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.federated_evaluation:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        if not self.federated_evaluation:
            return None
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    def __repr__(self) -> str:
        return f"DPStrategy({type(self.strategy).__name__}, {self.server.cohort!r})"


def make_client_app(
    model_fn: Callable[[], nn.Module],
    data_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    local: LocalTraining | None = None,
) -> ClientApp:
    """A Flower ``ClientApp`` running dpfy's client step.

    Args:
      model_fn: builds the model (its trainable parameters are the exchanged arrays).
      data_fn: ``partition_id -> (x, y)``: the client's data (``node_config["partition-id"]``).
      local: local SGD hyperparameters.

    The client trains from the global model, and when the server asks for client-side clipping
    (config ``dpfy-clipping = "client"``) clips its delta to ``dpfy-clip-norm`` and reports
    ``dpfy-unclipped``. It replies with ``global + delta`` and ``num-examples``.
    """
    local = local or LocalTraining()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        model = model_fn()
        key = next(iter(msg.content.array_records))
        arrays = msg.content.array_records[key].to_torch_state_dict()
        start = {k: v.clone() for k, v in arrays.items()}
        load_tensors(model, start)
        x, y = data_fn(int(context.node_config["partition-id"]))
        delta = local_update(
            model, x, y, epochs=local.epochs, batch_size=local.batch_size, lr=local.lr
        )
        config = next(iter(msg.content.config_records.values()), ConfigRecord())
        unclipped = True
        if config.get(CLIPPING_KEY) == "client":
            delta, unclipped = clip_update(delta, float(cast(float, config[CLIP_NORM_KEY])))
        new = {n: start[n] + delta[n] for n in start}
        content = RecordDict(
            {
                key: ArrayRecord(new),
                "metrics": MetricRecord({"num-examples": len(x), UNCLIPPED_KEY: int(unclipped)}),
            }
        )
        return Message(content, reply_to=msg)

    return app

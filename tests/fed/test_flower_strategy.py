"""DPStrategy driven by hand (a fake grid, no Ray): cohorts, the release it hands on, refusals.

The oracle for the release is the transport-free round (``DPFedAvg.finish_round``) with the same
seeds: the Flower wrapper must produce exactly ``global + its noisy mean``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg, FedAvgM  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from dpfy import events as ev  # noqa: E402
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query  # noqa: E402
from dpfy.fed.flower import DPStrategy  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402

NODES = [101, 205, 307, 409, 511, 613, 717, 819, 923, 1031]


class FakeGrid:
    def __init__(self, nodes=NODES) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)


def _server(kind="poisson", seed=0):
    cohort = (
        CohortSampler(10, sampling_rate=0.5, randomness=Randomness(seed))
        if kind == "poisson"
        else CohortSampler(10, "fixed_size", clients_per_round=4, randomness=Randomness(seed))
    )
    return DPFedAvg(cohort, client_update_query(1.0, 1.1), Ledger(), randomness=Randomness(9))


def _fedavg(**kw):
    return FedAvg(fraction_train=1.0, min_train_nodes=0, min_available_nodes=0,
                  fraction_evaluate=0.0, **kw)


def _global():
    return {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}


def _delta(node: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(node)
    return {"w": 3 * torch.randn(2, 3, generator=g), "b": torch.randn(3, generator=g)}


def _replies(messages, start):
    out = []
    for m in messages:
        d = _delta(int(m.metadata.dst_node_id))
        arrays = ArrayRecord({k: start[k] + d[k] for k in start})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})})
        out.append(Message(content, reply_to=m))
    return out


@pytest.mark.parametrize("kind", ["poisson", "fixed_size"])
def test_the_wrapper_releases_exactly_the_rounds_noisy_mean(kind) -> None:
    server = _server(kind)
    strategy = DPStrategy(_fedavg(), server)
    start = _global()
    msgs = list(strategy.configure_train(1, ArrayRecord(start), ConfigRecord(), FakeGrid()))
    rnd = server.open_round
    assert sorted(int(m.metadata.dst_node_id) for m in msgs) == [NODES[i] for i in rnd.cohort]
    if kind == "fixed_size":
        assert len(msgs) == 4
    arrays, metrics = strategy.aggregate_train(1, _replies(msgs, start))
    got = arrays.to_torch_state_dict()
    # oracle: the transport-free round with the same seeds and the same deltas
    twin = _server(kind)
    r2 = twin.begin_round()
    assert r2.cohort == rnd.cohort
    mean = twin.finish_round(start, {i: _delta(NODES[i]) for i in r2.cohort})
    for k in start:
        torch.testing.assert_close(got[k], start[k] + mean[k])
    assert server.ledger.to_event() == twin.ledger.to_event()
    assert "num-examples" not in metrics  # client metrics are not released


def test_an_empty_cohort_still_releases_noise() -> None:
    server = DPFedAvg(
        CohortSampler(10, sampling_rate=1e-9, randomness=Randomness(0)),
        client_update_query(1.0, 1.0), Ledger(), randomness=Randomness(1),
    )
    strategy = DPStrategy(_fedavg(), server)
    start = _global()
    msgs = list(strategy.configure_train(1, ArrayRecord(start), ConfigRecord(), FakeGrid()))
    assert msgs == []
    arrays, _ = strategy.aggregate_train(1, [])
    assert not torch.equal(arrays.to_torch_state_dict()["w"], start["w"])
    assert server.ledger.noise_multipliers() == {0: 1.0}


def test_a_server_optimizer_post_processes_the_noisy_mean() -> None:
    start = _global()

    def one_round(inner) -> dict[str, torch.Tensor]:
        server = _server()
        strategy = DPStrategy(inner, server)
        msgs = list(strategy.configure_train(1, ArrayRecord(start), ConfigRecord(), FakeGrid()))
        arrays, _ = strategy.aggregate_train(1, _replies(msgs, start))
        assert server.ledger.iteration == 1
        return arrays.to_torch_state_dict()

    plain = one_round(_fedavg())
    momentum = one_round(
        FedAvgM(fraction_train=1.0, min_train_nodes=0, min_available_nodes=0,
                fraction_evaluate=0.0, server_learning_rate=0.5)
    )
    # FedAvgM's first step: global + 0.5 x (noisy mean), from the same noisy mean
    for k in start:
        torch.testing.assert_close(momentum[k] - start[k], 0.5 * (plain[k] - start[k]))


def test_a_population_other_than_the_accounted_one_is_refused() -> None:
    strategy = DPStrategy(_fedavg(), _server(), wait_for_nodes=0.0)
    with pytest.raises(RuntimeError, match="num_clients=10"):
        strategy.configure_train(1, ArrayRecord(_global()), ConfigRecord(), FakeGrid(NODES[:7]))


def test_a_dropped_or_malformed_reply_contributes_nothing() -> None:
    server = _server()
    strategy = DPStrategy(_fedavg(), server)
    start = _global()
    msgs = list(strategy.configure_train(1, ArrayRecord(start), ConfigRecord(), FakeGrid()))
    replies = _replies(msgs, start)
    bad = Message(RecordDict({"arrays": ArrayRecord({"w": torch.zeros(5)}),
                              "metrics": MetricRecord({"num-examples": 1})}), reply_to=msgs[0])
    strategy.aggregate_train(1, [bad, *replies[1:]])
    assert server.last_dropped == 1
    assert server.ledger.to_event() == ev.PoissonSampled(0.5, ev.Gaussian(1.1))

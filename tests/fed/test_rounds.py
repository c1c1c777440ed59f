"""DP-FedAvg without Flower: the round's release, its ledger, clipping sites, restarts, refusals.

Oracles: a naive per-client clip-and-sum loop in float64 (the noise cancels between two releases
drawn from equal seeds), the accountant on the event of the sampler that ran, and the server-side
clip-norm trajectory for the client-side adaptive variant.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpfy import accounting
from dpfy import events as ev
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query, run_in_process
from dpfy.fed.client import clip_update, local_update
from dpfy.fed.simulation import LocalTraining
from dpfy.ledger import Ledger
from dpfy.ledger.records import SumQueryRecord
from dpfy.randomness import Randomness
from dpfy.report import build_report

torch.set_num_threads(1)
TEMPLATE = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}


def _updates(cohort, scale=1.0, seed=0) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        c: {"w": scale * torch.randn(3, 2, generator=g), "b": scale * torch.randn(2, generator=g)}
        for c in cohort
    }


def _naive_clipped_sum(updates, clip) -> np.ndarray:
    total = np.zeros(8)
    for u in updates.values():
        v = np.concatenate([u["w"].double().numpy().ravel(), u["b"].double().numpy()])
        total += v * min(1.0, clip / np.linalg.norm(v))
    return total


def _server(seed=0, *, n=10, clipping="server", kind="poisson", adaptive=False, z=1.0, clip=1.0):
    cohort = (
        CohortSampler(n, sampling_rate=0.5, randomness=Randomness(seed))
        if kind == "poisson"
        else CohortSampler(n, "fixed_size", clients_per_round=4, randomness=Randomness(seed))
    )
    query = client_update_query(
        clip, z, adaptive=adaptive, expected_clients=cohort.expected_size, count_noise_std=5.0
    )
    return DPFedAvg(cohort, query, Ledger(), clipping=clipping, randomness=Randomness(seed + 1))


def _flat(d) -> np.ndarray:
    return np.concatenate([d["w"].double().numpy().ravel(), d["b"].double().numpy()])


@pytest.mark.parametrize("clipping", ["server", "client"])
def test_release_is_the_clipped_sum_plus_noise_over_the_expected_cohort(clipping) -> None:
    a, b = _server(3, clipping=clipping), _server(3, clipping=clipping)
    ra, rb = a.begin_round(), b.begin_round()
    assert ra.cohort == rb.cohort and len(ra.cohort) > 1
    ua = _updates(ra.cohort, scale=2.0, seed=1)
    ub = {c: u for c, u in _updates(rb.cohort, scale=0.1, seed=2).items() if c != rb.cohort[0]}
    # same seed, same noise: the difference is the difference of the clipped sums / (q N)
    diff = _flat(a.finish_round(TEMPLATE, ua)) - _flat(b.finish_round(TEMPLATE, ub))
    want = (_naive_clipped_sum(ua, 1.0) - _naive_clipped_sum(ub, 1.0)) / 5.0
    np.testing.assert_allclose(diff, want, atol=1e-6)
    assert b.last_dropped == 1


def test_a_client_that_did_not_clip_is_clipped_by_the_server() -> None:
    a, b = _server(4, clipping="client"), _server(4, clipping="client")
    ra, _ = a.begin_round(), b.begin_round()
    big = _updates(ra.cohort[:1], scale=50.0, seed=3)  # norm far above C, sent unclipped
    clipped = {c: clip_update(u, 1.0)[0] for c, u in big.items()}
    np.testing.assert_allclose(
        _flat(a.finish_round(TEMPLATE, big)), _flat(b.finish_round(TEMPLATE, clipped)), atol=1e-6
    )


def test_noise_std_is_z_clip_over_the_expected_cohort() -> None:
    server = _server(5, z=0.7, clip=2.0)
    big = {"w": torch.zeros(200, 100)}
    rnd = server.begin_round()
    out = server.finish_round(big, {c: {"w": torch.zeros(200, 100)} for c in rnd.cohort})
    std = float(out["w"].double().std())
    assert std == pytest.approx(0.7 * 2.0 / 5.0, rel=0.03)  # 20,000 values: 5 sigma ~ 2.5 %
    (rec,) = [r for r in server.ledger.entries if isinstance(r, SumQueryRecord)]
    assert (rec.sensitivity, rec.noise_std) == (2.0, pytest.approx(1.4))


@pytest.mark.parametrize("kind", ["poisson", "fixed_size"])
def test_ledger_records_each_round_and_accounts_the_sampler_that_ran(kind) -> None:
    torch.manual_seed(0)
    clients = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(10)]
    server = _server(6, kind=kind, z=1.2)
    run_in_process(server, torch.nn.Linear(4, 3), clients, 3, local=LocalTraining(batch_size=3))
    ledger = server.ledger
    assert ledger.iteration == 3 and ledger.unit == "client"
    assert ledger.noise_multipliers() == pytest.approx({0: 1.2, 1: 1.2, 2: 1.2})
    if kind == "poisson":
        event = ev.SelfComposed(ev.PoissonSampled(0.5, ev.Gaussian(1.2)), 3)
    else:
        event = ev.SelfComposed(ev.FixedSizeSampled(4, 10, ev.Gaussian(1.2)), 3)
        assert ledger.samples[0].spec.adjacency == "replace_one"
    assert ledger.to_event() == event
    got = accounting.epsilon(ledger, 1e-3, "rdp").epsilon
    assert got == accounting.epsilon(event, 1e-3, "rdp").epsilon


def test_an_empty_poisson_cohort_still_releases_noise_and_is_recorded() -> None:
    server = DPFedAvg(
        CohortSampler(3, sampling_rate=1e-9, randomness=Randomness(0)),
        client_update_query(1.0, 1.0), Ledger(), randomness=Randomness(1),
    )
    rnd = server.begin_round()
    assert rnd.cohort == ()
    out = server.finish_round(TEMPLATE, {})
    assert float(out["w"].abs().sum()) > 0  # pure noise, divided by q N
    assert server.ledger.noise_multipliers() == {0: 1.0}


def test_client_side_adaptive_clipping_follows_the_server_side_trajectory() -> None:
    torch.manual_seed(1)
    clients = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(10)]
    norms = {}
    for site in ("server", "client"):
        server = _server(7, clipping=site, adaptive=True, clip=0.05)
        torch.manual_seed(2)
        hist = run_in_process(server, torch.nn.Linear(4, 3), clients, 4)
        norms[site] = [h["clip_norm"] for h in hist] + [server.query.clip_norm]
        assert server.ledger.noise_multipliers() == pytest.approx(dict.fromkeys(range(4), 1.0))
    assert norms["client"] == pytest.approx(norms["server"], rel=1e-9)
    assert norms["server"][-1] != norms["server"][0]  # the clip norm moved


def test_restart_from_state_dict_continues_the_seeded_run_exactly(tmp_path) -> None:
    torch.manual_seed(0)
    clients = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(10)]
    local = LocalTraining(batch_size=6)  # full-batch local steps: no local randomness

    def fresh(path):
        torch.manual_seed(3)
        s = _server(8, adaptive=True)
        s.ledger = Ledger(path)
        return s, torch.nn.Linear(4, 3)

    s1, m1 = fresh(tmp_path / "a.jsonl")
    h1 = run_in_process(s1, m1, clients, 4, local=local)
    s2, m2 = fresh(tmp_path / "b.jsonl")
    run_in_process(s2, m2, clients, 2, local=local)
    state, weights = s2.state_dict(), {k: v.clone() for k, v in m2.state_dict().items()}
    s2.ledger.close()
    del s2, m2  # the server "crashes"; only the checkpoint state and the ledger file remain
    s3, m3 = fresh(tmp_path / "b.jsonl")  # the same ledger file, resumed
    s3.load_state_dict(state)
    m3.load_state_dict(weights)
    h3 = run_in_process(s3, m3, clients, 2, local=local)
    assert s3.ledger.iteration == 4 and s3.rounds_done == 4
    assert [h["round"] for h in h3] == [3, 4]
    assert [h["cohort_size"] for h in h3] == [h["cohort_size"] for h in h1[2:]]
    assert [h["clip_norm"] for h in h3] == pytest.approx([h["clip_norm"] for h in h1[2:]])
    for k, v in m1.state_dict().items():
        torch.testing.assert_close(m3.state_dict()[k], v, atol=1e-5, rtol=1e-5)
    assert s3.ledger.to_event() == s1.ledger.to_event()


def test_report_states_the_client_unit_and_the_trust_model() -> None:
    torch.manual_seed(0)
    clients = [(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(10)]
    for site in ("server", "client"):
        server = _server(9, clipping=site)
        run_in_process(server, torch.nn.Linear(4, 3), clients, 2)
        report = build_report(server.ledger, delta=1e-3)
        assert report.unit_of_privacy == "client"
        assert "one client" in report.formal_statement
        assert "federated" in report.dp_setting
        assert f"{site}-side clipping" in report.dp_setting
        assert "in the clear" in report.dp_setting
        assert "Seeded experiment" in report.release


def test_local_update_is_plain_sgd_from_the_global_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    delta = local_update(model, x, y, epochs=1, batch_size=4, lr=0.5)
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, [ref.weight, ref.bias])
    torch.testing.assert_close(delta["weight"], -0.5 * grads[0])
    torch.testing.assert_close(delta["bias"], -0.5 * grads[1])


def test_clip_update_bounds_the_norm_and_reports_the_bit() -> None:
    small = {"a": torch.tensor([0.3, 0.4])}
    out, unclipped = clip_update(small, 1.0)
    assert unclipped and torch.equal(out["a"], small["a"])
    out, unclipped = clip_update({"a": torch.tensor([3.0, 4.0])}, 1.0)
    assert not unclipped and math.isclose(float(out["a"].norm()), 1.0, rel_tol=1e-6)


def test_poisson_cohorts_include_each_client_with_probability_q() -> None:
    sampler = CohortSampler(200, sampling_rate=0.1, randomness=Randomness(0))
    counts = np.zeros(200)
    for _ in range(200):
        counts[sampler.draw()] += 1
    # 40,000 Bernoulli(0.1) draws: mean within 5 sigma (sigma = 0.0015)
    assert abs(counts.mean() / 200 - 0.1) < 0.0075
    fixed = CohortSampler(50, "fixed_size", clients_per_round=7, randomness=Randomness(1))
    cohort = fixed.draw()
    assert len(set(cohort.tolist())) == 7


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CohortSampler(0, sampling_rate=0.5), "num_clients"),
        (lambda: CohortSampler(10, sampling_rate=1.5), "sampling_rate"),
        (lambda: CohortSampler(10), "sampling_rate"),
        (lambda: CohortSampler(10, "fixed_size", clients_per_round=11), "clients_per_round"),
        (lambda: CohortSampler(10, "shuffle", sampling_rate=0.5), "kind"),
        (lambda: client_update_query(1.0, 1.0, adaptive=True), "expected_clients"),
        (lambda: client_update_query(-1.0, 1.0), "clip_norm"),
        (lambda: DPFedAvg(CohortSampler(10, sampling_rate=0.5), "q", Ledger()), "query"),
        (lambda: DPFedAvg(CohortSampler(10, sampling_rate=0.5),
                          client_update_query(1.0, 1.0), Ledger(), clipping="both"), "clipping"),
        (lambda: LocalTraining(epochs=0), "epochs"),
    ],
)
def test_bad_input_is_refused_with_the_parameter_named(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_updates_from_outside_the_cohort_are_refused_before_anything_is_recorded() -> None:
    server = _server(10)
    rnd = server.begin_round()
    outsider = next(c for c in range(10) if c not in rnd.cohort)
    with pytest.raises(ValueError, match="cohort"):
        server.finish_round(TEMPLATE, _updates([outsider]))
    assert not [r for r in server.ledger.entries if isinstance(r, SumQueryRecord)]
    with pytest.raises(RuntimeError, match="begin_round"):
        _server(11).finish_round(TEMPLATE, {})

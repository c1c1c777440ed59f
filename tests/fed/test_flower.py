"""DP-FedAvg on a real Flower simulation (Ray backend, flwr 1.42): ledger, restart, refusals."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")
# ray and flwr.simulation are imported by the simulation itself: together they take several
# CPU seconds, which every pytest worker would otherwise pay when it collects this module
if importlib.util.find_spec("ray") is None:
    pytest.skip("could not import 'ray'", allow_module_level=True)

from flwr.app import ArrayRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import (  # noqa: E402
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from dpfy import accounting, runs  # noqa: E402
from dpfy import events as ev  # noqa: E402
from dpfy.audit.run import audit_run  # noqa: E402
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query  # noqa: E402
from dpfy.fed.flower import DPStrategy, make_client_app  # noqa: E402
from dpfy.fed.simulation import LocalTraining  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.ledger.records import SumQueryRecord  # noqa: E402

NUM_CLIENTS = 10
LOG_LEVEL = logging.WARNING
Z, CLIP, RATE = 1.3, 0.5, 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _data(partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(partition)
    x = torch.randn(12, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


def _plain_fedavg() -> FedAvg:
    return FedAvg(
        fraction_train=1.0, min_train_nodes=0, min_available_nodes=0, fraction_evaluate=0.0
    )


def _server_phase(directory: Path, grid: Grid, total_rounds: int, clipping: str) -> dict:
    """A server built only from what is on disk (ledger file, checkpoint) runs until
    ``total_rounds`` rounds are done, then is dropped as a crash would drop it.

    Server-side clipping uses a fixed clip norm; client-side clipping the adaptive one."""
    ledger = Ledger(directory / "ledger.jsonl")
    cohort = CohortSampler(NUM_CLIENTS, sampling_rate=RATE)
    query = client_update_query(
        CLIP, Z, adaptive=clipping == "client", expected_clients=cohort.expected_size,
        count_noise_std=10.0, learning_rate=0.5,
    )
    server = DPFedAvg(cohort, query, ledger, clipping=clipping)
    strategy = DPStrategy(_plain_fedavg(), server, checkpoint=directory / "ckpt.pt")
    fresh = ArrayRecord({k: v.detach() for k, v in _model().state_dict().items()})
    start = strategy.initial_arrays(fresh)
    out = {"resumed": strategy.resumed_arrays is not None, "run_id": ledger.run_id}
    if out["resumed"]:  # the checkpoint's model, not a fresh one
        out["start"] = start.to_torch_state_dict()
    result = strategy.start(
        grid=grid, initial_arrays=start, num_rounds=strategy.remaining_rounds(total_rounds)
    )
    out["arrays"] = result.arrays.to_torch_state_dict()
    out["rounds_done"] = server.rounds_done
    ledger.close()
    return out


def _simulate(phases: tuple[tuple[Path, int, str], ...]) -> list[dict]:
    """One Flower simulation (Ray backend) whose ServerApp runs one fresh server per phase:
    ``(directory, total rounds, clipping site)``, each server built from that directory."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPU here: quiet Ray
    outs: list[dict] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for directory, total, clipping in phases:
            outs.append(_server_phase(directory, grid, total, clipping))

    # Ray workers unpickle the client app; this test module is not on their path.
    import ray.cloudpickle
    from flwr.simulation import run_simulation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    client_app = make_client_app(_model, _data, local=LocalTraining(epochs=1, batch_size=4))
    logging.getLogger("flwr").setLevel(LOG_LEVEL)
    run_simulation(
        server_app,
        client_app,
        num_supernodes=NUM_CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}},
    )
    assert len(outs) == len(phases), "the ServerApp failed (see the log above)"
    return outs


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Both federated runs of this module in one Flower simulation, as starting Ray and its
    client worker costs far more than the rounds: a server with server-side clipping that
    runs 2 rounds, is dropped as a crash would drop it and is restarted to finish 4; then, in
    a directory of its own, a server with client-side adaptive clipping that runs 3 rounds."""
    restart = tmp_path_factory.mktemp("flower-restart")
    client = tmp_path_factory.mktemp("flower-client-clipping")
    outs = _simulate(((restart, 2, "server"), (restart, 4, "server"), (client, 3, "client")))
    return {"restart": (restart, outs[:2]), "client": (client, outs[2:])}


@pytest.mark.slow
def test_flower_simulation_ledger_and_restart(simulated, request) -> None:
    run_dir, (first, second) = simulated["restart"]
    assert first["rounds_done"] == 2 and not first["resumed"]
    # the restarted server continues from its checkpoint: the same model, the same ledger
    assert second["resumed"] and second["rounds_done"] == 4
    assert second["run_id"] == first["run_id"]
    for k, v in first["arrays"].items():
        assert torch.equal(second["start"][k], v)
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    assert ledger.run_id == first["run_id"] and ledger.verification.ok
    assert ledger.unit == "client"
    assert ledger.iteration == 4  # one sample per round, over both servers
    sums = [r for r in ledger.entries if isinstance(r, SumQueryRecord)]
    assert len(sums) == 4  # one release per round
    for r in sums:  # noise std as recorded: z x C, sensitivity C
        assert r.sensitivity == CLIP and math.isclose(r.noise_std, Z * CLIP)
    spec = ledger.samples[0].spec
    assert (spec.sampler, spec.dataset_size, spec.sampling_rate) == ("poisson", 10, RATE)
    # epsilon from the ledger equals the accountant on the event of what ran
    event = ev.SelfComposed(ev.PoissonSampled(RATE, ev.Gaussian(Z)), 4)
    for method in ("rdp", "pld"):
        assert accounting.epsilon(ledger, 1e-3, method).epsilon == pytest.approx(
            accounting.epsilon(event, 1e-3, method).epsilon, rel=1e-12
        )
    assert ledger.metadata["clipping_site"] == "server"
    assert all(np.isfinite(v.numpy()).all() for v in second["arrays"].values())
    # the report at the end: unit client, the trust model stated
    report = runs.report_ledger(run_dir / "ledger.jsonl", delta=1e-3, out=run_dir / "report")
    text = (run_dir / "report" / "report.md").read_text()
    assert report.report.unit_of_privacy == "client" and "one client" in text
    assert "server-side clipping" in text and "in the clear" in text
    from dpfy.publication import unclassified_fields

    for directory in (run_dir, run_dir / "report"):  # a release, public or configuration
        assert unclassified_fields(directory) == [], directory
    # the audit of the server's directory: it needs the run's report beside the ledger, then
    # raises no false alarm and states the checks a federated run cannot have
    with pytest.raises(ValueError, match="holds ledger.jsonl but no report.json: write the"):
        audit_run(run_dir, method="one-run", trials=1000)
    request.getfixturevalue("fixed_os_key")  # the self-tests' noise: deterministic
    runs.report_ledger(run_dir / "ledger.jsonl", delta=1e-3, figures=False)
    audit = audit_run(run_dir, method="one-run", trials=1000)
    assert audit["verdict"] == "no violation found" and audit["self_tests"] == []
    assert audit["self_tests_run"][-1] == "federated" and audit["real_model"] is None
    notes = "\n".join(audit["self_test_notes"])
    assert "keys: not checked (the federated server" in notes
    assert "real model: not rebuilt (a federated run" in notes


@pytest.mark.slow
def test_flower_client_side_adaptive_clipping(simulated) -> None:
    run_dir, (only,) = simulated["client"]
    assert only["rounds_done"] == 3
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    assert ledger.metadata["clipping_site"] == "client"
    # two Gaussian parts per round (clipped sum, unclipped count), effective z as requested
    assert ledger.noise_multipliers() == pytest.approx(dict.fromkeys(range(3), Z))
    sums = [r for r in ledger.entries if isinstance(r, SumQueryRecord)]
    assert [r.name for r in sums] == ["client_update/sum", "client_update/unclipped_count"] * 3
    clip_norms = [r.sensitivity for r in sums[::2]]
    assert clip_norms[0] == CLIP and len(set(clip_norms)) == 3  # the clip norm adapted
    event = ev.SelfComposed(ev.PoissonSampled(RATE, ev.Gaussian(Z)), 3)
    assert accounting.epsilon(ledger, 1e-3, "rdp").epsilon == pytest.approx(
        accounting.epsilon(event, 1e-3, "rdp").epsilon, rel=1e-9
    )


@pytest.mark.parametrize(
    "noisy",
    [
        lambda s: DifferentialPrivacyServerSideFixedClipping(s, 1.0, 1.0, 5),
        lambda s: DifferentialPrivacyClientSideAdaptiveClipping(s, 1.0, 100),
    ],
)
def test_a_strategy_that_adds_noise_is_refused_before_the_first_round(noisy) -> None:
    ledger = Ledger()
    server = DPFedAvg(CohortSampler(10, sampling_rate=0.5), client_update_query(1.0, 1.0), ledger)
    with pytest.raises(ValueError, match="must not add noise itself"):
        DPStrategy(noisy(_plain_fedavg()), server)
    assert ledger.iteration == 0 and len(ledger) == 0


def test_a_strategy_that_samples_clients_itself_is_refused() -> None:
    server = DPFedAvg(CohortSampler(10, sampling_rate=0.5), client_update_query(1.0, 1.0), Ledger())
    with pytest.raises(ValueError, match="fraction_train=1.0"):
        DPStrategy(FedAvg(fraction_train=0.5), server)

"""Data-parallel DP-SGD on torch.distributed (gloo, 2 local processes).

Oracles: the 1-process run of the same seeded experiment (weights to 1e-6, same ledger), the
1-process clipped sum with no noise (to 1e-6), and the Gaussian law of the noise rank 0 draws
(its recorded std, by a Kolmogorov-Smirnov test). Ranks are spawned with
``torch.multiprocessing`` on a free localhost port; worker functions write what they saw into
a temporary directory.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import dpfy.randomness as R
from dpfy import accounting
from dpfy.ledger import Ledger
from dpfy.queries import GaussianSumQuery
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateGradient, PrivateTrainer, TrainerOptions
from dpfy.training.data import PhysicalBatcher
from dpfy.training.distributed import (
    Distributed,
    DistributedError,
    ShardBatcher,
    per_process_batch,
)
from dpfy.training.launch import spawn_workers

N, D, K = 64, 8, 3
CLIP, Z = 0.5, 1.3
P = 8  # global physical chunk: 4 rows per rank
TIMEOUT = 4.0


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, K))


def _trainer(model, ledger, dist=None, *, p=P, callbacks=(), loss_fn=None):
    x, y = _data()
    sampler = PoissonSampler(N, 0.25, randomness=Randomness(1))
    params = model.module.parameters() if hasattr(model, "module") else model.parameters()
    return PrivateTrainer(
        model,
        torch.optim.SGD(params, lr=0.5, momentum=0.9),
        loss_fn or nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        sampler,
        options=TrainerOptions(
            clip_norm=CLIP,
            epochs=2,
            delta=1e-5,
            noise_multiplier=Z,
            max_physical_batch_size=p,
            ledger=ledger,
            randomness=Randomness(2),
            callbacks=callbacks,
            distributed=dist,
        ),
    )


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ledger(d: Distributed, out: Path, name: str) -> Ledger:
    return Ledger(out / name) if d.releases else Ledger()


def _fixed_key(rank: int) -> Randomness:
    """A secure stream keyed with a fixed per-rank key instead of one from the OS (a spawned
    rank is out of the fixed_os_key fixture's reach): its noise, and the statistical checks on
    it, are the same in every run."""
    rng, key = Randomness.secure_mode(), bytes([rank + 1]) * 32
    with mock.patch.object(R.os, "urandom", lambda n: key[:n]):
        rng.uniform(1)  # the keystream reads its key at its first draw
    return rng


# ---------------------------------------------------------------------------------------------
# workers (run in spawned processes)
# ---------------------------------------------------------------------------------------------


def _equal_worker(d: Distributed, out: Path) -> None:
    torch.set_num_threads(1)
    r = d.rank
    # (a) the seeded trainer; rank 1 starts from other weights (rank 0's are broadcast)
    model = _model(seed=r)
    ledger = _ledger(d, out, "ledger.jsonl")
    history = _trainer(model, ledger, d).fit().history.steps
    d.check_in_sync(model)
    torch.save(_flat(model), out / f"plain_{r}.pt")
    torch.save([(h.batch_size, h.loss, h.accuracy) for h in history], out / f"history_{r}.pt")
    if d.releases:
        ledger.close()
    # (b) the same run with a DistributedDataParallel model
    ddp = nn.parallel.DistributedDataParallel(_model(seed=r))
    _trainer(ddp, _ledger(d, out, "ddp.jsonl"), d).fit()
    torch.save(_flat(ddp.module), out / f"ddp_{r}.pt")
    # (c) no noise: the reduced clipped sum of one logical batch, through the shard batcher
    x, y = _data()
    model = _model(seed=0)
    pg = PrivateGradient(model, NoPrivacyQuery(CLIP), expected_batch_size=16.0, reducer=d)
    batcher = ShardBatcher(PhysicalBatcher(x, y, max_physical_batch_size=P // 2), d,
                           max_physical_batch_size=P)
    indices = np.arange(3, 3 + 19)  # 3 chunks of 8, the last one partial
    for chunk in batcher.chunks(indices):
        pg.accumulate(chunk.inputs, chunk.targets, nn.CrossEntropyLoss(reduction="none"),
                      weights=chunk.weights)
    led = Ledger()
    pg.release(ledger=led, sample_id=led.record_sample(PoissonSampler(N, 0.25).sample_spec()),
               randomness=Randomness(0))
    torch.save(torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
               out / f"nonoise_{r}.pt")
    # (c') rank 1 accumulates nothing at all: its zeros join the same all-reduce
    model = _model(seed=0)
    pg = PrivateGradient(model, NoPrivacyQuery(CLIP), expected_batch_size=16.0, reducer=d)
    if d.releases:
        pg.accumulate(x[indices], y[indices], nn.CrossEntropyLoss(reduction="none"))
    led = Ledger()
    pg.release(ledger=led, sample_id=led.record_sample(PoissonSampler(N, 0.25).sample_spec()),
               randomness=Randomness(0))
    torch.save(torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
               out / f"idle_{r}.pt")
    # (d) noise on, secure (a fixed key per rank): noise = released - clipped sum, std zC per
    # coordinate
    model = _model(seed=0)
    pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=1.0, reducer=d)
    ref = PrivateGradient(_model(seed=0), NoPrivacyQuery(CLIP), expected_batch_size=1.0)
    noise, secure = [], _fixed_key(r)
    for step in range(25):
        idx = np.arange(step, step + 10) % N
        for chunk in batcher.chunks(idx):
            pg.accumulate(chunk.inputs, chunk.targets, nn.CrossEntropyLoss(reduction="none"),
                          weights=chunk.weights)
        led = _ledger(d, out, "noise.jsonl") if step == 0 else led
        sid = led.record_sample(PoissonSampler(N, 0.25).sample_spec())
        pg.release(ledger=led, sample_id=sid, randomness=secure)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        ref.accumulate(x[idx], y[idx], nn.CrossEntropyLoss(reduction="none"))
        r_led = Ledger()
        ref.release(ledger=r_led, sample_id=r_led.record_sample(
            PoissonSampler(N, 0.25).sample_spec()), randomness=Randomness(0))
        want = torch.cat([p.grad.reshape(-1) for p in ref.model.parameters()])
        noise.append(got - want)
    torch.save(torch.cat(noise), out / f"noise_{r}.pt")
    # (e) a world size that does not divide the physical batch: refused before any step
    ledger = _ledger(d, out, "refused.jsonl")
    try:
        _trainer(_model(), ledger, d, p=7).fit()
    except ValueError as e:
        (out / f"refused_{r}.txt").write_text(f"{e}\n{len(ledger.samples)}")


def _progress(out: Path, rank: int) -> list:
    path = out / f"applied_{rank}.txt"
    path.write_text("0")
    steps = [0]

    def count(info) -> None:
        if info.kind == "step":
            steps[0] += 1
            path.write_text(str(steps[0]))

    return [count]


def _crash_worker(d: Distributed, out: Path, victim: int, hang: bool = False) -> None:
    """``victim`` dies in the middle of step 3 (rank 1: in its forward pass; rank 0: right
    after its ledger write, before the broadcast), or (``hang``) rank 1 stops answering there
    for three timeouts. The survivor must stop with a clear error."""
    torch.set_num_threads(1)
    r = d.rank
    ledger = _ledger(d, out, "ledger.jsonl")
    calls = [0]
    loss = nn.CrossEntropyLoss(reduction="none")

    def loss_fn(outputs, targets):
        if len(outputs) > 1:  # the chunks (padded to a fixed size), not the attribution check's
            calls[0] += 1
        if r == victim == 1 and calls[0] == 5:  # 2 chunks per step: step 3, first chunk
            (out / "killed.txt").write_text(str(time.time()))
            if hang:
                time.sleep(3 * TIMEOUT)
            os._exit(3)
        return loss(outputs, targets)

    if r == victim == 0:
        original = ledger.record_sum_queries

        releases = [0]

        def record_then_die(*args, **kwargs):
            original(*args, **kwargs)
            releases[0] += 1
            if releases[0] == 3:
                (out / "killed.txt").write_text(str(time.time()))
                os._exit(3)

        ledger.record_sum_queries = record_then_die  # type: ignore[method-assign]
    trainer = _trainer(_model(), ledger, d, callbacks=_progress(out, r), loss_fn=loss_fn)
    try:
        trainer.fit()
    except DistributedError as e:
        (out / f"error_{r}.txt").write_text(f"{time.time()}\n{e}")
        raise


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def _check_exits(exits, allowed_fail=()):
    for e in exits:
        if e.rank not in allowed_fail:
            assert e.exitcode == 0 and e.error is None, e


def test_two_processes_equal_one_process(tmp_path):
    exits = spawn_workers(_equal_worker, 2, (tmp_path,), timeout=30.0)
    _check_exits(exits)
    torch.set_num_threads(1)
    # the 1-process run of the same seeded experiment
    model, ledger = _model(seed=0), Ledger()
    history = _trainer(model, ledger).fit().history.steps
    want = _flat(model)
    # the monitoring figures count the whole logical batch on every rank
    stats_1 = np.array([(h.batch_size, h.loss, h.accuracy) for h in history])
    for r in (0, 1):
        np.testing.assert_allclose(np.array(torch.load(tmp_path / f"history_{r}.pt")), stats_1,
                                   atol=1e-6)
    for name in ("plain", "ddp"):
        for r in (0, 1):
            got = torch.load(tmp_path / f"{name}_{r}.pt")
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the ledger: same records, so the same epsilon; written by rank 0 alone
    two = Ledger.load(tmp_path / "ledger.jsonl")
    assert two.to_event() == ledger.to_event()
    assert two.metadata["workers"] == 2
    e1 = accounting.epsilon(ledger, delta=1e-5, method="rdp").epsilon
    e2 = accounting.epsilon(two, delta=1e-5, method="rdp").epsilon
    assert e1 == e2 and math.isfinite(e1)
    assert not (tmp_path / "ddp_1.jsonl").exists()
    # no noise: the reduced clipped sum is the 1-process clipped sum of the batch
    x, y = _data()
    ref = PrivateGradient(_model(seed=0), NoPrivacyQuery(CLIP), expected_batch_size=16.0)
    idx = np.arange(3, 22)
    ref.accumulate(x[idx], y[idx], nn.CrossEntropyLoss(reduction="none"))
    led = Ledger()
    ref.release(ledger=led, sample_id=led.record_sample(PoissonSampler(N, 0.25).sample_spec()),
                randomness=Randomness(0))
    want = torch.cat([p.grad.reshape(-1) for p in ref.model.parameters()])
    for r in (0, 1):
        for name in ("nonoise", "idle"):
            torch.testing.assert_close(torch.load(tmp_path / f"{name}_{r}.pt"), want, atol=1e-6,
                                       rtol=0)
    # noise on: one draw on rank 0 with exactly the recorded std, the same on both ranks
    n0, n1 = torch.load(tmp_path / "noise_0.pt"), torch.load(tmp_path / "noise_1.pt")
    torch.testing.assert_close(n0, n1, atol=1e-6, rtol=0)
    recorded = Ledger.load(tmp_path / "noise.jsonl")
    std = {s.noise_std for s in recorded.entries if hasattr(s, "noise_std")}
    assert std == {Z * CLIP}
    sample = n0.double().numpy() / (Z * CLIP)
    assert len(sample) == 25 * sum(p.numel() for p in _model().parameters())
    # statistical: secure noise under a fixed key per rank (_fixed_key): deterministic
    assert stats.kstest(sample, "norm").pvalue > 1e-3
    assert abs(sample.std() - 1.0) < 0.05  # a share with std / sqrt(2) or two draws would fail
    # a world size that does not divide the physical batch: refused before the first step
    for r in (0, 1):
        message, samples = (tmp_path / f"refused_{r}.txt").read_text().rsplit("\n", 1)
        assert "max_physical_batch_size must be a multiple of the world size 2" in message
        assert samples == "0"


@pytest.mark.slow
@pytest.mark.parametrize(("victim", "hang"), [(1, False), (0, False), (1, True)])
def test_killed_rank_stops_the_run_without_undercounting(tmp_path, victim, hang):
    start = time.time()
    exits = spawn_workers(_crash_worker, 2, (tmp_path, victim, hang), timeout=TIMEOUT)
    survivor = 1 - victim
    assert exits[victim].exitcode == 3
    assert exits[survivor].exitcode == 1
    assert exits[survivor].error.startswith("DistributedError")
    assert "timeout=4 s" in exits[survivor].error
    stopped, _ = (tmp_path / f"error_{survivor}.txt").read_text().split("\n", 1)
    killed = float((tmp_path / "killed.txt").read_text())
    assert float(stopped) - killed < TIMEOUT + 3.0  # seconds, not the 30-minute default
    if hang:  # nothing closed a connection: the collective timeout itself stopped rank 0
        assert float(stopped) - killed > TIMEOUT - 1.0
    assert time.time() - start < 120
    # the ledger survives, and every step any rank applied is in it
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    releases = sum(1 for e in ledger.entries if type(e).__name__ == "SumQueryRecord")
    applied = [int((tmp_path / f"applied_{r}.txt").read_text()) for r in (0, 1)]
    assert max(applied) == 2
    assert releases >= max(applied)
    assert releases == (3 if victim == 0 else 2)


def test_per_process_batch_refuses_a_world_size_that_does_not_divide():
    assert per_process_batch(8, 2) == 4
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        per_process_batch(8, 3)


def test_a_ddp_model_without_a_reducer_is_refused():
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, module):  # no process group needed to test the refusal
            nn.Module.__init__(self)
            self.module = module

    with pytest.raises(ValueError, match="reducer="):
        PrivateGradient(FakeDDP(_model()), GaussianSumQuery(1.0, 1.0), expected_batch_size=4)


def test_shard_batcher_splits_every_chunk_and_pads_the_count():
    x, y = _data()
    got = []
    for r in (0, 1):
        d = Distributed(r, 2, 5.0)
        b = ShardBatcher(PhysicalBatcher(x, y, max_physical_batch_size=4), d,
                         max_physical_batch_size=8)
        chunks = list(b.chunks(np.arange(10, 20)))  # 10 rows: chunks of 8 and 2
        assert len(chunks) == 2
        got.append([c.count for c in chunks])
        rows = torch.cat([c.inputs[: c.count] for c in chunks])
        assert torch.equal(rows, x[np.r_[10 + 4 * r : 14 + 4 * r, 18 + 4 * r : 20][: len(rows)]])
    assert got == [[4, 2], [4, 0]]


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ("3", "max_physical_batch_size must be a multiple of the world size 3"),
        ("0", "workers must be an integer in [1, "),
    ],
)
def test_cli_refuses_workers_that_cannot_split_the_batch(tmp_path, capsys, workers, message):
    from dpfy.cli import main

    out = tmp_path / "run"
    code = main(["train", "mnist", "--workers", workers, "--out", str(out), "--train-limit", "64"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # refused before anything is written or started


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"workers": 0}, "workers must be an integer in"),
        ({"workers": 3}, "multiple of the world size 3"),
        ({"dataset": "rotten-tomatoes", "workers": 2}, "workers applies only to the image"),
    ],
)
def test_train_and_report_refuses_bad_workers_before_writing(tmp_path, kwargs, needle):
    from dpfy import runs
    from dpfy.config import RunConfig

    with pytest.raises(ValueError, match=needle):
        runs.train_and_report(RunConfig(**{"dataset": "mnist", "out": tmp_path / "run", **kwargs}))
    assert not (tmp_path / "run").exists()


def test_refusals_before_any_collective(tmp_path, monkeypatch):
    from dpfy.queries import AdaptiveClipQuery
    from dpfy.training.distributed import from_env, init_process_group

    rank1 = Distributed(1, 2, 5.0)  # no process group: every refusal comes first
    with pytest.raises(ValueError, match="stateless"):
        PrivateGradient(_model(), AdaptiveClipQuery(1.0, 1.0, 16.0), expected_batch_size=16,
                        reducer=rank1)
    # a ledger file on a rank other than 0
    ledger = Ledger(tmp_path / "rank1.jsonl")
    with pytest.raises(ValueError, match="in-memory dpfy.ledger.Ledger\\(\\) on rank 1"):
        _trainer(_model(), ledger, rank1).fit()
    assert ledger.samples == ()
    with pytest.raises(ValueError, match="rank must be an integer in \\[0, 1\\]"):
        Distributed(2, 2, 5.0)
    with pytest.raises(ValueError, match="timeout must be in"):
        Distributed(0, 2, 0.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        init_process_group(0, 1, master_port=1234, backend="mpi")
    with pytest.raises(ValueError, match="needs a GPU"):
        init_process_group(0, 1, master_port=1234, backend="nccl")
    with pytest.raises(ValueError, match="master_port must be an integer in"):
        init_process_group(0, 1, master_port=0)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        from_env()

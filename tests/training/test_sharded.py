"""DP-SGD on FSDP2-sharded models (``fully_shard``, gloo, 2 local processes).

Oracles: the 1-process, unsharded run of the same experiment (weights to 1e-6 with noise off,
gathered with ``full_tensor()``; the same ledger and epsilon with noise on), the 1-process
clipped sum (subtracted from each rank's noisy shard: what is left is the noise), the Gaussian
law with the recorded std (Kolmogorov-Smirnov, std ratio), the coordinate count (every
coordinate noised exactly once over the ranks) and the correlation of the two ranks' noise
(independent streams, also when both ranks are given the same seed).
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
from dpfy.training.distributed import Distributed, DistributedError, ShardBatcher
from dpfy.training.launch import spawn_workers
from dpfy.training.sharded import rank_randomness, shard_rows

N, D, H, K = 64, 8, 7, 3  # H = 7 rows: uneven shards (4 + 3)
CLIP, Z = 0.5, 1.3
P = 8
TIMEOUT = 4.0
LOSS = nn.CrossEntropyLoss(reduction="none")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, K))


def _shard(model: nn.Module, d: Distributed) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = d.mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
        for p in model.parameters()
    ])


def _trainer(model, ledger, dist=None, *, z=Z, loss_fn=LOSS, callbacks=()):
    x, y = _data()
    return PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        loss_fn,
        x,
        y,
        PoissonSampler(N, 0.25, randomness=Randomness(1)),
        options=TrainerOptions(
            clip_norm=CLIP,
            epochs=2,
            delta=1e-5,
            noise_multiplier=z,
            max_physical_batch_size=P,
            ledger=ledger,
            randomness=Randomness(2),
            callbacks=callbacks,
            distributed=dist,
        ),
    )


def _ledger(d: Distributed, out: Path, name: str) -> Ledger:
    return Ledger(out / name) if d.releases else Ledger()


def _fixed_key(rank: int) -> Randomness:
    """A secure stream keyed with a fixed per-rank key instead of one from the OS (a spawned
    rank is out of the fixed_os_key fixture's reach): its noise, and the statistical checks on
    it, are the same in every run, and the ranks' streams still differ."""
    rng, key = Randomness.secure_mode(), bytes([rank + 1]) * 32
    with mock.patch.object(R.os, "urandom", lambda n: key[:n]):
        rng.uniform(1)  # the keystream reads its key at its first draw
    return rng


def _steps(pg, opt, batcher, d=None, steps=4):
    """``steps`` noise-free releases and optimizer steps on fixed batches."""
    x, y = _data()
    for s in range(steps):
        idx = np.arange(5 * s, 5 * s + 19) % N
        if batcher is None:
            pg.accumulate(x[idx], y[idx], LOSS)
        else:
            for chunk in batcher.chunks(idx):
                pg.accumulate(chunk.inputs, chunk.targets, LOSS, weights=chunk.weights)
        led = Ledger()
        pg.release(ledger=led, sample_id=led.record_sample(PoissonSampler(N, 0.25).sample_spec()),
                   randomness=Randomness(0))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _worker(d: Distributed, out: Path) -> None:
    torch.set_num_threads(1)
    r, x, y = d.rank, *_data()
    batcher = ShardBatcher(PhysicalBatcher(x, y, max_physical_batch_size=P // 2), d,
                           max_physical_batch_size=P)
    # (a) noise off, several steps with momentum: the gathered weights
    model = _shard(_model(seed=0), d)
    pg = PrivateGradient(model, NoPrivacyQuery(CLIP), expected_batch_size=16.0, reducer=d)
    assert pg._sharded is not None
    _steps(pg, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), batcher)
    torch.save(_full(model), out / f"nonoise_{r}.pt")
    # (b) the trainer (noise on, seeded); rank 1 starts from other weights (rank 0's are synced)
    model = _shard(_model(seed=r), d)
    ledger = _ledger(d, out, "ledger.jsonl")
    _trainer(model, ledger, d).fit()
    d.check_in_sync(model)
    if d.releases:
        ledger.close()
    # (c) noise on: the noise of each shard, secure (a fixed key per rank) and (same seed on
    # both ranks) seeded
    ref = PrivateGradient(_model(seed=0), NoPrivacyQuery(CLIP), expected_batch_size=1.0)
    for kind, rng in (("secure", _fixed_key(r)), ("seeded", Randomness(7))):
        model = _shard(_model(seed=0), d)
        pg = PrivateGradient(model, GaussianSumQuery(CLIP, Z), expected_batch_size=1.0,
                             reducer=d)
        led = _ledger(d, out, f"noise_{kind}.jsonl")
        noise = []
        for step in range(15):
            idx = np.arange(step, step + 10) % N
            for chunk in batcher.chunks(idx):
                pg.accumulate(chunk.inputs, chunk.targets, LOSS, weights=chunk.weights)
            pg.release(ledger=led, sample_id=led.record_sample(
                PoissonSampler(N, 0.25).sample_spec()), randomness=rng)
            ref.accumulate(x[idx], y[idx], LOSS)
            want = ref.clipped_sum()
            ref.reset()
            parts = []
            for name, p in model.named_parameters():
                a, b = shard_rows(p.shape[0], d.world_size, r)
                parts.append((p.grad.to_local() - want[name][a:b]).reshape(-1))
            noise.append(torch.cat(parts))
        torch.save(torch.stack(noise), out / f"noise_{kind}_{r}.pt")


def test_sharded_two_processes_equal_one_process(tmp_path):
    exits = spawn_workers(_worker, 2, (tmp_path,), timeout=30.0)
    for e in exits:
        assert e.exitcode == 0 and e.error is None, e
    torch.set_num_threads(1)
    # (a) noise off: the sharded 2-process weights are the 1-process weights
    model = _model(seed=0)
    pg = PrivateGradient(model, NoPrivacyQuery(CLIP), expected_batch_size=16.0)
    _steps(pg, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), None)
    want = _full(model)
    for r in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"nonoise_{r}.pt"), want, atol=1e-6,
                                   rtol=0)
    # (b) the ledger of the trainer: the 1-process records, so the same epsilon
    one = Ledger()
    _trainer(_model(seed=0), one).fit()
    two = Ledger.load(tmp_path / "ledger.jsonl")
    assert two.to_event() == one.to_event()
    e1 = accounting.epsilon(one, delta=1e-5, method="rdp").epsilon
    e2 = accounting.epsilon(two, delta=1e-5, method="rdp").epsilon
    assert e1 == e2 and math.isfinite(e1)
    # (c) the noise: every coordinate once, the recorded std, independent across ranks
    # statistical: secure noise under a fixed key per rank (_fixed_key), or seed 7: deterministic
    total = sum(p.numel() for p in _model().parameters())
    for kind in ("secure", "seeded"):
        n0 = torch.load(tmp_path / f"noise_{kind}_0.pt").double().numpy()
        n1 = torch.load(tmp_path / f"noise_{kind}_1.pt").double().numpy()
        assert n0.shape[1] + n1.shape[1] == total  # shards cover every coordinate once
        assert n0.shape[1] != n1.shape[1]  # uneven shards (7 rows: 4 + 3)
        recorded = Ledger.load(tmp_path / f"noise_{kind}.jsonl")
        assert {e.noise_std for e in recorded.entries if hasattr(e, "noise_std")} == {Z * CLIP}
        for shard in (n0, n1):
            sample = shard.reshape(-1) / (Z * CLIP)
            per_coordinate = np.sqrt(np.mean(shard**2, axis=0)) / (Z * CLIP)
            assert per_coordinate.min() > 0.2  # none skipped (chi2 with 15 dof: never this low)
            assert stats.kstest(sample, "norm").pvalue > 1e-3
            assert abs(sample.std() - 1.0) < 4.0 / math.sqrt(2 * sample.size)
        m = min(n0.shape[1], n1.shape[1])
        a, b = n0[:, :m].reshape(-1), n1[:, :m].reshape(-1)
        corr = float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))
        assert abs(corr) < 4.0 / math.sqrt(a.size)  # no two ranks draw the same noise


def test_rank_randomness_derives_independent_seeded_streams():
    seeded = Randomness(5)
    assert rank_randomness(seeded, 0) is seeded
    one, two = rank_randomness(seeded, 1), rank_randomness(seeded, 2)
    assert len({seeded.seed, one.seed, two.seed}) == 3
    assert rank_randomness(Randomness(5), 1).seed == one.seed  # reproducible per (seed, rank)
    secure = Randomness.secure_mode()
    assert rank_randomness(secure, 1) is secure  # each process keys its own from the OS
    assert shard_rows(7, 2, 0) == (0, 4) and shard_rows(7, 2, 1) == (4, 7)
    assert shard_rows(1, 2, 1) == (1, 1)


def _refusal_worker(d: Distributed, out: Path) -> None:
    from dpfy.correlated import Cyclic
    from dpfy.correlated.plan import make_plan
    from dpfy.queries.correlated import CorrelatedNoiseQuery

    torch.set_num_threads(1)
    found = []

    def refused(fn) -> None:
        try:
            fn()
        except ValueError as e:
            found.append(str(e))
        else:
            found.append("accepted")

    sharded = _shard(_model(), d)
    refused(lambda: PrivateGradient(sharded, GaussianSumQuery(CLIP, Z), expected_batch_size=4))
    refused(lambda: PrivateGradient(sharded, GaussianSumQuery(CLIP, Z), expected_batch_size=4,
                                    microbatch_size=2, microbatch_mode="sum", reducer=d))
    plan = make_plan("bandmf", 4, Cyclic(2), band=2, buffers=1, maxiter=20)
    refused(lambda: PrivateGradient(
        sharded, CorrelatedNoiseQuery(plan, CLIP, Z), expected_batch_size=4, reducer=d))

    class Odd(nn.Module):  # no norm rule: the vmap fallback would see shards
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, D))

        def forward(self, x):
            return x @ self.w.t()

    from torch.distributed.fsdp import fully_shard

    odd = fully_shard(Odd(), mesh=d.mesh())
    refused(lambda: PrivateGradient(odd, GaussianSumQuery(CLIP, Z), expected_batch_size=4,
                                    reducer=d))
    partly = _model()
    fully_shard(partly[0], mesh=d.mesh())  # the last layer stays a plain replica
    refused(lambda: PrivateGradient(partly, GaussianSumQuery(CLIP, Z), expected_batch_size=4,
                                    reducer=d))
    (out / f"refused_{d.rank}.txt").write_text("\n---\n".join(found))


def test_sharded_refusals_before_the_first_step(tmp_path):
    exits = spawn_workers(_refusal_worker, 2, (tmp_path,), timeout=30.0)
    for e in exits:
        assert e.exitcode == 0 and e.error is None, e
    for r in (0, 1):
        found = (tmp_path / f"refused_{r}.txt").read_text().split("\n---\n")
        assert "needs reducer=" in found[0]
        assert "microbatch_mode='sum'" in found[1]
        assert "correlated noise is not supported" in found[2]
        assert "no per-example norm rule" in found[3]
        assert "'2.weight' must be sharded by fully_shard" in found[4]


def _crash_worker(d: Distributed, out: Path, victim: int) -> None:
    """``victim`` dies in step 3 (rank 1: after its first forward; rank 0: right after its
    ledger write, before the barrier). The survivor must stop with a clear error."""
    torch.set_num_threads(1)
    r = d.rank
    ledger = _ledger(d, out, "ledger.jsonl")
    calls, steps = [0], [0]

    def loss_fn(outputs, targets):
        calls[0] += 1
        if r == victim == 1 and calls[0] == 5:  # 2 chunks per step: step 3, first chunk
            (out / "killed.txt").write_text(str(time.time()))
            os._exit(3)
        return LOSS(outputs, targets)

    if r == victim == 0:
        original, releases = ledger.record_sum_queries, [0]

        def record_then_die(*args, **kwargs):
            original(*args, **kwargs)
            releases[0] += 1
            if releases[0] == 3:
                (out / "killed.txt").write_text(str(time.time()))
                os._exit(3)

        ledger.record_sum_queries = record_then_die  # type: ignore[method-assign]

    def count(info) -> None:
        if info.kind == "step":
            steps[0] += 1
            (out / f"applied_{r}.txt").write_text(str(steps[0]))

    (out / f"applied_{r}.txt").write_text("0")
    trainer = _trainer(_shard(_model(), d), ledger, d, loss_fn=loss_fn, callbacks=[count])
    try:
        trainer.fit()
    except (DistributedError, RuntimeError) as e:
        (out / f"error_{r}.txt").write_text(f"{time.time()}\n{type(e).__name__}: {e}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_sharded_killed_rank_never_undercounts(tmp_path, victim):
    exits = spawn_workers(_crash_worker, 2, (tmp_path, victim), timeout=TIMEOUT)
    survivor = 1 - victim
    assert exits[victim].exitcode == 3
    assert exits[survivor].exitcode == 1, exits
    stopped, message = (tmp_path / f"error_{survivor}.txt").read_text().split("\n", 1)
    assert float(stopped) - float((tmp_path / "killed.txt").read_text()) < TIMEOUT + 3.0
    assert message.startswith("DistributedError"), message
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    releases = sum(1 for e in ledger.entries if type(e).__name__ == "SumQueryRecord")
    applied = [int((tmp_path / f"applied_{r}.txt").read_text()) for r in (0, 1)]
    assert max(applied) == 2
    assert releases >= max(applied)
    assert releases == (3 if victim == 0 else 2)


@pytest.mark.slow
@pytest.mark.usefixtures("quick_image_runs")  # physical batches of 64 rows, no figures
def test_cli_trains_a_sharded_model_with_two_workers(tmp_path, capsys):
    from dpfy.cli import main

    out = tmp_path / "run"  # a 64-image test split: evaluating all 10,000 is not under test
    code = main(["train", "mnist", "--workers", "2", "--shard", "--train-limit", "128",
                 "--test-limit", "64", "--epochs", "1", "--batch-size", "32", "--seed", "0",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    ledger = Ledger.load(out / "ledger.jsonl")
    assert ledger.metadata["workers"] == 2 and ledger.metadata["sharded"] is True
    state = torch.load(out / "model.pt")
    assert all(type(v) is torch.Tensor for v in state.values())  # gathered, not shards
    assert state["7.weight"].shape == (32, 512)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard"], "shard needs workers >= 2"),
        (["--shard", "--workers", "3"], "multiple of the world size 3"),
    ],
)
def test_cli_refuses_shard_without_workers(tmp_path, capsys, args, message):
    from dpfy.cli import main

    out = tmp_path / "run"
    code = main(["train", "mnist", *args, "--out", str(out), "--train-limit", "64"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not out.exists()

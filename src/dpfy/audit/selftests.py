"""White-box self-tests of the distributed, federated and correlated-noise release paths.

Each self-test runs the real release code on inputs whose noise-free result is known in closed
form, subtracts it, and tests what is left (the noise that was actually added) against what the
ledger records. Every statistic is a standardised deviation that is approximately N(0, 1)
when the code is correct, and the test fails when the largest one in absolute value exceeds
the two-sided Bonferroni threshold ``Phi^{-1}(1 - alpha / (2 m))`` over its ``m`` tests (so a
correct implementation fails with probability at most about ``alpha``; ``1e-6`` by default).

* **Standard deviation.** For ``n`` i.i.d. ``N(0, s^2)`` values ``x``, the estimate
  ``s_hat = sqrt(mean(x^2))`` has standard error about ``s / sqrt(2 n)``; the statistic is
  ``(s_hat / s - 1) sqrt(2 n)`` with ``s`` the *recorded* std. Noise added twice (``sqrt 2``
  times the std), at half the std, or not at all (``s_hat = 0``) is far outside for the sizes
  used here (``n`` in the thousands).
* **Whiteness** (correlated noise) and **independence** (every other path). For two
  independent ``N(0, s^2)`` vectors of ``P`` values, ``<x, y> / (P s^2)`` has standard error
  ``1 / sqrt(P)``; the statistic is that correlation times ``sqrt(P)``. Applied to every two
  steps (rounds) of independent noise it is about ``sqrt(P)`` when one draw is used twice,
  which neither the std test nor a replay with identical seeds can see.

:func:`dpsgd_selftest` checks one process's DP-SGD steps (the recorded std, fresh noise at
every step). :func:`distributed_selftest` spawns a gloo process group on this machine (rank 0 is the
calling process) and checks that the noise of a data-parallel DP-SGD step is added once, at
the recorded std, and that every rank receives the same gradient (docs/architecture.md 5.18).
:func:`sharded_selftest` does the same for a model sharded with FSDP2 (``fully_shard``): each
rank noises its own shard, so every coordinate must be noised once at the recorded std and the
ranks' noise must be uncorrelated (5.18, "Sharded models (FSDP2)").
:func:`federated_selftest` runs DP-FedAvg rounds of :class:`dpfy.fed.DPFedAvg` (the server
calls of :func:`dpfy.fed.run_in_process`) on known client deltas (5.19).
:func:`correlated_selftest` recovers the noise sequence ``W`` of a
:class:`~dpfy.queries.correlated.CorrelatedNoiseQuery` over its ``T`` steps and checks that
``C W``, with ``C`` the strategy matrix *the ledger records*, is i.i.d. ``N(0, sigma^2)``
(Denisov et al. 2022; 5.16).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
from scipy import stats
from torch import nn

from dpfy._validate import check_int, check_range
from dpfy.correlated import Cyclic
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query
from dpfy.ledger import Ledger
from dpfy.ledger.records import MatrixStepRecord, SumQueryRecord
from dpfy.queries import GaussianSumQuery
from dpfy.queries.correlated import CorrelatedNoiseQuery
from dpfy.randomness import Randomness
from dpfy.sampling import CyclicSampler
from dpfy.sampling.spec import SampleSpec
from dpfy.training import PrivateGradient
from dpfy.training.distributed import Distributed, GradientReducer
from dpfy.training.launch import run_local


@dataclasses.dataclass(frozen=True, slots=True)
class SelfTest:
    """The outcome of one self-test.

    Attributes:
      name: which release path was tested.
      passed: no finding (``statistic <= threshold`` and every exact check held).
      statistic: the largest absolute standardised deviation (about N(0, 1) when correct).
      threshold: the Bonferroni-corrected two-sided critical value it is compared with.
      findings: what failed, one sentence each (empty when passed).
    """

    name: str
    passed: bool
    statistic: float
    threshold: float
    findings: tuple[str, ...]


def _threshold(alpha: float, tests: int) -> float:
    """``Phi^{-1}(1 - alpha / (2 m))``: two-sided, Bonferroni over ``m`` tests."""
    return float(stats.norm.isf(alpha / (2.0 * tests)))


def _std_z(x: np.ndarray, std: float) -> tuple[float, float]:
    """(measured std / recorded std, the standardised deviation of that ratio from 1)."""
    measured = float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0
    if not std > 0.0:
        return (math.inf if measured > 0 else math.nan), math.inf
    ratio = measured / std
    return ratio, (ratio - 1.0) * math.sqrt(2.0 * x.size)


def _result(name: str, zs: list[float], thr: float, findings: list[str]) -> SelfTest:
    stat = max((abs(z) for z in zs), default=0.0)
    if not stat <= thr:
        findings.append(
            f"the largest standardised deviation is {stat:.3g}, above the threshold {thr:.3g}"
        )
    return SelfTest(name, not findings, stat, thr, tuple(findings))


def _check_common(alpha: float, clip_norm: float, noise_multiplier: float) -> None:
    check_range("alpha", alpha, 0.0, 0.5, low_open=True, high_open=True)
    check_range("clip_norm", clip_norm, 0.0, 1e15, low_open=True)
    check_range("noise_multiplier", noise_multiplier, 0.0, 1e6, low_open=True)


def _rows(count: int, dim: int, clip_norm: float, seed: int) -> np.ndarray:
    """``count`` vectors of ``dim`` values with norms spread over ``[0.2 C, 3 C]``."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((count, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x * (clip_norm * np.linspace(0.2, 3.0, count))[:, None]


def _clipped_sum(x: np.ndarray, clip_norm: float) -> np.ndarray:
    """The closed-form clipped sum: ``sum_i x_i min(1, C / ||x_i||)`` in float64."""
    norms = np.linalg.norm(x, axis=1)
    return np.asarray((x * np.minimum(1.0, clip_norm / norms)[:, None]).sum(axis=0))


# -- 1. distributed DP-SGD: the noise is added once across ranks -------------------------------
@dataclasses.dataclass(frozen=True)
class _DistConfig:
    dim: int
    rows: int
    steps: int
    clip_norm: float
    noise_multiplier: float
    alpha: float
    make_reducer: Callable[[Distributed], GradientReducer] | None
    make_randomness: Callable[[], Randomness] | None


def _linear_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``w . x_i``: example i's gradient with respect to ``w`` is exactly ``x_i``."""
    return outputs[:, 0] * targets


def _independence(noise: list[np.ndarray], std: float) -> list[tuple[float, int, int]]:
    """``(z, s, t)`` for every two steps ``s < t`` of ``noise`` (one vector of ``P`` values
    per step, recorded std ``std``): ``z = <x_s, x_t> / (std^2 sqrt(P))``, about N(0, 1) for
    independent draws and ``sqrt(P)`` for the same noise used again."""
    if not noise or not std > 0.0:
        return []
    mat = np.stack(noise) / std
    corr = mat @ mat.T / math.sqrt(mat.shape[1])
    return [(float(corr[s, t]), s, t) for t in range(len(noise)) for s in range(t)]


def _independence_finding(pairs: list[tuple[float, int, int]], thr: float, unit: str,
                          size: int) -> list[str]:
    """One finding for the most correlated pair above ``thr`` (none when all are below)."""
    if not pairs:
        return []
    z, s, t = max(pairs, key=lambda p: abs(p[0]))
    if abs(z) <= thr:
        return []
    return [
        f"independence: the noise of {unit}s {s} and {t} is correlated ({z:.3g} standard "
        f"errors; 0 for independent draws, {math.sqrt(size):.3g} for the same noise used twice)"
    ]


def _keeping_threads(run: Callable[[], object]) -> SelfTest:
    """``run()`` (a worker, here or as rank 0 of a local launch: it sets 1 torch thread), with
    the caller's torch thread count restored afterwards."""
    threads = torch.get_num_threads()
    try:
        result = run()
    finally:
        torch.set_num_threads(threads)
    assert isinstance(result, SelfTest)
    return result


def _distributed_worker(d: Distributed | None, cfg: _DistConfig) -> SelfTest:
    torch.set_num_threads(1)
    rank, world = (0, 1) if d is None else (d.rank, d.world_size)
    x = _rows(cfg.rows, cfg.dim, cfg.clip_norm, seed=0)
    known = _clipped_sum(x, cfg.clip_norm)
    mine = torch.from_numpy(x[rank::world]).float()
    reducer = None if d is None else d if cfg.make_reducer is None else cfg.make_reducer(d)
    rng = Randomness.secure_mode() if cfg.make_randomness is None else cfg.make_randomness()
    model = nn.Linear(cfg.dim, 1, bias=False)
    pg = PrivateGradient(
        model, GaussianSumQuery(cfg.clip_norm, cfg.noise_multiplier), expected_batch_size=1.0,
        reducer=reducer,
    )
    ledger = Ledger()
    noise, spread = [], 0.0
    for _ in range(cfg.steps):
        sid = ledger.record_sample(SampleSpec("full_batch"))
        pg.accumulate(mine, torch.ones(mine.shape[0]), _linear_loss)
        pg.release(ledger=ledger, sample_id=sid, randomness=rng)
        assert model.weight.grad is not None
        g = model.weight.grad.detach().reshape(-1).double().clone()
        noise.append(g.numpy() - known)  # the denominator is 1
        if d is not None:
            first = g.clone()
            d.share_([first])  # rank 0's gradient on every rank
            spread = max(spread, float((g - first).abs().max()))
    if d is not None:
        spread = d.sum_numbers([spread])[0]
    findings: list[str] = []
    recs = [r for r in ledger.entries if isinstance(r, SumQueryRecord)]
    if len(recs) != cfg.steps:
        findings.append(f"ledger: {len(recs)} release records for {cfg.steps} steps")
    declared = {r.noise_std for r in recs}
    std = recs[0].noise_std if len(declared) == 1 else math.nan
    if len(declared) != 1:
        findings.append(f"ledger: the steps record different noise stds {sorted(declared)}")
    if spread != 0.0:
        findings.append(f"ranks: the released gradients differ by up to {spread:.3g}")
    ratio, z = _std_z(np.concatenate(noise), std)
    pairs = _independence(noise, std)
    thr = _threshold(cfg.alpha, 1 + len(pairs))
    if not abs(z) <= thr:
        findings.append(
            f"noise: the released gradient minus the clipped sum has std {ratio:.4g} x the "
            f"recorded {std:.6g} (1 when added once"
            + ("" if d is None else f"; {math.sqrt(world):.3g} when every rank adds it")
            + "; 0 when skipped)"
        )
    findings += _independence_finding(pairs, thr, "step", cfg.dim)
    name = "dpsgd" if d is None else "distributed"
    return _result(name, [z] + [p[0] for p in pairs], thr, findings)


def distributed_selftest(
    world_size: int = 2,
    *,
    dim: int = 512,
    rows: int = 16,
    steps: int = 8,
    clip_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    alpha: float = 1e-6,
    timeout: float = 60.0,
    make_reducer: Callable[[Distributed], GradientReducer] | None = None,
    make_randomness: Callable[[], Randomness] | None = None,
) -> SelfTest:
    """Noise added exactly once across ranks of a data-parallel DP-SGD step (gloo, CPU).

    ``world_size`` local processes share ``rows`` examples of a bias-free linear model with the
    loss ``w . x_i`` (example i's gradient is ``x_i``; norms from 0.2 C to 3 C, so clipping
    acts), each rank holding every ``world_size``-th row. Over ``steps`` releases with
    denominator 1 the released gradient minus the closed-form clipped sum must have the
    per-coordinate std the ledger records (``steps x dim`` values), every two steps' noise
    must be uncorrelated (as in :func:`dpsgd_selftest`), every step must have one release
    record, and every rank must hold the same gradient bit for bit.

    ``make_reducer`` (module-level, picklable: it runs in the spawned ranks) wraps each rank's
    :class:`~dpfy.training.distributed.Distributed`, and ``make_randomness`` builds each rank's
    noise randomness (default: secure). Both exist to show that a broken variant is caught;
    leave them unset to test dpfy's own code.
    """
    check_int("world_size", world_size, 2, 64)
    check_int("dim", dim)
    check_int("rows", rows, world_size)
    check_int("steps", steps)
    check_range("timeout", timeout, 0.0, 86400.0, low_open=True)
    _check_common(alpha, clip_norm, noise_multiplier)
    cfg = _DistConfig(dim, rows, steps, float(clip_norm), float(noise_multiplier), float(alpha),
                      make_reducer, make_randomness)
    return _keeping_threads(
        lambda: run_local(_distributed_worker, world_size, (cfg,), timeout=timeout)
    )


def dpsgd_selftest(
    *,
    dim: int = 512,
    rows: int = 16,
    steps: int = 8,
    clip_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    alpha: float = 1e-6,
    randomness: Randomness | None = None,
) -> SelfTest:
    """One process's DP-SGD steps draw fresh noise at the recorded std at every step.

    The model and data of :func:`distributed_selftest` in this process (no reducer): over
    ``steps`` releases of :class:`~dpfy.training.PrivateGradient` with denominator 1, the
    released gradient minus the closed-form clipped sum must have the recorded std (one test
    over ``steps x dim`` values), each step must have one release record, and every two
    steps' noise vectors (``dim`` values each) must be uncorrelated (``steps (steps - 1) / 2``
    tests: noise used again at a later step, which the replay's identical seeds cannot see,
    has standardised correlation ``sqrt(dim)``). ``randomness``: the noise (default: secure).
    """
    check_int("dim", dim)
    check_int("rows", rows)
    check_int("steps", steps, 2)
    _check_common(alpha, clip_norm, noise_multiplier)
    cfg = _DistConfig(dim, rows, steps, float(clip_norm), float(noise_multiplier), float(alpha),
                      None, None if randomness is None else lambda: randomness)
    return _keeping_threads(lambda: _distributed_worker(None, cfg))


# -- 1b. sharded (FSDP2) DP-SGD: each coordinate noised once, on the rank holding it ----------
@dataclasses.dataclass(frozen=True)
class _ShardConfig:
    dim: int
    out: int
    rows: int
    steps: int
    clip_norm: float
    noise_multiplier: float
    alpha: float
    make_randomness: Callable[[int], Randomness] | None


def _outer_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``u . (W x_i)`` with ``u = 1 / sqrt(out)``: example i's gradient is ``u x_i^T``, of
    norm ``||x_i||``."""
    return outputs.sum(1) * targets / math.sqrt(outputs.shape[1])


def _sharded_worker(d: Distributed, cfg: _ShardConfig) -> SelfTest:
    from torch.distributed.fsdp import fully_shard

    from dpfy.training.sharded import shard_rows

    torch.set_num_threads(1)
    w, r = d.world_size, d.rank
    x = _rows(cfg.rows, cfg.dim, cfg.clip_norm, seed=0)
    u = np.full(cfg.out, 1.0 / math.sqrt(cfg.out))
    a, b = shard_rows(cfg.out, w, r)
    known = np.outer(u, _clipped_sum(x, cfg.clip_norm))[a:b].reshape(-1)  # this rank's shard
    mine = torch.from_numpy(x[r::w]).float()
    rng = Randomness.secure_mode() if cfg.make_randomness is None else cfg.make_randomness(r)
    model = nn.Linear(cfg.dim, cfg.out, bias=False)
    fully_shard(model, mesh=d.mesh())  # in place: model's class becomes FSDPLinear
    pg = PrivateGradient(
        model, GaussianSumQuery(cfg.clip_norm, cfg.noise_multiplier), expected_batch_size=1.0,
        reducer=d,
    )
    ledger = Ledger()
    noise = []
    for _ in range(cfg.steps):
        sid = ledger.record_sample(SampleSpec("full_batch"))
        pg.accumulate(mine, torch.ones(mine.shape[0]), _outer_loss)
        pg.release(ledger=ledger, sample_id=sid, randomness=rng)
        grad = model.weight.grad
        assert grad is not None
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        noise.append(local.detach().reshape(-1).double().numpy() - known)
    mat = np.stack(noise)  # [steps, shard size]
    # every rank's noise on every rank (zero-padded to the largest shard), for the pairwise tests
    width = math.ceil(cfg.out / w) * cfg.dim
    every = torch.zeros(w, cfg.steps, width, dtype=torch.float64)
    every[r, :, : mat.shape[1]] = torch.from_numpy(mat)
    d.sum_([every])
    own = [float(mat.shape[1] if k == r else 0) for k in range(w)]
    sizes = [int(v) for v in d.sum_numbers(own)]
    findings: list[str] = []
    recs = [e for e in ledger.entries if isinstance(e, SumQueryRecord)]
    declared = {e.noise_std for e in recs}
    std = recs[0].noise_std if len(recs) == cfg.steps and len(declared) == 1 else math.nan
    if len(recs) != cfg.steps or len(declared) != 1:
        findings.append(f"ledger: {len(recs)} release records with stds {sorted(declared)} for "
                        f"{cfg.steps} steps")
    if sum(sizes) != cfg.out * cfg.dim:
        findings.append(f"shards: {sum(sizes)} coordinates over the ranks, the parameter has "
                        f"{cfg.out * cfg.dim} (each must be noised exactly once)")
    zs: list[float] = []
    per_rank = [_independence(list(every[k, :, : sizes[k]].numpy()), std) for k in range(w)]
    tests = w + w * (w - 1) // 2 + sum(len(p) for p in per_rank)
    thr = _threshold(cfg.alpha, tests)
    for k in range(w):  # each rank's shard at the recorded std: twice, half or none is caught
        ratio, z = _std_z(every[k, :, : sizes[k]].numpy().reshape(-1), std)
        zs.append(z)
        if not abs(z) <= thr:
            findings.append(
                f"noise: rank {k}'s shard of the released gradient minus the clipped sum has "
                f"std {ratio:.4g} x the recorded {std:.6g} (1 when each coordinate is noised "
                "once; 0 when a rank skips its shard)"
            )
    for k in range(w):  # independent streams: no two ranks draw the same noise
        for j in range(k + 1, w):
            m = min(sizes[k], sizes[j])
            xk, xj = every[k, :, :m].numpy().reshape(-1), every[j, :, :m].numpy().reshape(-1)
            z = float(np.dot(xk, xj) / (xk.size * std * std)) * math.sqrt(xk.size)
            zs.append(z)
            if not abs(z) <= thr:
                findings.append(f"noise: ranks {k} and {j} drew correlated noise "
                                f"(standardised correlation {z:.3g}; 0 for independent streams)")
    for k, pairs in enumerate(per_rank):  # and each rank's steps from one another
        zs += [p[0] for p in pairs]
        findings += [f"rank {k}: {f}" for f in _independence_finding(pairs, thr, "step",
                                                                       sizes[k])]
    return _result("sharded", zs, thr, findings)


def sharded_selftest(
    world_size: int = 2,
    *,
    dim: int = 256,
    out: int = 4,
    rows: int = 16,
    steps: int = 8,
    clip_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    alpha: float = 1e-6,
    timeout: float = 60.0,
    make_randomness: Callable[[int], Randomness] | None = None,
) -> SelfTest:
    """Noise added exactly once per coordinate of an FSDP2-sharded DP-SGD step (gloo, CPU).

    A bias-free ``Linear(dim, out)`` is sharded with ``fully_shard`` over ``world_size`` local
    processes (rank r holds rows ``[r c, (r+1) c)`` of the weight, ``c = ceil(out / W)``), with
    the loss ``u . (W x_i)`` (example i's gradient ``u x_i^T``, of norm ``||x_i||``, between
    0.2 C and 3 C). Over ``steps`` releases with denominator 1 each rank's shard of the
    released gradient minus its shard of the closed-form clipped sum must have the recorded
    per-coordinate std (one test per rank), every pair of ranks' noise must be uncorrelated (one
    test per pair), so must every two steps' noise on each rank (as in :func:`dpsgd_selftest`),
    the shards must cover every coordinate once, and each step must have one release record at
    one std.

    ``make_randomness(rank)`` (module-level, picklable) builds each rank's noise randomness
    (default: secure); it exists to show that a broken variant is caught.
    """
    check_int("world_size", world_size, 2, 64)
    check_int("dim", dim)
    check_int("out", out, world_size)
    check_int("rows", rows, world_size)
    check_int("steps", steps)
    check_range("timeout", timeout, 0.0, 86400.0, low_open=True)
    _check_common(alpha, clip_norm, noise_multiplier)
    cfg = _ShardConfig(dim, out, rows, steps, float(clip_norm), float(noise_multiplier),
                       float(alpha), make_randomness)
    return _keeping_threads(
        lambda: run_local(_sharded_worker, world_size, (cfg,), timeout=timeout)
    )


# -- 2. DP-FedAvg: one record and one noise draw per round ------------------------------------
def federated_selftest(
    *,
    num_clients: int = 20,
    clients_per_round: int = 5,
    rounds: int = 6,
    dim: int = 1000,
    clip_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    alpha: float = 1e-6,
    randomness: Randomness | None = None,
) -> SelfTest:
    """DP-FedAvg rounds add noise once per round at the recorded std, one record per round.

    A :class:`~dpfy.fed.DPFedAvg` server (fixed-size cohorts, fixed clipping, server-side
    clipping) runs ``rounds`` rounds through the calls :func:`dpfy.fed.run_in_process` makes
    (``begin_round``, then ``finish_round`` with the cohort's deltas), with client ``c``'s delta
    a fixed vector of ``dim`` values and norm between 0.2 C and 3 C. Each round's mean delta
    times the expected cohort, minus the closed-form clipped sum of the cohort's deltas, must
    have the std that round's release records declare (``rounds + 1`` tests: each round and
    all rounds together), every two rounds' noise must be uncorrelated (``rounds (rounds - 1)
    / 2`` tests, as in :func:`dpsgd_selftest`), and each round must have exactly one release
    record.
    ``randomness``: the server's noise randomness (default: secure).
    """
    check_int("num_clients", num_clients, 2)
    check_int("clients_per_round", clients_per_round, 1, num_clients)
    check_int("rounds", rounds)
    check_int("dim", dim)
    _check_common(alpha, clip_norm, noise_multiplier)
    deltas = _rows(num_clients, dim, clip_norm, seed=1)
    cohort = CohortSampler(num_clients, "fixed_size", clients_per_round=clients_per_round)
    ledger = Ledger()
    server = DPFedAvg(cohort, client_update_query(clip_norm, noise_multiplier), ledger,
                      randomness=randomness)
    template = {"w": torch.zeros(dim, dtype=torch.float64)}
    thr = _threshold(alpha, rounds + 1 + rounds * (rounds - 1) // 2)
    findings: list[str] = []
    zs: list[float] = []
    noises: list[np.ndarray] = []
    stds: list[float] = []
    for _ in range(rounds):
        rnd = server.begin_round()
        updates = {c: {"w": torch.from_numpy(deltas[c].copy())} for c in rnd.cohort}
        mean = server.finish_round(template, updates)
        noise = mean["w"].numpy() * cohort.expected_size - _clipped_sum(
            deltas[list(rnd.cohort)], clip_norm
        )
        recs = [r for r in ledger.entries
                if isinstance(r, SumQueryRecord) and r.sample_id == rnd.sample_id]
        if len(recs) != 1:
            findings.append(f"round {rnd.number}: {len(recs)} release records, expected 1")
        if not recs:
            continue
        std = math.sqrt(sum(r.noise_std**2 for r in recs))  # what the records declare in all
        ratio, z = _std_z(noise, std)
        zs.append(z)
        noises.append(noise / std)
        stds.append(std)
        if not abs(z) <= thr:
            findings.append(
                f"round {rnd.number}: the noise has std {ratio:.4g} x the recorded {std:.6g}"
            )
    if noises:
        ratio, z = _std_z(np.concatenate(noises), 1.0)
        zs.append(z)
        if not abs(z) <= thr:
            findings.append(f"all rounds: the noise has std {ratio:.4g} x the recorded one")
    pairs = _independence(noises, 1.0)  # already in units of each round's recorded std
    findings += _independence_finding(pairs, thr, "round", dim)
    zs += [p[0] for p in pairs]
    total = sum(isinstance(r, SumQueryRecord) for r in ledger.entries)
    if total != rounds:
        findings.append(f"ledger: {total} release records for {rounds} rounds")
    return _result("federated", zs, thr, findings)


# -- 3. correlated noise: C W is white at the recorded std ------------------------------------
def _whitener(plan: CorrelatedPlan) -> np.ndarray:
    """``M`` (``T x T``) with ``M W`` white when ``W`` is the plan's noise at unit std:
    ``C`` for a square strategy, ``L^{-1}`` with ``L L^T = G G^T`` otherwise."""
    c = plan.strategy_matrix()
    if c.shape[0] == c.shape[1]:
        return c
    g = plan.noise_map()
    chol = np.linalg.cholesky(g @ g.T)
    return np.asarray(np.linalg.solve(chol, np.eye(chol.shape[0])))


def correlated_selftest(
    plan: CorrelatedPlan,
    *,
    size: int = 4096,
    clip_norm: float = 1.0,
    noise_multiplier: float = 1.0,
    alpha: float = 1e-6,
    randomness: Randomness | None = None,
    max_steps: int = 64,
) -> SelfTest:
    """The noise of a correlated-noise run is ``C^{-1} z`` for the ledger's ``C`` (``G z``,
    ``G`` the plan's :meth:`~dpfy.correlated.CorrelatedPlan.noise_map`, for a strategy whose
    ``C`` is not square: the efficient tree).

    A :class:`~dpfy.queries.correlated.CorrelatedNoiseQuery` for ``plan`` releases zero sums
    of ``size`` values at each of the plan's ``T`` steps (batches of a cyclic sampler with the
    plan's period, or one epoch), so its outputs are the noise ``W`` (``T x size``). With ``C``
    the strategy matrix of the ledger's ``matrix_run`` record and ``sigma`` the std of its
    ``matrix_step`` records, each row of ``C W`` must have std ``sigma`` (``T`` tests) and every
    two rows must be uncorrelated (``T (T - 1) / 2`` tests). For a non-square ``C`` the
    whitener is ``L^{-1}`` instead of ``C``, ``L L^T = G G^T`` (Cholesky; for a square ``C``
    with unit diagonal this ``L`` is ``C^{-1}`` itself). ``randomness``: the query's noise
    (default: secure). A plan of more than ``max_steps`` steps is tested on its first
    ``max_steps`` (the test forms ``C``): the same plan with fewer steps, whose ``C`` is the
    leading block of the long one (Toeplitz ``C``, and tree nodes that do not depend on ``T``),
    so its noise is the long run's first steps.
    """
    if not isinstance(plan, CorrelatedPlan):
        raise TypeError(f"plan must be a dpfy.correlated.CorrelatedPlan, got plan={plan!r}")
    check_int("size", size, 16)
    check_int("max_steps", max_steps, 2, 1024)
    _check_common(alpha, clip_norm, noise_multiplier)
    if plan.steps > max_steps:
        plan = dataclasses.replace(plan, steps=max_steps)
    t_steps = plan.steps
    period = plan.schema.period if isinstance(plan.schema, Cyclic) else t_steps
    spec = CyclicSampler(2 * period, 2).sample_spec()
    query = CorrelatedNoiseQuery(plan, clip_norm, noise_multiplier)
    rng = randomness if randomness is not None else Randomness.secure_mode()
    ledger = Ledger()
    rows = []
    for t in range(t_steps):
        sid = ledger.record_sample(spec, epoch=t // period, step=t)
        out = query.add_noise({"w": torch.zeros(size, dtype=torch.float64)}, ledger=ledger,
                              sample_id=sid, randomness=rng)
        rows.append(out["w"].numpy().copy())
    w = np.stack(rows)
    findings: list[str] = []
    found = ledger.matrix_run(query.name)
    steps = [r for r in ledger.entries if isinstance(r, MatrixStepRecord)]
    m = t_steps + t_steps * (t_steps - 1) // 2
    thr = _threshold(alpha, m)
    if found is None or found[1] != t_steps or len(steps) != t_steps:
        findings.append(f"ledger: no matrix run with {t_steps} step records")
        return _result("correlated", [], thr, findings)
    run = found[0]
    sigma = run.noise_multiplier * run.clip_norm
    if any(not math.isclose(r.noise_std, sigma, rel_tol=1e-12) for r in steps):
        findings.append(f"ledger: a step records a noise std other than z C = {sigma:.6g}")
    z = _whitener(run.plan) @ w / sigma  # i.i.d. N(0, 1) when correct
    zs: list[float] = []
    for t in range(t_steps):
        ratio, dev = _std_z(z[t], 1.0)
        zs.append(dev)
        if not abs(dev) <= thr:
            findings.append(f"step {t}: (C W)_t has std {ratio:.4g} x the recorded {sigma:.6g}")
    corr = z @ z.T / size * math.sqrt(size)
    worst = (0.0, 0, 0)
    for s in range(t_steps):
        for t in range(s):
            zs.append(float(corr[s, t]))
            worst = max(worst, (abs(float(corr[s, t])), t, s))
    if not worst[0] <= thr:
        findings.append(
            f"whiteness: rows {worst[1]} and {worst[2]} of C W are correlated "
            f"({worst[0] / math.sqrt(size):.3g}, {worst[0]:.3g} standard errors): the noise is "
            f"not C^{{-1}} z for the recorded {run.plan.strategy} strategy"
        )
    return _result(f"correlated ({plan.strategy})", zs, thr, findings)


"""Running sampling jobs: seeding, chunking, an optional executor, and a progress bar.

Computation is split into jobs of at most 2^24 Gaussian draws (each job chunked further to
``chunk_elements`` draws in memory). Job seeds are ``numpy.random.SeedSequence`` children of
the run's seed, so results do not depend on the executor. Jobs run in this process or on any
``concurrent.futures.Executor`` (e.g. ``ProcessPoolExecutor``; Dask and Ray provide
Executor-compatible clients); a rich progress bar appears on stderr when a run takes longer
than ~2 s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np

from dpfy.accounting.monte_carlo.base import IntArray, Job, JobResult, Sampler
from dpfy.accounting.monte_carlo.conditional import sample_conditional
from dpfy.accounting.monte_carlo.epochs import Epoch
from dpfy.accounting.monte_carlo.importance import sample_importance
from dpfy.accounting.monte_carlo.order_statistics import default_orders, sample_order_statistics
from dpfy.accounting.monte_carlo.plain import sample_plain
from dpfy.accounting.monte_carlo.tilted import sample_tilted

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


SAMPLERS: Mapping[str, Sampler] = {
    "plain": sample_plain,
    "importance": sample_importance,
    "order_statistics": sample_order_statistics,
    "conditional": sample_conditional,
    "tilted": sample_tilted,
}
"""The sampler of each mode (the ``auto`` choice is made before jobs are built)."""

_JOB_DRAWS = 1 << 24  # Gaussian draws (or equivalent work) per job
_PROGRESS_AFTER_S = 2.0


def run_job(job: Job) -> JobResult:
    """Run one job (top-level, so a process pool can pickle it)."""
    return SAMPLERS[job.mode](job, np.random.default_rng(job.seed))


def sample_losses(
    epochs: Sequence[Epoch],
    *,
    samples: int,
    threshold: float,
    mode: str,
    seed: int | None,
    executor: Executor | None,
    chunk_elements: int,
    progress: bool,
    pilot: bool = False,
    m_star: float = math.inf,
    big_fraction: float = 0.0,
    tilt_order: int = 0,
) -> list[JobResult]:
    """Run the sampling jobs; ``pilot`` draws from a stream independent of the main one."""
    orders: tuple[IntArray, ...] | None = None
    if mode == "order_statistics":
        orders = tuple(default_orders(max(e.steps - 1, 1)) for e in epochs)
    per_sample = sum(
        (len(o) + 2) * 3 if mode == "order_statistics" else e.steps
        for e, o in zip(epochs, orders or [np.zeros(0)] * len(epochs), strict=True)
    )
    job_samples = max(1, min(samples, _JOB_DRAWS // max(per_sample, 1)))
    n_jobs = math.ceil(samples / job_samples)
    root = np.random.SeedSequence(seed)
    seeds = root.spawn(n_jobs) if not pilot else np.random.SeedSequence(
        root.entropy, spawn_key=(1 << 30,)
    ).spawn(n_jobs)
    jobs = [
        Job(
            tuple(epochs),
            min(job_samples, samples - i * job_samples),
            seeds[i],
            mode,
            threshold,
            chunk_elements,
            orders,
            m_star,
            big_fraction,
            tilt_order,
        )
        for i in range(n_jobs)
    ]
    return execute(jobs, executor, progress)


def execute(jobs: Sequence[Job], executor: Executor | None, progress: bool) -> list[JobResult]:
    """Results of ``jobs`` in job order, run in this process or on ``executor``."""
    start = time.perf_counter()
    bar: Progress | None = None
    task: TaskID | None = None
    results: list[JobResult | None] = [None] * len(jobs)

    def tick(done: int) -> None:
        nonlocal bar, task
        if not progress:
            return
        if bar is None and time.perf_counter() - start > _PROGRESS_AFTER_S and done < len(jobs):
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TimeRemainingColumn

            bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                "{task.completed}/{task.total} chunks",
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            bar.start()
            task = bar.add_task("Monte Carlo accounting", total=len(jobs))
        if bar is not None and task is not None:
            bar.update(task, completed=done)

    try:
        if executor is None:
            for i, job in enumerate(jobs):
                results[i] = run_job(job)
                tick(i + 1)
        else:
            from concurrent.futures import as_completed

            futures = {executor.submit(run_job, job): i for i, job in enumerate(jobs)}
            for done, fut in enumerate(as_completed(futures), start=1):
                results[futures[fut]] = fut.result()
                tick(done)
    finally:
        if bar is not None:
            bar.stop()
    return [r for r in results if r is not None]

"""Throughput of data-parallel DP-SGD: 1 process vs N processes (gloo, this machine).

The tanh CNN of ``dpfy.training.recipes`` on synthetic 28x28 images (no dataset needed),
Poisson sampling with expected batch ``--batch`` out of ``--n`` examples, one physical chunk
per step (``--batch`` rows, split across the processes), seeded randomness. Each setting runs
``--warmup`` steps, then times ``--steps`` steps on rank 0 (``PrivateTrainer.fit`` continued
with ``max_steps``); examples/s counts the sampled examples. Settings:

* 1 process with 1 torch thread, and with ``--threads`` threads;
* W processes (``--workers``) with ``--threads // W`` threads each (the same cores);
* the same W processes with the model sharded by FSDP2 (``fully_shard`` on every layer with
  parameters and on the root; :mod:`dpfy.training.sharded`).

On a machine with few cores this measures the overhead of the collectives (index broadcast,
all-reduce of the clipped sums, broadcast of the noisy gradient), not scaling.

    python benchmarks/distributed.py [--workers 2] [--threads 2] [--steps 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from torch import nn

from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateTrainer, TrainerOptions
from dpfy.training.distributed import Distributed
from dpfy.training.launch import run_local
from dpfy.training.recipes import make_model


def _run(distributed: Distributed | None, cfg: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(0)
    n, batch = int(cfg["n"]), int(cfg["batch"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    model = make_model("tanh_cnn")
    if cfg.get("shard"):
        from torch.distributed.fsdp import fully_shard

        assert distributed is not None
        mesh = distributed.mesh()
        for layer in model.modules():
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    trainer = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        PoissonSampler(n, batch / n, randomness=Randomness(1)),
        options=TrainerOptions(
            clip_norm=1.0,
            epochs=1,
            delta=1e-5,
            noise_multiplier=1.0,
            max_physical_batch_size=batch,
            randomness=Randomness(2),
            distributed=distributed,
        ),
    )
    trainer.fit(max_steps=int(cfg["warmup"]))
    done = trainer.global_step_
    t0 = time.perf_counter()
    trainer.fit(max_steps=done + int(cfg["steps"]))
    seconds = time.perf_counter() - t0
    examples = sum(s.batch_size for s in trainer.history_.steps[done:])
    return {"seconds": seconds, "steps": trainer.global_step_ - done, "examples": examples,
            "examples_per_s": examples / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = {k: getattr(args, k) for k in ("n", "batch", "warmup", "steps", "threads")}
    single = _run(None, {**cfg, "threads": 1})
    one = _run(None, cfg)
    per = {**cfg, "threads": max(1, args.threads // args.workers)}
    many = run_local(_run, args.workers, (per,), timeout=120.0)
    sharded = run_local(_run, args.workers, ({**per, "shard": True},), timeout=120.0)
    result = {
        "config": {**cfg, "workers": args.workers, "threads_per_worker": per["threads"]},
        "one_process_one_thread": single,
        "one_process": one,
        "workers": many,
        "workers_sharded": sharded,
        "ratio_vs_one_thread": many["examples_per_s"] / single["examples_per_s"],
        "ratio_vs_threads": many["examples_per_s"] / one["examples_per_s"],
        "sharded_vs_replicated": sharded["examples_per_s"] / many["examples_per_s"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"tanh CNN, Poisson batch {args.batch} of {args.n}, {args.steps} timed steps")
    print(f"1 process x 1 thread: {single['examples_per_s']:8.1f} examples/s "
          f"({single['seconds']:.2f} s)")
    print(f"1 process x {args.threads} threads: {one['examples_per_s']:8.1f} examples/s "
          f"({one['seconds']:.2f} s)")
    print(f"{args.workers} processes x {per['threads']} threads: "
          f"{many['examples_per_s']:8.1f} examples/s ({many['seconds']:.2f} s)")
    print(f"{args.workers} processes x {per['threads']} threads, FSDP2-sharded: "
          f"{sharded['examples_per_s']:8.1f} examples/s ({sharded['seconds']:.2f} s)")
    print(f"{args.workers} processes / 1 process x 1 thread: "
          f"{result['ratio_vs_one_thread']:.2f}; / 1 process x {args.threads} threads: "
          f"{result['ratio_vs_threads']:.2f}; sharded / replicated: "
          f"{result['sharded_vs_replicated']:.2f}")


if __name__ == "__main__":
    main()

"""Data-parallel DP-SGD in your own script: one process, or every process torchrun starts.

    python docs/examples/torchrun_train.py --out runs/lib                  # one process
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id job1 \\
        docs/examples/torchrun_train.py --out runs/lib --mode ddp fsdp2   # on each machine

``--mode`` (one or several, run in turn; each writes ``OUT/MODE/ledger.jsonl``):
``replicated`` (every rank holds the model), ``ddp`` (a DistributedDataParallel model: dpfy
runs the per-example pass on its ``.module`` and reduces the clipped sums itself) or ``fsdp2``
(every layer sharded with ``fully_shard``; each rank noises its own shard). Rank 0 samples,
writes the ledger and prints the epsilon; the other ranks keep an in-memory mirror of the
ledger. The epsilon is the one-process run's: one global sample per step, one noise draw per
coordinate. Data: 256 random rows, so the script runs in seconds on a CPU.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dpfy.ledger import Ledger
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateTrainer, TrainerOptions
from dpfy.training.distributed import Distributed, from_env
from dpfy.training.sharded import shard_model
from dpfy.training.torchrun import torchrun_env


def train(d: Distributed | None, mode: str, out: Path) -> None:
    """One DP-SGD run of ``mode`` on this process's rank (``d``; None: one process)."""
    device = d.device if d is not None else torch.device("cpu")
    torch.manual_seed(0)  # the same data on every rank; rank 0's initial weights are broadcast
    x = torch.randn(256, 20)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 2)).to(device)
    if d is not None and mode == "fsdp2":
        shard_model(model, d)  # fully_shard(layer, mesh=d.mesh()) on every layer, then the root
    elif d is not None and mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    releases = d is None or d.releases  # rank 0 (or the only process) writes the ledger
    if releases:
        (out / mode).mkdir(parents=True, exist_ok=True)
    trainer = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        nn.CrossEntropyLoss(reduction="none"),
        x.to(device),
        y.to(device),
        PoissonSampler(len(x), 32 / len(x)),  # expected batch 32; secure randomness
        options=TrainerOptions(
            clip_norm=1.0,
            epochs=2,
            delta=1e-5,
            target_epsilon=3.0,
            max_physical_batch_size=16,  # rows per forward pass over all ranks: W divides it
            ledger=Ledger(out / mode / "ledger.jsonl") if releases else Ledger(),
            distributed=d,
        ),
    )
    result = trainer.fit()
    if releases:
        trainer.ledger.close()
        print(f"{mode}: epsilon = {result.privacy.epsilon:.6f} ({result.privacy.method}, "
              f"delta = 1e-5, {result.steps} steps, noise multiplier "
              f"{result.noise_multiplier:.6f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the ledgers here")
    parser.add_argument("--mode", nargs="+", choices=("replicated", "ddp", "fsdp2"),
                        default=["replicated"])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl: one GPU per process (GPU LOCAL_RANK of each machine)")
    args = parser.parse_args()
    # Under torchrun: join its process group. Otherwise: one process, no group.
    d = from_env(backend=args.backend, timeout=60) if torchrun_env() is not None else None
    for mode in args.mode:
        train(d, mode, args.out)
    if d is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DP-FedAvg on Fashion-MNIST split non-IID over 1,000 clients: accuracy vs rounds.

What it measures: test accuracy of the global model after each block of rounds, for
non-private FedAvg and for client-level DP-FedAvg (dpfy.fed) calibrated to epsilon 3 and 8 at
delta 1e-4 (< 1/N = 1e-3 for N = 1,000 clients). Every DP run's epsilon is re-derived from its
ledger by ``dpfy report`` (``report/`` of each run), never from the hyperparameters.

Setup (all public hyperparameters):
  * data: the 60,000 Fashion-MNIST training images sorted by label, cut into 2,000 shards of
    30, two shards per client (McMahan et al. 2017's pathological non-IID split: most clients
    hold one or two classes); test accuracy on the 10,000 test images;
  * model: multinomial logistic regression (784 x 10 + 10 = 7,850 parameters);
  * cohort: Poisson sampling of clients with q = 0.2 (200 expected clients per round),
    ``--rounds`` rounds (default 60); clients run ``--local-epochs`` epochs of SGD (batch 20,
    lr 0.1) from the global model;
  * DP: adaptive clipping of the client deltas to the median norm (Andrew et al. 2021,
    initial C = 1, count noise std = 200 / 20), noise multiplier calibrated with dpfy's
    certified search for the whole run, server-side clipping, noise once per round, mean over
    the expected cohort size, server learning rate 1;
  * non-private FedAvg: the same cohorts and local training, the plain mean of the deltas of
    the clients that took part.

Two engines run the same DP configuration (``--engine``):

* ``in-process`` (default): the fast path of ``dpfy.fed.run_in_process`` (the same
  ``DPFedAvg`` round logic, cohort sampler, queries and client code as the Flower strategy,
  without Flower's transport), for speed on one CPU thread;
* ``flower``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend
  limited to one CPU, one ClientApp actor): a ``ServerApp`` runs ``dpfy.fed.flower.
  DPStrategy`` around Flower's ``FedAvg``, ``make_client_app`` builds the ``ClientApp``, one
  virtual SuperNode per client. The cohort sampler, the clipping, the noise stream and the
  ledger are built as in process, with the same seeds; the clients' data are assigned by
  Flower's ``partition-id``, which is not the server's client index (node ids are random),
  and local batch order comes from each Ray worker's torch generator, so the runs agree in
  distribution, not bit for bit. Its results go to ``results_flower.{md,json}``.

Seeded randomness: the runs are reproducible experiments, not DP releases (their reports say
so).

Resumable: each configuration keeps its ledger, a checkpoint after every round and its
history under ``--out`` (the Flower engine under ``<name>-flower``); re-running continues
where it stopped. At the end it writes ``results.md``, ``results.json`` and
``accuracy_vs_rounds.png`` (in-process) or ``results_flower.{md,json}`` (Flower).

    python benchmarks/fedavg.py [--rounds 60] [--out benchmarks/results/fedavg] [--quick]
        [--engine {in-process,flower}] [--configs nonprivate,eps3,eps8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfy import accounting
from dpfy.datasets import load_fashion_mnist
from dpfy.fed import CohortSampler, DPFedAvg, client_update_query
from dpfy.fed.budget import calibrate_rounds
from dpfy.fed.client import apply_delta, load_tensors, local_update, model_tensors
from dpfy.fed.simulation import LocalTraining
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.training.checkpoint import (
    ledger_state,
    load_checkpoint,
    restore_ledger,
    save_checkpoint,
)

NUM_CLIENTS, SHARDS_PER_CLIENT, RATE, DELTA = 1000, 2, 0.2, 1e-4
EVAL_EVERY = 5
CONFIGS = {"nonprivate": None, "eps3": 3.0, "eps8": 8.0}
LOCAL = {"batch_size": 20, "lr": 0.1}


def split_non_iid(y: torch.Tensor, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Sort by label, cut into ``2 num_clients`` shards, give each client two random shards."""
    order = np.argsort(y.numpy(), kind="stable")
    shards = np.array_split(order, SHARDS_PER_CLIENT * num_clients)
    perm = np.random.default_rng(seed).permutation(len(shards))
    k = SHARDS_PER_CLIENT
    return [
        np.concatenate([shards[j] for j in perm[k * c : k * (c + 1)]]) for c in range(num_clients)
    ]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def run_config(
    name: str, epsilon: float | None, args: argparse.Namespace, clients: list, test: tuple
) -> dict[str, Any]:
    """One configuration, resumed from its checkpoint if there is one."""
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    n = len(clients)
    cohort = CohortSampler(n, sampling_rate=RATE, randomness=Randomness(1))
    local = LocalTraining(epochs=args.local_epochs, **LOCAL)
    model = make_model()
    server = None
    z = None
    if epsilon is not None:
        z = calibrate_rounds(cohort, args.rounds, epsilon, DELTA)
        query = client_update_query(
            1.0, z, adaptive=True, expected_clients=cohort.expected_size,
            count_noise_std=cohort.expected_size / 20.0,
        )
        server = DPFedAvg(cohort, query, Ledger(out / "ledger.jsonl"), randomness=Randomness(2))
    history: list[dict[str, Any]] = []
    done, seconds = 0, 0.0
    if server is not None and server.ledger.iteration and not ckpt.exists():
        raise SystemExit(
            f"{out / 'ledger.jsonl'} holds {server.ledger.iteration} rounds but there is no "
            f"checkpoint to resume from: move the run away to start again"
        )
    if ckpt.exists():
        state = load_checkpoint(ckpt)
        model.load_state_dict(state["model"])
        history, done, seconds = list(state["history"]), int(state["rounds_done"]), state["seconds"]
        torch.set_rng_state(state["torch_rng"])
        if server is not None:
            restore_ledger(server.ledger, state["ledger"])
            server.load_state_dict(state["server"])
        else:
            cohort.load_state_dict(state["cohort"])
        print(f"{name}: resumed after round {done}", flush=True)
    elif server is not None:
        server.ledger.record_metadata(
            target_epsilon=float(epsilon), target_delta=DELTA, rounds=args.rounds,
            local_epochs=args.local_epochs, model="logistic regression 784x10",
            dataset=f"Fashion-MNIST, {n} clients, 2 label-sorted shards each",
        )
    x_test, y_test = test
    if not history:
        history.append({"round": 0, "test_accuracy": accuracy(model, x_test, y_test)})
    for r in range(done + 1, args.rounds + 1):
        t0 = time.perf_counter()
        start = model_tensors(model)
        if server is not None:
            rnd = server.begin_round()
            members = rnd.cohort
        else:
            members = tuple(int(i) for i in cohort.draw())
        updates = {}
        for c in members:
            load_tensors(model, start)
            xc, yc = clients[c]
            updates[c] = local_update(
                model, xc, yc, epochs=local.epochs, batch_size=local.batch_size, lr=local.lr
            )
        if server is not None:
            mean = server.finish_round(start, updates)
        elif updates:
            mean = {k: sum(u[k] for u in updates.values()) / len(updates) for k in start}
        else:
            mean = {k: torch.zeros_like(v) for k, v in start.items()}
        load_tensors(model, apply_delta(start, mean))
        seconds += time.perf_counter() - t0
        if r % EVAL_EVERY == 0 or r == args.rounds:
            row = {"round": r, "test_accuracy": accuracy(model, x_test, y_test)}
            if server is not None:
                row["clip_norm"] = float(server.query.clip_norm)
            history.append(row)
            print(f"{name}: round {r} acc {row['test_accuracy']:.4f} ({seconds:.0f} s)", flush=True)
        state = {
            "model": model.state_dict(), "history": history, "rounds_done": r,
            "seconds": seconds, "torch_rng": torch.get_rng_state(),
        }
        if server is not None:
            state["server"] = server.state_dict()
            state["ledger"] = ledger_state(server.ledger)
        else:
            state["cohort"] = cohort.state_dict()
        save_checkpoint(ckpt, state)
    return finish_result(name, epsilon, z, history, seconds, server, out)


def finish_result(
    name: str, epsilon: float | None, z: float | None, history: list[dict[str, Any]],
    seconds: float, server: DPFedAvg | None, out: Path,
) -> dict[str, Any]:
    """The result row of a finished run: accuracy history, and epsilon from its ledger."""
    result: dict[str, Any] = {
        "name": name, "target_epsilon": epsilon, "noise_multiplier": z,
        "final_accuracy": history[-1]["test_accuracy"], "history": history,
        "train_seconds": seconds,
    }
    if server is not None:
        ledger = server.ledger
        ledger.record_metadata(
            utility={"test_accuracy": result["final_accuracy"]},
            accuracy_by_step=[[h["round"], h["test_accuracy"]] for h in history],
        )
        result["ledger_epsilon_pld"] = accounting.epsilon(ledger, DELTA, "pld").epsilon
        result["ledger_epsilon_rdp"] = accounting.epsilon(ledger, DELTA, "rdp").epsilon
        result["rounds_in_ledger"] = ledger.iteration
        ledger.close()
        from dpfy import runs

        report_dir = out / "report"
        if not (report_dir / "report.md").exists():
            runs.report_ledger(out / "ledger.jsonl", delta=DELTA, out=report_dir, figures=False)
        result["report"] = str(report_dir / "report.md")
    return result


# -- the Flower engine ------------------------------------------------------------------------
class FlowerClientData:
    """``partition-id -> (x, y)`` in a Ray worker: the split is built once per worker process.

    Flower unpickles the ClientApp (and with it this class, defined in ``__main__``) afresh
    for each message, so the cache lives in a module registered in ``sys.modules``, which
    lasts as long as the worker process."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def __call__(self, partition: int) -> tuple[torch.Tensor, torch.Tensor]:
        import sys
        import types

        cache = sys.modules.setdefault("_fedavg_bench_clients", types.ModuleType("cache"))
        clients = getattr(cache, f"n{self.num_clients}", None)
        if clients is None:
            x, y = load_fashion_mnist("train")
            parts = split_non_iid(y, self.num_clients)
            clients = [(x[torch.as_tensor(p)], y[torch.as_tensor(p)]) for p in parts]
            setattr(cache, f"n{self.num_clients}", clients)
        return clients[partition]


def flower_model() -> torch.nn.Module:
    """The client's model skeleton (its values are the global model's, sent by the server).

    Not seeded: a seed here would reset the worker's torch generator, i.e. give every client
    the same local batch order in every round."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))


def run_flower(
    name: str, epsilon: float, args: argparse.Namespace, test: tuple
) -> dict[str, Any]:
    """One DP configuration through Flower's simulation engine, resumed from its checkpoint."""
    import logging
    import os

    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from dpfy.fed.flower import DPStrategy, make_client_app

    out = Path(args.out) / f"{name}-flower"
    out.mkdir(parents=True, exist_ok=True)
    saved_file = out / "history.json"
    saved: dict[str, Any] = (
        json.loads(saved_file.read_text()) if saved_file.exists()
        else {"history": [], "seconds": 0.0, "sessions": []}
    )
    n = args.clients
    cohort = CohortSampler(n, sampling_rate=RATE, randomness=Randomness(1))
    z = calibrate_rounds(cohort, args.rounds, epsilon, DELTA)
    query = client_update_query(
        1.0, z, adaptive=True, expected_clients=cohort.expected_size,
        count_noise_std=cohort.expected_size / 20.0,
    )
    server = DPFedAvg(cohort, query, Ledger(out / "ledger.jsonl"), randomness=Randomness(2))
    x_test, y_test = test
    history: list[dict[str, Any]] = saved["history"]
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        plain = FedAvg(
            fraction_train=1.0, min_train_nodes=0, min_available_nodes=0, fraction_evaluate=0.0
        )
        strategy = DPStrategy(plain, server, checkpoint=out / "checkpoint.pt", wait_for_nodes=600)
        if strategy.resumed_arrays is None:
            server.ledger.record_metadata(
                target_epsilon=float(epsilon), target_delta=DELTA, rounds=args.rounds,
                local_epochs=args.local_epochs, model="logistic regression 784x10",
                dataset=f"Fashion-MNIST, {n} clients, 2 label-sorted shards each",
                engine="flower run_simulation (Ray, 1 CPU)",
            )
        else:
            print(f"{name} (flower): resumed after round {server.rounds_done}", flush=True)
        model = make_model()
        start = strategy.initial_arrays(ArrayRecord(model.state_dict()))
        mark = [time.perf_counter()]

        def evaluate(_: int, arrays: ArrayRecord) -> MetricRecord | None:
            saved["seconds"] += time.perf_counter() - mark[0]  # the round(s) since the last call
            r = server.rounds_done
            row = None
            due = r == 0 or r % EVAL_EVERY == 0 or r == args.rounds
            if due and all(h["round"] != r for h in history):
                model.load_state_dict(arrays.to_torch_state_dict())
                row = {"round": r, "test_accuracy": accuracy(model, x_test, y_test),
                       "clip_norm": float(server.query.clip_norm)}
                history.append(row)
                print(f"{name} (flower): round {r} acc {row['test_accuracy']:.4f} "
                      f"({saved['seconds']:.0f} s)", flush=True)
            saved_file.write_text(json.dumps(saved, indent=1))
            mark[0] = time.perf_counter()
            return None if row is None else MetricRecord({"test-accuracy": row["test_accuracy"]})

        strategy.start(
            grid=grid, initial_arrays=start, num_rounds=strategy.remaining_rounds(args.rounds),
            evaluate_fn=evaluate,
        )

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPU: quiet Ray
    logging.getLogger("flwr").setLevel(logging.WARNING)
    client_app = make_client_app(
        flower_model, FlowerClientData(n),
        local=LocalTraining(epochs=args.local_epochs, **LOCAL),
    )
    t0 = time.perf_counter()
    before = server.rounds_done
    run_simulation(
        server_app, client_app, num_supernodes=n,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}},
    )
    wall = time.perf_counter() - t0
    saved["sessions"].append({"wall_seconds": wall, "rounds_before": before,
                              "rounds_after": server.rounds_done})
    saved_file.write_text(json.dumps(saved, indent=1))
    if server.rounds_done < args.rounds:
        raise SystemExit(f"{name} (flower): stopped after round {server.rounds_done} (see log)")
    result = finish_result(f"{name}-flower", epsilon, z, history, saved["seconds"], server, out)
    result["engine"] = "flower"
    result["simulation_wall_seconds"] = sum(s["wall_seconds"] for s in saved["sessions"])
    result["sessions"] = saved["sessions"]
    return result


def write_outputs(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    stem = "results" if args.engine == "in-process" else "results_flower"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"DP-FedAvg, Fashion-MNIST, {args.clients} non-IID clients, q = {RATE}, "
        f"{args.rounds} rounds, {args.local_epochs} local epoch(s), delta = {DELTA:g}, "
        f"engine {args.engine}",
        "",
        "| run | target eps | z | eps from ledger (PLD) | accuracy by round | final acc | "
        "train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        marks = ", ".join(
            f"{h['round']}: {h['test_accuracy']:.3f}" for h in r["history"]
            if h["round"] in (0, 10, 20, 30, 40, 60, 100) or h["round"] == args.rounds
        )
        eps = r.get("ledger_epsilon_pld")
        lines.append(
            f"| {r['name']} | {r['target_epsilon'] or '-'} | "
            f"{'-' if r['noise_multiplier'] is None else format(r['noise_multiplier'], '.3f')} | "
            f"{'inf (no noise)' if eps is None else format(eps, '.3f')} | {marks} | "
            f"{r['final_accuracy']:.4f} | {r['train_seconds']:.0f} |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.engine != "in-process":
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        rounds = [h["round"] for h in r["history"]]
        acc = [h["test_accuracy"] for h in r["history"]]
        label = "FedAvg (non-private)" if r["target_epsilon"] is None else (
            f"DP-FedAvg, client-level eps={r['target_epsilon']:g}"
        )
        ax.plot(rounds, acc, marker="o", markersize=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Fashion-MNIST, {args.clients} non-IID clients, delta={DELTA:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_rounds.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS)
    parser.add_argument("--out", default="benchmarks/results/fedavg")
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 clients, 3 rounds")
    parser.add_argument("--engine", choices=["in-process", "flower"], default="in-process")
    parser.add_argument(
        "--configs", default=None,
        help="comma-separated subset of nonprivate,eps3,eps8 (default: all three in-process, "
        "eps3 with --engine flower)",
    )
    args = parser.parse_args()
    default = "eps3" if args.engine == "flower" else ",".join(CONFIGS)
    names = (args.configs or default).split(",")
    if not set(names) <= set(CONFIGS):
        parser.error(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
    if args.engine == "flower" and "nonprivate" in names:
        parser.error("the flower engine runs the DP configurations (DPStrategy) only")
    if args.quick:
        args.clients, args.rounds, args.out = 100, 3, str(Path(args.out) / "quick")
    if args.clients * DELTA >= 1:
        raise SystemExit(f"delta={DELTA} must be below 1/N = {1 / args.clients:g}")
    torch.set_num_threads(1)
    x_test, y_test = load_fashion_mnist("test")
    if args.engine == "flower":  # the clients' data are loaded in the Ray worker
        results = [run_flower(name, CONFIGS[name], args, (x_test, y_test)) for name in names]
    else:
        x, y = load_fashion_mnist("train")
        parts = split_non_iid(y, args.clients)
        clients = [(x[torch.as_tensor(p)], y[torch.as_tensor(p)]) for p in parts]
        results = [
            run_config(name, CONFIGS[name], args, clients, (x_test, y_test)) for name in names
        ]
    write_outputs(results, args)


if __name__ == "__main__":
    main()

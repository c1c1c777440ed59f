"""Runs launched by torchrun: two "machines" on localhost (two torchrun agents, c10d, gloo).

Each launch starts two ``torchrun --nnodes 2 --nproc-per-node 1`` agents with the same
``--rdzv-id`` and a c10d rendezvous on a free port of 127.0.0.1, as two machines would (no
``--node-rank``: the rendezvous assigns the ranks). Oracles: the one-process run of the same
configuration (the same ledger events, so the same epsilon), the run directory (only rank 0
writes it) and each process's output. The refusals need no launch: the environment torchrun
sets is faked, and every inconsistent setup is refused before anything joins or is written.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

from dpfy import accounting
from dpfy.ledger import Ledger
from dpfy.training.torchrun import TorchrunEnv, torchrun_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "examples" / "torchrun_train.py"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK")
#: The smallest `dpfy train` run (the limits of the --workers tests), one torch thread each.
TRAIN = ["train", "mnist", "--train-limit", "128", "--test-limit", "64", "--epochs", "1",
         "--batch-size", "32", "--seed", "0", "--threads", "1"]


def _launch(tmp_path: Path, name: str, command: list[str]) -> list[tuple[int, str]]:
    """Two torchrun agents ("nodes") running ``command``; (exit code, output) of each."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", f"{name}-{port}", "--local-addr", "127.0.0.1",
            *command]
    logs = [tmp_path / f"{name}-agent{i}.log" for i in (0, 1)]
    procs = []
    for log in logs:
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                          cwd=ROOT, start_new_session=True))
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:  # only if one hung: its agent and workers, by the session we started
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)


def _fake_launch(monkeypatch: pytest.MonkeyPatch, rank: int = 0, world: int = 2) -> None:
    """The environment torchrun gives rank ``rank`` of ``world`` (nothing listens)."""
    _clean_env(monkeypatch)
    for key, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": 0,
                       "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1,
                       "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(key, str(value))


def _epsilon(ledger: Ledger) -> float:
    return float(accounting.epsilon(ledger, delta=1e-5, method="pld").epsilon)


# ---------------------------------------------------------------------------------------------
# two nodes on localhost
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_library_script_under_torchrun_on_two_nodes(tmp_path, monkeypatch, capsys):
    """docs/examples/torchrun_train.py: DDP and FSDP2, the 1-process epsilon, rank 0's ledger."""
    two = tmp_path / "two"
    ran = _launch(tmp_path, "lib", [str(SCRIPT), "--out", str(two), "--mode", "ddp", "fsdp2"])
    for code, output in ran:
        assert code == 0, output
    printed = "".join(output for _, output in ran)
    for mode in ("ddp", "fsdp2"):  # printed once, by rank 0
        assert printed.count(f"{mode}: epsilon = ") == 1, printed
    # the same script in this one process
    _clean_env(monkeypatch)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--out", str(tmp_path / "one")])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "replicated: epsilon = " in capsys.readouterr().out
    one = Ledger.load(tmp_path / "one" / "replicated" / "ledger.jsonl")
    # one ledger file per mode, written by rank 0 alone; nothing else in the run directory
    assert sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file()) == [
        "ddp/ledger.jsonl", "fsdp2/ledger.jsonl"]
    for mode in ("ddp", "fsdp2"):
        ledger = Ledger.load(two / mode / "ledger.jsonl")
        assert ledger.metadata["workers"] == 2
        assert ledger.metadata.get("sharded", False) is (mode == "fsdp2")
        assert ledger.to_event() == one.to_event()
        assert _epsilon(ledger) == _epsilon(one) <= 3.0


@pytest.mark.slow
def test_dpfy_train_detects_torchrun_on_two_nodes(tmp_path, monkeypatch, capsys, request):
    """`dpfy train mnist --shard` started by torchrun on each node: one run directory."""
    out = tmp_path / "two"
    dpfy = Path(sys.executable).with_name("dpfy")
    ran = _launch(tmp_path, "cli", ["--no-python", str(dpfy), *TRAIN, "--shard",
                                    "--out", str(out)])
    for code, output in ran:
        assert code == 0, output
    printed = "".join(output for _, output in ran)
    assert printed.count("run directory:") == 1 and "Traceback" not in printed
    assert printed.count("rank 1 of 2: done") == 1
    ledger = Ledger.load(out / "ledger.jsonl")
    meta = ledger.metadata
    assert (meta["workers"], meta["sharded"], meta["launcher"]) == (2, True, "torchrun")
    assert {"model.pt", "report.md", "report.json", "run.toml"} <= {p.name for p in out.iterdir()}
    _audit_raises_no_false_alarm(out, monkeypatch)
    # the same configuration in one process (sharding needs two: the event is the same), in
    # physical batches of 64 rows and without figures (the two-node run above has both)
    from dpfy.cli import main

    _clean_env(monkeypatch)
    request.getfixturevalue("quick_image_runs")
    assert main([*TRAIN, "--out", str(tmp_path / "one")]) == 0, capsys.readouterr().err
    one = Ledger.load(tmp_path / "one" / "ledger.jsonl")
    assert ledger.to_event() == one.to_event()
    reported = [json.loads((d / "report.json").read_text())["epsilon"] for d in
                (out, tmp_path / "one")]
    assert reported[0] == reported[1] == _epsilon(one) <= 3.0


def _audit_raises_no_false_alarm(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dpfy audit` of the two-node run directory: no violation, its own model (gathered from
    the shards into model.pt) checked. The two-process self-tests the ledger calls for are
    recorded, not run (each spawns a gloo group again: ~20 s here); their runs on unmodified
    code are in tests/audit/test_selftests.py and tests/audit/test_planted_bugs.py."""
    from dpfy.audit import run as run_mod
    from dpfy.audit.selftests import SelfTest
    from dpfy.cli import main

    called: list[tuple[str, int, float, float]] = []

    def recorded(name: str):
        def selftest(world: int, *, clip_norm: float, noise_multiplier: float) -> SelfTest:
            called.append((name, world, clip_norm, noise_multiplier))
            return SelfTest(name, True, 0.0, 1.0, ())
        return selftest

    monkeypatch.setattr(run_mod, "distributed_selftest", recorded("distributed"))
    monkeypatch.setattr(run_mod, "sharded_selftest", recorded("sharded"))
    assert main(["audit", str(out), "--method", "one-run", "--trials", "1000"]) == 0
    audit = json.loads((out / "report.json").read_text())["audit"]
    assert audit["verdict"] == "no violation found" and audit["self_tests"] == []
    z, c = audit["noise_multiplier"], audit["clip_norm"]
    assert called == [("distributed", 2, c, z), ("sharded", 2, c, z)]
    assert audit["self_tests_run"] == ["replay", "sampler", "ledger counts", "recorded epsilon",
                                       "keys", "distributed", "sharded", "real model"]
    assert audit["real_model"]["tensors"] == 8  # every tensor of the mnist CNN
    assert audit["self_test_notes"] == [
        "keys: a seeded run (not a DP release): no key to commit to"]
    assert "## Audit" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------------
# refused before anything joins or is written (the environment of a launch, faked)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "args", "message"),
    [
        (2, ["--workers", "2"], "workers must be 1 under torchrun (WORLD_SIZE=2)"),
        (1, ["--workers", "2"], "workers must be 1 under torchrun (WORLD_SIZE=1)"),
        (3, [], "max_physical_batch_size must be a multiple of the world size 3"),
        (1, ["--shard"], "shard needs workers >= 2 (processes to shard over), or a torchrun"),
        (2, ["--mechanism", "bandmf"], "needs mechanism='dpsgd'"),
        (2, ["--unit", "user", "--users", "64"], "needs unit='example'"),
        (2, ["--audit-canaries", "10"], "needs no one-run audit"),
    ],
)
def test_cli_refuses_an_inconsistent_launch_in_one_line(
    tmp_path, monkeypatch, capsys, world, args, message
):
    from dpfy.cli import main

    _fake_launch(monkeypatch, world=world)
    out = tmp_path / "run"
    code = main([*TRAIN, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # refused before anything is written or joined


def test_cli_refuses_a_text_dataset_and_a_used_run_directory_before_joining(
    tmp_path, monkeypatch, capsys
):
    from dpfy.cli import main

    _fake_launch(monkeypatch)
    assert main(["train", "rotten-tomatoes", "--out", str(tmp_path / "text")]) == 2
    assert "needs an image dataset, got dataset='rotten-tomatoes'" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "ledger.jsonl").write_text("")
    assert main([*TRAIN, "--out", str(used)]) == 2  # rank 0 checks it before joining
    assert "ledger.jsonl exists" in capsys.readouterr().err
    monkeypatch.delenv("MASTER_ADDR")
    assert main([*TRAIN, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "MASTER_ADDR missing" in err and len(err.strip().splitlines()) == 1


def test_from_env_reports_an_unreachable_store_in_one_line(monkeypatch):
    from dpfy.training.distributed import DistributedError, from_env

    _fake_launch(monkeypatch, rank=1)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens there
    with pytest.raises(DistributedError, match="rank 1 of 2: joining the process group at "
                       "127.0.0.1:") as info:
        from_env(timeout=1.0, start_timeout=1.0)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# what torchrun tells a process
# ---------------------------------------------------------------------------------------------


def test_torchrun_env_reads_the_launch_and_refuses_an_incomplete_one():
    full = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}
    assert torchrun_env(full) == TorchrunEnv(3, 4, 1, 2, "node0", 29500, "job")
    assert torchrun_env(full).nodes == 2
    assert torchrun_env({}) is None
    # a login profile's MASTER_ADDR / MASTER_PORT alone is no launch
    assert torchrun_env({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}) is None
    # another launcher: no run id, no local world size
    other = {k: full[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert torchrun_env(other) == TorchrunEnv(3, 4, 0, 4, "node0", 29500, None)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT missing"):
        torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    for key, value, needle in [
        ("RANK", "4", "RANK must be an integer in [0, 3], got RANK=4"),
        ("WORLD_SIZE", "two", "WORLD_SIZE must be an integer in [0, inf), got WORLD_SIZE='two'"),
        ("MASTER_PORT", "70000", "MASTER_PORT must be an integer in [1, 65535]"),
        ("LOCAL_RANK", "2", "LOCAL_RANK must be an integer in [0, 1], got LOCAL_RANK=2"),
        ("MASTER_ADDR", " ", "MASTER_ADDR missing"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            torchrun_env({**full, key: value})

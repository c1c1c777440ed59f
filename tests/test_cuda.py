"""The DP step and the recipes on a CUDA device (skipped where torch sees none).

The rest of the suite runs on the CPU (and the ``meta`` device). These tests repeat the checks
that matter on a GPU: per-example norms and clipped sums of every exact layer and of the
transformer architectures against the per-example loop run on the same device, the seeded
device noise's moments, and short ``dpfy train`` runs with ``device="cuda"`` whose model files
load on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

#: ``DPFY_TEST_DEVICE=cpu`` runs these tests on the CPU (to check the tests themselves).
CUDA = torch.device(os.environ.get("DPFY_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device")


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value


def _zoo_cases():
    from tests.training.test_layer_zoo import EXACT

    return sorted(EXACT)


@pytest.mark.parametrize("name", _zoo_cases())
def test_exact_layer_on_cuda_matches_the_per_example_loop(name):
    from tests.training.test_layer_zoo import DT, EXACT, Net, _compare, _packed

    make, body, make_inputs, _ = EXACT[name]
    torch.manual_seed(0)
    try:
        layer = make()
    except AttributeError as exc:  # a layer newer than this torch (the device's may be older)
        pytest.skip(str(exc))
    model = Net(layer, body).to(DT).to(CUDA)
    inputs = make_inputs()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    # pack_padded_sequence takes its lengths on the CPU (the LSTM case's second input)
    inputs = (_to(inputs[0], CUDA), *(t if body is _packed else _to(t, CUDA)
                                      for t in inputs[1:]))
    got = _compare(model, inputs)  # the zoo's comparison, run where the model is
    assert all(g.device.type == CUDA.type for g in got.values())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_transformers_on_cuda_match_the_per_example_loop(arch, lora):
    from dpfy.training.losses import causal_lm_loss, sequence_classification_loss
    from tests.training.test_transformers import CASES, _batch, _check_exact, _lora

    torch.manual_seed(0)
    build, task, targets, token_types = CASES[arch]
    model = build()
    if lora:
        model = _lora(model, targets, task)
    model = model.to(CUDA).eval()
    inputs, labels = _batch(token_types=token_types)
    if arch == "bert":
        labels, loss_fn = torch.tensor([0, 2, 1, 2]), sequence_classification_loss
    else:
        loss_fn = causal_lm_loss
    pg = _check_exact(model, _to(inputs, CUDA), labels.to(CUDA), loss_fn)
    assert all(g.device.type == CUDA.type for g in pg.clipped_sum().values())


def test_seeded_noise_on_cuda_has_the_stated_moments_and_fresh_draws():
    from dpfy.randomness import Randomness

    rng = Randomness(seed=0, device_noise=True)  # the device path, also under the CPU check
    a = torch.empty(1_000_000, device=CUDA)
    b = torch.empty(1_000_000, device=CUDA)
    rng.normal_([a], [2.0])
    rng.normal_([b], [2.0])
    for t in (a, b):
        assert t.device.type == CUDA.type
        assert abs(float(t.mean())) < 5 * 2.0 / 1000  # 5 standard errors
        assert abs(float(t.std()) - 2.0) < 0.01
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(corr) < 5e-3  # two steps' noise: independent draws


def test_text_and_image_runs_train_on_cuda_and_their_models_load_on_the_cpu(tmp_path: Path):
    from dpfy.config import RunConfig
    from dpfy.training.recipes import train_image_classifier
    from dpfy.training.text import train_text_classifier

    text = train_text_classifier(RunConfig(
        dataset="rotten-tomatoes", device=CUDA.type, seed=0, epochs=1, train_limit=256,
        test_limit=64, batch_size=64, max_length=32, linear_probe=0.25, target_epsilon=8.0,
        out=tmp_path / "text"))
    image = train_image_classifier(RunConfig(
        dataset="mnist", device=CUDA.type, seed=0, epochs=1, train_limit=4096, test_limit=256,
        batch_size=128, target_epsilon=8.0, out=tmp_path / "image"))
    for run in (text, image):
        assert run.steps >= 1 and run.epsilon <= 8.0 + 1e-9
        assert next(run.model.parameters()).device.type == CUDA.type
        state = torch.load(Path(run.model_path), map_location="cpu", weights_only=True)
        assert all(t.device.type == "cpu" for t in state.values())
    assert image.test_accuracy > 0.5  # 32 steps on 4,096 MNIST images

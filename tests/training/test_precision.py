"""Mixed precision in the DP step (:mod:`dpfy.training.precision`).

bf16 and fp16 autocast against the fp32 naive per-example loop for the tiny BERT/GPT-2/Llama
configs of ``test_transformers.py`` (padding in the attention mask and one weight-0 row):
per-example norms and the clipped sum within 2 % relative (bf16) and 0.5 % (fp16). Measured on
2 CPU cores, torch 2.13 (max over the six models): per-example norms 9.9e-3 (bf16) and 5.3e-4
(fp16), clipped sum 1.7e-2 (bf16) and 9.6e-4 (fp16); without LoRA 1.2e-3 / 3.4e-3 (bf16) and
1.8e-4 / 4.7e-4 (fp16). The loss scale never reaches the clip; trainable bf16 parameters are
refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpfy.ledger import Ledger  # noqa: E402
from dpfy.queries import GaussianSumQuery  # noqa: E402
from dpfy.queries.sum import NoPrivacyQuery  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.sampling import SampleSpec  # noqa: E402
from dpfy.training import PrivateGradient, PrivateOptions  # noqa: E402
from dpfy.training.losses import causal_lm_loss, sequence_classification_loss  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)
from dpfy.training.precision import autocast_dtype, check_loss_scale, check_precision  # noqa: E402
from tests.training.test_transformers import CASES, B, _batch, _lora  # noqa: E402

TOL = {"bf16": 0.02, "fp16": 0.005}
WEIGHTS = torch.tensor([1.0, 1.0, 0.0, 1.0])  # row 2 is padding


def _model(arch, lora, seed=0):
    torch.manual_seed(seed)
    build, task, targets, token_types = CASES[arch]
    model = build()
    if lora:
        model = _lora(model, targets, task)
    inputs, labels = _batch(seed=seed, token_types=token_types)
    if arch == "bert":
        labels, loss_fn = torch.tensor([0, 2, 1, 2]), sequence_classification_loss
    else:
        loss_fn = causal_lm_loss
    return model.eval(), inputs, labels, loss_fn


def _rel(got, want):
    num = sum(float((got[n].double() - want[n].double()).square().sum()) for n in want)
    den = sum(float(want[n].double().square().sum()) for n in want)
    return math.sqrt(num / den)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_autocast_matches_fp32_loop(arch, lora, precision):
    model, inputs, labels, loss_fn = _model(arch, lora)
    ref = per_example_gradients(model, inputs, labels, loss_fn)  # fp32, no autocast
    ref_norms = sum(g.double().flatten(1).square().sum(1) for g in ref.values()).sqrt()
    clip = float(ref_norms[WEIGHTS > 0].median())  # some rows clipped, some not
    pg = PrivateGradient(
        model, NoPrivacyQuery(clip), expected_batch_size=B, precision=precision
    )
    stats = pg.accumulate(inputs, labels, loss_fn, weights=WEIGHTS, return_norms=True)
    real = WEIGHTS > 0
    norm_err = ((stats.norms - ref_norms).abs() / ref_norms)[real].max()
    assert float(norm_err) <= TOL[precision], float(norm_err)
    got = pg.clipped_sum()
    assert all(t.dtype == torch.float32 for t in got.values())
    sum_err = _rel(got, clipped_sum_reference(ref, clip, weights=WEIGHTS))
    assert sum_err <= TOL[precision], sum_err
    assert stats.num_nonfinite == 0 and stats.num_examples == 3


class _Gate(nn.Module):
    """A layer without a norm rule: the generic vmap(grad) rule handles it."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x * self.w)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_generic_rule_under_autocast(precision):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _Gate(8), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    ref = per_example_gradients(model, x, y, loss_fn)
    ref_norms = sum(g.double().flatten(1).square().sum(1) for g in ref.values()).sqrt()
    pg = PrivateGradient(model, NoPrivacyQuery(0.3), expected_batch_size=5, precision=precision)
    assert pg.plans_[1].rule is None
    stats = pg.accumulate(x, y, loss_fn, return_norms=True)
    assert float(((stats.norms - ref_norms).abs() / ref_norms).max()) <= TOL[precision]
    assert _rel(pg.clipped_sum(), clipped_sum_reference(ref, 0.3)) <= TOL[precision]


def test_autocast_forward_really_ran_in_low_precision():
    """A failure-capable control: the bf16 step differs from the fp32 one (else the test
    above would pass without any autocast)."""
    model, inputs, labels, loss_fn = _model("gpt2", False)
    sums = {}
    for precision in ("fp32", "bf16"):
        pg = PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B, precision=precision)
        pg.accumulate(inputs, labels, loss_fn)
        sums[precision] = pg.clipped_sum()
    err = _rel(sums["bf16"], sums["fp32"])
    assert 1e-5 < err < 0.02, err


def test_user_autocast_block_and_rules_in_fp32():
    """Inside the caller's own autocast block (make_private loops) the rules still see fp32."""
    model, inputs, labels, loss_fn = _model("llama", False)
    ref = PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B, precision="bf16")
    s_ref = ref.accumulate(inputs, labels, loss_fn, return_norms=True)
    assert s_ref.norms is not None
    clip = float(s_ref.norms.median())  # the clip weights depend on the norms
    ref = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=B, precision="bf16")
    ref.accumulate(inputs, labels, loss_fn)
    pg = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=B)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # backward inside the block too
        chunk = pg.open_chunk(B)
        losses = loss_fn(model(**inputs), labels)
        stats = chunk.accumulate(losses)
    assert stats.num_examples == B
    assert stats.loss_sum == pytest.approx(s_ref.loss_sum, rel=1e-6)
    assert _rel(pg.clipped_sum(), ref.clipped_sum()) < 1e-6


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_loss_scale_does_not_change_the_clipped_sum(precision):
    model, inputs, labels, loss_fn = _model("gpt2", True, seed=1)
    results = []
    for scale in (1.0, 2.0**4, 2.0**10):
        pg = PrivateGradient(
            model, NoPrivacyQuery(0.5), expected_batch_size=B, precision=precision,
            loss_scale=scale,
        )
        stats = pg.accumulate(inputs, labels, loss_fn, weights=WEIGHTS, return_norms=True)
        results.append((stats.norms, pg.clipped_sum()))
    (n0, s0), (n1, s1), (n2, s2) = results
    if precision == "fp32":  # a power of two scales exactly
        assert torch.equal(n0, n2) and all(torch.equal(s0[k], s2[k]) for k in s0)
    else:  # fp16: 2**4 and 2**10 only move gradients away from underflow
        # a few fp16 roundoffs (2^-11 = 4.9e-4 each): the CPU's fp16 kernels differ between
        # machines (1.1e-4 on the norms and 5.6e-4 on the sum were seen on one, < 1e-4 on another)
        real = WEIGHTS > 0
        assert float(((n1 - n2).abs() / n2)[real].max()) < 2e-3
        assert _rel(s1, s2) < 2e-3
    assert float(n2.max()) < 100.0  # unscaled: S = 1024 would show as norms x 1024


def test_fp16_overflow_drops_rows_and_release_is_finite():
    model, inputs, labels, loss_fn = _model("gpt2", False)
    pg = PrivateGradient(
        model, GaussianSumQuery(1.0, 1.0), expected_batch_size=B, precision="fp16",
        loss_scale=2.0**24,  # S x (logit gradient) > 65504: the fp16 backward overflows
    )
    stats = pg.accumulate(inputs, labels, loss_fn, weights=WEIGHTS)
    assert stats.num_nonfinite == 3  # every real row, the padding row does not count
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.04))
    pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    for p in pg._params.values():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert bool(torch.isfinite(p.grad).all())


def test_noise_added_in_fp32_under_autocast():
    model, inputs, labels, loss_fn = _model("bert", False)
    pg = PrivateGradient(
        model, GaussianSumQuery(1.0, 1.0), expected_batch_size=B, precision="bf16"
    )
    pg.accumulate(inputs, labels, loss_fn)
    ledger = Ledger()
    sid = ledger.record_sample(SampleSpec("poisson", dataset_size=100, sampling_rate=0.04))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(seed=0))
    g = model.classifier.weight.grad
    assert g is not None and g.dtype == torch.float32
    assert bool((g.bfloat16().float() != g).any())  # not rounded to bf16 anywhere


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pure_low_precision_parameters_refused(dtype):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)
    with pytest.raises(ValueError, match=r"'0\.weight'.*fp32 master weights.*precision='bf16'"):
        PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B)
    model[0].requires_grad_(False)  # frozen low-precision layers are fine, trainable ones not
    with pytest.raises(ValueError, match=r"'1\.weight'"):
        PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B)
    model[1].float()
    PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B)


def test_bad_precision_and_loss_scale():
    with pytest.raises(ValueError, match=r"precision must be one of \{fp32, bf16, fp16\}"):
        check_precision("fp8")
    with pytest.raises(ValueError, match=r"loss_scale must be in \[1, 2\*\*24\]"):
        check_loss_scale(0.5)
    with pytest.raises(ValueError, match="loss_scale"):
        check_loss_scale(math.inf)
    with pytest.raises(TypeError, match="loss_scale must be a number"):
        check_loss_scale("8")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="precision="):
        PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B, precision="half")
    pg = PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B, precision="fp16")
    assert pg.loss_scale == 2.0**8
    with pytest.raises(ValueError, match="loss_scale"):
        pg.accumulate(torch.randn(2, 2), torch.tensor([0, 1]), nn.CrossEntropyLoss(
            reduction="none"), loss_scale=0.0)


def _tiny_private(precision, dtype=torch.float32, **kw):
    from torch.utils.data import TensorDataset

    import dpfy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dpfy.make_private(
        model,
        opt,
        TensorDataset(x, y),
        target_epsilon=4.0,
        delta=1e-5,
        epochs=1,
        clip_norm=1.0,
        expected_batch_size=16,
        randomness=Randomness(0),
        options=PrivateOptions(
            **kw,
            precision=precision,
        ),
    )
    return private


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_make_private_autocast_equals_fp32_up_to_the_forward_rounding(precision):
    """Same seed, same batches, same noise: one released step differs from the fp32 run only
    by the low-precision forward (noise is fp32 in both)."""
    grads = {}
    for prec in ("fp32", precision):
        model, optimizer, criterion, loader = _tiny_private(prec)
        batches = iter(loader)  # kept: closing the generator closes the chunk
        x, y = next(batches)
        with optimizer.autocast():
            out = model(x)
            loss = criterion(out, y)
        assert out.dtype == (torch.float32 if prec == "fp32" else autocast_dtype(prec))
        loss.backward()
        optimizer.step()
        assert optimizer.ledger.metadata["precision"] == prec
        grads[prec] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert all(g.dtype == torch.float32 for g in grads[prec].values())
    assert _rel(grads[precision], grads["fp32"]) < TOL[precision]
    assert _rel(grads[precision], grads["fp32"]) > 0  # the forward did run in low precision


def test_make_private_refuses_pure_bf16_and_bad_options_before_writing():
    with pytest.raises(ValueError, match=r"'0\.weight' is torch\.bfloat16.*master"):
        _tiny_private("bf16", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="precision must be one of"):
        _tiny_private("float16")
    with pytest.raises(ValueError, match="loss_scale must be in"):
        _tiny_private("fp16", loss_scale=2.0**30)


def test_private_trainer_precision():
    from dpfy.sampling import PoissonSampler
    from dpfy.training import PrivateTrainer, TrainerOptions

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    trainer = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        PoissonSampler(64, 0.25, randomness=Randomness(0)),
        options=TrainerOptions(
            clip_norm=1.0,
            epochs=1,
            delta=1e-5,
            noise_multiplier=1.0,
            randomness=Randomness(0),
            precision="bf16",
        ),
    )
    trainer.fit()
    assert trainer.private_gradient_.precision == "bf16"
    assert trainer.ledger.metadata["precision"] == "bf16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    bad = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(reduction="none"),
        x,
        y,
        PoissonSampler(64, 0.25, randomness=Randomness(0)),
        options=TrainerOptions(
            clip_norm=1.0,
            epochs=1,
            delta=1e-5,
            noise_multiplier=1.0,
            precision="fp8",
        ),
    )
    with pytest.raises(ValueError, match="precision must be one of"):
        bad.fit()
    assert bad.ledger.iteration == 0


def test_average_microbatches_under_fp16():
    """Microbatch averages (Ponomareva et al. 2023, Alg. 3 option 2): the seed S / k."""
    model, inputs, labels, loss_fn = _model("gpt2", False)
    ref = per_example_gradients(model, inputs, labels, loss_fn)
    pg = PrivateGradient(
        model, NoPrivacyQuery(0.05), expected_batch_size=B, microbatch_size=2,
        microbatch_mode="average", precision="fp16",
    )
    stats = pg.accumulate(inputs, labels, loss_fn, weights=WEIGHTS)
    want = clipped_sum_reference(ref, 0.05, weights=WEIGHTS, microbatch_size=2)
    assert stats.num_nonfinite == 0
    assert _rel(pg.clipped_sum(), want) <= TOL["fp16"]

"""dpfy.hf.DPSFTTrainer (TRL's SFTTrainer): example run, exact per-example clipping on TRL's
padded batches (-100 labels), refusals before any ledger write. Tiny models, no download."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from dpfy import accounting  # noqa: E402
from dpfy.hf import DPSFTTrainer, PrivacyArguments  # noqa: E402
from dpfy.hf.trainer import LogicalBatch  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.training.losses import causal_lm_loss  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


def _example():
    spec = importlib.util.spec_from_file_location(
        "trl_sft_lora", ROOT / "docs" / "examples" / "trl_sft_lora.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_ledger_report_and_model_card(tmp_path):
    trainer = _example().main(str(tmp_path))  # secure randomness: a DP release
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    assert trainer.state.global_step == ledger.iteration == 4
    assert ledger.metadata["trainer"] == "dpfy.hf.DPSFTTrainer"
    z = trainer.noise_multiplier
    assert z > 0 and ledger.to_event() == trainer._dp_sampler.privacy_event(z, steps=4)
    eps = accounting.epsilon(ledger, 1e-5, trainer._dp_method).epsilon
    assert trainer.epsilon() == eps and eps <= 8.0 and abs(eps - 8.0) < 0.05
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(eps) and report["release"].startswith("DP release")
    card = (tmp_path / "README.md").read_text()
    privacy = card[card.index("## Privacy") :]
    for text in ("DP release", "Formal statement", "Ledger integrity: intact and signed",
                 "`ledger.jsonl`"):
        assert text in privacy, text
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.model.is_activation_checkpointing  # TRL's default, the non-reentrant kind
    assert ledger.metadata["precision"] == "bf16"  # TRL's default bf16=True is honoured


class Capturing(DPSFTTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", []) + [inputs]
        return super().training_step(model, inputs, num_items_in_batch)


def _data(kind):
    ex = _example()
    if kind == "text":
        return datasets.Dataset.from_dict({"text": ex.LINES * 2})
    prompts = [line.split(" ", 2)[:2] for line in ex.LINES * 2]
    return datasets.Dataset.from_dict({
        "prompt": [" ".join(p) for p in prompts],
        "completion": [line[len(" ".join(p)):] for p, line in zip(prompts, ex.LINES * 2,
                                                                   strict=True)],
    })


def _config(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=3, max_length=40,
                report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                logging_steps=100, dataloader_pin_memory=False)
    return trl.SFTConfig(**{**base, **kw})


PRIVACY = {f.name for f in dataclasses.fields(PrivacyArguments)}


def _trainer(cls, out, data, config=None, **kw):
    ex = _example()
    tokenizer = ex.char_tokenizer(ex.LINES)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                           task_type="CAUSAL_LM")
    return cls(model=model, args=config or _config(out), train_dataset=data,
               processing_class=tokenizer, peft_config=lora,
               privacy=PrivacyArguments(**{k: v for k, v in kw.items() if k in PRIVACY}),
               **{k: v for k, v in kw.items() if k not in PRIVACY})


@pytest.mark.parametrize("kind", ["text", "prompt_completion"])
def test_noise_off_update_equals_per_example_clipped_reference(tmp_path, kind):
    """One step, noise off, SGD: the update is -lr/B times the clipped sum of each row's own
    causal-LM gradient (token mean over its labelled tokens), from the per-example loop on
    the very batches TRL collated (right padding and prompt tokens labelled -100)."""
    lr, clip = 0.5, 0.05
    config = _config(tmp_path, optim="sgd", learning_rate=lr, max_steps=1, max_grad_norm=0.0,
                     lr_scheduler_type="constant", weight_decay=0.0,
                     gradient_accumulation_steps=3, bf16=False)  # TRL's default is bf16
    trainer = _trainer(Capturing, tmp_path, _data(kind), config, noise_multiplier=0.0,
                       clip_norm=clip, randomness=Randomness(3))
    with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without gradient
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    model = trainer.model
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    after = {n: p.detach().clone() for n, p in model.named_parameters() if n in start}
    with torch.no_grad():  # the reference runs on the same model at its starting point (a
        for n, p in model.named_parameters():  # deep copy of TRL's peft model does not train)
            if n in start:
                p.copy_(start[n])
    (batch,) = trainer.seen
    assert isinstance(batch, LogicalBatch) and batch.num_rows > 0
    ref, ignored, clipped = None, 0, 0
    for inputs, weights in batch.chunks:
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        ignored += int((labels[weights > 0] == -100).sum())
        grads = per_example_gradients(model, inputs, labels, causal_lm_loss)
        norms = sum(g.double().flatten(1).square().sum(1) for g in grads.values()).sqrt()
        clipped += int(((norms > clip) & (weights > 0)).sum())
        part = clipped_sum_reference(grads, clip, weights=weights)
        ref = part if ref is None else {n: ref[n] + part[n] for n in ref}
    assert ignored > 0 and clipped > 0  # padding/prompt positions and clipping both exercised
    assert start and set(ref) == set(start) and all("lora_" in n for n in start)
    for name, p0 in start.items():
        expected = (p0.double() - lr * ref[name].double() / 9.0).float()  # / E[B]
        torch.testing.assert_close(after[name], expected, rtol=1e-4, atol=1e-6)
    assert trainer.epsilon() == float("inf")  # released without noise: not private
    assert model.is_activation_checkpointing  # TRL's default (non-reentrant) was on


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(packing=True), "packing"),
        (dict(padding_free=True), "padding_free"),
        (dict(loss_type="dft"), "loss_type"),
        (dict(gradient_checkpointing_kwargs={"use_reentrant": True}), "reentrant"),
        (dict(compute_loss_func=lambda *a, **k: 0.0), "compute_loss_func"),
    ],
)
def test_refusals_come_before_any_ledger_write(tmp_path, change, match):
    kw = {k: v for k, v in change.items() if k == "compute_loss_func"}
    config = _config(tmp_path, **{k: v for k, v in change.items() if k not in kw})
    with pytest.raises(ValueError, match=match):
        trainer = _trainer(DPSFTTrainer, tmp_path, _data("text"), config, target_epsilon=4.0,
                           randomness=Randomness(0), **kw)
        trainer.train()
    assert not (tmp_path / "ledger.jsonl").exists()

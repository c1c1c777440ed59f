"""BERT sequence classification through dpfy.hf.DPTrainer (tiny config, right padding with an
attention mask): a few private steps write the ledger and the report, the saved model's card
carries the privacy statement, and with noise off the update equals the per-example clipped
reference, with transformers' (non-reentrant) gradient checkpointing on or off."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dpfy import accounting  # noqa: E402
from dpfy.hf import DPTrainer, PrivacyArguments  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.training.losses import sequence_classification_loss  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)

V, T = 48, 12


class Sentences(torch.utils.data.Dataset):
    """``n`` right-padded token rows (lengths 3..12, pad id 0) with a label in {0, 1, 2}."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, V, (n, T), generator=g)
        self.lengths = 3 + torch.arange(n) % (T - 2)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(T) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask,
                "labels": self.labels[i]}


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=T, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(cfg)


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, report_to=[],
                save_strategy="no", use_cpu=True, logging_steps=100, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def test_trains_writes_the_ledger_and_the_saved_card(tmp_path):
    args = _args(tmp_path, max_steps=3, learning_rate=1e-2, gradient_accumulation_steps=2)
    trainer = DPTrainer(
        model=_bert(),
        args=args,
        train_dataset=Sentences(),
        privacy=PrivacyArguments(
            target_epsilon=4.0,
            delta=1e-5,
            clip_norm=1.0,
        ),
    )
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    assert trainer.state.global_step == ledger.iteration == 3
    assert ledger.metadata["model"] == "BertForSequenceClassification"
    eps = accounting.epsilon(ledger, 1e-5, trainer._dp_method).epsilon
    assert 0 < eps <= 4.0 and trainer.epsilon() == eps
    assert json.loads((tmp_path / "privacy_report.json").read_text())["epsilon"] == (
        pytest.approx(eps))
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, start[n])]
    assert len(moved) == len(start)  # every trainable parameter got its noisy update
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))  # save_pretrained, then the card's privacy section
    card = (saved / "README.md").read_text()
    privacy = card[card.index("## Privacy") :]
    for text in ("DP release", "Formal statement", "Unit of privacy: example",
                 "Ledger integrity: intact and signed", "delta: 1e-05"):
        assert text in privacy, text
    again = transformers.BertForSequenceClassification.from_pretrained(saved)
    assert torch.equal(again.classifier.weight, trainer.model.classifier.weight)


class Capturing(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", []) + [inputs]
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_noise_off_update_equals_per_example_clipped_reference(tmp_path, checkpointing):
    lr, clip = 0.5, 0.5
    args = _args(tmp_path, optim="sgd", learning_rate=lr, max_steps=1, max_grad_norm=0.0,
                 lr_scheduler_type="constant", weight_decay=0.0, gradient_accumulation_steps=2,
                 gradient_checkpointing=checkpointing)
    trainer = Capturing(
        model=_bert(),
        args=args,
        train_dataset=Sentences(),
        privacy=PrivacyArguments(
            noise_multiplier=0.0,
            clip_norm=clip,
            randomness=Randomness(4),
        ),
    )
    model = trainer.model
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    assert model.is_activation_checkpointing == checkpointing
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    (batch,) = trainer.seen
    ref, padded, clipped = None, 0, 0
    for inputs, weights in batch.chunks:
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        padded += int((inputs["attention_mask"] == 0).sum())
        grads = per_example_gradients(model, inputs, labels, sequence_classification_loss)
        norms = sum(g.double().flatten(1).square().sum(1) for g in grads.values()).sqrt()
        clipped += int(((norms > clip) & (weights > 0)).sum())
        part = clipped_sum_reference(grads, clip, weights=weights)
        ref = part if ref is None else {n: ref[n] + part[n] for n in ref}
    assert padded > 0 and clipped > 0
    for name, p0 in start.items():
        update, want = (after[name] - p0).double(), -lr * ref[name].double() / 8.0  # / E[B]
        err = float((update - want).norm())
        assert err <= 1e-4 * float(want.norm()) + 1e-7, (name, err)

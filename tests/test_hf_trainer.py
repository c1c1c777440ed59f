"""dpfy.hf.DPTrainer: ledger, epsilon, exact clipped update, model card, refusals (tiny models)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dpfy import accounting  # noqa: E402
from dpfy.hf import DPTrainer, PrivacyArguments  # noqa: E402
from dpfy.hf.trainer import LogicalBatch  # noqa: E402
from dpfy.ledger import Ledger  # noqa: E402
from dpfy.randomness import Randomness  # noqa: E402
from dpfy.training.losses import causal_lm_loss  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)

ROOT = Path(__file__).resolve().parents[1]
V = 64


def _example():
    spec = importlib.util.spec_from_file_location(
        "hf_trainer_lora", ROOT / "docs" / "examples" / "hf_trainer_lora.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=V - 1,
        eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _args(out, **kw):
    base = dict(
        output_dir=str(out), per_device_train_batch_size=4, report_to=[], save_strategy="no",
        use_cpu=True, num_train_epochs=1, logging_steps=100, disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**base, **kw})


def test_example_ledger_report_and_model_card(tmp_path):
    trainer = _example().main(str(tmp_path))  # secure randomness: a DP release
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    steps = trainer.state.global_step
    assert steps == ledger.iteration == 4  # 64 examples, expected logical batch 8 x 2 = 16
    assert ledger.verification.complete and ledger.ended == "as planned: 4 of 4 planned releases"
    z = trainer.noise_multiplier
    assert ledger.to_event() == trainer._dp_sampler.privacy_event(z, steps=steps)
    eps = accounting.epsilon(ledger, 1e-5, trainer._dp_method).epsilon
    assert trainer.epsilon() == eps and eps <= 8.0 and abs(eps - 8.0) < 0.05
    assert ledger.metadata["expected_batch_size"] == 16.0
    report = json.loads((tmp_path / "privacy_report.json").read_text())
    assert report["epsilon"] == pytest.approx(eps) and report["delta"] == 1e-5
    assert report["release"].startswith("DP release")
    assert "differential privacy" in (tmp_path / "privacy_report.md").read_text()
    card = (tmp_path / "README.md").read_text()
    privacy = card[card.index("## Privacy") :]
    for text in ("DP release", "Formal statement", "add_or_remove", "Unit of privacy: example",
                 "delta: 1e-05", "Ledger integrity: intact and signed", "`ledger.jsonl`",
                 "poisson"):
        assert text in privacy, text
    assert "PEFT" in card  # peft's own card is kept
    # the Trainer's own logs: no unnoised loss of a private batch, no wall time
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert trainer.state.log_history and not logged & {"loss", "train_loss", "train_runtime"}
    for state in tmp_path.rglob("trainer_state.json"):
        assert '"loss"' not in state.read_text() and "train_loss" not in state.read_text()
    # Only the LoRA parameters were trained (and noised).
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    # what dpfy audit checks beside the replay: the epsilon recorded at close is the file's,
    # the keys are committed and registered, every tensor of the model gets the declared noise
    from dpfy.audit.counts import recorded_epsilon_check
    from dpfy.audit.keys import key_check
    from dpfy.audit.realmodel import model_noise_check

    meta = ledger.metadata
    assert meta["epsilon"] == pytest.approx(eps) and recorded_epsilon_check(ledger) == ()
    assert key_check(meta) == ((), ()) and meta["key_registry"] == "local"
    real = model_noise_check(  # seeded: deterministic
        trainer.model, noise_std=z * meta["clip_norm"], clip_norm=meta["clip_norm"],
        noise_multiplier=z, expected_batch_size=16.0, secure=False)
    assert real.findings == () and real.tensors > 0


class Capturing(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen = getattr(self, "seen", []) + [inputs]
        return super().training_step(model, inputs, num_items_in_batch)


class Ids(torch.utils.data.Dataset):
    def __init__(self, n=24, length=8):
        self.ids = torch.randint(0, V, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_noise_off_update_equals_per_example_clipped_reference(tmp_path):
    model = _gpt2()
    before = copy.deepcopy(model)
    lr, clip = 0.5, 0.1
    args = _args(tmp_path, optim="sgd", learning_rate=lr, max_steps=1, max_grad_norm=0.0,
                 lr_scheduler_type="constant", weight_decay=0.0, per_device_train_batch_size=3,
                 gradient_accumulation_steps=3)
    trainer = Capturing(
        model=model,
        args=args,
        train_dataset=Ids(),
        privacy=PrivacyArguments(
            noise_multiplier=0.0,
            clip_norm=clip,
            randomness=Randomness(2),
        ),
    )
    trainer.train()
    (batch,) = trainer.seen
    assert isinstance(batch, LogicalBatch) and batch.num_rows > 0
    ref = None
    for inputs, weights in batch.chunks:
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        grads = per_example_gradients(before, inputs, labels, causal_lm_loss)
        part = clipped_sum_reference(grads, clip, weights=weights)
        ref = part if ref is None else {n: ref[n] + part[n] for n in ref}
    params = dict(model.named_parameters())
    for name, p0 in before.named_parameters():
        expected = (p0.detach().double() - lr * ref[name].double() / 9.0).float()  # / E[B]
        torch.testing.assert_close(params[name].detach(), expected, rtol=1e-4, atol=1e-6)
    assert trainer.epsilon() == float("inf")  # released without noise: not private


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ()


class OwnSampler(DPTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(self.train_dataset)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(args=dict(train_sampling_strategy="group_by_length")), "group_by_length"),
        (dict(args=dict(gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": True})), "reentrant"),
        (dict(args=dict(gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"preserve_rng_state": True})),
         "reentrant"),  # torch's default with other kwargs: reentrant
        (dict(compute_loss_func=lambda *a, **k: 0.0), "compute_loss_func"),
        (dict(args=dict(label_smoothing_factor=0.1)), "label_smoothing"),
        (dict(cls=OwnSampler), "custom train sampler"),
        (dict(train_dataset=Stream()), "IterableDataset"),
        (dict(target_epsilon=None), "target_epsilon must be given"),
        (dict(train=dict(resume_from_checkpoint=True)), "resume_from_checkpoint"),
    ],
)
def test_refusals_come_before_any_ledger_write(tmp_path, change, match):
    privacy = PrivacyArguments(target_epsilon=change.get("target_epsilon", 4.0),
                               randomness=Randomness(0))
    kw = dict(model=_gpt2(), args=_args(tmp_path, **change.get("args", {})),
              train_dataset=change.get("train_dataset", Ids()), privacy=privacy)
    if "compute_loss_func" in change:
        kw["compute_loss_func"] = change["compute_loss_func"]
    with pytest.raises((ValueError, TypeError), match=match):
        trainer = change.get("cls", DPTrainer)(**kw)
        trainer.train(**change.get("train", {}))
    assert not (tmp_path / "ledger.jsonl").exists()


def test_privacy_arguments_outside_their_record_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"privacy=PrivacyArguments\(target_epsilon="):
        DPTrainer(model=_gpt2(), args=_args(tmp_path), train_dataset=Ids(), target_epsilon=4.0)


def test_bf16_training_arguments_autocast_the_forward_and_keep_fp32(tmp_path):
    """``bf16=True`` runs the forward in bf16 (seen by a hook) and clips and noises in fp32:
    one step stays within 2 % of the same fp32 step (same seed, noise off)."""
    params = {}
    for bf16 in (False, True):
        model = _gpt2()
        dtypes = set()
        model.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda m, i, o, seen=dtypes: seen.add(o.dtype)
        )
        args = _args(tmp_path / str(bf16), optim="sgd", learning_rate=0.5, max_steps=1,
                     max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
                     bf16=bf16)
        trainer = DPTrainer(
            model=model,
            args=args,
            train_dataset=Ids(),
            privacy=PrivacyArguments(
                noise_multiplier=0.0,
                clip_norm=0.1,
                randomness=Randomness(2),
            ),
        )
        trainer.train()
        assert dtypes == {torch.bfloat16 if bf16 else torch.float32}
        assert trainer.ledger.metadata["precision"] == ("bf16" if bf16 else "fp32")
        params[bf16] = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in params[bf16].values())
    start = dict(_gpt2().named_parameters())
    num = sum(float((params[True][n] - params[False][n]).square().sum()) for n in start)
    den = sum(float((params[False][n] - start[n]).square().sum()) for n in start)
    assert 0 < num**0.5 < 0.02 * den**0.5  # the update differs by bf16 rounding only


def test_fp16_training_arguments_refused_with_the_alternative(tmp_path):
    with pytest.raises(ValueError, match=r"fp16=True.*precision='fp16'"):
        DPTrainer(
            model=_gpt2(),
            args=_args(tmp_path, fp16=True),
            train_dataset=Ids(),
            privacy=PrivacyArguments(
                target_epsilon=4.0,
                randomness=Randomness(0),
            ),
        )
    with pytest.raises(ValueError, match=r"precision must be 'bf16'"):
        DPTrainer(
            model=_gpt2(),
            args=_args(tmp_path, bf16=True),
            train_dataset=Ids(),
            privacy=PrivacyArguments(
                target_epsilon=4.0,
                randomness=Randomness(0),
                precision="fp16",
            ),
        )
    trainer = DPTrainer(
        model=_gpt2(),
        args=_args(tmp_path),
        train_dataset=Ids(),
        privacy=PrivacyArguments(
            target_epsilon=4.0,
            randomness=Randomness(0),
            precision="fp16",
        ),
    )
    assert trainer._dp_gradient.loss_scale == 2.0**8
    assert not (tmp_path / "ledger.jsonl").exists()


def test_every_field_the_trainer_writes_is_a_release_public_or_configuration(tmp_path):
    """The Trainer's own files (checkpoints' trainer_state.json, config.json, ...) beside the
    ledger and the privacy report: each field is classified (dpfy.publication.PROVENANCE),
    none is an unnoised statistic of the private batches."""
    from dpfy.publication import unclassified_fields

    privacy = PrivacyArguments(noise_multiplier=1.0, clip_norm=1.0, randomness=Randomness(2))
    counting = _args(tmp_path, include_num_input_tokens_seen=True)
    with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
        DPTrainer(model=_gpt2(), args=counting, train_dataset=Ids(), privacy=privacy)
    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, logging_steps=1)
    trainer = DPTrainer(
        model=_gpt2(), args=args, train_dataset=Ids(), privacy=privacy,
    )
    trainer.train()
    trainer.save_model()
    assert list(tmp_path.glob("checkpoint-*/trainer_state.json"))
    assert unclassified_fields(tmp_path) == []

"""Activation checkpointing (transformers, non-reentrant) with dpfy's per-example norms.

With ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
the hooks record the first forward pass only (the re-run inside backward is not recorded),
so the clipped sum must equal the one without checkpointing and the per-example loop to 1e-5
relative, on a tiny BERT classifier and a tiny GPT-2 (fully trainable: GPT-2's position
embedding sees position ids [1, T]), both through ``accumulate`` and through ``open_chunk``
(the path of ``make_private`` and ``DPTrainer``). Reentrant checkpointing is refused up front.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dpfy.queries.sum import NoPrivacyQuery  # noqa: E402
from dpfy.training import PrivateGradient  # noqa: E402
from dpfy.training.losses import causal_lm_loss, sequence_classification_loss  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)
from dpfy.training.validate import UnsupportedModuleError, validate_module  # noqa: E402

B, T, V = 4, 10, 64
LENGTHS = [10, 7, 4, 9]  # real tokens per example; the rest is right padding


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=V - 1,
        eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _batch(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()
    ids = ids * mask
    if kind == "bert":
        return {"input_ids": ids, "attention_mask": mask}, torch.tensor([0, 2, 1, 2])
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


MODELS = {"bert": (_bert, sequence_classification_loss), "gpt2": (_gpt2, causal_lm_loss)}


def _clipped_sum(model, inputs, labels, loss_fn, clip, path):
    pg = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=B)
    pg.attribution.every = 0  # its alone pass would call the counted layer too
    if path == "accumulate":
        pg.accumulate(inputs, labels, loss_fn)
    else:
        chunk = pg.open_chunk(batch_size=B)
        chunk.accumulate(loss_fn(model(**inputs), labels), torch.ones(B))
    return pg.clipped_sum()


def _close(got, want):
    err = float((got.double() - want.double()).norm())
    assert err <= 1e-5 * float(want.double().norm()) + 1e-12, err


@pytest.mark.parametrize("path", ["accumulate", "open_chunk"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_non_reentrant_checkpointing_matches_plain_and_loop(arch, path):
    make, loss_fn = MODELS[arch]
    torch.manual_seed(0)
    model = make()
    model.train()  # transformers checkpoints only in training mode
    inputs, labels = _batch(arch)
    ref = per_example_gradients(model, inputs, labels, loss_fn)
    norms = sum(g.double().flatten(1).square().sum(1) for g in ref.values()).sqrt()
    clip = float(norms.median())  # about half of the examples are clipped
    want = clipped_sum_reference(ref, clip)
    plain = _clipped_sum(model, inputs, labels, loss_fn, clip, path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_activation_checkpointing
    validate_module(model)  # the non-reentrant variant is accepted
    calls = []
    inner = (  # transformers checkpoints a layer's forward: an inner module's call re-runs
        model.bert.encoder.layer[0].attention.self.query if arch == "bert"
        else model.transformer.h[0].attn.c_attn
    )
    # calls with autograd on: the layout probe's passes run without it
    inner.register_forward_hook(lambda *a: calls.append(1) if torch.is_grad_enabled() else None)
    checkpointed = _clipped_sum(model, inputs, labels, loss_fn, clip, path)
    assert len(calls) == 2  # the forward ran again inside backward: checkpointing was active
    assert set(checkpointed) == set(plain) == set(want)
    for name in want:
        _close(plain[name], want[name])
        _close(checkpointed[name], want[name])


@pytest.mark.parametrize("kwargs", [{"use_reentrant": True}, {"preserve_rng_state": True}])
def test_reentrant_checkpointing_is_refused_up_front(kwargs):
    model = _gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with pytest.raises(UnsupportedModuleError, match="use_reentrant': False"):
        validate_module(model)
    model.gradient_checkpointing_disable()
    validate_module(model)

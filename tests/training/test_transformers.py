"""Pretrained-transformer architectures (tiny configs, no downloads) against the per-example loop.

BERT sequence classification, GPT-2 causal LM (tied input/output embeddings, ``Conv1D``) and
Llama causal LM (RMSNorm, rotary attention), each fully trainable and with peft LoRA, on padded
batches: per-example norms and the clipped sum must equal the naive loop to 1e-5 (fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dpfy.queries.sum import NoPrivacyQuery  # noqa: E402
from dpfy.training import PrivateGradient  # noqa: E402
from dpfy.training.losses import (  # noqa: E402
    causal_lm_loss,
    sequence_classification_loss,
    token_classification_loss,
)
from dpfy.training.norms.capture import plan_modules  # noqa: E402
from dpfy.training.norms.reference import (  # noqa: E402
    clipped_sum_reference,
    per_example_gradients,
)
from dpfy.training.norms.registry import register_unsupported  # noqa: E402

B, T, V = 4, 10, 64
LENGTHS = [10, 7, 4, 9]  # real tokens per example; the rest is right padding


def _close(got, ref, rtol=1e-5):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    assert float((got - ref).norm()) <= rtol * float(ref.norm()) + 1e-12, (got, ref)


def _batch(seed=0, token_types=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = ids * mask  # pad id 0 (BERT's padding_idx)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        inputs["token_type_ids"] = (torch.arange(T) >= 5).long().expand(B, T) * mask
    labels = ids.masked_fill(mask == 0, -100)
    return inputs, labels


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=3,
    )
    return transformers.BertForSequenceClassification(cfg)


def _gpt2(**kw):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=V - 1,
        eos_token_id=V - 1, **kw
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def _lora(model, targets, task, **kw):
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type=task, **kw
    )
    model = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model


CASES = {
    "bert": (_bert, "SEQ_CLS", ["query", "value"], True),
    "gpt2": (_gpt2, "CAUSAL_LM", ["c_attn"], False),
    "llama": (_llama, "CAUSAL_LM", ["q_proj", "v_proj"], False),
}


def _check_exact(model, inputs, labels, loss_fn):
    ref = per_example_gradients(model, inputs, labels, loss_fn)
    ref_sq = sum(g.double().flatten(1).square().sum(1) for g in ref.values())
    clip = float(ref_sq.sqrt().median())  # about half of the examples are clipped
    pg = PrivateGradient(model, NoPrivacyQuery(clip), expected_batch_size=B)
    stats = pg.accumulate(inputs, labels, loss_fn, return_norms=True)
    _close(stats.norms, ref_sq.sqrt())
    got, want = pg.clipped_sum(), clipped_sum_reference(ref, clip)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])
    return pg


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_norms_and_clipped_sum_match_loop(arch, lora):
    torch.manual_seed(0)
    build, task, targets, token_types = CASES[arch]
    model = build()
    if lora:
        model = _lora(model, targets, task)
    model.eval()  # dropout off: the loop and the batch see the same function
    inputs, labels = _batch(token_types=token_types)
    if arch == "bert":
        labels = torch.tensor([0, 2, 1, 2])
        loss_fn = sequence_classification_loss
    else:
        loss_fn = causal_lm_loss
    pg = _check_exact(model, inputs, labels, loss_fn)
    planned = [p.name for p in pg.plans_]
    if lora:  # the frozen base is not captured: only LoRA factors (and modules_to_save)
        assert all("lora_" in n or "modules_to_save" in n for n in planned), planned
        assert any("lora_A" in n for n in planned)
    else:
        assert all(p.rule is not None for p in pg.plans_), [
            (p.name, type(p.module).__name__) for p in pg.plans_ if p.rule is None
        ]
    if arch == "gpt2" and not lora:
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        assert "lm_head" in planned and "lm_head.weight" not in pg.param_names_


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_forced_modes_match_loop(mode, lora, monkeypatch):
    """Both ways of the cost choice, for Conv1D (transposed weight) and LoRA factors."""
    import dpfy.training.norms.linear as linear_module

    monkeypatch.setattr(linear_module, "choose_mode", lambda *args: mode)
    torch.manual_seed(3)
    model = _lora(_gpt2(), ["c_attn", "c_fc"], "CAUSAL_LM") if lora else _gpt2()
    inputs, labels = _batch(seed=3)
    _check_exact(model.eval(), inputs, labels, causal_lm_loss)


def test_choose_mode_by_cost_and_memory():
    from dpfy.training.norms.linear import choose_mode

    assert choose_mode(8, 1, 16, 768, 768, 4) == "ghost"  # short sequence, wide layer
    assert choose_mode(8, 1, 1024, 768, 768, 4) == "materialize"  # long sequence
    assert choose_mode(8, 1, 128, 768, 8, 4) == "materialize"  # LoRA factor d x r
    assert choose_mode(8, 1, 128, 768, 50257, 4) == "ghost"  # LM head: N V d too large
    assert choose_mode(2, 1, 16384, 64, 64, 4) == "materialize"  # T^2 Grams too large


def test_padding_contributes_nothing():
    torch.manual_seed(1)
    model = _llama().eval()
    inputs, labels = _batch()
    losses = causal_lm_loss(model(**inputs), labels)
    # changing the tokens under padding changes no loss and no gradient norm
    padded = inputs["attention_mask"] == 0
    other = dict(inputs, input_ids=inputs["input_ids"].masked_fill(padded, 5))
    assert torch.equal(losses, causal_lm_loss(model(**other), labels))
    pg = PrivateGradient(model, NoPrivacyQuery(), expected_batch_size=B)
    n1 = pg.accumulate(inputs, labels, causal_lm_loss, return_norms=True).norms
    n2 = pg.accumulate(other, labels, causal_lm_loss, return_norms=True).norms
    _close(n1, n2, rtol=1e-6)


def test_loss_helpers():
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, 2, -100, -100], [-100, -100, -100, -100]])
    per_ex = token_classification_loss(logits, labels)
    manual = nn.functional.cross_entropy(logits[0, :2], labels[0, :2])
    assert torch.allclose(per_ex[0], manual) and per_ex[1] == 0
    summed = token_classification_loss(logits, labels, reduction="sum")
    assert torch.allclose(summed[0], 2 * manual)
    shifted = causal_lm_loss((logits,), torch.tensor([[0, 1, 2, -100], [3, 4, -100, -100]]))
    assert torch.allclose(shifted[1], nn.functional.cross_entropy(logits[1, :1], labels.new([4])))
    reg = sequence_classification_loss(torch.ones(3, 1), torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(reg, torch.tensor([0.0, 1.0, 4.0]))
    with pytest.raises(ValueError, match="reduction"):
        token_classification_loss(logits, labels, reduction="max")  # type: ignore[arg-type]


def test_gradient_checkpointing_is_exact_and_not_double_counted():
    torch.manual_seed(2)
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model.gradient_checkpointing_enable()
    model.train()  # transformers checkpoints only in training mode
    assert model.transformer.h[0].gradient_checkpointing
    inputs, labels = _batch()
    _check_exact(model, inputs, labels, causal_lm_loss)
    lora = _lora(_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), ["c_attn"], "CAUSAL_LM")
    lora.gradient_checkpointing_enable()
    lora.train()
    _check_exact(lora, inputs, labels, causal_lm_loss)


def test_reentrant_checkpointing_is_refused():
    model = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    # refused when the step is built (dpfy.training.validate), before any batch is seen
    with pytest.raises(ValueError, match="use_reentrant"):
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=B)


class _Scaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return x * self.scale


class _Odd(_Scaler):
    pass


def test_unsupported_layer_is_refused_when_the_step_is_built():
    model = _llama()
    model.model.layers[0].post_attention_layernorm = _Scaler()  # no norm rule
    plans = plan_modules(model)
    assert [p.rule for p in plans if isinstance(p.module, _Scaler)] == [None]  # vmap fallback
    where = r"'model\.layers\.0\.post_attention_layernorm' \(_Scaler\)"
    with pytest.raises(ValueError, match=where):
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=B, fallback="error")
    register_unsupported(_Odd, reason="it is odd; freeze it")
    model.model.layers[1].post_attention_layernorm = _Odd()
    with pytest.raises(ValueError, match=r"layers\.1\.post_attention_layernorm' \(_Odd\).*odd"):
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=B)
    model.model.layers[1].post_attention_layernorm.scale.requires_grad_(False)
    PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=B)  # frozen: fine

"""The mean-pooled classification head: pooling, zero start, per-example independence."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dpfy.hf.heads import MeanPooledClassifier, mean_pool  # noqa: E402


def test_mean_pool_ignores_padding_and_empty_rows():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    pooled = mean_pool(hidden, mask)
    assert torch.equal(pooled[0], hidden[0, :2].mean(0))
    assert torch.equal(pooled[1], torch.zeros(2))  # no attended token: zeros, not NaN
    assert torch.equal(mean_pool(hidden, None), hidden.mean(1))


def _tiny_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertModel(cfg, add_pooling_layer=False)


def test_head_starts_at_zero_and_rows_do_not_mix():
    model = MeanPooledClassifier(_tiny_bert(), 16, num_labels=3)
    ids = torch.randint(0, 50, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = 0
    assert torch.equal(model(ids, attention_mask=mask).logits, torch.zeros(4, 3))
    torch.nn.init.normal_(model.head.weight)
    full = model(ids, attention_mask=mask).logits
    alone = model(ids[1:2], attention_mask=mask[1:2]).logits
    assert torch.allclose(full[1], alone[0], atol=1e-5)
    # padded positions do not change the logits
    ids2 = ids.clone()
    ids2[1, 3:] = 7
    assert torch.allclose(model(ids2, attention_mask=mask).logits[1], full[1], atol=1e-5)


def test_private_gradient_matches_naive_loop_on_the_pooled_head():
    from dpfy.queries import GaussianSumQuery
    from dpfy.training.losses import sequence_classification_loss
    from dpfy.training.step import PrivateGradient

    model = MeanPooledClassifier(_tiny_bert(), 16, num_labels=2)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    ids = torch.randint(0, 50, (5, 6))
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[2, 4:] = 0
    y = torch.randint(0, 2, (5,))
    clip = 0.05
    pg = PrivateGradient(model, GaussianSumQuery(clip, 1.0), expected_batch_size=5)
    pg.accumulate({"input_ids": ids, "attention_mask": mask}, y, sequence_classification_loss)
    got = pg.clipped_sum()
    params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    want = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(5):
        model.zero_grad()
        out = model(ids[i : i + 1], attention_mask=mask[i : i + 1])
        sequence_classification_loss(out, y[i : i + 1]).sum().backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params.values()))
        factor = min(1.0, clip / float(norm))
        for n, p in params.items():
            want[n] += factor * p.grad
    for n in params:
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7), n

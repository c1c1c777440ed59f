"""The mean-pooled classification head: pooling, zero start, per-example independence."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dpfy.models.heads import MeanPooledClassifier, mean_pool  # noqa: E402


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


def test_cutting_shared_padding_leaves_the_clipped_sum_unchanged():
    """trim_padding is exact: the padded and the cut chunk give the same clipped sum."""
    from dpfy.queries import GaussianSumQuery
    from dpfy.training.losses import sequence_classification_loss
    from dpfy.training.step import PrivateGradient
    from dpfy.training.text import trim_padding

    model = MeanPooledClassifier(_tiny_bert(), 16, num_labels=2)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    ids = torch.randint(1, 50, (4, 12))
    mask = torch.zeros(4, 12, dtype=torch.long)
    for row, length in enumerate((3, 7, 5, 2)):
        mask[row, :length] = 1
    ids = ids * mask  # right padding with id 0, as the tokenizer pads
    y = torch.tensor([0, 1, 1, 0])
    padded = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}
    cut = trim_padding(padded)
    assert all(v.shape == (4, 7) for v in cut.values())
    assert torch.equal(cut["input_ids"], ids[:, :7])
    sums = []
    for batch in (padded, cut):
        pg = PrivateGradient(model, GaussianSumQuery(0.05, 1.0), expected_batch_size=4)
        pg.accumulate(batch, y, sequence_classification_loss)
        sums.append(pg.clipped_sum())
    for name in sums[0]:
        assert torch.allclose(sums[0][name], sums[1][name], rtol=1e-5, atol=1e-7), name
    # nothing to cut: the very same tensors come back; no mask: untouched
    full = {"input_ids": ids[:, :7], "attention_mask": torch.ones(4, 7, dtype=torch.long)}
    assert trim_padding(full) is full
    assert trim_padding({"x": ids}) == {"x": ids}


def test_token_dataset_orders_by_length_and_collates_cut():
    import numpy as np

    from dpfy.training.text import TokenDataset, collate_trimmed

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    data = TokenDataset({"input_ids": mask * 5, "attention_mask": mask}, torch.tensor([0, 1, 0]))
    assert data.lengths().tolist() == [3, 1, 2]
    ordered = data.reordered(np.argsort(data.lengths().numpy(), kind="stable"))
    assert ordered.lengths().tolist() == [1, 2, 3]
    assert ordered.labels.tolist() == [1, 0, 0]
    batch = collate_trimmed([ordered[0], ordered[1]])
    assert batch["input_ids"].shape == (2, 2) and batch["labels"].tolist() == [1, 0]

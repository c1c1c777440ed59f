"""Position ids [1, T] broadcast over the batch, through make_private's open chunk.

A model that embeds ``arange(T)[None]`` once and adds it to every row (GPT-2 does so when no
``position_ids`` are given) calls its position embedding on a batch-1 input. The chunk that
make_private opens must know the physical batch size so that call is recorded per example:
the clipped sum must equal the per-example loop (to 1e-5 relative), padding rows included.
A module called on batch-1 slices more than once in one forward (a per-example loop in the
model) cannot be read so, and is refused before its backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import dpfy
from dpfy.randomness import Randomness
from dpfy.training import PrivateOptions
from dpfy.training.losses import causal_lm_loss
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients

V, T, N = 32, 8, 12


class Tokens(Dataset):
    """Right-padded token rows (lengths 3..7) with causal-LM labels (-100 on padding)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        mask = (torch.arange(T) < 3 + i % 5).long()
        ids = torch.randint(1, V, (T,), generator=g) * mask
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}


class PositionLM(nn.Module):
    """Token + learned position embeddings (positions [1, T], broadcast), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, 8)
        self.pos = nn.Embedding(T, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, V)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)  # [1, T]
        h = self.tok(input_ids) + self.pos(positions)
        h = self.norm(h) * attention_mask.unsqueeze(-1)
        return self.head(h)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=T, bos_token_id=V - 1,
        eos_token_id=V - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _first_chunk_matches_loop(model: nn.Module, forward) -> None:
    clip = 0.5
    private = dpfy.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Tokens(),
        target_epsilon=4.0,
        delta=1e-5,
        epochs=1,
        clip_norm=clip,
        expected_batch_size=6,
        loss_fn=causal_lm_loss,
        randomness=Randomness(0),
        options=PrivateOptions(
            max_physical_batch_size=4,
        ),
    )
    model, optimizer, criterion, loader = private
    batches = iter(loader)
    batch = next(batches)
    labels = batch.pop("labels")
    criterion(forward(model, batch), labels).backward()
    engine = optimizer._engine
    got = engine.pg.clipped_sum()
    ref = per_example_gradients(model, batch, labels, causal_lm_loss)
    want = clipped_sum_reference(ref, clip, weights=engine.weights)
    assert set(got) == set(want) and any(n.endswith("pos.weight") or "wpe" in n for n in got)
    for name, w in want.items():
        err = float((got[name].double() - w).norm())
        assert err <= 1e-5 * float(w.norm()) + 1e-12, name
    batches.close()


def test_broadcast_position_embedding_is_per_example():
    torch.manual_seed(0)
    _first_chunk_matches_loop(PositionLM(), lambda m, b: m(**b))


def test_gpt2_default_position_ids_are_per_example():
    torch.manual_seed(0)
    _first_chunk_matches_loop(_gpt2(), lambda m, b: m(**b))


class LoopedHead(nn.Module):
    """A per-example loop written in forward: the head is called on x[i:i+1] for each i."""

    def __init__(self, concatenate: bool) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.concatenate = concatenate

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.concatenate:
            return torch.cat([self.head(h[i : i + 1]) for i in range(h.shape[0])])
        out = torch.zeros(h.shape[0], 3)
        for i in range(h.shape[0]):
            out = out + self.head(h[i : i + 1]) * (torch.arange(h.shape[0]) == i)[:, None]
        return out



@pytest.mark.parametrize("concatenate", [False, True])
def test_per_example_loop_in_forward_is_refused_before_backward(concatenate):
    # Read as one shared call, the head's batch-1 calls were widened to the batch and each
    # example's gradient took other examples' rows (one example moved the clipped sum by 1.10 C).
    from dpfy.queries import GaussianSumQuery
    from dpfy.training import PrivateGradient

    torch.manual_seed(0)
    model = LoopedHead(concatenate)
    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=4.0)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=r"module 'head' \(Linear\) was called more than once"):
        pg.accumulate(x, y, nn.CrossEntropyLoss(reduction="none"))
    assert all(p.grad is None for p in model.parameters())
    # a batch of one is one example: nothing to attribute, and it matches the loop
    pg.reset()
    pg.accumulate(x[:1], y[:1], nn.CrossEntropyLoss(reduction="none"))

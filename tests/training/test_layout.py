"""Which dimension is the batch: decided by reordering the examples, not by sizes.

A registered rule reads dimension 0 of its input as the batch and the generic rule maps over
every argument with B rows. Both readings fail silently when a size coincides with the batch
size B: a time-major input [T, B, d] with T == B, a shared codebook with B rows
(``dpfy.training.norms.layout``). Each case is compared with the naive per-example loop in
float64, or must be refused (naming the module) before anything is released.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dpfy.queries import GaussianSumQuery
from dpfy.training import PrivateGradient
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients

CLIP = 0.5


class TimeMajorLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, 3]
        h = self.inp(x.transpose(0, 1))  # time-major [T, B, 4]
        return self.head(torch.tanh(h).mean(0))


class TimeMajorEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T]
        return self.head(self.emb(ids.t().contiguous()).mean(0))  # ids [T, B]


class BatchFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, 3]
        return self.head(torch.tanh(self.inp(x)).mean(1))


class Quantise(nn.Module):
    """A user layer (generic rule) given a tensor shared by every example: the codebook."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) @ book.T


class Codebook(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.register_buffer("book", torch.randn(k, 3))
        self.q = Quantise()
        self.head = nn.Linear(k, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.q(x, self.book)))


def _loss() -> nn.Module:
    return nn.CrossEntropyLoss(reduction="none")


def _error(pg: PrivateGradient, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    pg.reset()
    pg.accumulate(x, y, _loss())
    got = pg.clipped_sum()
    want = clipped_sum_reference(per_example_gradients(model, x, y, _loss()), CLIP)
    return max(
        float((got[n].double() - w).norm() / (w.norm() + 1e-30)) for n, w in want.items()
    )


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)


def _pg(model: nn.Module) -> PrivateGradient:
    return PrivateGradient(model, GaussianSumQuery(CLIP, 1.0), expected_batch_size=5.0)


@pytest.mark.parametrize(
    ("model", "x", "name"),
    [
        (TimeMajorLinear, lambda: torch.randn(5, 5, 3), "'inp' (Linear)"),
        (TimeMajorEmbedding, lambda: torch.randint(0, 11, (5, 5)), "'emb' (Embedding)"),
    ],
)
def test_time_major_with_sequence_length_equal_to_the_batch_is_refused(model, x, name):
    # sizes alone read [T, B, d] with T == B as batch-first: each example's gradient then took
    # one time step of every example (one example moved the clipped sum by 2.38 C)
    model = model()
    pg = _pg(model)
    refusal = rf"module {re.escape(name)} got an input .*dimension is 1, not 0"
    with pytest.raises(ValueError, match=refusal):
        pg.accumulate(x(), torch.randint(0, 2, (5,)), _loss())
    assert all(p.grad is None for p in model.parameters())


def test_batch_first_with_sequence_length_equal_to_the_batch_is_exact_and_probed_once():
    model = BatchFirst()
    pg = _pg(model)
    pg.attribution.every = 0  # its alone pass would be counted too
    x, y = torch.randn(5, 5, 3), torch.randint(0, 2, (5,))
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    pg.accumulate(x, y, _loss())
    assert len(calls) == 3  # the chunk and the probe's two passes (in order, rotated)
    pg.accumulate(x, y, _loss())
    assert len(calls) == 4  # pinned: the next chunk is not probed again
    handle.remove()
    assert _error(pg, model, x, y) < 1e-10


def test_a_shared_codebook_with_as_many_rows_as_the_batch_is_exact():
    # every argument with B rows was mapped over as if per example: wrong (refused by the
    # coverage check when it coincided on the first chunk, wrong on later ones)
    model = Codebook(5)
    pg = _pg(model)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    assert _error(pg, model, x, y) < 1e-10


def test_a_coincidence_on_a_later_chunk_keeps_the_first_chunks_answer():
    # Poisson sampling: the first chunk has 7 rows, a later one as many as the codebook (5)
    model = Codebook(5)
    pg = _pg(model)
    assert _error(pg, model, torch.randn(7, 3), torch.randint(0, 2, (7,))) < 1e-10
    assert _error(pg, model, torch.randn(5, 3), torch.randint(0, 2, (5,))) < 1e-10
    assert pg._layouts.generic  # decided on the first chunk, pinned


def test_the_probe_leaves_modes_and_random_streams_as_they_were():
    model = nn.Sequential(BatchFirst(), nn.Dropout(0.3))
    model.train()
    pg = _pg(model)
    x, y = torch.randn(5, 5, 3), torch.randint(0, 2, (5,))
    plain = _pg(nn.Sequential(BatchFirst(), nn.Dropout(0.3)))
    plain._layouts.unavailable = True  # no probe
    torch.manual_seed(3)
    pg.accumulate(x, y, _loss())
    after_step = torch.rand(1)
    torch.manual_seed(3)
    plain.accumulate(x, y, _loss())
    assert torch.equal(torch.rand(1), after_step)
    assert all(m.training for m in model.modules())


def test_open_chunk_callers_are_probed_through_their_model_call():
    model = TimeMajorLinear()
    pg = _pg(model)
    x, y = torch.randn(5, 5, 3), torch.randint(0, 2, (5,))
    chunk = pg.open_chunk(batch_size=5)
    losses = _loss()(model(x), y)
    with pytest.raises(ValueError, match="batch dimension is 1"):
        chunk.accumulate(losses)

"""dpfy.training.loader: any map-style Dataset, fixed-shape padded chunks, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dpfy.queries import GaussianSumQuery
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training.data import accumulate_logical_batch
from dpfy.training.loader import (
    REFUSAL,
    DatasetBatcher,
    PrivateBatchSampler,
    check_dataset,
    check_sampler,
    chunk_rows,
    split_batch,
)
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

LOSS = nn.CrossEntropyLoss(reduction="none")
VOCAB, LENGTH = 11, 6


class Tokens(Dataset):
    """A tokenizer's output: padded ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g) * self.mask
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Pooled(nn.Module):
    """forward(input_ids, attention_mask): masked mean of embeddings, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled)


def _per_example_clipped_sum(model, items, clip):
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for item in items:
        model.zero_grad()
        out = model(item["input_ids"][None], item["attention_mask"][None])
        LOSS(out, item["labels"][None]).sum().backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        w = min(1.0, clip / float(norm))
        for n, p in model.named_parameters():
            total[n] += w * p.grad
    return total


def test_dict_dataset_chunks_are_padded_and_padding_contributes_nothing():
    data = Tokens()
    batcher = DatasetBatcher(data, max_physical_batch_size=4)
    indices = np.array([3, 7, 1, 30, 12, 5])
    chunks = list(batcher.chunks(indices))
    assert [c.count for c in chunks] == [4, 2]
    for c in chunks:
        assert set(c.inputs) == {"input_ids", "attention_mask"}
        assert c.inputs["input_ids"].shape == (4, LENGTH) and c.targets.shape == (4,)
    assert chunks[1].weights.tolist() == [1.0, 1.0, 0.0, 0.0]
    model = Pooled()
    pg = PrivateGradient(model, GaussianSumQuery(0.3, 1.0), expected_batch_size=6)
    accumulate_logical_batch(pg, batcher, indices, LOSS)  # model(**inputs)
    got = pg.clipped_sum()
    want = _per_example_clipped_sum(model, [data[int(i)] for i in indices], 0.3)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def test_forward_callable_and_split_conventions():
    x = torch.randn(5, 3)
    assert split_batch(x) == (x, None)
    assert split_batch([x, 1]) == (x, 1)
    assert split_batch((x, x, 2)) == ((x, x), 2)
    inputs, y = split_batch({"a": x, "labels": 3})
    assert set(inputs) == {"a"} and y == 3
    model = nn.Linear(3, 2)
    seen = []

    def forward(m, inputs):
        seen.append(type(inputs))
        return m(inputs["features"])

    pg = PrivateGradient(model, GaussianSumQuery(1.0, 1.0), expected_batch_size=5, forward=forward)
    pg.accumulate({"features": x}, torch.zeros(5, dtype=torch.long), LOSS)
    assert seen and set(seen) == {dict}  # the chunk's call (and the attribution check's)


def test_chunk_rows_fixed_shapes():
    assert [c for _, c in chunk_rows(np.arange(5), 2, None)] == [2, 2, 1]
    assert [len(r) for r, _ in chunk_rows(np.arange(5), None, 8)] == [8]
    rows, count = chunk_rows(np.array([], dtype=np.int64), None, None)[0]
    assert count == 0 and rows.tolist() == [0]  # one padding row of a valid index
    assert len(chunk_rows(np.arange(3), 2, 8)) == 4  # truncating sampler: fixed pass count


def _trained(x, y, data, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    sampler = PoissonSampler(len(x), 0.2, randomness=Randomness(1))
    PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        LOSS,
        *data,
        sampler,
        **kw,
        options=TrainerOptions(
            clip_norm=0.5,
            epochs=1,
            delta=1e-5,
            noise_multiplier=1.0,
            max_physical_batch_size=4,
            randomness=Randomness(2),
        ),
    ).fit()
    return [p.detach().clone() for p in model.parameters()]


def test_trainer_on_a_dataset_of_tuples_equals_the_tensor_fast_path():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randint(0, 2, (40,), generator=g)
    fast = _trained(x, y, (x, y))
    for data in (TensorDataset(x, y), [(x[i], y[i]) for i in range(len(x))]):
        for a, b in zip(fast, _trained(x, y, (data, None)), strict=True):
            torch.testing.assert_close(a, b)


def test_trainer_on_a_dict_dataset():
    data = Tokens(30)
    model = Pooled()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = PrivateTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        LOSS,
        data,
        None,
        PoissonSampler(len(data), 0.2, randomness=Randomness(0)),
        options=TrainerOptions(
            clip_norm=1.0,
            epochs=1,
            delta=1e-5,
            noise_multiplier=1.0,
            max_physical_batch_size=4,
            randomness=Randomness(1),
        ),
    ).fit()
    assert result.steps == 5 and result.ledger.iteration == 5
    assert set(model.state_dict()) == set(before)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_refusals_name_the_reason():
    x = torch.randn(10, 2)
    with pytest.raises(TypeError, match="IterableDataset") as err:
        check_dataset(Stream())
    assert REFUSAL in str(err.value)
    with pytest.raises(TypeError, match="DataLoader") as err:
        check_dataset(DataLoader(TensorDataset(x), batch_size=2))
    assert REFUSAL in str(err.value)
    with pytest.raises(TypeError, match="sampler must be a dpfy.sampling sampler"):
        check_sampler(torch.utils.data.RandomSampler(range(10)), 10)
    with pytest.raises(ValueError, match="dataset_size"):
        check_sampler(PoissonSampler(9, 0.5), 10)
    with pytest.raises(TypeError, match="IterableDataset"):
        PrivateTrainer(
            nn.Linear(2, 2),
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1),
            LOSS,
            Stream(),
            None,
            PoissonSampler(3, 0.5),
            options=TrainerOptions(
                clip_norm=1.0,
                epochs=1,
                delta=1e-5,
                noise_multiplier=1.0,
            ),
        ).fit()


def test_batch_sampler_queues_chunk_infos_in_order():
    bs = PrivateBatchSampler(
        PoissonSampler(50, 0.2, randomness=Randomness(0)), max_physical_batch_size=4
    )
    lists = list(bs)
    assert len(lists) == len(bs.infos) and all(len(r) == 4 for r in lists)
    assert sum(i.count for i in bs.infos) == sum(
        len(b) for b in PoissonSampler(50, 0.2, randomness=Randomness(0)).batches(0)
    )
    assert sum(i.last for i in bs.infos) == len(bs) == 5

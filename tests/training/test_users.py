"""User-level DP-SGD (dpfy.training.users): the clipped unit is one user's data.

Oracles: a naive per-user loop (per-example gradients by one backward pass each, summed or
averaged per user, clipped, summed, divided by the expected number of users), the add/remove
sensitivity measured by removing every example of one user, and the report's wording.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpfy.ledger import Ledger
from dpfy.ledger.hyperparameters import ledger_hyperparameters
from dpfy.queries.sum import NoPrivacyQuery
from dpfy.randomness import Randomness
from dpfy.report import build_report
from dpfy.sampling import make_sampler
from dpfy.training.data import accumulate_logical_batch
from dpfy.training.step import PrivateGradient
from dpfy.training.trainer import TrainerOptions
from dpfy.training.users import (
    UserBatcher,
    UserLevelTrainer,
    check_user_ids,
    group_by_user,
    private_facts,
    synthetic_user_ids,
)

torch.set_num_threads(1)

C = 0.5
N_EX = 60


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_EX, 5, generator=g)
    y = torch.randint(0, 3, (N_EX,), generator=g)
    ids = np.random.default_rng(seed).integers(0, 9, N_EX) * 7 + 3  # 9 users, sparse ids
    return x, y, ids


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


LOSS = nn.CrossEntropyLoss(reduction="none")


def _naive(model, x, y, layout, users, reduction, clip):
    """Per-user reduced gradient by one backward pass per example, clipped, summed."""
    out = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for u in users:
        rows = layout.slots[u][layout.slots[u] >= 0]
        g = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        for i in rows:
            model.zero_grad()
            LOSS(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
            for k, p in model.named_parameters():
                g[k] += p.grad / (len(rows) if reduction == "mean" else 1.0)
        norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values()))
        w = min(1.0, clip / norm) if norm > 0 else 1.0
        for k in out:
            out[k] += w * g[k]
    model.zero_grad()
    return out


def _trainer(model, x, y, ids, *, cap=None, reduction="sum", users_per_batch=3, z=1.0,
             physical=8, **kw):
    layout_users = len(np.unique(ids))
    sampler = make_sampler("poisson", layout_users, users_per_batch, randomness=Randomness(1),
                           unit="user")
    return UserLevelTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        LOSS,
        x,
        y,
        sampler,
        user_ids=ids,
        max_examples_per_user=cap,
        reduction=reduction,
        layout_randomness=Randomness(3),
        **kw,
        options=TrainerOptions(
            clip_norm=C,
            epochs=1,
            delta=1e-3,
            noise_multiplier=z,
            randomness=Randomness(2),
            max_physical_batch_size=physical,
        ),
    )


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cap", [None, 3])
def test_noise_off_release_equals_naive_per_user_reference(reduction, cap):
    x, y, ids = _data()
    model = _model()
    layout = group_by_user(ids, max_examples_per_user=cap, randomness=Randomness(3))
    expected_users = 2.5
    pg = PrivateGradient(model, NoPrivacyQuery(C), expected_batch_size=expected_users *
                         layout.cap, microbatch_size=layout.cap, microbatch_mode="sum")
    batcher = UserBatcher(x, y, layout, users_per_chunk=2, reduction=reduction)
    users = np.array([0, 2, 3, 5, 8])
    if reduction == "mean":
        def loss_fn(out, t):
            return LOSS(out, t) * batcher.row_scale
    else:
        loss_fn = LOSS
    accumulate_logical_batch(pg, batcher, users, loss_fn)
    ledger = Ledger()
    sid = ledger.record_sample(make_sampler("poisson", layout.num_users, 2,
                                            unit="user").sample_spec())
    pg.release(ledger=ledger, sample_id=sid, randomness=Randomness(0))
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    ref = _naive(model, x, y, layout, users, reduction, C)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k] / expected_users, atol=1e-5, rtol=1e-5)
    if cap is not None:  # the cap bit: some users had more than 3 examples
        assert layout.users_capped > 0
        assert layout.counts.max() == 3


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_trainer_pre_noise_gradient_equals_naive_reference(reduction):
    x, y, ids = _data(1)
    model = _model()
    tr = _trainer(model, x, y, ids, cap=4, reduction=reduction)
    tr._setup()
    users = np.array([1, 4, 6, 7])
    accumulate_logical_batch(tr.private_gradient_, tr.batcher_, users, tr.loss_fn)
    pg = tr.private_gradient_
    assert pg.denominator_ == pytest.approx(tr.sampler.expected_batch_size)
    got = {k: v / pg.denominator_ for k, v in pg.clipped_sum().items()}
    ref = _naive(model, x, y, tr.layout, users, reduction, C)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k] / tr.sampler.expected_batch_size,
                                   atol=1e-5, rtol=1e-5)


def _pre_noise_sum(model, x, y, ids, users):
    tr = _trainer(model, x, y, ids, physical=64)
    tr._setup()
    accumulate_logical_batch(tr.private_gradient_, tr.batcher_, users, tr.loss_fn)
    return torch.cat([v.reshape(-1) for v in tr.private_gradient_.clipped_sum().values()])


def test_removing_one_user_moves_the_sum_by_at_most_the_recorded_sensitivity():
    x, y, ids = _data(2)
    model = _model()
    with torch.no_grad():  # large weights: every user's summed gradient exceeds C
        for p in model.parameters():
            p.mul_(6.0)
    tr = _trainer(model, x, y, ids, z=1.0)
    tr.fit(max_steps=1)
    recorded = ledger_hyperparameters(tr.ledger)["l2_sensitivity_per_query"]["gradient"]
    assert recorded == [C]
    uniq = np.unique(ids)
    everyone = np.arange(len(uniq))
    full = _pre_noise_sum(model, x, y, ids, everyone)
    for u in range(len(uniq)):
        keep = ids != uniq[u]  # D': every example of user u removed
        others = np.arange(len(uniq) - 1)  # the same users, renumbered without u
        without = _pre_noise_sum(model, x[keep], y[keep], ids[keep], others)
        moved = float((full - without).norm())
        assert moved <= C * (1 + 1e-5)
        assert moved == pytest.approx(C, rel=1e-4)  # the user's sum exceeds C: equality
    # a small user sum moves it by its own norm, below C
    model2 = _model()
    with torch.no_grad():
        for p in model2.parameters():
            p.mul_(0.01)
    full2 = _pre_noise_sum(model2, x, y, ids, everyone)
    keep = ids != uniq[0]
    without2 = _pre_noise_sum(model2, x[keep], y[keep], ids[keep], np.arange(len(uniq) - 1))
    assert 0 < float((full2 - without2).norm()) < C


def test_ledger_and_report_speak_of_users_everywhere():
    x, y, ids = _data(3)
    tr = _trainer(_model(), x, y, ids, cap=4)
    result = tr.fit()
    ledger = result.ledger
    assert ledger.unit == "user"
    assert {r.spec.unit for r in ledger.samples} == {"user"}
    assert {r.spec.dataset_size for r in ledger.samples} == {9}
    facts = ledger.metadata["user_level"]
    assert facts["num_users"] == 9 and facts["max_examples_per_user"] == 4
    # counts, the largest user, how many were capped and the layout's hash: private
    private = {"num_examples", "num_examples_used", "largest_user", "users_capped",
               "layout_sha256"}
    assert not private & set(facts)
    kept = private_facts(tr)["user_level"]
    assert set(kept) == private and kept["num_examples"] == N_EX
    assert kept["num_examples_used"] == int(np.minimum(np.bincount(ids)[ids.min()::7], 4).sum())
    rep = build_report(ledger, delta=1e-3)
    assert rep.unit_of_privacy == "user"
    assert "at the level of one user" in rep.formal_statement
    assert "each user is included" in rep.assumptions[0]
    assert rep.user_level["num_users"] == 9
    assert "N = 9 users" in rep.user_level["delta_vs_1_over_n"]
    ex = rep.user_level["example_level"]
    assert ex["epsilon"] >= rep.epsilon  # the example-level reading is a group bound
    assert "group privacy" in ex["derivation"]
    md = rep.to_markdown()
    assert "unit of privacy: user" in md
    assert "(N = 9 users)" in md
    assert "## Unit of privacy: one user" in md
    assert "Example level (group privacy" in md
    assert "each example" not in md


@pytest.mark.parametrize(
    ("ids", "exc", "needle"),
    [
        (None, ValueError, "user_ids is missing"),
        (np.linspace(0, 5, N_EX), TypeError, "integer"),
        (np.array(["a"] * N_EX), TypeError, "integer"),
        (np.ones(N_EX, dtype=bool), TypeError, "integer"),
        (torch.zeros(N_EX), TypeError, "integer"),
        (np.zeros(N_EX - 1, dtype=np.int64), ValueError, f"must be {N_EX}"),
        (np.zeros((N_EX, 2), dtype=np.int64), ValueError, "one-dimensional"),
    ],
)
def test_bad_user_ids_refused_before_anything_runs(ids, exc, needle):
    x, y, _ = _data()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    sampler = make_sampler("poisson", 9, 3, randomness=Randomness(1), unit="user")
    ledger = Ledger()
    with pytest.raises(exc, match=needle):
        UserLevelTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            x,
            y,
            sampler,
            user_ids=ids,
            options=TrainerOptions(
                clip_norm=C,
                epochs=1,
                delta=1e-3,
                noise_multiplier=1.0,
                ledger=ledger,
            ),
        )
    assert ledger.iteration == 0 and not ledger.entries
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("cap", "needle"), [(0, "max_examples_per_user"),
                                             (-2, "max_examples_per_user"),
                                             (1.5, "max_examples_per_user")])
def test_bad_cap_refused(cap, needle):
    x, y, ids = _data()
    with pytest.raises(ValueError, match=needle):
        _trainer(_model(), x, y, ids, cap=cap)
    with pytest.raises(ValueError, match=needle):
        group_by_user(ids, max_examples_per_user=cap)


def test_sampler_must_draw_the_users_with_their_unit():
    x, y, ids = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = TrainerOptions(clip_norm=C, epochs=1, delta=1e-3, noise_multiplier=1.0)
    common = dict(options=options, user_ids=ids)
    with pytest.raises(ValueError, match="unit='user'"):
        UserLevelTrainer(model, opt, LOSS, x, y, make_sampler("poisson", 9, 3), **common)
    with pytest.raises(ValueError, match="9 users"):
        UserLevelTrainer(model, opt, LOSS, x, y,
                         make_sampler("poisson", N_EX, 3, unit="user"), **common)
    with pytest.raises(ValueError, match="reduction"):
        UserLevelTrainer(model, opt, LOSS, x, y, make_sampler("poisson", 9, 3, unit="user"),
                         reduction="median", **common)


def test_grouping_layout_and_cap_subsets():
    ids = np.array([5, 2, 5, 5, 9, 2, 5])
    full = group_by_user(ids)
    assert full.ids.tolist() == [2, 5, 9] and full.cap == 4 and full.users_capped == 0
    assert full.slots.tolist() == [[1, 5, -1, -1], [0, 2, 3, 6], [4, -1, -1, -1]]
    capped = group_by_user(ids, max_examples_per_user=2, unit="movie",
                           randomness=Randomness(0))
    assert capped.unit == "movie" and capped.users_capped == 1 and capped.num_used == 5
    kept = capped.slots[1]
    assert set(kept.tolist()) <= {0, 2, 3, 6} and len(set(kept.tolist())) == 2
    assert capped.facts("sum")["max_examples_per_user"] == 2
    # every 2-subset of user 5's four examples is drawn (uniform subset, not a prefix)
    seen = {tuple(group_by_user(ids, max_examples_per_user=2, randomness=Randomness(s))
                  .slots[1].tolist()) for s in range(60)}
    assert len(seen) == 6
    assert synthetic_user_ids(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert check_user_ids(torch.arange(3), 3).dtype == np.int64


def test_checkpoint_keeps_the_layout(tmp_path):
    x, y, ids = _data(4)
    tr = _trainer(_model(), x, y, ids, cap=2)
    tr.fit(max_steps=1)
    path = tr.save_checkpoint(tmp_path / "ckpt.pt")
    # a fresh trainer draws other subsets (another seed) until the checkpoint restores them
    fresh = _trainer(_model(), x, y, ids, cap=2)
    fresh.layout = group_by_user(ids, max_examples_per_user=2, randomness=Randomness(99))
    assert fresh.layout.digest != tr.layout.digest
    fresh.resume(path)
    assert fresh.layout.digest == tr.layout.digest
    assert fresh.batcher_.layout is fresh.layout


def test_dataset_inputs_give_the_same_gradient_as_tensors():
    from torch.utils.data import TensorDataset

    x, y, ids = _data(5)
    model = _model()
    sums = []
    for data, targets in ((x, y), (TensorDataset(x, y), None)):
        sampler = make_sampler("poisson", 9, 3, randomness=Randomness(1), unit="user")
        tr = UserLevelTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            data,
            targets,
            sampler,
            user_ids=ids,
            max_examples_per_user=5,
            reduction="mean",
            layout_randomness=Randomness(3),
            options=TrainerOptions(
                clip_norm=C,
                epochs=1,
                delta=1e-3,
                noise_multiplier=1.0,
                max_physical_batch_size=10,
            ),
        )
        tr._setup()
        accumulate_logical_batch(tr.private_gradient_, tr.batcher_, np.array([0, 3, 4, 8]),
                                 tr.loss_fn)
        sums.append(tr.private_gradient_.clipped_sum())
    for k in sums[0]:
        torch.testing.assert_close(sums[0][k], sums[1][k], atol=1e-6, rtol=1e-6)

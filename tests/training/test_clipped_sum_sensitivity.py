"""The guarantee itself: one unit of privacy moves the clipped sum by at most C (2C replaced).

DP-SGD's noise is calibrated to the L2 sensitivity of the clipped sum (Abadi et al. 2016;
Ponomareva et al. 2023, Alg. 1 and 3; ``docs/architecture.md``, 5.11 and 5.17). The layer zoo
(``tests/training/test_layer_zoo.py``) checks the fast path against the per-example loop; this
file checks the property the accounting relies on, directly and without that loop: for data
sets D and D' that differ in one unit,

* add/remove (D' = D without one unit: its rows deleted, or turned into weight-0 padding):
  ``||S(D) - S(D')|| <= sensitivity`` the query records (C; 2C for microbatch averages, where
  removing an example turns its row into padding, as ``dpfy.training.step`` assumes);
* replace-one (the unit replaced by a fresh random one; by itself made extreme: floating
  inputs and targets x1e3, token ids one token repeated; by a duplicate of another unit of D;
  by its mirror image, see below): ``||S(D) - S(D')|| <= 2C``,

where ``S = PrivateGradient.clipped_sum()`` after ``accumulate`` (noise is added only at
``release``), all trainable parameters concatenated, in float64 with relative slack 1e-9. The
cases: every exact layer of the zoo (its models and inputs imported from the zoo; the layers
with linear-form rules also with ghost and materialised norms forced) and mixed models
(embedding + recurrent + attention, conv + GroupNorm + linear, a tied-weight LM with broadcast
position embeddings and a causal mask, a LoRA-like model around frozen layers, physical
microbatches, user-level groups and microbatch averages). D holds B units (B from 1 to 6), C
is the median per-unit norm (the geometric mean of the middle two for even B, half the norm
when B = 1), so clipping is active for some units and not for others.

The bounds are reached, so the test can fail: removing the unit of largest norm (always
clipped; in average mode, padding all rows of the largest microbatch, a probe rather than a
neighbour) moves S by exactly C, and for the squared-error models the mirror image of that
unit (each target reflected through the model's output, y' = 2 out - y, whose gradient is
exactly the opposite) moves it by exactly 2C; both are asserted (relative 1e-6), and in every
case some removal and some replacement move S by more than C/2. Clip weights equal to 1, a
clip norm 1e-6 too large, squared norms 1e-7 too small (which the coverage check of
``dpfy.training.norms.coverage`` cannot see: it compares sums with weights 1), or one clip
weight for all rows, each fails every case they change.

Automatic clipping (Bu et al. 2023; :mod:`dpfy.queries.clipping`) weights every unit by
``C / (norm + gamma)``, above 1 for units with norm below ``C - gamma``; the mixed models run
again with it (gamma = C / 4, so some weights exceed 1). The same bounds hold, and they are
reached as closely as the clip function allows: removing the unit of largest norm n moves S by
exactly ``C n / (n + gamma)``, its mirror image by twice that (both asserted).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from dpfy.queries import GaussianSumQuery
from dpfy.queries.clipping import ClippingMode
from dpfy.queries.sum import ClippedUnit
from dpfy.training import PrivateGradient
from dpfy.training.losses import causal_lm_loss
from dpfy.training.step import MicrobatchMode
from tests.training.test_layer_zoo import DT, EXACT, Net, _force_mode, _loss, _Mixed

#: Relative slack for float64 rounding of sums of a few rows.
RTOL = 1e-9
#: Scale of the floating inputs of the extreme replacement.
EXTREME = 1e3
#: Automatic clipping's gamma, relative to C: units with norm below 3C/4 get weights above 1.
GAMMA = 0.25

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]  # inputs, targets, weights


pytestmark = pytest.mark.usefixtures("one_thread")  # hundreds of tiny passes


@dataclass(frozen=True)
class Case:
    """A model, a source of random rows, and how rows form units of privacy.

    ``draw(n)`` returns n random rows: the model's inputs (batch on dim 0) and targets.
    D holds ``batch`` clipped units of :attr:`group` rows each.
    """

    model: Callable[[], nn.Module]
    draw: Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    batch: int
    mode: MicrobatchMode = "examples"
    microbatch_size: int | None = None

    @property
    def group(self) -> int:
        """Rows of one clipped unit: ``microbatch_size`` in sum and average mode, else 1."""
        return (self.microbatch_size or 1) if self.mode != "examples" else 1


# ---------------------------------------------------------------------------------------------
# The zoo's layers, with the zoo's models and inputs


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _zoo_draw(make_inputs: Callable[[], Any]) -> Callable[[int], Any]:
    """n rows from the zoo's inputs factory (4 rows a call, concatenated)."""

    def draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        parts = [_as_tuple(make_inputs()) for _ in range(-(-n // 4))]
        inputs = tuple(torch.cat(xs)[:n] for xs in zip(*parts, strict=True))
        return inputs, torch.randn(n, 1, dtype=DT)

    return draw


#: B per zoo entry, cycling over the sorted names: every size occurs, 1 and 2 included.
ZOO_BATCHES = (1, 2, 3, 5, 2, 6, 4)


def _zoo_case(name: str) -> Case:
    make, body, make_inputs, _ = EXACT[name]
    batch = ZOO_BATCHES[sorted(EXACT).index(name) % len(ZOO_BATCHES)]
    return Case(lambda: Net(make(), body), _zoo_draw(make_inputs), _loss, batch)


def _zoo_params() -> list[Any]:
    cases = []
    for name, (_, _, _, modes) in sorted(EXACT.items()):
        for mode in ("auto", "ghost", "materialize") if modes else ("auto",):
            cases.append(pytest.param(name, mode, id=f"{name}-{mode}"))
    return cases


# ---------------------------------------------------------------------------------------------
# Mixed models


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _lm_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(out, ids, reduction="sum")


def _padded_ids(n: int, t: int, vocab: int) -> torch.Tensor:
    """Token ids in 1..vocab-1 with 0 (padding) after a random length in [2, t]."""
    ids = torch.randint(1, vocab, (n, t))
    lengths = torch.randint(2, t + 1, (n,))
    return ids.masked_fill(torch.arange(t) >= lengths[:, None], 0)


class _TextClassifier(nn.Module):
    """Embedding (padding index 0), bidirectional LSTM, self-attention over the real tokens,
    LayerNorm, masked mean pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6, padding_idx=0)
        self.lstm = nn.LSTM(6, 4, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        h, _ = self.lstm(self.embed(ids))
        h = self.norm(h + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0])
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        logits: torch.Tensor = self.head((h * keep).sum(1) / keep.sum(1))
        return logits


def _text_draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (_padded_ids(n, 5, 12),), torch.randint(0, 3, (n,))


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
        nn.Conv2d(4, 4, 3, stride=2), nn.GroupNorm(2, 4), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )


def _image_draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(n, 1, 7, 7, dtype=DT),), torch.randint(0, 3, (n,))


class _TiedLM(nn.Module):
    """A GPT-like LM: token and position embeddings (positions looked up on a batch-1 index and
    broadcast over the batch), one causal Transformer layer, LayerNorm, and an output head
    that shares the token table."""

    def __init__(self, vocab: int = 11, d: int = 6, t: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 8, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device)[None])
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
        logits: torch.Tensor = self.head(self.norm(self.block(h, src_mask=mask, is_causal=True)))
        return logits


def _lm_draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    ids = torch.randint(0, 11, (n, 5))
    return (ids,), ids


class _LoRALinear(nn.Module):
    """A frozen Linear plus a trainable rank-2 update (Hu et al. 2022). Both factors are
    random, as after some training (B = 0 at the start would give A no gradient)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


class _LoRAModel(nn.Module):
    """Frozen embedding and LayerNorm, two LoRA-adapted Linears, a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6).requires_grad_(False)
        self.fc1 = _LoRALinear(6, 6)
        self.norm = nn.LayerNorm(6).requires_grad_(False)
        self.fc2 = _LoRALinear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc1(self.embed(ids))))
        logits: torch.Tensor = self.head(torch.tanh(self.fc2(h)).mean(1))
        return logits


def _lora_draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randint(0, 12, (n, 4)),), torch.randint(0, 3, (n,))


def _mixed_draw(n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    pad = torch.zeros(n, 5, dtype=torch.bool)
    pad[::2, -2:] = True
    return (torch.randint(0, 12, (n, 5)), pad), torch.randn(n, 2, dtype=DT)


MIXED: dict[str, Case] = {
    "zoo-mixed": Case(_Mixed, _mixed_draw, _loss, 3),
    "embedding-lstm-attention-linear": Case(_TextClassifier, _text_draw, _ce, 4),
    "conv-groupnorm-linear": Case(_conv_net, _image_draw, _ce, 5),
    "tied-lm": Case(_TiedLM, _lm_draw, _lm_loss, 2),
    "lora-frozen-base": Case(_LoRAModel, _lora_draw, _ce, 1),
    # physical microbatches of 2 rows: each example is still clipped (Alg. 3, option 1)
    "physical-microbatches": Case(
        _TextClassifier, _text_draw, _ce, 5, mode="examples", microbatch_size=2
    ),
    # user-level DP: 3 rows a unit, their summed gradient clipped (5.17)
    "user-level-groups": Case(_conv_net, _image_draw, _ce, 3, mode="sum", microbatch_size=3),
    "user-level-groups-b1": Case(_LoRAModel, _lora_draw, _ce, 1, mode="sum", microbatch_size=2),
    # microbatch averages (Alg. 3, option 2): the unit is an example, the sensitivity 2C
    "microbatch-averages": Case(
        _TextClassifier, _text_draw, _ce, 2, mode="average", microbatch_size=2
    ),
}


# ---------------------------------------------------------------------------------------------
# The harness


def _take(rows: tuple[tuple[torch.Tensor, ...], torch.Tensor], index: list[int]) -> Any:
    inputs, targets = rows
    return tuple(x[index] for x in inputs), targets[index]


def _extreme(inputs: tuple[torch.Tensor, ...], targets: torch.Tensor
             ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Rows made extreme: floating inputs and targets scaled by :data:`EXTREME`, each row of
    token ids [n, T] one token repeated (its first); lengths, labels and masks unchanged."""
    out = []
    for x in inputs:
        if x.is_floating_point():
            x = x * EXTREME
        elif x.dtype != torch.bool and x.dim() == 2:
            x = x[:, :1].expand_as(x).clone()
        out.append(x)
    return tuple(out), targets * EXTREME if targets.is_floating_point() else targets


def _clipped_sum(pg: PrivateGradient, batch: Batch, loss_fn: Any) -> torch.Tensor:
    """S(batch), all trainable parameters concatenated (0 for an empty batch)."""
    pg.reset()
    inputs, targets, weights = batch
    if targets.shape[0] > 0:
        pg.accumulate(inputs, targets, loss_fn, weights=weights)
    return torch.cat([v.reshape(-1) for v in pg.clipped_sum().values()])


def _step(
    model: nn.Module, case: Case, clip: float, clipping: ClippingMode = "flat"
) -> PrivateGradient:
    unit: ClippedUnit = "microbatch_average" if case.mode == "average" else "example"
    query = GaussianSumQuery(clip, 1.0, clipped_unit=unit, clipping=clipping,
                             stability=GAMMA * clip)
    return PrivateGradient(
        model, query, expected_batch_size=float(case.batch * case.group),
        microbatch_size=case.microbatch_size, microbatch_mode=case.mode,
    )


def _clip_between(norms: torch.Tensor) -> float:
    """The median norm (geometric mean of the middle two for even B); half the norm if B = 1."""
    s = sorted(float(v) for v in norms)
    if len(s) == 1:
        return 0.5 * s[0]
    return math.sqrt(s[(len(s) - 1) // 2] * s[len(s) // 2])


@dataclass(frozen=True)
class Measured:
    """||S(D) - S(D')|| for each neighbour, with the clip norm C and the sensitivity the query
    records. ``largest``: the clipped unit of largest norm removed (in average mode the rows of
    the largest microbatch, all turned into padding: a probe, not a neighbour); ``mirror``:
    that unit replaced by its mirror image (squared-error models only); ``reach``: how far the
    clip function moves S for that unit, C (flat) or ``C n / (n + gamma)`` (automatic)."""

    largest: float
    removal: list[float]
    replacement: list[float]
    mirror: float | None
    clip: float
    sensitivity: float
    reach: float


class _Neighbours:
    """The neighbours of D = (inputs, targets, weights): D holds ``units`` units of ``k`` rows
    (in average mode the unit of privacy is one row)."""

    def __init__(self, d: Batch, k: int) -> None:
        self.inputs, self.targets, self.weights = d
        self.k = k
        self.units = self.targets.shape[0] // k

    def rows(self, j: int) -> list[int]:
        return list(range(j * self.k, (j + 1) * self.k))

    def deleted(self, j: int) -> Batch:
        keep = [i for i in range(self.units * self.k) if i not in self.rows(j)]
        return tuple(x[keep] for x in self.inputs), self.targets[keep], self.weights[keep]

    def padded(self, j: int) -> Batch:
        w = self.weights.clone()
        w[self.rows(j)] = 0.0
        return self.inputs, self.targets, w

    def unit(self, j: int) -> Batch:
        rows = self.rows(j)
        return tuple(x[rows] for x in self.inputs), self.targets[rows], self.weights[rows]

    def replaced(self, j: int, new: Batch) -> Batch:
        inputs = tuple(x.clone() for x in self.inputs)
        for x, v in zip(inputs, new[0], strict=True):
            x[self.rows(j)] = v
        targets, weights = self.targets.clone(), self.weights.clone()
        targets[self.rows(j)], weights[self.rows(j)] = new[1], new[2]
        return inputs, targets, weights


def _measure(case: Case, seed: int, clipping: ClippingMode = "flat") -> Measured:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = case.model().to(DT)
    k = case.group
    rows = case.batch * k
    pool = case.draw(rows + 2 * k)
    inputs, targets = _take(pool, list(range(rows)))
    weights = torch.ones(rows, dtype=DT)
    if case.mode == "sum":  # users with fewer examples: weight-0 slots in every other group
        weights[k - 1 :: 2 * k] = 0.0
    d: Batch = (inputs, targets, weights)

    norms = _step(model, case, 1.0).accumulate(
        inputs, targets, case.loss_fn, weights=weights, return_norms=True
    ).norms
    assert norms is not None and bool(torch.isfinite(norms).all()) and bool((norms > 0).all())
    clip = _clip_between(norms)
    if case.batch > 1:  # clipping active for some units, not for others
        assert bool((norms > clip).any()) and bool((norms < clip).any()), (norms, clip)
    order = [int(i) for i in torch.argsort(norms, descending=True)]  # units, largest first
    pg = _step(model, case, clip, clipping)
    sensitivity = pg.query.sensitivity  # type: ignore[attr-defined]
    top = float(norms.max())
    reach = clip if clipping == "flat" else clip * top / (top + GAMMA * clip)
    assert sensitivity == (2.0 if case.mode == "average" else 1.0) * clip

    # the unit of privacy: a row in average mode (its microbatch's rows, largest first)
    if case.mode == "average":
        order = [m * k + r for m in order for r in range(k)]
    nb = _Neighbours(d, 1 if case.mode == "average" else k)
    largest, smallest = order[0], order[-1]
    ones = torch.ones(nb.k, dtype=DT)
    fresh = [(*_take(pool, list(range(rows + i * nb.k, rows + (i + 1) * nb.k))), ones)
             for i in range(2)]
    removals = [] if case.mode == "average" else [nb.deleted(j) for j in order]
    removals += [nb.padded(j) for j in dict.fromkeys([largest, rng.randrange(nb.units)])]
    j = rng.randrange(nb.units)
    replacements = [
        nb.replaced(largest, fresh[0]),
        nb.replaced(rng.randrange(nb.units), fresh[1]),
        nb.replaced(j, (*_extreme(*nb.unit(j)[:2]), nb.unit(j)[2])),
        nb.replaced(smallest, nb.unit(largest)) if nb.units > 1  # a duplicate of another
        else nb.replaced(0, (*_extreme(*fresh[1][:2]), ones)),
    ]
    mirror: Batch | None = None
    if case.loss_fn is _loss and case.mode != "average":
        # the largest unit with each target reflected through the model's output: the loss
        # (out - y')^2 with y' = 2 out - y has exactly the opposite gradient, moving S by 2C
        x, y, w = nb.unit(largest)
        with torch.no_grad():
            mirror = nb.replaced(largest, (x, 2.0 * model(*x) - y, w))
    s = _clipped_sum(pg, d, case.loss_fn)

    def moved(n: Batch) -> float:
        return float((s - _clipped_sum(pg, n, case.loss_fn)).norm())

    moved_r = [moved(n) for n in removals]
    if case.mode == "average":  # the probe: every row of the largest microbatch padded
        gone = moved((inputs, targets, weights.index_fill(0, torch.tensor(order[:k]), 0.0)))
    else:
        gone = moved_r[0]  # the largest unit deleted
    return Measured(
        gone, moved_r, [moved(n) for n in replacements],
        None if mirror is None else moved(mirror), clip, sensitivity, reach,
    )


def _check(case: Case, seed: int, clipping: ClippingMode = "flat") -> None:
    m = _measure(case, seed, clipping)
    replaced = m.replacement + ([] if m.mirror is None else [m.mirror])
    assert max(m.removal) <= m.sensitivity * (1 + RTOL), m
    assert max(replaced) <= 2 * m.clip * (1 + RTOL), m
    # reachable: removing the largest unit (clipped) moves S by exactly C (automatic: the
    # reach), its mirror image by exactly twice that; in every case some neighbour moves S by
    # more than C / 2
    assert m.largest <= m.clip * (1 + RTOL) and m.largest == pytest.approx(m.reach, rel=1e-6), m
    if m.mirror is not None:
        assert m.mirror == pytest.approx(2 * m.reach, rel=1e-6), m
    assert max(m.removal) > 0.5 * m.clip and max(m.replacement) > 0.5 * m.clip, m


@pytest.mark.parametrize("name,mode", _zoo_params())
def test_one_example_moves_the_clipped_sum_of_a_zoo_layer_by_at_most_c(
    name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force_mode(monkeypatch, mode)
    _check(_zoo_case(name), seed=sorted(EXACT).index(name))


@pytest.mark.parametrize("name", sorted(MIXED))
def test_one_unit_moves_the_clipped_sum_of_a_mixed_model_by_at_most_c(name: str) -> None:
    _check(MIXED[name], seed=100 + sorted(MIXED).index(name))


#: Automatic clipping runs the clip weights through the same per-layer weighted sums as flat
#: clipping; these cases cover each kind of sum (embedding, recurrent, attention, tied and
#: frozen weights, user-level groups, microbatch averages, a convolution both ways) cheaply.
AUTOMATIC = ("embedding-lstm-attention-linear", "tied-lm", "lora-frozen-base",
             "user-level-groups-b1", "microbatch-averages")


@pytest.mark.parametrize("name", AUTOMATIC)
def test_one_unit_moves_an_automatically_clipped_sum_by_at_most_c(name: str) -> None:
    _check(MIXED[name], seed=200 + sorted(MIXED).index(name), clipping="automatic")


@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_one_example_moves_an_automatically_clipped_conv_sum_by_at_most_c(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force_mode(monkeypatch, mode)
    _check(_zoo_case("Conv2d"), seed=300, clipping="automatic")

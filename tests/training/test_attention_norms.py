"""nn.MultiheadAttention's exact rule (dpfy.training.norms.attention) against the per-example
loop reference: the recomputed call equals the module's own, and the rule's per-example norms
and weighted sums equal the loop's, for every feature of the layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from dpfy.queries.sum import NoPrivacyQuery
from dpfy.training import PrivateGradient
from dpfy.training.norms.attention import attention_rule, recompute_attention
from dpfy.training.norms.reference import clipped_sum_reference, per_example_gradients
from dpfy.training.norms.registry import Capture

E, HEADS, B, L, S = 8, 2, 4, 3, 5


def _close(got, ref, rtol=1e-6):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    assert float((got - ref).norm()) <= rtol * float(ref.norm()) + 1e-12, (got, ref)


def _detach(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _loss(out, y):
    return (out * y).sum(1)


class _Attend(nn.Module):
    """MHA on batch-first inputs, one flat row per example (the reference slices dim 0).

    ``mode``: "self" (query is key is value), "kv" (key is value) or "qkv" (three tensors).
    A 3-D attention mask is passed per example as [B, heads, L, S]; a 2-D one is fixed.
    """

    def __init__(self, mha, mode="self", mask=None, **call):
        super().__init__()
        self.mha, self.mode, self.mask = mha, mode, mask
        self.call = {"need_weights": False, **call}

    def forward(self, query, key=None, value=None, kpm=None, mask3=None):
        bf = self.mha.batch_first
        query = query if bf else query.transpose(0, 1)
        if self.mode == "self":
            key = value = query
        else:
            key = key if bf else key.transpose(0, 1)
            value = key if self.mode == "kv" else value if bf else value.transpose(0, 1)
        mask = self.mask if mask3 is None else mask3.reshape(-1, *mask3.shape[2:])
        out, w = self.mha(query, key, value, key_padding_mask=kpm, attn_mask=mask, **self.call)
        out = out if bf else out.transpose(0, 1)
        flat = torch.tanh(out).flatten(1)
        return flat if w is None else torch.cat([flat, w.flatten(1)], 1)


def _rule_grads(model, inputs, y, group_size=1):
    """The rule's LayerGrads, the targets' gradients by autograd as the step computes them."""
    recorded = []

    def hook(module, args, kwargs, output):
        rec = recompute_attention(module, args, kwargs, output)
        for mine, theirs in zip(rec.output, output, strict=True):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert mine.shape == theirs.shape
                assert float((mine - theirs).detach().abs().max()) <= 1e-10
        recorded.append((tree_map(_detach, args), tree_map(_detach, kwargs), rec))
        return rec.output

    handle = model.mha.register_forward_hook(hook, with_kwargs=True)
    try:
        out = model(*inputs)
    finally:
        handle.remove()
    targets = [t for _, _, rec in recorded for t in rec.targets]
    live = [t for t in targets if t.requires_grad]
    grads = iter(torch.autograd.grad(_loss(out, y).sum(), live, materialize_grads=True))
    caps = []
    for args, kwargs, rec in recorded:
        gouts = tuple(next(grads) if t.requires_grad else torch.zeros_like(t) for t in rec.targets)
        caps.append(Capture(args, kwargs, gouts, extra=rec.extra))
    return attention_rule(model.mha, caps, group_size)


def _check(model, inputs, group_size=1):
    """Norms per parameter and weighted sums (plain, into ``out``, overwriting) vs the loop."""
    torch.manual_seed(123)
    y = torch.randn(B, model(*inputs).shape[1], dtype=torch.float64)
    ref = per_example_gradients(model, inputs, y, _loss)
    ref = {n.removeprefix("mha."): g for n, g in ref.items()}
    k = group_size
    units = {n: g.reshape(B // k, k, *g.shape[1:]).sum(1) for n, g in ref.items()}
    lg = _rule_grads(model, inputs, y, group_size)
    sq = lg.squared_norms()
    assert set(sq) == set(units)
    for n, u in units.items():
        _close(sq[n], u.flatten(1).square().sum(1))
    w = torch.rand(B // k, dtype=torch.float64)
    weights = dict.fromkeys(units, w)
    expect = {n: torch.einsum("n,n...->...", w, u) for n, u in units.items()}
    got = lg.weighted_sum(weights)
    out = {n: torch.full_like(u[0], float("nan")) for n, u in units.items()}
    lg.weighted_sum(weights, out, overwrite=True)
    for n in units:
        _close(got[n], expect[n])
        _close(out[n], expect[n])


def _mha(**kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dtype=torch.float64, **kw)
    with torch.no_grad():  # nonzero biases (they start at 0)
        for p in mha.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mha


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _kpm(src=S):
    """Bool padding mask [B, S]: a different number of trailing keys masked per example."""
    return torch.arange(src)[None, :] >= torch.tensor([src, src - 1, src - 2, 2])[:, None]


CASES = {
    "self": (dict(batch_first=True), "self", None, {}, lambda: (_x(B, L, E),)),
    "self-seq-first-bool-kpm-mask2d": (
        dict(),
        "self",
        torch.ones(L, L, dtype=torch.bool).triu(1),
        {},
        lambda: (_x(B, L, E), None, None, _kpm(L)),
    ),
    "cross-kv-float-kpm-mask2d": (
        dict(batch_first=True),
        "kv",
        torch.randn(L, S, dtype=torch.float64),
        {},
        lambda: (_x(B, L, E), _x(B, S, E), None, torch.randn(B, S, dtype=torch.float64)),
    ),
    "qkv-mask3d-bool-weights-per-head": (
        dict(batch_first=True),
        "qkv",
        None,
        dict(need_weights=True, average_attn_weights=False),
        lambda: (_x(B, L, E), _x(B, S, E), _x(B, S, E), None, torch.rand(B, HEADS, L, S) < 0.3),
    ),
    "kdim-vdim-seq-first-weights": (
        dict(kdim=6, vdim=5),
        "qkv",
        None,
        dict(need_weights=True),
        lambda: (_x(B, L, E), _x(B, S, 6), _x(B, S, 5), _kpm()),
    ),
    "bias-kv-zero-attn-masks": (
        dict(batch_first=True, add_bias_kv=True, add_zero_attn=True),
        "self",
        torch.rand(L, L) < 0.5,
        {},
        lambda: (_x(B, L, E), None, None, _kpm(L)),
    ),
    "bias-kv-cross-weights": (
        dict(add_bias_kv=True),
        "kv",
        None,
        dict(need_weights=True),
        lambda: (_x(B, L, E), _x(B, S, E), None, _kpm()),
    ),
    "causal": (
        dict(batch_first=True),
        "self",
        nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64),
        dict(is_causal=True, need_weights=False),
        lambda: (_x(B, L, E),),
    ),
    "no-bias": (dict(bias=False), "kv", None, {}, lambda: (_x(B, L, E), _x(B, S, E))),
}


@pytest.mark.parametrize(
    "case,group_size",
    [(c, 1) for c in CASES]  # and microbatches of two in two representative cases
    + [("self-seq-first-bool-kpm-mask2d", 2), ("bias-kv-cross-weights", 2)],
)
def test_attention_rule_matches_loop(case, group_size):
    kw, mode, mask, call, make = CASES[case]
    torch.manual_seed(1)
    model = _Attend(_mha(**kw), mode, mask, **call)
    _check(model, make(), group_size)


class _TwoCalls(nn.Module):
    """One MHA called for self-attention, then cross-attention (two packings in one chunk)."""

    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def forward(self, x, mem):
        h, _ = self.mha(x, x, x, need_weights=False)
        out, _ = self.mha(h, mem, mem, need_weights=False)
        return torch.tanh(out).flatten(1)


@pytest.mark.parametrize("group_size", [1, 2])
def test_attention_called_twice_with_different_packings(group_size):
    model = _TwoCalls(_mha(batch_first=True, add_bias_kv=True))
    _check(model, (_x(B, L, E), _x(B, S, E)), group_size)


def test_attention_partly_frozen():
    mha = _mha(batch_first=True, add_bias_kv=True)
    mha.in_proj_weight.requires_grad_(False)
    mha.bias_v.requires_grad_(False)
    mha.out_proj.bias.requires_grad_(False)
    _check(_Attend(mha, "qkv"), (_x(B, L, E), _x(B, S, E), _x(B, S, E)))


def test_unbatched_attention_is_refused():
    mha = _mha()
    x = _x(L, E)
    out = mha(x, x, x)
    with pytest.raises(ValueError, match="batched"):
        recompute_attention(mha, (x, x, x), {}, out)


def test_dropout_is_redrawn_in_training():
    """In training the recomputation draws its own dropout (the output it returns is used)."""
    mha = _mha(batch_first=True, dropout=0.5)
    x = _x(B, L, E)
    out = mha(x, x, x)
    torch.manual_seed(5)
    a = recompute_attention(mha, (x, x, x), {"need_weights": True}, out)
    torch.manual_seed(5)
    b = recompute_attention(mha, (x, x, x), {"need_weights": False}, out)
    assert a is not None and b is not None
    assert a.output[1] is not None and bool((a.output[1] == 0).any())
    mha.eval()
    c = recompute_attention(mha, (x, x, x), {}, out)
    d = mha(x, x, x)
    assert c is not None
    assert float((c.output[0] - d[0]).detach().abs().max()) <= 1e-10


# --- end to end: PrivateGradient's clipped sums (recompute hook, subtree plan) vs the loop ----


def _clipped_sum_check(model, inputs, y, microbatch=1, loss=_loss):
    """``pg.clipped_sum()`` (clip at the median unit norm) against the loop reference."""
    k = microbatch
    per_ex = per_example_gradients(model, inputs, y, loss)
    units = {n: g.reshape(B // k, k, *g.shape[1:]).sum(1) / k for n, g in per_ex.items()}
    norms = sum(u.flatten(1).square().sum(1) for u in units.values()).sqrt()
    clip = float(norms.median())
    pg = PrivateGradient(
        model,
        NoPrivacyQuery(clip),
        expected_batch_size=float(B),
        microbatch_size=k if k > 1 else None,
        microbatch_mode="average" if k > 1 else "examples",
        coverage_check="every",
    )
    stats = pg.accumulate(inputs, y, loss, return_norms=True)
    _close(stats.norms, norms)
    ref = clipped_sum_reference(per_ex, clip, microbatch_size=k)
    got = pg.clipped_sum()
    for n in ref:
        _close(got[n], ref[n])


@pytest.mark.parametrize(
    "case,microbatch",
    [
        ("self", 1),
        ("cross-kv-float-kpm-mask2d", 2),
        ("qkv-mask3d-bool-weights-per-head", 1),
        ("bias-kv-zero-attn-masks", 2),
        ("self-seq-first-bool-kpm-mask2d", 2),
        ("kdim-vdim-seq-first-weights", 1),
        ("bias-kv-cross-weights", 1),
    ],
)
def test_private_gradient_with_attention(case, microbatch):
    kw, mode, mask, call, make = CASES[case]
    model = _Attend(_mha(**kw), mode, mask, **call)
    inputs = make()
    y = torch.randn(B, model(*inputs).shape[1], dtype=torch.float64)
    _clipped_sum_check(model, inputs, y, microbatch)


class _Encoder(nn.Module):
    """Two encoder layers (causal mask and padding mask) and a linear readout, batch first."""

    def __init__(self, norm_first):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            E, HEADS, 16, dropout=0.0, batch_first=True, norm_first=norm_first, dtype=torch.float64
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3, dtype=torch.float64)

    def forward(self, x, kpm):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        kpm = torch.zeros_like(kpm, dtype=x.dtype).masked_fill(kpm, float("-inf"))  # as mask
        h = self.encoder(x, mask=mask, src_key_padding_mask=kpm, is_causal=True)
        return self.head(h[:, 0])


class _Decoder(nn.Module):
    """A decoder layer (self- and cross-attention); ``batch_first=False``: sequence first."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.decoder = nn.TransformerDecoderLayer(
            E, HEADS, 16, dropout=0.0, batch_first=batch_first, dtype=torch.float64
        )

    def forward(self, tgt, memory, memory_kpm):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=tgt.dtype)
        bf = self.decoder.self_attn.batch_first
        out = self.decoder(
            tgt if bf else tgt.transpose(0, 1),
            memory if bf else memory.transpose(0, 1),
            tgt_mask=mask,
            memory_key_padding_mask=memory_kpm,
            tgt_is_causal=True,
        )
        return (out if bf else out.transpose(0, 1)).flatten(1)


class _Seq2Seq(nn.Module):
    """nn.Transformer (one encoder and one decoder layer), batch first."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(
            E, HEADS, 1, 1, 16, dropout=0.0, batch_first=True, dtype=torch.float64
        )

    def forward(self, src, tgt):
        return self.transformer(src, tgt).flatten(1)


def _ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("norm_first,microbatch", [(False, 1), (True, 2)])
def test_private_gradient_transformer_encoder(norm_first, microbatch):
    torch.manual_seed(2)
    model = _Encoder(norm_first)
    inputs = (_x(B, L, E), _kpm(L))
    _clipped_sum_check(model, inputs, torch.tensor([0, 2, 1, 2]), microbatch, _ce)


def test_private_gradient_transformer_decoder_and_seq2seq():
    torch.manual_seed(3)
    model = _Decoder()
    y = _x(B, L * E)
    _clipped_sum_check(model, (_x(B, L, E), _x(B, S, E), _kpm()), y)
    model = _Seq2Seq()
    _clipped_sum_check(model, (_x(B, S, E), _x(B, L, E)), y, microbatch=2)


def test_sequence_first_transformer_layer_is_refused():
    """Its Linear and LayerNorm children see [L, B, E]: rows are positions, not examples."""
    model = _Decoder(batch_first=False)
    with pytest.raises(ValueError, match="batch_first=True"):
        PrivateGradient(model, NoPrivacyQuery(1.0), expected_batch_size=float(B))


def test_private_gradient_attention_dropout_is_consistent():
    """With dropout in training, the per-example sums still equal the batch gradient of the
    same backward (the coverage check, on every chunk), i.e. the redrawn dropout is the one
    the model used."""
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(
        E, HEADS, 16, dropout=0.3, batch_first=True, dtype=torch.float64
    )
    model = nn.Sequential(layer, nn.Flatten())
    pg = PrivateGradient(
        model, NoPrivacyQuery(1.0), expected_batch_size=float(B), coverage_check="every"
    )
    for _ in range(2):
        pg.accumulate(_x(B, L, E), _x(B, L * E), _loss)


def test_private_gradient_attention_under_bf16_autocast():
    """Under autocast the context the rule keeps is bf16 and the gradients the step hands it
    are upcast to fp32: the norms stay close to the fp32 loop's."""
    torch.manual_seed(6)
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer, nn.Flatten())
    x, y = torch.randn(B, L, E), torch.randn(B, L * E)
    per_ex = per_example_gradients(model, x, y, _loss)
    ref = sum(g.double().flatten(1).square().sum(1) for g in per_ex.values()).sqrt()
    pg = PrivateGradient(
        model, NoPrivacyQuery(1.0), expected_batch_size=float(B), precision="bf16",
        coverage_check="every",
    )
    stats = pg.accumulate(x, y, lambda out, y: _loss(out.float(), y), return_norms=True)
    _close(stats.norms, ref, rtol=5e-2)

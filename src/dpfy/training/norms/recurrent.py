"""Recurrent layers: exact per-example gradients of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` and cells.

PyTorch runs these layers as fused kernels whose gate pre-activations never reach Python. The
forward hook (``register_norm_rule(..., recompute=...)``) keeps the module's own output and
hands the model the same values through one autograd node, :class:`_Recurrence`, whose
backward pass is ours (``recurrent_bptt.py``): from the layer's input and the hidden states it
output, the gates of every step are recomputed in batched ops (two GEMMs over all steps; the
LSTM's cell state is an elementwise scan), and backpropagation through time in batched ops
gives ``dL/dgi_t`` [B, T, G] for every step and example (G = 4H for LSTM, 3H for GRU, H for
RNN), the gradient of the layer's input, and of ``h0``/``c0``. The module's forward runs once;
its fused backward never runs. A layer below the top one of a multi-layer module is run again
as one fused call per layer (its outputs are not returned by the module); with inter-layer
dropout in training mode every layer is, with a dropout mask drawn here, and the module's own
output (under a mask nobody sees) is replaced, so the model and the gradients see one mask.

``dL/dgi_t`` reaches the rule as the gradient of a zero *probe* [B, T, G] per layer and
direction that :class:`_Recurrence` takes as an input and ignores; the probe is the output
of :class:`_WeightTap` of the layer's parameters, whose backward (run only when autograd is
asked for the parameters' batch gradients, as the coverage check does) gives them as sums
of the per-example gradients below. Per example n every weight gradient is a sum over time
of outer products, a :class:`~dpfy.training.norms.linear.LinearForm`:

* ``W_ih``: A = layer input ``x_t`` [T, d], G = ``dL/dgi_t``; ``b_ih = sum_t G``;
* ``W_hh``: A = ``h_{t-1}`` [T, H_out], G = ``dL/dgh_t`` (equal to ``dL/dgi_t`` for RNN and
  LSTM; GRU: its n block times the reset gate ``r_t``); ``b_hh = sum_t G``;
* ``W_hr`` (LSTM, ``proj_size > 0``): A = ``o_t * tanh(c_t)`` [T, H], G = ``dL/dh_t`` (the
  gradient of a second probe [B, T, P]).

Several calls of one module (a cell in a Python loop over time) are concatenated along T.

A :class:`~torch.nn.utils.rnn.PackedSequence` is padded (batch in its original order) and run
with a per-step validity mask (the reverse direction starts at each sequence's own last
element from ``h0``); ``h_n``/``c_n`` are in the original batch order, as the module returns
them. Unbatched inputs are refused: a per-example gradient needs a batch dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpfy.training.norms.composite import CompositeGrads, Slot
from dpfy.training.norms.linear import LinearForm, fold_linear_form
from dpfy.training.norms.recurrent_bptt import (
    Backward,
    Gates,
    Kind,
    Steps,
    Weights,
    backward_through_time,
    gate_grad_hh,
    gates,
)
from dpfy.training.norms.recurrent_grads import GateForm, ghost_cheaper
from dpfy.training.norms.registry import (
    Capture,
    LayerGrads,
    Recomputed,
    register_norm_rule,
    register_unsupported,
)

_RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)
_CELLS = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)


@dataclasses.dataclass(frozen=True, slots=True)
class Track:
    """What one layer and direction of a call leaves for the rule (detached, time-major).

    Attributes:
      suffix: parameter-name suffix (``"_l1_reverse"``; ``""`` for a cell).
      x: the layer's input [T, B, d] (after inter-layer dropout).
      h_prev: the hidden state each step started from [T, B, H_out].
      gate: index in ``Capture.grad_outputs`` of ``dL/dgi`` [T, B, G].
      reset: GRU only: the reset gate ``r_t`` [T, B, H].
      proj_in: LSTM with projections only: ``o_t * tanh(c_t)`` [T, B, H].
      proj: index in ``Capture.grad_outputs`` of ``dL/dh_t`` [T, B, P] (projections only).
      mask: the inter-layer dropout mask (scaled by ``1 / (1 - p)``) that ``x`` was
        multiplied by [T, B, d], or ``None``; kept for checking against a per-example loop.
    """

    suffix: str
    x: torch.Tensor
    h_prev: torch.Tensor
    gate: int
    reset: torch.Tensor | None = None
    proj_in: torch.Tensor | None = None
    proj: int | None = None
    mask: torch.Tensor | None = None


def _kind(module: nn.Module) -> Kind:
    if isinstance(module, nn.LSTM | nn.LSTMCell):
        return "lstm"
    if isinstance(module, nn.GRU | nn.GRUCell):
        return "gru"
    nonlinearity = getattr(module, "nonlinearity", "tanh")
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"unknown RNN nonlinearity {nonlinearity!r}")
    return "relu" if nonlinearity == "relu" else "tanh"


def _params(module: nn.Module, suffix: str) -> tuple[torch.Tensor | None, ...]:
    """``(w_ih, w_hh, b_ih, b_hh, w_hr)`` of layer/direction ``suffix`` (``""``: a cell)."""
    out = []
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"):
        p = getattr(module, name + suffix, None)
        out.append(p if isinstance(p, torch.Tensor) else None)
    if out[0] is None or out[1] is None:
        raise ValueError(f"{type(module).__name__} has no weight_ih{suffix}/weight_hh{suffix}")
    return tuple(out)


def _weights(module: nn.Module, suffix: str) -> Weights:
    """The parameters of layer/direction ``suffix``, detached."""
    w_ih, w_hh, b_ih, b_hh, w_hr = (
        None if p is None else p.detach() for p in _params(module, suffix)
    )
    assert w_ih is not None and w_hh is not None
    return Weights(w_ih, w_hh, b_ih, b_hh, w_hr)


def _suffix(layer: int, direction: int, cell: bool) -> str:
    return "" if cell else f"_l{layer}" + ("_reverse" if direction else "")


@dataclasses.dataclass(slots=True)
class _Call:
    """One call of a recurrent module or cell, as :class:`_Recurrence` runs it.

    Attributes:
      layout: how the call's input and output lie: ``"batch_first"``, ``"time_major"``,
        ``"packed"`` (``pack`` is the input) or ``"cell"`` ([B, d] -> [B, H], T = 1).
      index: packed input: row of the packed data -> ``t * B + b`` (original batch order).
      reuse: the module's own output ``(out [T, B, D*P] time-major, h_n, c_n, model
        outputs)``, or ``None`` (every layer run here: dropout between layers).
      gates: filled by the forward pass, per ``layer * dirs + direction``.
      masks: inter-layer dropout masks (scaled) per layer > 0, time-major.
    """

    module: nn.Module
    kind: Kind
    layers: int
    dirs: int
    hidden: int
    h_out: int
    steps: Steps
    layout: str
    pack: PackedSequence | None = None
    index: torch.Tensor | None = None
    reuse: tuple[Any, ...] | None = None
    dropout: float = 0.0
    gates: dict[int, Gates] = dataclasses.field(default_factory=dict)
    masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def to_time(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor in the call's input/output layout -> time-major padded [T, B, F]."""
        if self.layout == "cell":
            return t.unsqueeze(0)
        if self.layout == "time_major":
            return t
        if self.layout == "batch_first":
            return t.transpose(0, 1)
        assert self.index is not None
        steps, batch = self.steps.steps, self.steps.batch
        out = t.new_zeros(steps * batch, t.shape[-1])
        return out.index_copy_(0, self.index, t).view(steps, batch, -1)

    def from_time(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_time` (packed: the rows of the packed data)."""
        if self.layout == "cell":
            return t[0]
        if self.layout == "time_major":
            return t
        if self.layout == "batch_first":
            return t.transpose(0, 1)
        assert self.index is not None
        return t.reshape(-1, t.shape[-1]).index_select(0, self.index)


#: PyTorch's fused recurrent kernels, as ``torch.nn.RNNBase`` subclasses call them.
_FUSED: dict[str, Callable[..., Any]] = {
    "lstm": torch._VF.lstm,
    "gru": torch._VF.gru,
    "tanh": torch._VF.rnn_tanh,
    "relu": torch._VF.rnn_relu,
}


def _fused_layer(
    call: _Call, layer: int, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer (both directions) of the module by PyTorch's fused kernel, as its forward
    calls it (``torch.nn.RNNBase``), on the time-major padded input ``x``: ``(out [T, B,
    D*P] time-major padded, h_n [D, B, P], c_n)``, states in the original batch order."""
    module = call.module
    flat: list[torch.Tensor] = []
    for d in range(call.dirs):
        w = _weights(module, _suffix(layer, d, False))
        flat += [w.w_ih, w.w_hh]
        if w.b_ih is not None and w.b_hh is not None:
            flat += [w.b_ih, w.b_hh]
        if w.w_hr is not None:
            flat.append(w.w_hr)
    rows = slice(layer * call.dirs, (layer + 1) * call.dirs)
    h, c = h0[rows], None if c0 is None else c0[rows]
    fn = _FUSED[call.kind]
    bidir, bias = call.dirs == 2, bool(module.bias)
    if call.pack is None:
        hx: Any = h if c is None else (h, c)
        res = fn(x, hx, flat, bias, 1, 0.0, False, bidir, False)
        return res[0], res[1], res[2] if c is not None else None
    order, back = call.pack.sorted_indices, call.pack.unsorted_indices
    if order is not None:
        h = h.index_select(1, order)
        c = None if c is None else c.index_select(1, order)
    hx = h if c is None else (h, c)
    res = fn(call.from_time(x), call.pack.batch_sizes, hx, flat, bias, 1, 0.0, False, bidir)
    states = list(res[1:])
    if back is not None:
        states = [s.index_select(1, back) for s in states]
    return call.to_time(res[0]), states[0], states[1] if c is not None else None


def _inject(d: torch.Tensor, d_hn: torch.Tensor, steps: Steps, reverse: bool) -> torch.Tensor:
    """``d`` [T, B, P] (a copy) plus ``d_hn`` [B, P] at each sequence's final step."""
    d = d.clone()
    if reverse:
        d[0] += d_hn
    elif steps.last is None:
        d[-1] += d_hn
    else:
        rows = torch.arange(steps.batch, device=d.device)
        d.index_put_((steps.last, rows), d_hn, accumulate=True)
    return d


class _Recurrence(torch.autograd.Function):
    """The module's output as one autograd node whose backward is ours (module docstring).

    ``apply(call, x, h0, c0, *probes)``: ``x`` the call's input tensor (a packed input's
    data), ``h0``/``c0`` [L*D, B, .] (zeros when not given), the probes per layer and
    direction (gate, and projection's for LSTM with ``proj_size``). Returns ``(out, h_n,
    c_n)`` (no ``c_n`` unless LSTM), ``out`` in the call's layout.
    """

    @staticmethod
    def forward(
        ctx: Any,
        call: _Call,
        x: torch.Tensor,
        h0: torch.Tensor,
        c0: torch.Tensor | None,
        *probes: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        layer_in = call.to_time(x.detach())
        h0, c0 = h0.detach(), None if c0 is None else c0.detach()
        p = call.h_out
        h_n: list[torch.Tensor] = []
        c_n: list[torch.Tensor] = []
        for layer in range(call.layers):
            if layer > 0 and call.dropout > 0:
                keep = torch.empty_like(layer_in).bernoulli_(1.0 - call.dropout)
                call.masks[layer] = keep.div_(1.0 - call.dropout)
                layer_in = layer_in * call.masks[layer]
            if layer == call.layers - 1 and call.reuse is not None:
                out = call.reuse[0]
            else:
                out, hl, cl = _fused_layer(call, layer, layer_in, h0, c0)
                h_n.append(hl)
                if cl is not None:
                    c_n.append(cl)
            for d in range(call.dirs):
                k = layer * call.dirs + d
                init = (h0[k], None if c0 is None else c0[k])
                w = _weights(call.module, _suffix(layer, d, call.layout == "cell"))
                hs = out[..., d * p : (d + 1) * p]
                call.gates[k] = gates(call.kind, layer_in, hs, init, w, call.steps, d == 1)
            layer_in = out
        if call.reuse is not None:
            return tuple(t.detach() for t in call.reuse[3])
        result = [call.from_time(layer_in), torch.cat(h_n, 0)]
        if call.kind == "lstm":
            result.append(torch.cat(c_n, 0))
        if call.layout == "batch_first":
            result[0] = result[0].contiguous()
        return tuple(result)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        d_out = call.to_time(grads[0])
        d_hn, d_cn = grads[1], grads[2] if call.kind == "lstm" else None
        if call.layout == "cell":  # h' and c' are [B, H]
            d_hn, d_cn = d_hn.unsqueeze(0), None if d_cn is None else d_cn.unsqueeze(0)
        want_x, want_h0 = ctx.needs_input_grad[1], any(ctx.needs_input_grad[2:4])
        p = call.h_out
        results: dict[int, Backward] = {}
        d_h0: list[torch.Tensor | None] = [None] * (call.layers * call.dirs)
        d_c0: list[torch.Tensor | None] = [None] * (call.layers * call.dirs)
        d_x: torch.Tensor | None = None
        for layer in range(call.layers - 1, -1, -1):
            d_in: torch.Tensor | None = None
            for d in range(call.dirs):
                k = layer * call.dirs + d
                s = call.gates[k]
                ext = _inject(d_out[..., d * p : (d + 1) * p], d_hn[k], call.steps, d == 1)
                res = backward_through_time(
                    s, ext, None if d_cn is None else d_cn[k], call.steps, want_h0
                )
                results[k] = res
                d_h0[k], d_c0[k] = res.h0, res.c0
                if layer > 0 or want_x:
                    part = torch.matmul(res.gate, s.w.w_ih)
                    d_in = part if d_in is None else d_in.add_(part)
            if layer > 0:
                assert d_in is not None
                d_out = d_in * call.masks[layer] if layer in call.masks else d_in
            else:
                d_x = d_in
        probe_grads: list[torch.Tensor] = []
        for k in range(call.layers * call.dirs):
            # the probes are batch first (the step checks a target's batch dimension)
            probe_grads.append(results[k].gate.transpose(0, 1))
            if call.gates[k].proj_in is not None:
                probe_grads.append(results[k].h.transpose(0, 1))
        # contiguous: a layer upstream may read its output gradient as its own layout (a
        # GroupNorm's rule did not agree with the batch gradient on a strided one)
        dx = None if d_x is None or not want_x else call.from_time(d_x).contiguous()
        dh0 = torch.stack(d_h0, 0) if want_h0 and ctx.needs_input_grad[2] else None  # type: ignore[arg-type]
        dc0 = None
        if want_h0 and call.kind == "lstm" and ctx.needs_input_grad[3]:
            dc0 = torch.stack(d_c0, 0)  # type: ignore[arg-type]
        return (None, dx, dh0, dc0, *probe_grads)


class _WeightTap(torch.autograd.Function):
    """A zero probe [B, T, F] of one layer and direction, computed from its parameters.

    ``apply(tracks, key, shape, *params)``: the backward pass gets ``dL/dprobe`` (the
    per-example ``dL/dgi_t`` or ``dL/dh_t``) and returns the parameters' batch gradients,
    the sums over examples of the rule's per-example gradients; autograd runs it only when
    those are asked for (the coverage check). ``tracks[key]`` is filled by the forward pass
    of :class:`_Recurrence` (``("gate", k)``: params ``w_ih, w_hh, b_ih, b_hh``; ``("proj",
    k)``: ``w_hr``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        tracks: dict[int, Gates],
        key: tuple[str, int],
        shape: tuple[int, ...],
        *params: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.tracks, ctx.key = tracks, key
        ref = next(p for p in params if p is not None)
        return ref.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        what, k = ctx.key
        s: Gates = ctx.tracks[k]
        need = ctx.needs_input_grad[3:]
        g = g.transpose(0, 1)
        flat = g.reshape(-1, g.shape[-1])
        if what == "proj":
            assert s.proj_in is not None
            return (None, None, None, flat.t() @ s.proj_in.reshape(-1, s.proj_in.shape[-1]))
        gh = gate_grad_hh(s.reset, g).reshape(-1, g.shape[-1])
        out = [
            flat.t() @ s.x.reshape(-1, s.x.shape[-1]) if need[0] else None,
            gh.t() @ s.h_prev.reshape(-1, s.h_prev.shape[-1]) if need[1] else None,
            flat.sum(0) if need[2] else None,
            gh.sum(0) if need[3] else None,
        ]
        return (None, None, None, *out)


def _unbatched_error(module: nn.Module, shape: tuple[int, ...]) -> ValueError:
    """Why an unbatched call is refused, and what to pass instead."""
    name = type(module).__name__
    if isinstance(module, _RECURRENT):
        batched = (
            "[B, T, input_size] with batch_first=True (or [T, B, input_size] with "
            "batch_first=False), or a PackedSequence"
        )
    else:
        batched = "[B, input_size]"
    return ValueError(
        f"nn.{name} got an unbatched input of shape {shape}; per-example gradient clipping "
        f"needs a batch dimension: pass {batched}"
    )


def _call_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(input, hx)`` of a ``forward(input, hx=None)`` call, positional or by keyword."""
    inp = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return inp, hx


def _packed_steps(pack: PackedSequence) -> tuple[Steps, torch.Tensor]:
    """Steps of a packed input and its rows' places ``t * B + b`` (original batch order)."""
    sizes = pack.batch_sizes
    big_t, batch = len(sizes), int(sizes[0])
    device = pack.data.device
    sorted_valid = torch.arange(batch)[None, :] < sizes[:, None]  # [T, B] (t, sorted row)
    t_idx, j_idx = sorted_valid.nonzero(as_tuple=True)  # the packed data's row order
    t_idx, j_idx = t_idx.to(device), j_idx.to(device)
    rows = j_idx if pack.sorted_indices is None else pack.sorted_indices[j_idx]
    index = t_idx * batch + rows
    valid = torch.zeros(big_t * batch, dtype=torch.bool, device=device)
    valid[index] = True
    valid = valid.view(big_t, batch, 1)
    last = valid.sum(0).squeeze(-1) - 1
    return Steps(big_t, batch, valid, last), index


def _states(
    hx: Any, kind: Kind, shape: tuple[int, int, int, int], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h0, c0)`` as given (``c0``: LSTM only), zeros where not given; ``shape`` is
    ``(layers * dirs, B, H_out, H)``."""
    h0, c0 = hx if kind == "lstm" and hx is not None else (hx, None)
    if h0 is None:
        h0 = like.new_zeros(shape[:3])
    if kind == "lstm" and c0 is None:
        c0 = like.new_zeros((*shape[:2], shape[3]))
    return h0, c0


def _apply(
    call: _Call, x: torch.Tensor, init: tuple[torch.Tensor, torch.Tensor | None]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], tuple[Track, ...]]:
    """Run :class:`_Recurrence` with one probe per layer and direction (and projection):
    its outputs, the probes (the rule's targets) and the :class:`Track` s."""
    steps, module = call.steps, call.module
    probes: list[torch.Tensor] = []
    for layer in range(call.layers):
        for d in range(call.dirs):
            k = layer * call.dirs + d
            w_ih, w_hh, b_ih, b_hh, w_hr = _params(module, _suffix(layer, d, call.layout == "cell"))
            assert w_ih is not None
            shape = (steps.batch, steps.steps, w_ih.shape[0])
            probes.append(
                _WeightTap.apply(  # type: ignore[no-untyped-call]
                    call.gates, ("gate", k), shape, w_ih, w_hh, b_ih, b_hh
                )
            )
            if w_hr is not None:
                shape = (steps.batch, steps.steps, call.h_out)
                tap = _WeightTap.apply(call.gates, ("proj", k), shape, w_hr)  # type: ignore[no-untyped-call]
                probes.append(tap)
    outs = _Recurrence.apply(call, x, init[0], init[1], *probes)  # type: ignore[no-untyped-call]
    tracks: list[Track] = []
    i = 0
    for k in range(call.layers * call.dirs):
        s = call.gates[k]
        proj = i + 1 if s.proj_in is not None else None
        suffix = _suffix(k // call.dirs, k % call.dirs, call.layout == "cell")
        mask = call.masks.get(k // call.dirs)
        tracks.append(Track(suffix, s.x, s.h_prev, i, s.reset, s.proj_in, proj, mask))
        i += 2 if proj is not None else 1
    return outs, probes, tuple(tracks)


def recompute_recurrent(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Hand on a call of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` through :class:`_Recurrence`.

    Returns the module's output structure -- ``(output, h_n)``, LSTM ``(output, (h_n, c_n))``,
    ``output`` a tensor in the module's layout or a ``PackedSequence`` like the input -- with
    the probes ``(gate[, projection])`` per layer and direction as targets, and the
    :class:`Track` s as ``extra``.

    Raises:
      ValueError: an unbatched input (2-D tensor).
    """
    if not torch.is_grad_enabled():
        return None
    assert isinstance(module, _RECURRENT)
    inp, hx = _call_input(args, kwargs)
    kind = _kind(module)
    out, hidden = output
    dirs = 2 if module.bidirectional else 1
    h_out = module.proj_size if module.proj_size > 0 else module.hidden_size
    pack: PackedSequence | None = None
    index = None
    if isinstance(inp, PackedSequence):
        pack, x = inp, inp.data
        steps, index = _packed_steps(inp)
        layout = "packed"
    else:
        if inp.dim() != 3:
            raise _unbatched_error(module, tuple(inp.shape))
        x = inp
        layout = "batch_first" if module.batch_first else "time_major"
        big_t, batch = (x.shape[1], x.shape[0]) if module.batch_first else x.shape[:2]
        steps = Steps(big_t, batch)
    dropout = float(module.dropout) if module.training and module.num_layers > 1 else 0.0
    call = _Call(
        module, kind, module.num_layers, dirs, module.hidden_size, h_out, steps, layout,
        pack, index, dropout=dropout,
    )
    if dropout == 0.0:
        # the module's own output: the top layer's outputs, and what the model gets
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        data = out.data if isinstance(out, PackedSequence) else out
        call.reuse = (call.to_time(data.detach()), None, None, (data, *states))
    shape = (module.num_layers * dirs, steps.batch, h_out, module.hidden_size)
    outs, probes, tracks = _apply(call, x, _states(hx, kind, shape, x))
    first: Any = outs[0]
    if pack is not None:
        first = PackedSequence(first, pack.batch_sizes, pack.sorted_indices, pack.unsorted_indices)
    hidden_out: Any = (outs[1], outs[2]) if kind == "lstm" else outs[1]
    return Recomputed(output=(first, hidden_out), targets=tuple(probes), extra=tracks)


def recompute_cell(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Hand on a call of ``nn.RNNCell``/``nn.LSTMCell``/``nn.GRUCell`` (one time step) through
    :class:`_Recurrence` (T = 1, the cell's output reused).

    Returns ``h'`` (LSTMCell: ``(h', c')``), the probe as target and one :class:`Track`.

    Raises:
      ValueError: an unbatched input (1-D tensor).
    """
    if not torch.is_grad_enabled():
        return None
    assert isinstance(module, _CELLS)
    inp, hx = _call_input(args, kwargs)
    if inp.dim() != 2:
        raise _unbatched_error(module, tuple(inp.shape))
    kind = _kind(module)
    hidden = module.hidden_size
    call = _Call(module, kind, 1, 1, hidden, hidden, Steps(1, inp.shape[0]), "cell")
    states = output if isinstance(output, tuple) else (output,)
    call.reuse = (states[0].detach().unsqueeze(0), None, None, (states[0], *states))
    if kind == "lstm" and hx is not None:
        h, c = hx
    else:
        h, c = hx, None
    h = inp.new_zeros(inp.shape[0], hidden) if h is None else h
    if kind == "lstm" and c is None:
        c = inp.new_zeros(inp.shape[0], hidden)
    init = (h.unsqueeze(0), None if c is None else c.unsqueeze(0))
    outs, probes, tracks = _apply(call, inp, init)
    new: Any = outs[1] if kind != "lstm" else (outs[1], outs[2])
    return Recomputed(output=new, targets=tuple(probes), extra=tracks)


def _form(
    a: list[torch.Tensor],
    g: list[torch.Tensor],
    group_size: int,
    weight: tuple[str, torch.Tensor] | None,
    bias: tuple[str, torch.Tensor | None] | None,
) -> tuple[LinearForm, dict[str, Slot]] | None:
    """One weight (and bias) as a linear form over all calls' steps (concatenated along T).

    ``a``/``g``: per call [T, B, d] / [T, B, o]; ``weight``/``bias``: (name, parameter);
    frozen or absent parameters are not reported. ``None`` when nothing is trainable.
    """
    w_name = weight[0] if weight is not None and weight[1].requires_grad else None
    b_name = None
    if bias is not None and bias[1] is not None and bias[1].requires_grad:
        b_name = bias[0]
    if w_name is None and b_name is None:
        return None
    assert weight is not None
    acts = (a[0] if len(a) == 1 else torch.cat(a, 0)).transpose(0, 1)
    grads = (g[0] if len(g) == 1 else torch.cat(g, 0)).transpose(0, 1)
    acts, grads = fold_linear_form(acts.unsqueeze(1), grads.unsqueeze(1), group_size)
    form = LinearForm(acts, grads, weight[1].shape, weight_name=w_name, bias_name=b_name)
    slots: dict[str, Slot] = {n: (n, None) for n in (w_name, b_name) if n is not None}
    return form, slots


def _gate_forms(
    items: list[tuple[Track, torch.Tensor, torch.Tensor | None]],
    g_ih: list[torch.Tensor],
    group_size: int,
    suffix: str,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
) -> list[tuple[LayerGrads, dict[str, Slot]] | None]:
    """``weight_ih``/``weight_hh`` and biases of one layer and direction: one
    :class:`GateForm` (ghost norms sharing the gate gradients' Gram matrix) when it is the
    cheaper, else one materialising :class:`LinearForm` per weight."""
    w_ih, w_hh, b_ih, b_hh = params
    g_hh = [gate_grad_hh(tr.reset, g) for tr, g, _ in items]
    steps = sum(g.shape[0] for g in g_ih)
    gate, d, p = w_ih.shape[0], w_ih.shape[1], w_hh.shape[1]
    if ghost_cheaper(steps * group_size, gate, d, p):
        names = tuple(
            f"{n}{suffix}" if t is not None and t.requires_grad else None
            for n, t in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), params, strict=True)
        )
        if all(n is None for n in names):
            return []

        def cat(ts: list[torch.Tensor]) -> torch.Tensor:
            return ts[0] if len(ts) == 1 else torch.cat(ts, 0)

        reset = items[0][0].reset is not None
        form = GateForm(
            cat([tr.x for tr, _, _ in items]), cat([tr.h_prev for tr, _, _ in items]),
            cat(g_ih), cat(g_hh) if reset else None, names, group_size,  # type: ignore[arg-type]
        )
        return [(form, {n: (n, None) for n in names if n is not None})]
    return [
        _form(
            [tr.x for tr, _, _ in items], g_ih, group_size,
            ("weight_ih" + suffix, w_ih), ("bias_ih" + suffix, b_ih),
        ),
        _form(
            [tr.h_prev for tr, _, _ in items], g_hh, group_size,
            ("weight_hh" + suffix, w_hh), ("bias_hh" + suffix, b_hh),
        ),
    ]


def recurrent_rule(module: nn.Module, captures: list[Capture], group_size: int) -> LayerGrads:
    """Rule for the recurrent layers and cells: one :class:`LinearForm` per weight.

    ``captures`` carry the :class:`Track` s of :func:`recompute_recurrent` or
    :func:`recompute_cell` as ``extra`` and the targets' gradients (already multiplied by
    each example's weight) as ``grad_outputs``.
    """
    by_suffix: dict[str, list[tuple[Track, torch.Tensor, torch.Tensor | None]]] = {}
    for cap in captures:
        tracks: tuple[Track, ...] = cap.extra
        for tr in tracks:
            # the probes' gradients are batch first, views of time-major tensors
            g_proj = None if tr.proj is None else cap.grad_outputs[tr.proj].transpose(0, 1)
            g_gate = cap.grad_outputs[tr.gate].transpose(0, 1)
            by_suffix.setdefault(tr.suffix, []).append((tr, g_gate, g_proj))
    parts: list[tuple[LayerGrads, dict[str, Slot]]] = []
    for suffix, items in by_suffix.items():
        w_ih, w_hh, b_ih, b_hh, w_hr = _params(module, suffix)
        assert w_ih is not None and w_hh is not None
        g_ih = [g for _, g, _ in items]
        forms = _gate_forms(items, g_ih, group_size, suffix, (w_ih, w_hh, b_ih, b_hh))
        if w_hr is not None:
            forms.append(
                _form(
                    [tr.proj_in for tr, _, _ in items if tr.proj_in is not None],
                    [gp for _, _, gp in items if gp is not None],
                    group_size,
                    ("weight_hr" + suffix, w_hr),
                    None,
                )
            )
        parts.extend(f for f in forms if f is not None)
    shapes = {
        n: p.shape for n, p in module.named_parameters(recurse=False) if p.requires_grad
    }
    return CompositeGrads(parts, shapes)


register_norm_rule(*_RECURRENT, recompute=recompute_recurrent)(recurrent_rule)
register_norm_rule(*_CELLS, recompute=recompute_cell)(recurrent_rule)


# Opacus rebuilds nn.RNN / nn.GRU / nn.LSTM from one Linear module per gate so that its hooks
# see each weight; its final states are [layers * directions, batch, hidden] whatever
# batch_first says, so no per-example rule can read the call. torch's classes are clipped
# exactly above, with the same constructor and state_dict keys.
for _opacus, _torch in (("DPRNN", "RNN"), ("DPGRU", "GRU"), ("DPLSTM", "LSTM")):
    register_unsupported(
        f"opacus.layers.dp_rnn.{_opacus}",
        reason=(
            f"Opacus' {_opacus} rebuilds nn.{_torch} from one Linear module per gate and "
            "returns its final states as [layers * directions, batch, hidden] even with "
            "batch_first=True, so its per-example gradients cannot be taken from its calls."
        ),
        fix=(
            f"use torch.nn.{_torch} (dpfy.opacus.layers.{_opacus} is torch.nn.{_torch}), which "
            "dpfy clips exactly, with the same constructor arguments; it loads the layer's "
            f"weights as they are: new.load_state_dict(old.state_dict())."
        ),
    )

"""Recurrent layers: exact per-example gradients of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` and cells.

PyTorch runs these layers as fused kernels whose gate pre-activations never reach Python, so
each call is *recomputed* (``register_norm_rule(..., recompute=...)``): the recurrence is
unrolled in Python with the module's own parameters, that output replaces the module's
output for the rest of the model, and the tensors the parameter gradients need are autograd
targets. Per layer and direction (a cell is one layer, one direction, one step per call):

* ``gi = x W_ih^T + b_ih`` [B, T, G] for all time steps in one GEMM (G = 4H for LSTM, 3H for
  GRU, H for RNN). For RNN and LSTM the gates see ``gi_t + gh_t`` with
  ``gh_t = h_{t-1} W_hh^T + b_hh``, so both have the same gradient and ``b_hh`` is folded into
  ``gi``: one target serves both weights. For GRU, ``n_t = tanh(gi_n + r_t * gh_n)``, so the
  gradient of ``gh_t`` is the one of ``gi_t`` with its n block multiplied by ``r_t`` (kept,
  detached): again one target.
* LSTM with projections (``proj_size > 0``): ``h_t = (o_t * tanh(c_t)) W_hr^T``; its gradient
  (through the output and the recurrence) comes from a zero *probe* [B, T, P] added to each
  ``h_t`` (a leaf that requires grad; ``unbind`` hands its gradient back as one tensor).

Per example n every weight gradient is then a sum over time of outer products, i.e. a
:class:`~dpfy.training.norms.linear.LinearForm` (ghost norms or materialised, by cost):

* ``W_ih``: A = layer input ``x_t`` [T, d], G = ``dL/dgi_t``; ``b_ih = sum_t G``;
* ``W_hh``: A = ``h_{t-1}`` [T, H_out], G = ``dL/dgh_t``; ``b_hh = sum_t G``;
* ``W_hr``: A = ``o_t * tanh(c_t)`` [T, H], G = ``dL/dh_t``.

Several calls of one module (a cell in a Python loop over time) are concatenated along T.

A :class:`~torch.nn.utils.rnn.PackedSequence` is padded (batch in its original order), run
with a per-step validity mask (``h = where(valid_t, h_new, h)``: the reverse direction starts
at each sequence's own last element from ``h0``; padded outputs are zero) and packed again
with the input's ``batch_sizes``/``sorted_indices``, so the model sees the module's own
``PackedSequence``; ``h_n``/``c_n`` are in the original batch order, as the module returns
them. Inter-layer dropout in training mode draws its own mask (the output is replaced, so the
model and the gradients see that mask). Unbatched inputs are refused: a per-example gradient
needs a batch dimension.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from dpfy.training.norms.composite import CompositeGrads, Slot
from dpfy.training.norms.linear import LinearForm, fold_linear_form
from dpfy.training.norms.registry import (
    Capture,
    LayerGrads,
    Recomputed,
    register_norm_rule,
    register_unsupported,
)

#: The recurrence of a layer: RNN with tanh or ReLU, LSTM, GRU.
Kind = Literal["tanh", "relu", "lstm", "gru"]

_RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)
_CELLS = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)


@dataclasses.dataclass(frozen=True, slots=True)
class _Weights:
    """One layer and direction's parameters (``None``: absent, e.g. ``bias=False``)."""

    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None


@dataclasses.dataclass(frozen=True, slots=True)
class Track:
    """What one layer and direction of a call leaves for the rule (detached, batch first).

    Attributes:
      suffix: parameter-name suffix (``"_l1_reverse"``; ``""`` for a cell).
      x: the layer's input [B, T, d] (after inter-layer dropout).
      h_prev: the hidden state each step started from [B, T, H_out], in time order.
      gate: index in ``Capture.grad_outputs`` of ``dL/dgi`` [B, T, G].
      reset: GRU only: the reset gate ``r_t`` [B, T, H].
      proj_in: LSTM with projections only: ``o_t * tanh(c_t)`` [B, T, H].
      proj: index in ``Capture.grad_outputs`` of ``dL/dh_t`` [B, T, P] (projections only).
    """

    suffix: str
    x: torch.Tensor
    h_prev: torch.Tensor
    gate: int
    reset: torch.Tensor | None = None
    proj_in: torch.Tensor | None = None
    proj: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Direction:
    """Result of running one layer and direction over [B, T] (see :func:`_run_direction`)."""

    out: torch.Tensor  # [B, T, H_out], zero at invalid steps
    h_n: torch.Tensor  # [B, H_out]
    c_n: torch.Tensor | None  # [B, H] (LSTM)
    gi: torch.Tensor  # target [B, T, G]
    probe: torch.Tensor | None  # target [B, T, P] (projections)
    h_prev: torch.Tensor  # [B, T, H_out], detached
    reset: torch.Tensor | None  # [B, T, H], detached (GRU)
    proj_in: torch.Tensor | None  # [B, T, H], detached (projections)


def _kind(module: nn.Module) -> Kind:
    if isinstance(module, nn.LSTM | nn.LSTMCell):
        return "lstm"
    if isinstance(module, nn.GRU | nn.GRUCell):
        return "gru"
    nonlinearity = getattr(module, "nonlinearity", "tanh")
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"unknown RNN nonlinearity {nonlinearity!r}")
    return "relu" if nonlinearity == "relu" else "tanh"


def _weights(module: nn.Module, suffix: str) -> _Weights:
    """The parameters of layer/direction ``suffix`` (``""`` for a cell)."""

    def get(name: str) -> torch.Tensor | None:
        p = getattr(module, name + suffix, None)
        return p if isinstance(p, torch.Tensor) else None

    w_ih, w_hh = get("weight_ih"), get("weight_hh")
    if w_ih is None or w_hh is None:
        raise ValueError(f"{type(module).__name__} has no weight_ih{suffix}/weight_hh{suffix}")
    return _Weights(w_ih, w_hh, get("bias_ih"), get("bias_hh"), get("weight_hr"))


def _as_target(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an autograd target: a tensor computed from nothing trainable becomes a leaf
    that requires grad (its gradient is still the one of the loss w.r.t. its value)."""
    return t if t.requires_grad else t.requires_grad_()


def _run_direction(
    kind: Kind,
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor | None,
    w: _Weights,
    valid: torch.Tensor | None,
    reverse: bool,
) -> _Direction:
    """Unroll one layer and direction exactly as PyTorch's cells compute it.

    Args:
      kind: the recurrence.
      x: layer input [B, T, d] (any strides).
      h: initial hidden state [B, H_out]; ``c``: initial cell state [B, H] (LSTM, else None).
      w: the layer's parameters.
      valid: bool mask [B, T, 1] of the steps inside each sequence (packed input), or
        ``None`` (every sequence runs for T steps).
      reverse: run from t = T-1 down to 0.
    """
    steps_t = x.shape[1]
    if kind == "gru" or w.b_hh is None:
        bias = w.b_ih
    else:
        bias = w.b_hh if w.b_ih is None else w.b_ih + w.b_hh
    gi = _as_target(F.linear(x, w.w_ih, bias))
    gi_steps = gi.unbind(1)
    w_hh_t = w.w_hh.t()
    probe: torch.Tensor | None = None
    probes: tuple[torch.Tensor, ...] = ()
    w_hr_t = None if w.w_hr is None else w.w_hr.t()
    if w.w_hr is not None:
        probe = torch.zeros(
            x.shape[0], steps_t, w.w_hr.shape[0], dtype=gi.dtype, device=gi.device,
            requires_grad=True,
        )
        probes = probe.unbind(1)
    prevs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    resets: list[torch.Tensor] = []
    proj_ins: list[torch.Tensor] = []
    valid_steps = () if valid is None else valid.unbind(1)
    order = range(steps_t - 1, -1, -1) if reverse else range(steps_t)
    for t in order:
        prevs.append(h)
        c_new = None
        if kind == "gru":
            gh = F.linear(h, w.w_hh, w.b_hh)
            i_r, i_z, i_n = gi_steps[t].chunk(3, 1)
            h_r, h_z, h_n = gh.chunk(3, 1)
            r = torch.sigmoid(i_r + h_r)
            z = torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h_new = n + z * (h - n)
            resets.append(r)
        else:
            pre = torch.addmm(gi_steps[t], h, w_hh_t)
            if kind == "tanh":
                h_new = torch.tanh(pre)
            elif kind == "relu":
                h_new = torch.relu(pre)
            else:
                assert c is not None
                i, f, g, o = pre.chunk(4, 1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                if w_hr_t is not None:
                    proj_ins.append(h_new)
                    h_new = torch.addmm(probes[t], h_new, w_hr_t)
        if valid is None:
            h = h_new
            c = c_new if c_new is not None else c
        else:
            h = torch.where(valid_steps[t], h_new, h)
            if c_new is not None:
                assert c is not None
                c = torch.where(valid_steps[t], c_new, c)
        states.append(h)

    def in_time_order(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs[::-1] if reverse else xs

    out = torch.stack(in_time_order(states), 1)
    if valid is not None:
        out = out.masked_fill(~valid, 0.0)

    def stacked(xs: list[torch.Tensor]) -> torch.Tensor | None:
        return torch.stack(in_time_order(xs), 1).detach() if xs else None

    h_prev = torch.stack(in_time_order(prevs), 1).detach()
    return _Direction(out, h, c, gi, probe, h_prev, stacked(resets), stacked(proj_ins))


def _track(
    result: _Direction, suffix: str, x: torch.Tensor, targets: list[torch.Tensor]
) -> Track:
    """Append ``result``'s targets to ``targets`` and record where they went."""
    gate = len(targets)
    targets.append(result.gi)
    proj = None
    if result.probe is not None:
        proj = len(targets)
        targets.append(result.probe)
    return Track(suffix, x, result.h_prev, gate, result.reset, result.proj_in, proj)


def _call_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(input, hx)`` of a ``forward(input, hx=None)`` call, positional or by keyword."""
    inp = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return inp, hx


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


def recompute_recurrent(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Recompute a call of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` (see the module docstring).

    Returns the module's output structure -- ``(output, h_n)``, LSTM ``(output, (h_n, c_n))``,
    ``output`` a tensor in the module's layout or a ``PackedSequence`` like the input -- with
    targets ``(gi[, probe])`` per layer and direction, and the :class:`Track` s as ``extra``.

    Raises:
      ValueError: an unbatched input (2-D tensor).
    """
    if not torch.is_grad_enabled():
        return None
    assert isinstance(module, _RECURRENT)
    inp, hx = _call_input(args, kwargs)
    kind = _kind(module)
    if isinstance(inp, PackedSequence):
        x, lengths = pad_packed_sequence(inp, batch_first=True)
        steps = torch.arange(x.shape[1], device=x.device)
        valid: torch.Tensor | None = (
            steps[None, :] < lengths.to(x.device)[:, None]
        ).unsqueeze(-1)  # [B, T, 1]
    else:
        if inp.dim() != 3:
            raise _unbatched_error(module, tuple(inp.shape))
        x = inp if module.batch_first else inp.transpose(0, 1)
        valid = None
    batch = x.shape[0]
    dirs = 2 if module.bidirectional else 1
    hidden = module.hidden_size
    h_out = module.proj_size if module.proj_size > 0 else hidden
    if kind == "lstm" and hx is not None:
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    if h0 is None:
        h0 = x.new_zeros(module.num_layers * dirs, batch, h_out)
    if kind == "lstm" and c0 is None:
        c0 = x.new_zeros(module.num_layers * dirs, batch, hidden)
    targets: list[torch.Tensor] = []
    tracks: list[Track] = []
    h_n: list[torch.Tensor] = []
    c_n: list[torch.Tensor] = []
    layer_in = x
    for layer in range(module.num_layers):
        if layer > 0 and module.dropout > 0 and module.training:
            layer_in = F.dropout(layer_in, module.dropout, training=True)
        x_saved = layer_in.detach()
        outs = []
        for d in range(dirs):
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            k = layer * dirs + d
            res = _run_direction(
                kind, layer_in, h0[k], None if c0 is None else c0[k],
                _weights(module, suffix), valid, reverse=d == 1,
            )
            tracks.append(_track(res, suffix, x_saved, targets))
            outs.append(res.out)
            h_n.append(res.h_n)
            if res.c_n is not None:
                c_n.append(res.c_n)
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, -1)
    out: Any
    if isinstance(inp, PackedSequence):
        out = _repack(layer_in, inp, lengths)
    else:
        out = layer_in if module.batch_first else layer_in.transpose(0, 1).contiguous()
    hidden_out: Any = torch.stack(h_n, 0)
    if kind == "lstm":
        hidden_out = (hidden_out, torch.stack(c_n, 0))
    return Recomputed(output=(out, hidden_out), targets=tuple(targets), extra=tuple(tracks))


def _repack(out: torch.Tensor, like: PackedSequence, lengths: torch.Tensor) -> PackedSequence:
    """Padded output [B, T, F] in the original batch order -> a PackedSequence with ``like``'s
    ``batch_sizes`` and sorted/unsorted indices (the layout the module returns)."""
    if like.sorted_indices is not None:
        out = out.index_select(0, like.sorted_indices)
        lengths = lengths[like.sorted_indices.to(lengths.device)]
    data = pack_padded_sequence(out, lengths, batch_first=True, enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


def recompute_cell(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Recomputed | None:
    """Recompute a call of ``nn.RNNCell``/``nn.LSTMCell``/``nn.GRUCell`` (one time step).

    Returns ``h'`` (LSTMCell: ``(h', c')``), targets ``(gi,)`` and one :class:`Track` (T = 1).

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
    if kind == "lstm" and hx is not None:
        h, c = hx
    else:
        h, c = hx, None
    if h is None:
        h = inp.new_zeros(inp.shape[0], module.hidden_size)
    if kind == "lstm" and c is None:
        c = inp.new_zeros(inp.shape[0], module.hidden_size)
    x = inp.unsqueeze(1)
    res = _run_direction(kind, x, h, c, _weights(module, ""), None, reverse=False)
    targets: list[torch.Tensor] = []
    track = _track(res, "", x.detach(), targets)
    new: Any = res.h_n if res.c_n is None else (res.h_n, res.c_n)
    return Recomputed(output=new, targets=tuple(targets), extra=(track,))


def _grad_hh(track: Track, g_ih: torch.Tensor) -> torch.Tensor:
    """``dL/dgh`` [B, T, G] from ``dL/dgi``: equal for RNN/LSTM; GRU: n block times r_t."""
    if track.reset is None:
        return g_ih
    hidden = track.reset.shape[-1]
    return torch.cat([g_ih[..., : 2 * hidden], track.reset * g_ih[..., 2 * hidden :]], -1)


def _form(
    a: list[torch.Tensor],
    g: list[torch.Tensor],
    group_size: int,
    weight: tuple[str, torch.Tensor] | None,
    bias: tuple[str, torch.Tensor | None] | None,
) -> tuple[LinearForm, dict[str, Slot]] | None:
    """One weight (and bias) as a linear form over all calls' steps (concatenated along T).

    ``a``/``g``: per call [B, T, d] / [B, T, o]; ``weight``/``bias``: (name, parameter);
    frozen or absent parameters are not reported. ``None`` when nothing is trainable.
    """
    w_name = weight[0] if weight is not None and weight[1].requires_grad else None
    b_name = None
    if bias is not None and bias[1] is not None and bias[1].requires_grad:
        b_name = bias[0]
    if w_name is None and b_name is None:
        return None
    assert weight is not None
    acts = a[0] if len(a) == 1 else torch.cat(a, 1)
    grads = g[0] if len(g) == 1 else torch.cat(g, 1)
    acts, grads = fold_linear_form(acts.unsqueeze(1), grads.unsqueeze(1), group_size)
    form = LinearForm(acts, grads, weight[1].shape, weight_name=w_name, bias_name=b_name)
    slots: dict[str, Slot] = {n: (n, None) for n in (w_name, b_name) if n is not None}
    return form, slots


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
            g_proj = None if tr.proj is None else cap.grad_outputs[tr.proj]
            by_suffix.setdefault(tr.suffix, []).append((tr, cap.grad_outputs[tr.gate], g_proj))
    parts: list[tuple[LayerGrads, dict[str, Slot]]] = []
    for suffix, items in by_suffix.items():
        w = _weights(module, suffix)
        g_ih = [g for _, g, _ in items]
        forms = [
            _form(
                [tr.x for tr, _, _ in items], g_ih, group_size,
                ("weight_ih" + suffix, w.w_ih), ("bias_ih" + suffix, w.b_ih),
            ),
            _form(
                [tr.h_prev for tr, _, _ in items],
                [_grad_hh(tr, g) for tr, g, _ in items],
                group_size,
                ("weight_hh" + suffix, w.w_hh),
                ("bias_hh" + suffix, w.b_hh),
            ),
        ]
        if w.w_hr is not None:
            forms.append(
                _form(
                    [tr.proj_in for tr, _, _ in items if tr.proj_in is not None],
                    [gp for _, _, gp in items if gp is not None],
                    group_size,
                    ("weight_hr" + suffix, w.w_hr),
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

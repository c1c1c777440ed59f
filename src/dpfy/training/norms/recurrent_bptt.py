"""Gates and backpropagation through time of one recurrent layer and direction, in batched ops.

Given what a layer computed -- its input ``x_t`` and the hidden states ``h_t`` it output (the
module's own fused output, or a fused call per layer) -- every gate pre-activation follows
from ``x_t`` and ``h_{t-1}`` in two GEMMs over all time steps at once; only the LSTM's cell
state ``c_t = f_t c_{t-1} + i_t g_t`` is a sequential scan, elementwise. :func:`gates`
keeps, per step, the factors that turn the gradient of the hidden (and cell) state into the
gradient of the pre-activations; :func:`backward_through_time` then runs the recurrence
backwards (Werbos 1990, "Backpropagation through time: what it does and how to do it") with
one GEMM and three or four elementwise operations per step, giving ``dL/dgi_t`` for every
step and example: the per-example weight gradients are sums over time of outer products
(``recurrent.py``). Notation and gate layouts are PyTorch's (``torch.nn.LSTM``: gates
``i, f, g, o``; ``torch.nn.GRU``: ``r, z, n`` with ``n = tanh(gi_n + r * (W_hn h + b_hn))``).

Tensors here are time-major, ``[T, B, ...]``, so that each step's slice is contiguous.
Sequences of different lengths (a ``PackedSequence``) run with a validity mask: at a step
outside its sequence every factor is zero and the cell state's forget factor one, so the
states pass through unchanged and nothing flows into the gradients (the reverse direction
starts at each sequence's last step from ``h0``/``c0``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

#: The recurrence of a layer: RNN with tanh or ReLU, LSTM, GRU.
Kind = Literal["tanh", "relu", "lstm", "gru"]


@dataclasses.dataclass(frozen=True, slots=True)
class Weights:
    """One layer and direction's parameters, detached (``None``: absent, ``bias=False``)."""

    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None
    b_hh: torch.Tensor | None
    w_hr: torch.Tensor | None


@dataclasses.dataclass(frozen=True, slots=True)
class Steps:
    """Where each sequence of a call runs, time-major.

    Attributes:
      valid: bool [T, B, 1], the steps inside each sequence; ``None``: all run T steps.
      last: [B] each sequence's last step (with ``valid``).
    """

    steps: int
    batch: int
    valid: torch.Tensor | None = None
    last: torch.Tensor | None = None

    def first(self, reverse: bool) -> torch.Tensor | int:
        """The step each sequence starts from: 0, or its last step in reverse."""
        if not reverse:
            return 0
        return self.steps - 1 if self.last is None else self.last

    def masked(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [T, B, F] with zeros outside the sequences (in place)."""
        return t if self.valid is None else t.mul_(self.valid)


@dataclasses.dataclass(slots=True)
class Gates:
    """What the backward pass of one layer and direction needs (see :func:`gates`).

    Attributes:
      x: input [T, B, d]; h_prev: the state each step started from [T, B, P].
      k: [T, B, G]: ``dL/dpre = (dL/dc or dL/dh) * k`` (per gate block; GRU: times ``dL/dh``).
      kh: GRU: [T, B, 3H], ``dL/dgh = dL/dh * kh``; ``z``: GRU's update gate (masked).
      a: LSTM: [T, B, H], ``dL/dc += dL/dh * a``; ``f``: the forget gate (one off-sequence).
      proj_in: LSTM with projections: ``o * tanh(c)`` [T, B, H].
      reset: GRU: the reset gate ``r`` [T, B, H] (``dL/dgh`` of the n block is ``r`` times
        ``dL/dgi``'s).
    """

    kind: Kind
    reverse: bool
    w: Weights
    x: torch.Tensor
    h_prev: torch.Tensor
    k: torch.Tensor
    kh: torch.Tensor | None = None
    z: torch.Tensor | None = None
    a: torch.Tensor | None = None
    f: torch.Tensor | None = None
    proj_in: torch.Tensor | None = None
    reset: torch.Tensor | None = None


def previous_states(
    hs: torch.Tensor, h0: torch.Tensor, steps: Steps, reverse: bool, out: torch.Tensor
) -> torch.Tensor:
    """``h_{t-1}`` of each step [T, B, P] from the outputs ``hs``, written into ``out``."""
    if not reverse:
        out[0] = h0
        out[1:] = hs[:-1]
        return out
    out[-1] = h0
    out[:-1] = hs[1:]
    if steps.valid is not None:
        # reverse: step t continues from t + 1 inside the sequence, else starts from h0
        start = torch.cat([~steps.valid[1:], steps.valid.new_ones(1, *steps.valid.shape[1:])], 0)
        torch.where(start, h0.unsqueeze(0), out, out=out)
    return out


def _gemm_in(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` over all steps: [T, B, in] -> [T, B, out] (one GEMM)."""
    t, b, d = x.shape
    flat = x.reshape(t * b, d)
    out = torch.mm(flat, w.t()) if bias is None else torch.addmm(bias, flat, w.t())
    return out.view(t, b, -1)


def _blocks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The ``n`` equal blocks of the last dimension of ``t`` (views)."""
    size = t.shape[-1] // n
    return [t[..., j * size : (j + 1) * size] for j in range(n)]


def _tanh(t: torch.Tensor) -> torch.Tensor:
    """``tanh(t) = 2 sigmoid(2 t) - 1``, in place: one vectorised sigmoid, cheaper on CPU
    than ``torch.tanh`` (error at the rounding level of the dtype)."""
    return torch.sigmoid(t.mul_(2.0), out=t).mul_(2.0).sub_(1.0)


def gates(
    kind: Kind,
    x: torch.Tensor,
    hs: torch.Tensor,
    init: tuple[torch.Tensor, torch.Tensor | None],
    w: Weights,
    steps: Steps,
    reverse: bool,
) -> Gates:
    """Recompute one layer and direction's gates from its input and outputs (no autograd).

    Args:
      x: the layer's input [T, B, d] (zero off-sequence); hs: its outputs [T, B, P].
      init: ``(h0 [B, P], c0 [B, H] or None)``.
    """
    h0, c0 = init
    big_t, batch, d = x.shape
    p = hs.shape[-1]
    # [x_t, h_{t-1}] side by side: the LSTM's pre-activations are one GEMM with [W_ih, W_hh]
    xh = x.new_empty(big_t, batch, d + p)
    xh[..., :d] = x
    h_prev = previous_states(hs, h0, steps, reverse, xh[..., d:])
    x = xh[..., :d]
    if kind in ("tanh", "relu"):
        # the derivative of the nonlinearity at each step, read off its output
        k = 1.0 - hs * hs if kind == "tanh" else (hs > 0).to(hs.dtype)
        return Gates(kind, reverse, w, x, h_prev, steps.masked(k))
    if kind == "gru":
        return _gru_gates(x, h_prev, w, steps, reverse)
    assert c0 is not None
    bias = w.b_hh if w.b_ih is None else (w.b_ih if w.b_hh is None else w.b_ih + w.b_hh)
    w_cat = torch.cat([w.w_ih, w.w_hh], 1)
    pre = _gemm_in(xh, w_cat, bias)
    # sigmoid of every gate; the g block as tanh = 2 sigmoid(2 .) - 1 in the same call
    i, f, g, o = _blocks(pre, 4)
    g.mul_(2.0)
    act = torch.sigmoid(pre, out=pre)
    g.mul_(2.0).sub_(1.0)
    u = i * g
    if steps.valid is not None:  # off-sequence: c passes through unchanged
        f = torch.where(steps.valid, f, 1.0)
        u.mul_(steps.valid)
    c = torch.empty_like(u)
    state = c0
    for t in range(big_t - 1, -1, -1) if reverse else range(big_t):
        torch.addcmul(u[t], f[t], state, out=c[t])
        state = c[t]
    if reverse:
        c_prev = torch.cat([c[1:], c0.unsqueeze(0)], 0)
    else:
        c_prev = torch.cat([c0.unsqueeze(0), c[:-1]], 0)
    tc = _tanh(c)  # c itself is not needed any more
    hu = o * tc  # the hidden state before any projection
    # d tanh(c)/dc and the sigmoid/tanh derivatives, all steps at once, reusing u = i g and
    # hu = o tanh(c): a = o (1 - tanh(c)^2), ki = g i (1 - i), kf = c_prev f (1 - f),
    # kg = i (1 - g^2), ko = tanh(c) o (1 - o)
    a = steps.masked(torch.addcmul(o, hu, tc, value=-1.0))
    k = torch.empty_like(act)
    ki, kf, kg, ko = _blocks(k, 4)
    torch.addcmul(u, u, i, value=-1.0, out=ki)
    torch.mul(c_prev, torch.addcmul(f, f, f, value=-1.0), out=kf)
    torch.addcmul(i, u, g, value=-1.0, out=kg)
    torch.addcmul(hu, hu, o, value=-1.0, out=ko)
    proj_in = hu if w.w_hr is not None else None
    return Gates(kind, reverse, w, x, h_prev, steps.masked(k), a=a, f=f, proj_in=proj_in)


def _gru_gates(
    x: torch.Tensor, h_prev: torch.Tensor, w: Weights, steps: Steps, reverse: bool
) -> Gates:
    """GRU: ``h = (1 - z) n + z h_prev``; no scan (``h_prev`` is known at every step)."""
    gi = _gemm_in(x, w.w_ih, w.b_ih)
    gh = _gemm_in(h_prev, w.w_hh, w.b_hh)
    hidden = gi.shape[-1] // 3
    rz = torch.sigmoid(gi[..., : 2 * hidden] + gh[..., : 2 * hidden])
    r, z = rz[..., :hidden], rz[..., hidden:]
    gh_n = gh[..., 2 * hidden :]
    n = torch.tanh(torch.addcmul(gi[..., 2 * hidden :], r, gh_n))
    k = torch.empty_like(gi)
    kr, kz, kn = _blocks(k, 3)
    torch.mul(1.0 - z, 1.0 - n * n, out=kn)
    torch.mul(h_prev - n, z * (1.0 - z), out=kz)
    torch.mul(kn, gh_n * r * (1.0 - r), out=kr)
    k = steps.masked(k)
    kh = k.clone()
    kh[..., 2 * hidden :].mul_(r)
    z = steps.masked(z.clone())
    return Gates("gru", reverse, w, x, h_prev, k, kh=kh, z=z, reset=r)


@dataclasses.dataclass(frozen=True, slots=True)
class Backward:
    """Gradients of one layer and direction (time-major).

    Attributes:
      gate: ``dL/dgi_t`` [T, B, G] (for RNN/LSTM also ``dL/dgh_t``).
      h: ``dL/dh_t`` [T, B, P] (the total gradient of each output state).
      h0, c0: gradients of the initial states (``None`` unless asked for).
    """

    gate: torch.Tensor
    h: torch.Tensor
    h0: torch.Tensor | None
    c0: torch.Tensor | None


def backward_through_time(
    s: Gates, d_ext: torch.Tensor, d_cn: torch.Tensor | None, steps: Steps, want_h0: bool
) -> Backward:
    """Run the recurrence backwards: ``dL/dgi_t`` for every step from the outside gradients.

    Args:
      s: from :func:`gates`.
      d_ext: [T, B, P] the gradient each output state gets from outside the recurrence (the
        layer's output and, at each sequence's final step, ``h_n``).
      d_cn: LSTM: the gradient of ``c_n`` [B, H] (or ``None``: zero).
      want_h0: also return the initial states' gradients.
    """
    big_t, batch = d_ext.shape[0], d_ext.shape[1]
    dg = torch.empty_like(s.k)
    dh = torch.empty_like(d_ext)
    order = list(range(big_t) if s.reverse else range(big_t - 1, -1, -1))
    # per-step views made once (unbind), not indexed step by step
    ext, dhs, dgs = d_ext.unbind(0), dh.unbind(0), dg.unbind(0)
    w_hh = s.w.w_hh
    dc_carry = d_cn
    if s.kind == "gru":
        assert s.kh is not None and s.z is not None
        hidden = s.k.shape[-1] // 3
        ks = s.k.view(big_t, batch, 3, hidden).unbind(0)
        khs = s.kh.view(big_t, batch, 3, hidden).unbind(0)
        g3s, zs = dg.view(big_t, batch, 3, hidden).unbind(0), s.z.unbind(0)
        carry: torch.Tensor | None = None
        for t in order:
            if carry is None:
                dh_t = dhs[t].copy_(ext[t])
            else:
                dh_t = torch.add(ext[t], carry, out=dhs[t])
            dh3 = dh_t.unsqueeze(1)
            torch.mul(ks[t], dh3, out=g3s[t])
            carry = torch.addmm(dh_t * zs[t], (khs[t] * dh3).view(batch, -1), w_hh)
    elif s.kind != "lstm":
        ks = s.k.unbind(0)
        for j, t in enumerate(order):
            if j == 0:
                dh_t = dhs[t].copy_(ext[t])
            else:
                dh_t = torch.addmm(ext[t], dgs[order[j - 1]], w_hh, out=dhs[t])
            torch.mul(dh_t, ks[t], out=dgs[t])
    else:
        assert s.a is not None and s.f is not None
        hidden = s.k.shape[-1] // 4
        k_ifg = s.k[..., : 3 * hidden].view(big_t, batch, 3, hidden).unbind(0)
        k_o = s.k[..., 3 * hidden :].unbind(0)
        g_ifg = dg[..., : 3 * hidden].view(big_t, batch, 3, hidden).unbind(0)
        g_o = dg[..., 3 * hidden :].unbind(0)
        a_s, f_s, w_hr = s.a.unbind(0), s.f.unbind(0), s.w.w_hr
        for j, t in enumerate(order):
            if j == 0:
                dh_t = dhs[t].copy_(ext[t])
            else:
                dh_t = torch.addmm(ext[t], dgs[order[j - 1]], w_hh, out=dhs[t])
            dhu = dh_t if w_hr is None else torch.mm(dh_t, w_hr)
            dc = dhu * a_s[t] if dc_carry is None else torch.addcmul(dc_carry, dhu, a_s[t])
            torch.mul(k_ifg[t], dc.unsqueeze(1), out=g_ifg[t])
            torch.mul(dhu, k_o[t], out=g_o[t])
            dc_carry = dc * f_s[t]
    h0 = _initial_h(s, dg, dh, steps) if want_h0 else None
    # off-sequence steps of the reverse direction hold what flowed past the first step
    return Backward(dg, steps.masked(dh), h0, dc_carry if want_h0 else None)


def _initial_h(s: Gates, dg: torch.Tensor, dh: torch.Tensor, steps: Steps) -> torch.Tensor:
    """``dL/dh0``: what the first step of each sequence hands back to its initial state."""
    first = steps.first(s.reverse)
    if isinstance(first, int):
        g_first, dh_first = dg[first], dh[first]
        sel: tuple[torch.Tensor | int, ...] = (first,)
    else:
        rows = torch.arange(steps.batch, device=dg.device)
        g_first, dh_first = dg[first, rows], dh[first, rows]
        sel = (first, rows)
    if s.kind != "gru":
        return torch.mm(g_first, s.w.w_hh)
    assert s.kh is not None and s.z is not None
    dgh = s.kh[sel] * dh_first.repeat(1, 3)
    return torch.addmm(dh_first * s.z[sel], dgh, s.w.w_hh)


def gate_grad_hh(s_reset: torch.Tensor | None, g_ih: torch.Tensor) -> torch.Tensor:
    """``dL/dgh`` from ``dL/dgi``: equal for RNN/LSTM; GRU: the n block times ``r_t``."""
    if s_reset is None:
        return g_ih
    hidden = s_reset.shape[-1]
    return torch.cat([g_ih[..., : 2 * hidden], s_reset * g_ih[..., 2 * hidden :]], -1)


def linear_input(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dL/dx = dL/dgi W_ih`` over all steps (one GEMM)."""
    return F.linear(x, w.t())

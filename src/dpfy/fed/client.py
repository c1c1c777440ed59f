"""What a client does in a round: train locally from the global model, report a delta.

DP-FedAvg (McMahan et al. 2018, Alg. 1, ``ClientUpdate``): a sampled client copies the global
model, runs a few epochs of plain SGD on its own data and reports the difference between its
final and its starting weights. Local training needs no noise: the client-level guarantee comes
from clipping that whole delta and from the noise the server adds to the sum
(:mod:`dpfy.fed.server`). In the client-side clipping variant the client also clips its delta
(:func:`clip_update`) before sending it, and reports whether it was within the clip norm.

These helpers are shared by the in-process path (:mod:`dpfy.fed.simulation`) and the Flower
client (:mod:`dpfy.fed.flower`), so both run the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from dpfy._validate import check_int, check_range

Tensors = dict[str, torch.Tensor]


def model_tensors(model: nn.Module) -> Tensors:
    """The model's trainable parameters by name (detached copies, float as stored)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` into the model's trainable parameters (names must match)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(tensors):
        raise ValueError(
            f"tensors must name the model's trainable parameters {sorted(params)}, "
            f"got {sorted(tensors)}"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.as_tensor(tensors[n], dtype=p.dtype))


def apply_delta(global_tensors: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
                lr: float = 1.0) -> Tensors:
    """``global + lr x delta`` per tensor (the server's FedAvg step, lr 1 by default)."""
    return {n: global_tensors[n] + lr * delta[n].to(global_tensors[n].dtype)
            for n in global_tensors}


def local_update(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 0.1,
    generator: torch.Generator | None = None,
) -> Tensors:
    """Train ``model`` in place with SGD on one client's data; return the model delta.

    Args:
      model: holds the global weights on entry, the client's weights on return.
      x, y: the client's examples and labels (any number >= 0; an empty client reports 0).
      loss_fn: mean loss over a batch (default cross entropy).
      epochs: local epochs, >= 1; batch_size: local batch size, >= 1; lr: SGD step, > 0.
      generator: order of the local batches (local randomness is not part of the guarantee).

    Returns:
      ``final - initial`` for every trainable parameter.
    """
    check_int("epochs", epochs)
    check_int("batch_size", batch_size)
    check_range("lr", lr, 0.0, 1e15, low_open=True)
    if len(x) != len(y):
        raise ValueError(f"x and y must have one row per example, got {len(x)} and {len(y)}")
    loss_fn = loss_fn or nn.functional.cross_entropy
    start = model_tensors(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(int(epochs)):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), int(batch_size)):
            idx = order[i : i + int(batch_size)]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
    end = model_tensors(model)
    return {n: end[n] - start[n] for n in start}


def clip_update(delta: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[Tensors, bool]:
    """Client-side clipping: ``delta x min(1, C / ||delta||)`` (L2 over all tensors).

    Returns the clipped delta and whether the delta was within the clip norm (the bit the
    adaptive clipping of Andrew et al. 2021 counts).
    """
    check_range("clip_norm", clip_norm, 0.0, math.inf, low_open=True, high_open=True)
    sq = sum(float(t.double().square().sum()) for t in delta.values())
    norm = math.sqrt(sq)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {n: t * factor for n, t in delta.items()}, norm <= clip_norm

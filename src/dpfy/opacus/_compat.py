"""The few Opacus helpers that scripts import beside the engine, in dpfy's words.

* :func:`make_functional` (``opacus.grad_sample.functorch``): a module as a function of its
  parameters, for a loop that computes per-example gradients itself with ``torch.func``
  (Opacus' CIFAR-10 example imports it at the top).
* :class:`DifferentiallyPrivateDistributedDataParallel` (``opacus.distributed``): importable,
  so scripts that import it run in one process; building one is refused, naming dpfy's
  distributed path.
* :func:`refuse`: a refusal under a launcher (``torchrun``, several processes) is one line,
  printed by rank 0 only (not one traceback per rank); every rank then leaves the process
  group together (a barrier, then each destroys its group: under torchrun the TCP store is
  its agent's, so no rank's exit takes it from the others) and exits with status 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from dpfy.training.torchrun import torchrun_env

#: What a multi-process dpfy.opacus script is refused with (one line).
DISTRIBUTED = (
    "dpfy.opacus runs in one process; several processes are dpfy's distributed path, where "
    "rank 0 samples, draws the noise and writes the one ledger (dpfy.training.distributed, "
    "docs/distributed.md: torchrun with PrivateGradient or dpfy train --workers)"
)


def make_functional(
    mod: nn.Module, disable_autograd_tracking: bool = False
) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """``(fmodel, params)``: ``fmodel(params, *args)`` runs ``mod`` with ``params`` in place
    of its own (``torch.func.functional_call``); ``params`` are its current parameters,
    detached with ``disable_autograd_tracking``."""
    names = tuple(name for name, _ in mod.named_parameters())
    params = tuple(
        p.detach() if disable_autograd_tracking else p for _, p in mod.named_parameters()
    )

    def fmodel(new_params: tuple[torch.Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(
            mod, dict(zip(names, new_params, strict=True)), args, kwargs
        )

    return fmodel, params


class DifferentiallyPrivateDistributedDataParallel(nn.Module):
    """Opacus' DDP wrapper: importable, refused when built (:data:`DISTRIBUTED`)."""

    def __init__(self, model: nn.Module) -> None:
        refuse(NotImplementedError(
            f"DifferentiallyPrivateDistributedDataParallel is not part of dpfy.opacus: "
            f"{DISTRIBUTED}"
        ))


def refuse(error: Exception) -> NoReturn:
    """Raise ``error``; in a process a launcher started among several, print its one line
    from rank 0 only and end every rank in order instead (module docstring).

    Raises:
      SystemExit: status 1, under a launcher with more than one process.
    """
    launch = torchrun_env()
    if launch is None or launch.world_size == 1:
        raise error
    if launch.rank == 0:
        print(f"dpfy: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank refuses at the same line of the script
        dist.destroy_process_group()
    raise SystemExit(1)

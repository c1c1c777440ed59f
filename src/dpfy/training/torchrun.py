"""What ``torchrun`` tells a process it started: its rank, the world, where rank 0 listens.

``torchrun`` (``torch.distributed.run``) starts the processes of a run, on one machine or on
several (``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``), and hands each one its
place through environment variables: ``RANK`` (global rank, in [0, WORLD_SIZE)),
``WORLD_SIZE`` (processes over all machines), ``LOCAL_RANK`` (rank on this machine: which GPU
to take), ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (the TCP store of the
process group, hosted by the first machine's agent) and ``TORCHELASTIC_RUN_ID`` (the
``--rdzv-id``). Other launchers that follow the same convention (``torch.distributed.launch``,
a cluster scheduler's wrapper) set the first six.

:func:`torchrun_env` reads them, once and checked, into a :class:`TorchrunEnv`; it reads and
joins nothing else (:func:`dpfy.training.distributed.from_env` joins the process group). A
process is *launched* when ``RANK``, ``WORLD_SIZE`` or ``TORCHELASTIC_RUN_ID`` is set;
``MASTER_ADDR``/``MASTER_PORT`` alone (a cluster's login profile often exports them) do not
make it so. A launched process missing one of the four variables a process group needs is an
inconsistent setup and is refused with the names of the missing ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from dpfy._validate import check_int, check_range

#: The variables a launched process needs to join its process group.
REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Any of these marks a process as started by a launcher.
MARKERS = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")

#: Largest world size accepted (the bound of ``dpfy train --workers`` too).
MAX_WORLD_SIZE = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """This process's place in a launched run (validated in ``__post_init__``).

    Attributes:
      rank: global rank, in [0, world_size); rank 0 samples, draws the noise, writes the ledger.
      world_size: processes over all machines, in [1, 1024].
      local_rank: rank on this machine, in [0, local_world_size) (the GPU index under nccl).
      local_world_size: processes on this machine, in [1, world_size].
      master_addr: host of the process group's TCP store (the first machine, as torchrun
        resolved it; every machine must reach it).
      master_port: its TCP port, in [1, 65535].
      run_id: ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``), or ``None`` when another
        launcher set the variables.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str | None = None

    def __post_init__(self) -> None:
        check_int("WORLD_SIZE", self.world_size, 1, MAX_WORLD_SIZE)
        check_range("RANK", self.rank, 0, self.world_size - 1, integer=True)
        check_int("LOCAL_WORLD_SIZE", self.local_world_size, 1, self.world_size)
        check_range("LOCAL_RANK", self.local_rank, 0, self.local_world_size - 1, integer=True)
        check_range("MASTER_PORT", self.master_port, 1, 65535, integer=True)
        if not self.master_addr.strip():
            raise ValueError(
                f"MASTER_ADDR must be a host name or address, got MASTER_ADDR={self.master_addr!r}"
            )

    @property
    def nodes(self) -> int:
        """Machines in the run when each runs ``local_world_size`` processes (torchrun's
        ``--nnodes``); rounded up for an uneven launch."""
        return -(-self.world_size // self.local_world_size)


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's :class:`TorchrunEnv`, or ``None`` when no launcher started it.

    Args:
      environ: the environment to read (default ``os.environ``).

    Raises:
      ValueError: a launched process misses one of :data:`REQUIRED`, or a value is out of
        range (``RANK`` not below ``WORLD_SIZE``, a port outside [1, 65535], not a number).
    """
    env = os.environ if environ is None else environ
    if not any(k in env for k in MARKERS):
        return None
    missing = [k for k in REQUIRED if not env.get(k, "").strip()]
    if missing:
        raise ValueError(
            f"the launcher's environment is incomplete: {', '.join(missing)} missing (torchrun "
            f"sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; found "
            f"{', '.join(k for k in (*REQUIRED, 'TORCHELASTIC_RUN_ID') if k in env)})"
        )
    world = _integer(env, "WORLD_SIZE")
    return TorchrunEnv(
        rank=_integer(env, "RANK"),
        world_size=world,
        local_rank=_integer(env, "LOCAL_RANK", "0"),
        local_world_size=_integer(env, "LOCAL_WORLD_SIZE", str(world)),
        master_addr=env["MASTER_ADDR"].strip(),
        master_port=_integer(env, "MASTER_PORT"),
        run_id=env.get("TORCHELASTIC_RUN_ID"),
    )


def _integer(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    """``int(env[name])``; a value that is no integer is refused in the one template."""
    text = env.get(name, default)
    try:
        return int(str(text).strip())
    except ValueError:
        check_range(name, text, 0, None, integer=True)  # raises: text is no integer
        raise  # pragma: no cover - check_range raised

"""Probe models for the gray-box replay: one tiny model per layer type a run used.

A replay (:func:`dpfy.audit.replay.replay_release`) only exercises the norm rules of the model
it replays. A run's ledger records the layer types whose rules its step used (run facts,
``layer_types``: qualified class names); :func:`replay_layer_types` builds, for each type it
knows, a model whose trainable layers are that type and a ``Linear`` (so the per-example norm
adds the rules of two layer types), replays one release of the run's query on it with a
removed row whose gradient is far above the clip norm, and returns what the replays found. A
rule that leaves a parameter out of the per-example norm (the parameter is summed but not
clipped) moves the release by more than the declared sensitivity and changes the clipped sum
against the slow per-example reference.

Types without a probe here (a user's own layer, ``transformers`` layers registered by name,
the generic ``vmap`` rule) are returned as not replayed; the audit names them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from dpfy.audit.replay import replay_release
from dpfy.queries import GaussianSumQuery

#: Examples in a probe batch (row 0 is the one the neighbouring batch lacks).
PROBE_ROWS = 6


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x.reshape(x.shape[0], -1)
        return out


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x.flatten(2).mean(2)
        return out


class _Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.attn(x, x, x, need_weights=False)[0].flatten(1))
        return out


class _Recur(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.cell = kind in (nn.RNNCell, nn.LSTMCell, nn.GRUCell)
        self.layer = kind(4, 3) if self.cell else kind(4, 3, batch_first=True)
        self.head = nn.Linear(3 if self.cell else 9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cell:
            out: torch.Tensor = self.head(self.layer(x)[0].flatten(1))
            return out
        state = None
        for t in range(x.shape[1]):
            state = self.layer(x[:, t], state)
        out = self.head(state[0] if isinstance(state, tuple) else state)
        return out


def _inputs(kind: str, g: torch.Generator) -> torch.Tensor:
    b = PROBE_ROWS
    shapes = {"vec": (b, 4), "seq": (b, 3, 4), "c1": (b, 2, 6), "c2": (b, 2, 4, 4)}
    if kind == "ids":
        return torch.randint(0, 7, (b, 3), generator=g)
    return torch.randn(*shapes[kind], generator=g)


def _builders() -> dict[type[nn.Module], tuple[Callable[[], nn.Module], str]]:
    """Layer type -> (a model whose trainable layers are it and a Linear, its input kind)."""
    out: dict[type[nn.Module], tuple[Callable[[], nn.Module], str]] = {
        nn.Linear: (lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)), "vec"),
        nn.Conv1d: (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), _Flat(), nn.Linear(12, 3)), "c1"),
        nn.Conv2d: (lambda: nn.Sequential(nn.Conv2d(2, 2, 3), _Flat(), nn.Linear(8, 3)), "c2"),
        nn.Embedding: (lambda: nn.Sequential(nn.Embedding(7, 3), _Flat(), nn.Linear(9, 3)),
                       "ids"),
        nn.EmbeddingBag: (lambda: nn.Sequential(nn.EmbeddingBag(7, 3), nn.Linear(3, 3)), "ids"),
        nn.LayerNorm: (lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5)), "vec"),
        # after a convolution (its input varies per channel), averaged over positions (the
        # GroupNorm output's mean is about its bias, so its parameters carry most of the
        # gradient), then a Linear head
        nn.GroupNorm: (lambda: nn.Sequential(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4),
                                             _Pool(), nn.Linear(4, 3)), "c2"),
        nn.MultiheadAttention: (_Attend, "seq"),
    }
    if hasattr(nn, "RMSNorm"):
        out[nn.RMSNorm] = (lambda: nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5)), "vec")
    for kind in (nn.RNN, nn.LSTM, nn.GRU, nn.RNNCell, nn.LSTMCell, nn.GRUCell):
        out[kind] = (functools.partial(_Recur, kind), "seq")
    return out


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclasses.dataclass(frozen=True, slots=True)
class LayerReplay:
    """What the replays of a run's layer types found.

    Attributes:
      findings: breaches, each prefixed with the layer type's class name (empty: none).
      replayed: the qualified layer types that were replayed.
      not_replayed: recorded layer types without a probe model here.
    """

    findings: tuple[str, ...]
    replayed: tuple[str, ...]
    not_replayed: tuple[str, ...]


def replay_layer_types(
    layer_types: Iterable[str] | None,
    *,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float = 5.0,
    seed: int = 0,
) -> LayerReplay:
    """Replay one release of ``GaussianSumQuery(clip_norm, noise_multiplier)`` on a probe
    model of each recorded layer type (``None``, e.g. a ledger written before the types were
    recorded or a federated run: ``Linear`` only).

    Each probe: :data:`PROBE_ROWS` examples, targets drawn from ``seed`` with row 0 scaled by
    ``1000 C`` (its gradient is clipped), the loss ``<output, target>`` per example, and every
    check of :func:`~dpfy.audit.replay.replay_release` including the per-example reference
    clipped sum (denominator ``expected_batch_size``).
    """
    builders = {_name(k): v for k, v in _builders().items()}
    wanted: Sequence[str] = (
        [_name(nn.Linear)] if layer_types is None else sorted(set(layer_types))
    )
    findings: list[str] = []
    done: list[str] = []
    for qual in wanted:
        if qual not in builders:
            continue
        build, kind = builders[qual]

        def make(build: Callable[[], nn.Module] = build) -> nn.Module:
            torch.manual_seed(seed)
            return build()

        g = torch.Generator().manual_seed(seed)
        x = _inputs(kind, g)
        with torch.no_grad():
            out = make()(x)
        t = torch.randn(out.shape, generator=g)
        t[0] *= 1000.0 * clip_norm  # the removed row: a gradient far above C
        res = replay_release(
            make,
            lambda: GaussianSumQuery(clip_norm, noise_multiplier),
            x,
            t,
            lambda o, y: (o * y).sum(1),
            expected_batch_size=expected_batch_size,
            seed=seed,
            clip_norm=clip_norm,
        )
        short = qual.rsplit(".", 1)[-1]
        findings.extend(f"{short}: {f}" for f in res.findings)
        done.append(qual)
    missing = tuple(q for q in wanted if q not in builders)
    return LayerReplay(tuple(findings), tuple(done), missing)

"""The table of sampler kinds: everything the library knows about a kind, in one row.

A row (:class:`SamplerKind`) says which :class:`~dpfy.sampling.spec.SampleSpec` fields the kind
needs, which adjacency it assumes, whether it truncates, whether it is accounted per epoch,
which participation schemas of correlated noise it implements, how a report describes it,
which accountant suits it, how its ``(spec, z, count)`` becomes a :mod:`dpfy.events` event,
and how :func:`dpfy.sampling.make_sampler` builds its sampler. The
ledger, the report, the command line and the training recipes all read this table, so adding
a sampler kind is one module holding the sampler and one :func:`register_kind` call (see
``docs/architecture.md``, section 4.1, "A sampler").

Each built-in kind registers its own row in its module (``dpfy.sampling.poisson`` and so on).
This module imports neither torch nor :mod:`dpfy.accounting`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from dpfy import events as ev

if TYPE_CHECKING:  # pragma: no cover
    from dpfy.randomness import Randomness
    from dpfy.sampling.base import Sampler
    from dpfy.sampling.spec import SampleSpec


#: ``(spec, noise_multiplier, count) -> event``: ``count`` steps, or epochs for an epoch kind.
EventMap = Callable[["SampleSpec", float, int], ev.Event]

_ADJACENCIES: tuple[str, ...] = tuple(a.value for a in ev.Adjacency)


class SamplerClass(Protocol):
    """A sampler class as the table needs it: built from the practitioner's batch size."""

    def from_batch_size(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        max_batch_size: int | None = None,
        randomness: Randomness | None = None,
    ) -> Sampler:
        """The sampler whose (expected) batch size is ``batch_size`` out of ``dataset_size``."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerKind:
    """One row of the table of sampler kinds.

    Attributes:
      name: the kind's name in ledgers and specs (``"balls_and_bins"``).
      event: ``(spec, z, count) -> Event`` for ``count`` steps (``count`` epochs when
        ``epoch_structured``) at noise multiplier z; the one map from a ledger entry to events.
      needs: ``SampleSpec`` fields that must be given (``dataset_size`` is added when
        ``max_batch_size`` is).
      adjacency: default adjacency of a spec that states none.
      allowed_adjacency: adjacencies a spec of this kind may state.
      truncates: batches may be cut to ``max_batch_size`` (the event then carries the cost).
      epoch_structured: accounted per epoch: one event per epoch label at the smallest z of the
        epoch, and an epoch label holding more than ``steps_per_epoch`` samples is charged
        ceil(samples / steps_per_epoch) epochs (over-count, never under).
      once_per_epoch: an epoch kind that uses every unit at most once per epoch, so one epoch
        of it implements the single-epoch participation schema of correlated noise
        (:class:`dpfy.correlated.schemas.SingleEpoch`).
      cyclic: a ``once_per_epoch`` kind that repeats one order every epoch (unit i at steps
        i, i + p, ... with p = ``steps_per_epoch``): it implements the cyclic participation
        schema (:class:`dpfy.correlated.schemas.Cyclic`).
      assumptions: what a privacy report states about this sampler.
      default_accountant: the accountant training recipes use by default (``"auto"``: the API's).
      history_methods: accountants for the epsilon-over-training curve (None: the caller's);
        for an epoch kind the curve is drawn at epoch boundaries.
      sampler: the sampler class ``make_sampler`` builds (None: no sampler, e.g. full batch).
      check: extra validation of a spec of this kind (raise ValueError), or None.
      cli: offered by the accounting commands of the ``dpfy`` command line.
      cli_train: offered by ``dpfy train``.
    """

    name: str
    event: EventMap
    needs: tuple[str, ...] = ()
    adjacency: str = ev.Adjacency.ADD_OR_REMOVE.value
    allowed_adjacency: tuple[str, ...] = _ADJACENCIES
    truncates: bool = False
    epoch_structured: bool = False
    once_per_epoch: bool = False
    cyclic: bool = False
    assumptions: str = ""
    default_accountant: str = "auto"
    history_methods: tuple[str, ...] | None = None
    sampler: SamplerClass | None = None
    check: Callable[[SampleSpec], None] | None = None
    cli: bool = False
    cli_train: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name must be a Python identifier, got name={self.name!r}")
        if self.adjacency not in self.allowed_adjacency:
            raise ValueError(
                f"adjacency must be one of the allowed {self.allowed_adjacency}, got "
                f"adjacency={self.adjacency!r} for kind {self.name!r}"
            )
        for a in self.allowed_adjacency:
            ev._as_adjacency(a)
        if self.once_per_epoch and not self.epoch_structured:
            raise ValueError(
                f"once_per_epoch needs epoch_structured=True, got kind {self.name!r} with "
                "epoch_structured=False"
            )
        if self.cyclic and not self.once_per_epoch:
            raise ValueError(
                f"cyclic needs once_per_epoch=True, got kind {self.name!r} with "
                "once_per_epoch=False"
            )

    @property
    def cli_name(self) -> str:
        """Spelling on the command line (``balls-and-bins``)."""
        return self.name.replace("_", "-")


_KINDS: dict[str, SamplerKind] = {}


def register_kind(row: SamplerKind, *, replace: bool = False) -> SamplerKind:
    """Add ``row`` to the table; returns it.

    Raises:
      ValueError: a kind of that name is registered and ``replace`` is False.
    """
    if not isinstance(row, SamplerKind):
        raise ValueError(f"row must be a dpfy.sampling.SamplerKind, got row={row!r}")
    if row.name in _KINDS and not replace:
        raise ValueError(
            f"sampler kind {row.name!r} is already registered; pass replace=True to replace it"
        )
    _KINDS[row.name] = row
    return row


def unregister_kind(name: str) -> SamplerKind:
    """Remove a kind from the table (tests, plug-ins); returns its row."""
    row = kind(name)
    del _KINDS[row.name]
    return row


def kind(name: str) -> SamplerKind:
    """The row of kind ``name`` (``balls-and-bins`` with dashes is accepted).

    Raises:
      ValueError: no such kind.
    """
    key = str(name).replace("-", "_")
    row = _KINDS.get(key)
    if row is None:
        allowed = ", ".join(_KINDS)
        raise ValueError(f"kind must be one of {{{allowed}}}, got kind={name!r}")
    return row


def registered_kinds() -> tuple[SamplerKind, ...]:
    """Every registered row, in registration order."""
    return tuple(_KINDS.values())


def kind_names(having: str | None = None) -> tuple[str, ...]:
    """Names of every registered kind, in registration order; with ``having`` (a boolean field
    of :class:`SamplerKind`, e.g. ``"cyclic"``), only the kinds whose field is true.

    Read at call time, so kinds registered later are listed.
    """
    if having is None:
        return tuple(_KINDS)
    if having not in {f.name for f in dataclasses.fields(SamplerKind)}:
        raise ValueError(f"having must be a SamplerKind field, got having={having!r}")
    return tuple(name for name, row in _KINDS.items() if getattr(row, having) is True)


class _Column(Mapping[str, Any]):
    """Live read-only view ``kind name -> row.<field>`` over the registry (None values skipped)."""

    def __init__(self, field: str) -> None:
        if field not in {f.name for f in dataclasses.fields(SamplerKind)}:
            raise ValueError(f"field must be a SamplerKind field, got field={field!r}")
        self._field = field

    def _values(self) -> dict[str, Any]:
        pairs = ((r.name, getattr(r, self._field)) for r in _KINDS.values())
        return {name: value for name, value in pairs if value is not None}

    def __getitem__(self, name: str) -> Any:
        return self._values()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __repr__(self) -> str:
        return f"column({self._field!r}): {self._values()!r}"


def column(field: str) -> Mapping[str, Any]:
    """A live view ``kind name -> value of field`` of the table, e.g. ``column("assumptions")``.

    Kinds registered later appear in it; rows whose value is None are left out.
    """
    return _Column(field)

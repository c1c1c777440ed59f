"""Ledger records: the facts a run appends, each a frozen dataclass that round-trips JSON.

Every record type has ``to_dict`` (one JSON object, one line of the ledger file) and
``from_dict``; :func:`record_from_dict` dispatches on the ``"type"`` field through a registry that
refuses a second class under the same type name. Records validate their fields on
construction, so a malformed line is refused where it is read. See ``docs/architecture.md``
(the ledger) for the file format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from dpfy._validate import check_count, check_finite_nonneg, check_range, check_real
from dpfy.correlated.plan import CorrelatedPlan
from dpfy.sampling.spec import SampleSpec

FORMAT = "dpfy-ledger"
#: Version 2 adds the hash chain (``"prev"`` on every line after the header), the header's
#: ``run_id`` and the end record (``docs/ledger.md``); version 1 files are still read.
VERSION = 2
READABLE_VERSIONS = (1, 2)
_HEX = frozenset("0123456789abcdef")


def _check_hex(name: str, value: Any, length: int) -> None:
    if not (isinstance(value, str) and len(value) == length and set(value) <= _HEX):
        raise ValueError(
            f"{name} must be {length} lowercase hexadecimal digits, got {name}={value!r}"
        )
#: Largest sensitivity / noise_std of a sum query: the ledger composes (S/s)^2 (McMahan et al.
#: 2018), which must stay a finite float; beyond it the release is not private in any sense.
MAX_RATIO = 1e150


def _check_sample_id(value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sample_id must be an integer, got sample_id={value!r}")


@functools.lru_cache(maxsize=64)
def _cached_spec(items: tuple[tuple[str, Any], ...]) -> SampleSpec:
    return SampleSpec.from_dict(dict(items))


def _spec_from_dict(data: Any) -> SampleSpec:
    """``SampleSpec.from_dict`` with a small cache: a long ledger repeats one spec per line."""
    if not isinstance(data, dict):
        raise ValueError(f"spec must be an object, got {data!r}")
    items = tuple(sorted(data.items()))
    try:
        hash(items)
    except TypeError:  # an unhashable value: validate without the cache (it will be refused)
        return SampleSpec.from_dict(data)
    return _cached_spec(items)


_RecordT = TypeVar("_RecordT", bound="AnyRecord")
_RECORD_TYPES: dict[str, Callable[[Mapping[str, Any]], AnyRecord]] = {}  # type -> from_dict


def register_record(cls: type[_RecordT]) -> type[_RecordT]:
    """Make ``record_from_dict`` dispatch ``{"type": cls.kind, ...}`` to ``cls.from_dict``.

    Raises:
      ValueError: another record type already uses the name ``cls.kind``.
    """
    if cls.kind in _RECORD_TYPES:
        raise ValueError(f"record type {cls.kind!r} is already registered")
    _RECORD_TYPES[cls.kind] = cls.from_dict
    return cls


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class HeaderRecord:
    """First line of every ledger file: format, version and run identifier (a marker).

    ``run_id`` (version 2): 32 random hex digits naming the run the file belongs to; a
    checkpoint records it, so a resume into another ledger file is refused. ``public_key``
    (signed files): the run's Ed25519 public key, 64 hex digits, whose signature records
    vouch for the chain head (:mod:`dpfy.ledger.signing`); None in an unsigned file.
    """

    format: str = FORMAT
    version: int = VERSION
    run_id: str | None = None
    public_key: str | None = None
    kind: ClassVar[str] = "header"

    def __post_init__(self) -> None:
        if self.version >= 2 or self.run_id is not None:
            _check_hex("run_id", self.run_id, 32)
        if self.public_key is not None:
            _check_hex("public_key", self.public_key, 64)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "format": self.format, "version": self.version}
        if self.run_id is not None:
            out["run_id"] = self.run_id
        if self.public_key is not None:
            out["public_key"] = self.public_key
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeaderRecord:
        """Refuses another format or an unknown version."""
        if data.get("format") != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got format={data.get('format')!r}")
        version = data.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ValueError(
                f"version must be one of {READABLE_VERSIONS}, got version={version!r}"
            )
        return cls(FORMAT, version, data.get("run_id"), data.get("public_key"))


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class ResumeRecord:
    """Written when a file ledger is reopened to append (a marker, not a fact).

    ``truncated_previous``: the line before it was cut short by a crash (and terminated on
    resume), so a reader accepts that cut line in the middle of the file. ``cut`` (version 2):
    the SHA-256 of the cut line's bytes, so the hash chain covers it too.
    """

    truncated_previous: bool = False
    cut: str | None = None
    kind: ClassVar[str] = "resume"

    def __post_init__(self) -> None:
        if not isinstance(self.truncated_previous, bool):
            raise ValueError(
                f"truncated_previous must be a bool, got {self.truncated_previous!r}"
            )
        if self.cut is not None:
            _check_hex("cut", self.cut, 64)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "truncated_previous": self.truncated_previous}
        if self.cut is not None:
            out["cut"] = self.cut
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResumeRecord:
        return cls(data.get("truncated_previous", False), data.get("cut"))


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class EndRecord:
    """Written by ``Ledger.close()`` (a marker): ``count`` lines precede it, ``samples`` samples
    and ``releases`` releases (sum queries, non-private releases and matrix steps; None in
    files written before it was recorded) were recorded.

    A file whose last line is an end record was closed by its writer; one without is still
    open, crashed or was truncated (``docs/ledger.md``). A reader checks both counts against
    the lines it read. ``ended`` (optional): how the run ended, in words, when the training
    loop closed the ledger itself: ``"as planned: ..."`` or ``"early (...): R of P planned
    releases"`` (an exception, or the interpreter exiting before the plan ran), so a report
    never reads the releases made as the plan. ``files`` (optional): the SHA-256 (hex) of each
    file the run released beside the ledger, by its name in the run directory (``dpfy train``:
    ``{"model.pt": ...}``), signed with the rest of the chain.
    """

    count: int
    samples: int
    releases: int | None = None
    ended: str | None = None
    files: Mapping[str, str] | None = None
    kind: ClassVar[str] = "end"

    def __post_init__(self) -> None:
        check_count("count", self.count)
        check_count("samples", self.samples)
        if self.releases is not None:
            check_count("releases", self.releases)
        if self.ended is not None and (
            not isinstance(self.ended, str) or not 0 < len(self.ended) <= 500
        ):
            raise ValueError(
                f"ended must be a string of 1 to 500 characters, got ended={self.ended!r}"
            )
        if self.files is not None:
            if not isinstance(self.files, Mapping) or not all(
                isinstance(k, str) and k and "/" not in k and isinstance(v, str) and len(v) == 64
                and set(v) <= set("0123456789abcdef") for k, v in self.files.items()
            ):
                raise ValueError("files must map file names to SHA-256 digests (64 hex), got "
                                 f"files={self.files!r}")
            object.__setattr__(self, "files", dict(self.files))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "count": self.count, "samples": self.samples}
        if self.releases is not None:
            out["releases"] = self.releases
        if self.ended is not None:
            out["ended"] = self.ended
        if self.files is not None:
            out["files"] = dict(self.files)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EndRecord:
        return cls(data["count"], data["samples"], data.get("releases"), data.get("ended"),
                   data.get("files"))


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class SignatureRecord:
    """The run key's Ed25519 signature of the chain head at line ``lines`` (a marker).

    Written right after the line it covers (at ``Ledger.close()`` after the end record, and at
    each checkpoint), so its ``prev`` is the signed head. ``signature``: 128 hex digits over
    :func:`dpfy.ledger.signing.head_message`.
    """

    lines: int
    signature: str
    kind: ClassVar[str] = "signature"

    def __post_init__(self) -> None:
        check_count("lines", self.lines)
        _check_hex("signature", self.signature, 128)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "lines": self.lines, "signature": self.signature}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SignatureRecord:
        return cls(data["lines"], data["signature"])


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class SampleRecord:
    """One batch was drawn with ``spec`` (``sample_id`` is unique within the ledger).

    ``epoch`` (>= 0) groups the samples of epoch-structured samplers; ``step`` is informative.
    """

    sample_id: int
    spec: SampleSpec
    epoch: int = 0
    step: int | None = None
    kind: ClassVar[str] = "sample"

    def __post_init__(self) -> None:
        _check_sample_id(self.sample_id)
        if not isinstance(self.spec, SampleSpec):
            raise ValueError(f"spec must be a SampleSpec, got spec={self.spec!r}")
        check_count("epoch", self.epoch)
        object.__setattr__(self, "epoch", int(self.epoch))
        if self.step is not None:
            check_count("step", self.step)
            object.__setattr__(self, "step", int(self.step))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "sample_id": self.sample_id, "epoch": self.epoch}
        if self.step is not None:
            out["step"] = self.step
        out["spec"] = self.spec.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SampleRecord:
        spec = _spec_from_dict(data["spec"])
        return cls(data["sample_id"], spec, data["epoch"], data.get("step"))


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class SumQueryRecord:
    """A Gaussian sum was released from sample ``sample_id``.

    ``sensitivity``: add/remove L2 sensitivity of the released sum; ``noise_std``: standard
    deviation of the Gaussian noise added to each coordinate (same units); both finite, >= 0.
    """

    sample_id: int
    sensitivity: float
    noise_std: float
    name: str = ""
    kind: ClassVar[str] = "sum_query"

    def __post_init__(self) -> None:
        _check_sample_id(self.sample_id)
        check_finite_nonneg("sensitivity", self.sensitivity)
        check_finite_nonneg("noise_std", self.noise_std)
        object.__setattr__(self, "sensitivity", float(self.sensitivity))
        object.__setattr__(self, "noise_std", float(self.noise_std))
        if self.noise_std > 0.0 and not self.sensitivity / self.noise_std <= MAX_RATIO:
            raise ValueError(
                f"noise_std must be at least sensitivity / {MAX_RATIO:g} (the ledger squares "
                f"their ratio), got noise_std={self.noise_std!r} for "
                f"sensitivity={self.sensitivity!r}"
            )
        object.__setattr__(self, "name", str(self.name))

    def to_dict(self) -> dict[str, Any]:
        # Privacy-relevant fields first, so a truncated line is recovered when they survived.
        return {
            "type": self.kind,
            "sample_id": self.sample_id,
            "sensitivity": self.sensitivity,
            "noise_std": self.noise_std,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SumQueryRecord:
        check_real("sensitivity", data["sensitivity"])  # "1.1" is a string, not a number
        check_real("noise_std", data["noise_std"])
        if not isinstance(data.get("name", ""), str):
            raise TypeError(f"name must be a string, got name={data['name']!r}")
        return cls(
            data["sample_id"], data["sensitivity"], data["noise_std"], data.get("name", "")
        )


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class NonPrivateRecord:
    """A release without a privacy guarantee (``sample_id`` None: not tied to a sample)."""

    sample_id: int | None
    name: str
    reason: str
    kind: ClassVar[str] = "non_private"

    def __post_init__(self) -> None:
        _check_sample_id(self.sample_id, optional=True)
        object.__setattr__(self, "name", str(self.name))
        object.__setattr__(self, "reason", str(self.reason))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "sample_id": self.sample_id,
            "name": self.name,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NonPrivateRecord:
        for key in ("name", "reason"):
            if not isinstance(data[key], str):
                raise TypeError(f"{key} must be a string, got {key}={data[key]!r}")
        return cls(data["sample_id"], data["name"], data["reason"])


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class MetadataRecord:
    """Free-form, JSON-serialisable facts about the run (not privacy-relevant)."""

    info: dict[str, Any]
    kind: ClassVar[str] = "metadata"

    def __post_init__(self) -> None:
        if not isinstance(self.info, dict):
            raise ValueError(f"metadata info must be an object, got {self.info!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "info": self.info}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetadataRecord:
        return cls(data["info"])


def _check_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"name must be a non-empty string, got name={value!r}")
    return value


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class MatrixRunRecord:
    """A correlated-noise (matrix-mechanism) run named ``name`` starts (written before its
    first release; docs/architecture.md, 5.16).

    ``plan``: strategy parameters, planned steps ``T`` and participation schema;
    ``clip_norm``: L2 bound of one example's contribution to one step's sum;
    ``noise_multiplier``: z, the std of the strategy noise ``z_t`` over the clip norm;
    ``sensitivity``: the writer's ``max_u ||C u||`` per unit clip norm (the ledger recomputes
    it from ``plan`` and refuses a smaller recorded value).
    """

    name: str
    plan: CorrelatedPlan
    clip_norm: float
    noise_multiplier: float
    sensitivity: float
    kind: ClassVar[str] = "matrix_run"

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.plan, CorrelatedPlan):
            raise ValueError(f"plan must be a CorrelatedPlan, got plan={self.plan!r}")
        for field in ("clip_norm", "noise_multiplier", "sensitivity"):
            value = getattr(self, field)
            check_range(field, value, 0.0, math.inf, low_open=True, high_open=True)
            object.__setattr__(self, field, float(value))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "name": self.name,
            "noise_multiplier": self.noise_multiplier,
            "sensitivity": self.sensitivity,
            "clip_norm": self.clip_norm,
            "plan": self.plan.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MatrixRunRecord:
        for field in ("clip_norm", "noise_multiplier", "sensitivity"):
            check_real(field, data[field])
        plan = CorrelatedPlan.from_dict(data["plan"])
        return cls(data["name"], plan, data["clip_norm"], data["noise_multiplier"],
                   data["sensitivity"])


@register_record
@dataclasses.dataclass(frozen=True, slots=True)
class MatrixStepRecord:
    """Step ``index`` (0-based) of the matrix-mechanism run ``name`` releases the clipped sum
    of sample ``sample_id`` plus its correlated noise (written before the release).

    ``clip_norm``: bound of one example's contribution; ``noise_std``: std of the fresh
    strategy noise ``z_t`` drawn at this step (the added noise is ``(C^{-1} z)_t``).
    """

    sample_id: int
    name: str
    index: int
    clip_norm: float
    noise_std: float
    kind: ClassVar[str] = "matrix_step"

    def __post_init__(self) -> None:
        _check_sample_id(self.sample_id)
        _check_name(self.name)
        check_count("index", self.index)
        object.__setattr__(self, "index", int(self.index))
        for field in ("clip_norm", "noise_std"):
            value = getattr(self, field)
            check_range(field, value, 0.0, math.inf, low_open=True, high_open=True)
            object.__setattr__(self, field, float(value))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "sample_id": self.sample_id,
            "name": self.name,
            "index": self.index,
            "clip_norm": self.clip_norm,
            "noise_std": self.noise_std,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MatrixStepRecord:
        for field in ("clip_norm", "noise_std"):
            check_real(field, data[field])
        return cls(data["sample_id"], data["name"], data["index"], data["clip_norm"],
                   data["noise_std"])


#: The facts a ledger holds (:attr:`Ledger.entries`).
Record = (
    SampleRecord | SumQueryRecord | NonPrivateRecord | MetadataRecord | MatrixRunRecord
    | MatrixStepRecord
)
#: Lines of a ledger file that mark its structure and hold no fact.
Marker = HeaderRecord | ResumeRecord | EndRecord | SignatureRecord
AnyRecord = Record | Marker

def record_from_dict(data: Mapping[str, Any]) -> AnyRecord:
    """The record a ledger line or checkpoint entry holds: the inverse of ``record.to_dict()``.

    Dispatches on ``data["type"]``; the record type validates its own fields.

    Raises:
      ValueError: not an object, unknown type, or a field out of range (``KeyError`` /
        ``TypeError`` for a missing or ill-typed field).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a record must be a JSON object, got {data!r}")
    kind = data.get("type")
    from_dict = _RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if from_dict is None:
        raise ValueError(f"unknown entry type {kind!r}")
    return from_dict(data)



"""The privacy ledger: an append-only record of what a training run really did.

The training code never computes epsilon. It appends *facts* to a ledger (McMahan et al. 2018,
Sec. 6): which sampler drew each batch (:meth:`Ledger.record_sample`) and, for every noisy sum
released from that batch, the L2 sensitivity and the noise standard deviation actually used
(:meth:`Ledger.record_sum_query`). Afterwards :meth:`Ledger.to_event` turns the ledger into a
:mod:`dpfy.events` tree that any accountant can process, so a bug in hyperparameter logic cannot
make the reported epsilon too small, and a ledger can be re-accounted later with a tighter method.

Storage is JSON lines (one object per line, first line a header). Write-ahead: a sum-query entry
is written, flushed and fsynced *before* :meth:`Ledger.record_sum_query` returns, i.e. before the
caller releases the noisy value it describes. A crash can therefore only leave an entry whose value
was never released (over-count), never a released value without an entry (under-count).

Grouping (McMahan et al. 2018, Sec. 3, Eq. 1; DESIGN 3.4): all sum queries of one sample, with
sensitivities S_j and noise stds s_j, are one Gaussian sum query with noise multiplier
``z = (sum_j S_j^2 / s_j^2)^(-1/2)``. A query with ``noise_std = 0`` and ``S > 0`` is
non-private, and a ledger containing a non-private entry reports epsilon = infinity.

Units: sensitivities are the add/remove L2 sensitivity of the released sum in the units of the
sum (for one example's clipped gradient: the clip norm), noise stds are in the same units.

This module imports no torch.

Example:
    >>> from dpfy.ledger import Ledger, SampleSpec
    >>> ledger = Ledger()                      # in memory; Ledger("run.jsonl") writes a file
    >>> spec = SampleSpec("poisson", dataset_size=60_000, sampling_rate=0.01)
    >>> for step in range(3):
    ...     sid = ledger.record_sample(spec, step=step)
    ...     ledger.record_sum_query(sid, sensitivity=1.0, noise_std=1.1, name="grad")
    >>> ledger.to_event()
    SelfComposed(event=PoissonSampled(sampling_rate=0.01, event=Gaussian(noise_multiplier=1.1)), count=3)
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.sampling.kinds import kind, kind_names
from dpfy.sampling.spec import SampleSpec, spec_event

__all__ = [
    "SAMPLERS",
    "SampleSpec",
    "SampleRecord",
    "SumQueryRecord",
    "NonPrivateRecord",
    "MetadataRecord",
    "Ledger",
    "LedgerFormatError",
    "LedgerTruncationWarning",
    "effective_noise_multiplier",
]

FORMAT = "dpfy-ledger"
VERSION = 1

#: Built-in sampler kinds a :class:`SampleSpec` may name (the table in
#: :mod:`dpfy.sampling.kinds`; ``dpfy.sampling.kind_names()`` also lists kinds registered later).
SAMPLERS = kind_names()
# Two noise multipliers closer than this (relative) are folded into one run, keeping the smaller.
_Z_RTOL = 1e-12


class LedgerFormatError(ValueError):
    """A ledger file is malformed (other than a truncated last line)."""


class LedgerTruncationWarning(UserWarning):
    """A ledger's last line was cut short by a crash; it was read back and counted."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SampleRecord:
    """One batch was drawn with ``spec`` (``sample_id`` is unique within the ledger)."""

    sample_id: int
    spec: SampleSpec
    epoch: int = 0
    step: int | None = None
    kind: ClassVar[str] = "sample"

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.kind, "sample_id": self.sample_id, "epoch": self.epoch}
        if self.step is not None:
            out["step"] = self.step
        out["spec"] = self.spec.to_dict()
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class SumQueryRecord:
    """A Gaussian sum was released from sample ``sample_id``.

    ``sensitivity``: add/remove L2 sensitivity of the released sum; ``noise_std``: standard
    deviation of the Gaussian noise added to each coordinate (same units).
    """

    sample_id: int
    sensitivity: float
    noise_std: float
    name: str = ""
    kind: ClassVar[str] = "sum_query"

    def to_dict(self) -> dict[str, Any]:
        # Privacy-relevant fields first, so a truncated line is recovered when they survived.
        return {
            "type": self.kind,
            "sample_id": self.sample_id,
            "sensitivity": self.sensitivity,
            "noise_std": self.noise_std,
            "name": self.name,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class NonPrivateRecord:
    """A release without a privacy guarantee (``sample_id`` None: not tied to a sample)."""

    sample_id: int | None
    name: str
    reason: str
    kind: ClassVar[str] = "non_private"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "sample_id": self.sample_id,
            "name": self.name,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class MetadataRecord:
    """Free-form facts about the run (not privacy-relevant)."""

    info: dict[str, Any]
    kind: ClassVar[str] = "metadata"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "info": self.info}


Record = SampleRecord | SumQueryRecord | NonPrivateRecord | MetadataRecord


# --------------------------------------------------------------------------------------------
# Math
# --------------------------------------------------------------------------------------------


def effective_noise_multiplier(
    sensitivities: Sequence[float] | Iterable[float], noise_stds: Sequence[float] | Iterable[float]
) -> float:
    """Noise multiplier of several Gaussian sum queries on one sample, as one query.

    ``z = (sum_j S_j^2 / s_j^2)^(-1/2)`` (McMahan et al. 2018, Sec. 3, Eq. 1).

    Args:
      sensitivities: L2 sensitivities S_j >= 0 of the released sums.
      noise_stds: noise standard deviations s_j >= 0, same units.

    Returns:
      z in (0, inf]; ``inf`` if every S_j is 0 (nothing data-dependent released) and ``0.0`` if
      some query has ``s_j = 0 < S_j`` (non-private).
    """
    total = 0.0
    for s, sigma in zip(sensitivities, noise_stds, strict=True):
        check_range("sensitivity", s, 0.0, math.inf, high_open=True)
        check_range("noise_std", sigma, 0.0, math.inf, high_open=True)
        if s == 0.0:
            continue
        if sigma == 0.0:
            return 0.0
        total += (s / sigma) ** 2
    return math.inf if total == 0.0 else 1.0 / math.sqrt(total)


# --------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------


class Ledger:
    """Append-only privacy ledger, in memory or as a JSON-lines file.

    Args:
      path: file to write; ``None`` keeps the ledger in memory. An existing file is *resumed*:
        its entries are read (a truncated last line is kept and counted) and new entries are
        appended, so restarting a run never forgets what it already released.
      fsync: fsync after every sum-query / non-private entry (durable across an OS crash). With
        ``False`` entries are still flushed to the OS before the call returns (durable across a
        process crash).

    Thread-safe: one lock serialises appends.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, fsync: bool = True) -> None:
        self.path = None if path is None else os.fspath(path)
        self.fsync = bool(fsync)
        self.truncated_lines = 0
        self.read_only = False
        self._ends_truncated = False
        self._entries: list[Record] = []
        self._samples: dict[int, SampleRecord] = {}
        self._ratio: dict[int, float] = {}  # sample -> sum_j S_j^2 / s_j^2 (McMahan Eq. 1)
        self._nonprivate: dict[int, str] = {}  # sample -> first reason it is not private
        self._spec_cache: dict[tuple, SampleSpec] = {}
        self._event_cache: tuple[int, ev.Event] | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self._open_for_append()

    # -- writing ----------------------------------------------------------------------------
    def _open_for_append(self) -> None:
        existing = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if existing:
            self._parse(_read_text(self.path), source=self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with self
        if not existing:
            self._write({"type": "header", "format": FORMAT, "version": VERSION}, sync=True)
        else:
            if self._ends_truncated:
                # Terminate the cut line; the marker tells later loads it is not corruption.
                self._file.write("\n")
            cut = bool(self.truncated_lines and self._ends_truncated)
            self._write({"type": "resume", "truncated_previous": cut}, sync=True)

    def _write(self, obj: dict[str, Any], *, sync: bool) -> None:
        # sync=False entries (samples, metadata) may stay buffered: they release nothing, and
        # the next synced entry flushes them first (one file, in order).
        if self._file is None:
            return
        line = json.dumps(obj, separators=(",", ":"), allow_nan=False)
        self._file.write(line + "\n")
        if sync:
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())

    def _append(self, record: Record, *, sync: bool) -> None:
        if self.read_only:
            raise RuntimeError(
                "this ledger was loaded read-only; open it with Ledger(path) to append"
            )
        self._write(record.to_dict(), sync=sync)
        self._add(record)

    def _add(self, record: Record) -> None:
        self._entries.append(record)
        if isinstance(record, SumQueryRecord):
            sid, sens, std = record.sample_id, record.sensitivity, record.noise_std
            if sens == 0.0:
                pass  # nothing data-dependent released
            elif std == 0.0:
                self._nonprivate.setdefault(
                    sid, f"{record.name or 'sum query'}: released without noise"
                )
            else:
                self._ratio[sid] = self._ratio.get(sid, 0.0) + (sens / std) ** 2
        elif isinstance(record, SampleRecord):
            self._samples[record.sample_id] = record
            self._next_id = max(self._next_id, record.sample_id + 1)
        elif isinstance(record, NonPrivateRecord) and record.sample_id is not None:
            self._nonprivate.setdefault(record.sample_id, f"{record.name}: {record.reason}")

    def record_sample(self, spec: SampleSpec, *, epoch: int = 0, step: int | None = None) -> int:
        """Record that a batch was drawn with ``spec``; returns its ``sample_id``.

        Args:
          spec: the sampler facts.
          epoch: epoch index (>= 0); epoch-structured samplers are accounted per epoch, and
            every distinct epoch counts as a whole one.
          step: step index within the run or epoch (informative).
        """
        if not isinstance(spec, SampleSpec):
            raise ValueError(f"spec must be a dpfy.ledger.SampleSpec, got spec={spec!r}")
        _check_count("epoch", epoch)
        if step is not None:
            _check_count("step", step)
            step = int(step)
        with self._lock:
            sid = self._next_id
            self._append(SampleRecord(sid, spec, int(epoch), step), sync=False)
            return sid

    def record_sum_query(
        self, sample_id: int, *, sensitivity: float, noise_std: float, name: str = ""
    ) -> None:
        """Record (write-ahead) a Gaussian sum released from sample ``sample_id``.

        Returns only after the entry is flushed (and fsynced unless ``fsync=False``): release the
        noisy value *after* this call.

        Args:
          sample_id: id returned by :meth:`record_sample`.
          sensitivity: add/remove L2 sensitivity of the released sum, in [0, inf).
          noise_std: std of the Gaussian noise actually added per coordinate, in [0, inf);
            0 with a positive sensitivity makes the ledger non-private.
          name: label (e.g. the parameter group), informative.
        """
        _check_finite_nonneg("sensitivity", sensitivity)
        _check_finite_nonneg("noise_std", noise_std)
        with self._lock:
            self._check_sample(sample_id)
            record = SumQueryRecord(int(sample_id), float(sensitivity), float(noise_std), str(name))
            self._append(record, sync=True)

    def record_sum_queries(
        self, sample_id: int, queries: Sequence[tuple[float, float, str]]
    ) -> None:
        """Record several sum queries of one sample with a single fsync (write-ahead).

        Same as calling :meth:`record_sum_query` for each ``(sensitivity, noise_std, name)``,
        but all entries are validated first and made durable together before returning.
        """
        records = []
        for item in queries:
            sensitivity, noise_std, name = item
            _check_finite_nonneg("sensitivity", sensitivity)
            _check_finite_nonneg("noise_std", noise_std)
            records.append((float(sensitivity), float(noise_std), str(name)))
        with self._lock:
            self._check_sample(sample_id)
            for i, (sens, std, name) in enumerate(records):
                last = i == len(records) - 1
                self._append(SumQueryRecord(int(sample_id), sens, std, name), sync=last)

    def record_non_private(self, sample_id: int | None, *, name: str, reason: str) -> None:
        """Record (write-ahead) a release without privacy: the ledger's epsilon becomes inf.

        Args:
          sample_id: the sample the release used, or None for a release of the whole dataset.
          name: what was released. reason: why it is not private (shown in reports).
        """
        with self._lock:
            if sample_id is not None:
                self._check_sample(sample_id)
                sample_id = int(sample_id)
            self._append(NonPrivateRecord(sample_id, str(name), str(reason)), sync=True)

    def record_metadata(self, **info: Any) -> None:
        """Record free-form, JSON-serialisable run facts (not privacy-relevant)."""
        try:
            json.dumps(info, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata must be JSON-serialisable, got {info!r}: {err}") from None
        with self._lock:
            self._append(MetadataRecord(dict(info)), sync=False)

    def _check_sample(self, sample_id: Any) -> None:
        if isinstance(sample_id, bool) or not isinstance(sample_id, int) or (
            sample_id not in self._samples
        ):
            raise ValueError(
                f"sample_id must be an id returned by record_sample, got sample_id={sample_id!r}"
            )

    def close(self) -> None:
        """Flush and close the file; further appends raise."""
        with self._lock:
            if self._file is not None:
                self._file.flush()
                if self.fsync:
                    os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
            self.read_only = True

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> Ledger:
        """Read a ledger file (read-only).

        A last line cut short by a crash is read back with a :class:`LedgerTruncationWarning` and
        counted in :attr:`truncated_lines`; if its privacy-relevant fields survived it is also
        accounted (over-count; by write-ahead its value was never released). Anything else
        malformed raises :class:`LedgerFormatError` naming the line.
        """
        ledger = cls(None)
        ledger.path = os.fspath(path)
        ledger._parse(_read_text(ledger.path), source=ledger.path)
        ledger.read_only = True
        return ledger

    def _parse(self, text: str, *, source: str) -> None:
        lines = text.split("\n")
        self._ends_truncated = bool(lines) and lines[-1] != ""
        if lines and lines[-1] == "":
            lines.pop()
        n = len(lines)
        for i, line in enumerate(lines):
            lineno = i + 1
            where = f"ledger {source!r} line {lineno}"
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                last = i == n - 1 and self._ends_truncated
                marked = i + 1 < n and _is_resume_after_truncation(lines[i + 1])
                if last or marked:
                    self._recover_truncated(line, where)
                    continue
                raise LedgerFormatError(f"{where}: not valid JSON ({err}): {line[:80]!r}") from None
            try:
                self._load_object(obj, first=(i == 0))
            except (ValueError, TypeError, KeyError) as err:
                raise LedgerFormatError(f"{where}: {err}") from None

    def _load_object(self, obj: dict[str, Any], *, first: bool) -> None:
        kind = obj.get("type")
        if first:
            if kind != "header" or obj.get("format") != FORMAT:
                raise ValueError(f"the first line must be a {FORMAT} header, got {obj!r}")
            if obj.get("version") != VERSION:
                raise ValueError(f"version must be {VERSION}, got version={obj.get('version')!r}")
            return
        if kind == "sample":
            sid = obj["sample_id"]
            if not isinstance(sid, int) or sid in self._samples:
                raise ValueError(f"sample_id must be a new integer, got sample_id={sid!r}")
            _check_count("epoch", obj["epoch"])
            if obj.get("step") is not None:
                _check_count("step", obj["step"])
            self._add(SampleRecord(sid, self._spec(obj["spec"]), obj["epoch"], obj.get("step")))
        elif kind == "sum_query":
            self._check_sample(obj["sample_id"])
            _check_finite_nonneg("sensitivity", obj["sensitivity"])
            _check_finite_nonneg("noise_std", obj["noise_std"])
            self._add(
                SumQueryRecord(
                    obj["sample_id"],
                    float(obj["sensitivity"]),
                    float(obj["noise_std"]),
                    str(obj.get("name", "")),
                )
            )
        elif kind == "non_private":
            if obj["sample_id"] is not None:
                self._check_sample(obj["sample_id"])
            self._add(NonPrivateRecord(obj["sample_id"], str(obj["name"]), str(obj["reason"])))
        elif kind == "metadata":
            if not isinstance(obj["info"], dict):
                raise ValueError(f"metadata info must be an object, got {obj['info']!r}")
            self._add(MetadataRecord(obj["info"]))
        elif kind in ("header", "resume"):
            pass
        else:
            raise ValueError(f"unknown entry type {kind!r}")

    def _spec(self, data: dict[str, Any]) -> SampleSpec:
        if not isinstance(data, dict):
            raise ValueError(f"spec must be an object, got {data!r}")
        key = tuple(sorted(data.items()))
        spec = self._spec_cache.get(key)
        if spec is None:
            spec = self._spec_cache[key] = SampleSpec.from_dict(data)
        return spec

    def _recover_truncated(self, line: str, where: str) -> None:
        self.truncated_lines += 1
        recovered = _recover_sum_query(line)
        counted = "nothing to recover"
        if recovered is not None and recovered.sample_id in self._samples:
            self._add(recovered)
            counted = f"recovered and counted {recovered}"
        elif line.startswith('{"type":"non_private"'):
            sid = _int_field(line, "sample_id")
            sid = sid if sid in self._samples else None
            self._add(NonPrivateRecord(sid, "truncated", "entry cut short by a crash"))
            counted = "counted as a non-private release"
        warnings.warn(
            f"{where} was cut short (crash mid-write); {counted}. By write-ahead its value was "
            "never released, so the accounting can only over-count.",
            LedgerTruncationWarning,
            stacklevel=3,
        )

    # -- views ------------------------------------------------------------------------------
    @property
    def entries(self) -> tuple[Record, ...]:
        """All records in order (header and resume markers excluded)."""
        return tuple(self._entries)

    @property
    def samples(self) -> tuple[SampleRecord, ...]:
        """Sample records in order."""
        return tuple(r for r in self._entries if isinstance(r, SampleRecord))

    @property
    def iteration(self) -> int:
        """Number of samples recorded (training steps so far)."""
        return len(self._samples)

    @property
    def metadata(self) -> dict[str, Any]:
        """All metadata merged in order (later keys win)."""
        out: dict[str, Any] = {}
        for r in self._entries:
            if isinstance(r, MetadataRecord):
                out.update(r.info)
        return out

    @property
    def unit(self) -> str | None:
        """The unit of privacy of the recorded samples (None if nothing was sampled)."""
        units = {r.spec.unit for r in self._samples.values()}
        if len(units) > 1:
            raise ValueError(f"a ledger must use one unit of privacy, got units={sorted(units)}")
        return units.pop() if units else None

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        where = "memory" if self.path is None else repr(self.path)
        return f"Ledger({where}, samples={self.iteration}, entries={len(self)})"

    def noise_multipliers(self) -> dict[int, float]:
        """Effective noise multiplier of every sample with a data-dependent release.

        ``0.0`` marks a non-private sample (a non-private entry, or zero noise with a positive
        sensitivity); samples that released nothing data-dependent are omitted.
        """
        out: dict[int, float] = {}
        for sid in self._samples:
            if sid in self._nonprivate:
                out[sid] = 0.0
            elif sid in self._ratio:
                out[sid] = 1.0 / math.sqrt(self._ratio[sid])
        return out

    # -- accounting -------------------------------------------------------------------------
    def to_event(self) -> ev.Event:
        """The privacy event this ledger describes (McMahan et al. 2018, Sec. 3 and 6).

        Mapping (per sample, z = effective noise multiplier of its sum queries):
          * poisson -> ``PoissonSampled(q, Gaussian(z))``; runs of equal (spec, z) folded into
            ``SelfComposed``; with ``max_batch_size`` -> ``TruncatedPoisson``.
          * fixed_size -> ``FixedSizeSampled(batch_size, dataset_size, Gaussian(z))`` (replace_one).
          * full_batch -> ``Gaussian(z)``.
          * balls_and_bins / shuffle / deterministic -> ``BallsAndBins`` / ``Shuffled`` /
            ``Deterministic`` with the smallest z of each epoch (``TruncatedBallsAndBins`` with
            ``max_batch_size``); a partial epoch counts as a
            whole one, and an epoch label holding more than ``steps_per_epoch`` samples counts
            as ceil(samples / steps_per_epoch) epochs (over-count, never under).
          * a non-private release anywhere -> a ``NonPrivate`` sub-event (epsilon = inf).
        Samples that released nothing data-dependent cost nothing. An empty ledger is
        ``Composed(())``.

        Raises:
          ValueError: mixed units of privacy.
        """
        cached = self._event_cache
        if cached is not None and cached[0] == len(self._entries):
            return cached[1]
        event = self._build_event()
        self._event_cache = (len(self._entries), event)
        return event

    def _build_event(self) -> ev.Event:
        _ = self.unit  # one unit of privacy per ledger
        zs = self.noise_multipliers()
        reasons = self._nonprivate
        # Runs in sample order: [key, z, count (+ samples of an epoch label)]; the key is
        # ("step" | "epoch", spec) or ("nonprivate", reason).
        units: list[list[Any]] = []
        epoch_units: dict[tuple[SampleSpec, int], list[Any]] = {}
        epochal: dict[str, bool] = {}
        for rec in self._samples.values():
            spec = rec.spec
            if spec.sampler not in epochal:
                epochal[spec.sampler] = kind(spec.sampler).epoch_structured
            z = zs.get(rec.sample_id)
            if epochal[spec.sampler]:
                unit = epoch_units.get((spec, rec.epoch))
                if unit is None:
                    unit = epoch_units[(spec, rec.epoch)] = [("epoch", spec), math.inf, 0, 0]
                    units.append(unit)
                unit[3] += 1  # samples in this epoch label
                if z is not None and z != 0.0:
                    unit[1] = min(unit[1], z)
            elif z is not None and z != 0.0:
                units.append([("step", spec), z, 1])
            if z == 0.0:
                units.append([("nonprivate", reasons[rec.sample_id]), 0.0, 1])
        runs = _fold_runs(_charge_epochs(units))
        builder = ev.EventBuilder()
        for (tag, payload), z, count in runs:
            if tag == "nonprivate":
                builder.add(ev.NonPrivate(reason=payload), count)
            else:
                builder.add(spec_event(payload, z, count))
        for r in self._entries:
            if isinstance(r, NonPrivateRecord) and r.sample_id is None:
                builder.add(ev.NonPrivate(reason=f"{r.name}: {r.reason}"))
        return builder.build()

    def epsilon(self, delta: float, method: Any = "auto") -> Any:
        """Account the ledger: ``dpfy.accounting.epsilon(self.to_event(), delta, method)``.

        Returns a :class:`dpfy.accounting.PrivacyResult`; epsilon is ``inf`` when any release was
        non-private (whatever the method).
        """
        from dpfy import accounting

        event = self.to_event()
        if accounting.contains_non_private(event):
            check_range("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
            return accounting.PrivacyResult(
                epsilon=math.inf,
                delta=float(delta),
                method=method if isinstance(method, str) else getattr(method, "name", "?"),
                adjacency=event.adjacency_relation.value,
                notes=("the ledger contains a non-private release: no finite epsilon holds",),
            )
        return accounting.epsilon(event, delta, method)

    def delta(self, epsilon: float, method: Any = "auto") -> Any:
        """Smallest delta at ``epsilon``: ``dpfy.accounting.delta(self.to_event(), ...)``."""
        from dpfy import accounting

        return accounting.delta(self.to_event(), epsilon, method)


def _check_finite_nonneg(name: str, value: Any) -> None:
    if type(value) in (float, int) and 0.0 <= value < math.inf:
        return
    check_range(name, value, 0.0, math.inf, high_open=True)


def _check_count(name: str, value: Any) -> None:
    if type(value) is int and value >= 0:
        return
    check_range(name, value, 0, None, integer=True)


def _charge_epochs(units: list[list[Any]]) -> list[list[Any]]:
    """Epoch runs charge ceil(samples / steps_per_epoch) epochs; epochs without cost drop."""
    flat: list[list[Any]] = []
    for u in units:
        if u[0][0] != "epoch":
            flat.append(list(u))
            continue
        if u[1] == math.inf:
            continue
        per_epoch = u[0][1].steps_per_epoch
        epochs = -(-u[3] // per_epoch)
        if epochs > 1:
            warnings.warn(
                f"{u[3]} samples were recorded under one epoch label with "
                f"steps_per_epoch={per_epoch}; charging {epochs} epochs",
                stacklevel=3,
            )
        flat.append([u[0], u[1], epochs])
    return flat


def _fold_runs(units: list[list[Any]]) -> list[list[Any]]:
    """Fold consecutive runs of the same key and (nearly) the same z, keeping the smaller z."""
    runs: list[list[Any]] = []
    for u in units:
        prev = runs[-1] if runs else None
        if (
            prev is not None
            and prev[0] == u[0]
            and abs(prev[1] - u[1]) <= _Z_RTOL * max(prev[1], u[1])
        ):
            prev[1] = min(prev[1], u[1])
            prev[2] += u[2]
        else:
            runs.append(list(u))
    return runs


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="strict", newline="") as f:
        return f.read()


def _is_resume_after_truncation(line: str) -> bool:
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return (
        isinstance(obj, dict) and obj.get("type") == "resume" and obj.get("truncated_previous")
    )


_NUM = r"(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)[,}]"


def _float_field(line: str, name: str) -> float | None:
    m = re.search(rf'"{name}":{_NUM}', line)
    return float(m.group(1)) if m else None


def _int_field(line: str, name: str) -> int | None:
    m = re.search(rf'"{name}":(-?[0-9]+)[,}}]', line)
    return int(m.group(1)) if m else None


def _recover_sum_query(line: str) -> SumQueryRecord | None:
    if not line.startswith('{"type":"sum_query"'):
        return None
    sid = _int_field(line, "sample_id")
    s = _float_field(line, "sensitivity")
    sigma = _float_field(line, "noise_std")
    if sid is None or s is None or sigma is None or s < 0 or sigma < 0:
        return None
    return SumQueryRecord(sid, s, sigma, "truncated")

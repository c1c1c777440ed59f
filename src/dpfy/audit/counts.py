"""The ledger's steps and releases against the sampler's plan and the run's own count.

Every figure of a report is accounted from the ledger's sample and release records. A ledger
that misses a step is still a valid hash chain and accounts fewer steps (a smaller epsilon)
than the run took, so no accountant or chain check sees it. This check compares what the
ledger holds with two facts recorded apart from the release records:

* **the sampler's plan**: the trainer's run facts (``epochs``, ``steps_per_epoch``: the
  sampler's steps per epoch). A run that ran to its end (final metadata
  ``stopped = "completed"``) took ``epochs x steps_per_epoch`` steps; a run stopped by the
  budget guard or ``max_steps`` took fewer, and only the other checks apply;
* **the run's own count**: ``steps`` in the run directory's ``summary.json`` (the trainer's
  step counter, written beside the model).

The ledger's steps are its distinct step numbers (``SampleRecord.step``; samples without one,
such as a tuning trial's validation score, are other releases). It also checks that they have
no gap (``0 .. last``; a step recorded twice, e.g. around a resume, charges it twice and is
allowed) and that every step has at least one release record (sum query, non-private release
or correlated-noise step); a sample a crash left without one is allowed when its step was
taken again with a release (a resumed run).

:func:`recorded_epsilon_check` holds the file to the epsilon its writer accounted from the
records in its memory at close (``dpfy train``, ``make_private``, the Hugging Face
``DPTrainer``, ``dpfy.opacus``: metadata ``epsilon``, ``delta``, ``accounting``): lines that
account to less (a serializer that overstated the noise, releases lost on the way to the file)
are named. The functions return findings (sentences); empty: none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpfy.ledger import Ledger, LedgerIntegrityError
from dpfy.ledger.records import MatrixStepRecord, NonPrivateRecord, SumQueryRecord


def _count(value: Any) -> int | None:
    """``value`` when it is a non-negative int (not a bool), else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def planned_steps(metadata: Mapping[str, Any]) -> int | None:
    """``epochs x steps_per_epoch`` of the run facts when the run completed, else ``None``."""
    epochs, per = _count(metadata.get("epochs")), _count(metadata.get("steps_per_epoch"))
    if metadata.get("stopped") != "completed" or epochs is None or per is None:
        return None
    return epochs * per


def ledger_count_check(
    ledger: Ledger, summary: Mapping[str, Any] | None = None
) -> tuple[str, ...]:
    """Findings on the ledger's step and release counts (see the module docstring).

    Args:
      ledger: the run's ledger (its metadata holds the run facts).
      summary: the run's ``summary.json`` (its ``steps``), or ``None`` when there is none.
    """
    samples = ledger.samples
    steps = {s.step for s in samples if s.step is not None}
    # the step count: distinct step numbers (a sample without one is a release outside the
    # step loop, e.g. a tuning trial's validation score); a ledger numbering none: its samples
    distinct = len(steps) if steps else len(samples)
    findings: list[str] = []
    if steps:
        last = max(steps)
        gaps = sorted(set(range(last + 1)) - steps)
        if gaps:
            findings.append(
                f"ledger: step(s) {gaps[:5]} of 0..{last} have no sample record "
                f"({len(gaps)} missing): their releases are not accounted"
            )
    released = {
        r.sample_id
        for r in ledger.entries
        if isinstance(r, SumQueryRecord | NonPrivateRecord | MatrixStepRecord)
    }
    retaken = {s.step for s in samples if s.step is not None and s.sample_id in released}
    bare = [s.step if s.step is not None else s.sample_id for s in samples
            if s.sample_id not in released and (s.step is None or s.step not in retaken)]
    if bare:
        findings.append(f"ledger: step(s) {bare[:5]} have a sample record and no release record")
    plan = planned_steps(ledger.metadata)
    if plan is not None and distinct != plan:
        meta = ledger.metadata
        findings.append(
            f"ledger: {distinct} steps recorded, but the run completed the sampler's plan of "
            f"{meta['epochs']} epochs x {meta['steps_per_epoch']} steps = {plan}"
        )
    own = _count(summary.get("steps")) if summary is not None else None
    if own is not None and distinct != own:
        findings.append(
            f"ledger: {distinct} steps recorded, but the run's summary.json counts {own} steps"
        )
    return tuple(findings)


def recorded_epsilon_check(ledger: Ledger) -> tuple[str, ...]:
    """A finding when the file's lines account to less than the epsilon its writer recorded
    (:func:`dpfy.report.consistency.check_recorded_epsilon`, the check ``dpfy report`` refuses
    on); none when the writer recorded none (ledgers of older versions, runs without a delta).
    """
    from dpfy import accounting
    from dpfy.report.consistency import check_recorded_epsilon

    meta = ledger.metadata
    delta, method = meta.get("delta"), meta.get("accounting")
    if not isinstance(delta, int | float) or isinstance(delta, bool) or not 0 < delta < 1:
        return ()
    if not isinstance(method, str) or "epsilon" not in meta:
        return ()
    try:
        result = accounting.epsilon(ledger, float(delta), method)
        check_recorded_epsilon(ledger, result, float(delta))
    except LedgerIntegrityError as err:
        return (f"recorded epsilon: {err}",)
    except ValueError:  # a method this version does not know: nothing to compare
        return ()
    return ()

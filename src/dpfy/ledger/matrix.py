"""How a ledger's matrix-mechanism records become one :class:`dpfy.events.MatrixMechanism`.

A correlated-noise run (docs/architecture.md, 5.16) writes one :class:`MatrixRunRecord`
before its first release and one :class:`MatrixStepRecord` before each release. Its privacy
is not a per-step composition: the whole run is one Gaussian release of ``C x + z`` with
``mu = sensitivity / z``, where the sensitivity depends on *which steps each example can
join*, i.e. on the participation schema. So the resolution here trusts nothing the writer
could get wrong:

* the sensitivity is recomputed from the recorded plan (strategy parameters, ``T``, schema)
  and a smaller recorded one is refused;
* every step's noise std must be ``z x clip_norm`` of the run record, its clip norm the
  run's, and the steps must be numbered ``0, 1, ...`` with at most ``T`` of them;
* every step's batch must come from a sampler that implements the schema
  (:func:`check_schema_spec`): :class:`~dpfy.correlated.schemas.Cyclic` with period ``p``
  needs a sampler kind whose row is ``cyclic`` (one order repeated every epoch: the
  ``cyclic`` and ``deterministic`` samplers) with ``steps_per_epoch = p`` and step ``i`` in
  epoch ``i // p``; :class:`~dpfy.correlated.schemas.SingleEpoch` needs a kind whose row is
  ``once_per_epoch`` (each example at most once per epoch), and all steps in one epoch. Both
  facts are read from the table of sampler kinds (:mod:`dpfy.sampling.kinds`) at call
  time. A Poisson (or fixed-size) sampler with BandMF is refused: an example could join
  steps closer than the schema allows.

Refusals raise ``ValueError`` naming the run, the step and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dpfy import events as ev
from dpfy.correlated.schemas import Cyclic, Schema, SingleEpoch
from dpfy.ledger.records import MatrixRunRecord, MatrixStepRecord, SampleRecord
from dpfy.sampling.kinds import kind, kind_names
from dpfy.sampling.spec import SampleSpec

_RTOL = 1e-9


def check_schema_spec(
    schema: Schema, spec: SampleSpec, *, index: int | None = None, epoch: int | None = None
) -> None:
    """Refuse a batch spec that does not implement ``schema`` (``ValueError``, naming both).

    ``index`` (the step's position in the run) and ``epoch`` (its sample's epoch label) are
    checked when given: a cyclic step ``i`` must be in epoch ``i // period``.
    """
    if isinstance(schema, Cyclic):
        if not kind(spec.sampler).cyclic or spec.steps_per_epoch != schema.period:
            raise ValueError(
                f"the participation schema cyclic(period={schema.period}) needs a sampler "
                f"that repeats one order every epoch ({' or '.join(kind_names('cyclic'))}) with "
                f"steps_per_epoch={schema.period}, got sampler={spec.sampler!r} with "
                f"steps_per_epoch={spec.steps_per_epoch!r}"
            )
        if index is not None and epoch is not None and epoch != index // schema.period:
            raise ValueError(
                f"step {index} of a cyclic(period={schema.period}) run must be in epoch "
                f"{index // schema.period}, got epoch {epoch}"
            )
        return
    if isinstance(schema, SingleEpoch):
        if not kind(spec.sampler).once_per_epoch:
            raise ValueError(
                "the participation schema single_epoch needs an epoch sampler that uses each "
                f"example at most once per epoch ({', '.join(kind_names('once_per_epoch'))}), got "
                f"sampler={spec.sampler!r}"
            )
        if index is not None and spec.steps_per_epoch is not None and (
            index >= spec.steps_per_epoch
        ):
            raise ValueError(
                f"a single_epoch run has at most steps_per_epoch={spec.steps_per_epoch} "
                f"steps, got step {index}"
            )
        return
    raise ValueError(f"schema must be SingleEpoch or Cyclic for training, got {schema!r}")


def matrix_event(
    run: MatrixRunRecord,
    steps: Sequence[MatrixStepRecord],
    samples: Mapping[int, SampleRecord],
) -> ev.MatrixMechanism:
    """The event of one matrix-mechanism run, after checking its steps against its plan.

    A run record without steps (a crash before the first release) is still charged: the
    ledger over-counts, never under.

    Raises:
      ValueError: a recorded sensitivity below the exact one, a step out of order or beyond
        ``T``, a noise std or clip norm that differs from the run record, a sample of another
        spec than the first step's, or a sampler that does not implement the schema.
    """
    plan, where = run.plan, f"matrix run {run.name!r}"
    exact = plan.sensitivity
    if run.sensitivity < exact * (1.0 - _RTOL):
        raise ValueError(
            f"{where}: recorded sensitivity {run.sensitivity!r} is below the exact "
            f"max_u ||C u|| = {exact!r} of its plan under {plan.schema!r}"
        )
    if len(steps) > plan.steps:
        raise ValueError(
            f"{where}: {len(steps)} steps recorded, but the plan covers steps={plan.steps}"
        )
    first: SampleRecord | None = None
    for i, step in enumerate(steps):
        here = f"{where}, step {i}"
        if step.index != i:
            raise ValueError(f"{here}: steps must be numbered 0, 1, ...; got index {step.index}")
        if abs(step.clip_norm - run.clip_norm) > _RTOL * run.clip_norm:
            raise ValueError(
                f"{here}: clip_norm {step.clip_norm!r} differs from the run's {run.clip_norm!r}"
            )
        want = run.noise_multiplier * run.clip_norm
        if abs(step.noise_std - want) > _RTOL * want:
            raise ValueError(
                f"{here}: noise_std {step.noise_std!r} differs from noise_multiplier x "
                f"clip_norm = {want!r} of the run record"
            )
        sample = samples[step.sample_id]
        if first is None:
            first = sample
        elif sample.spec != first.spec:
            raise ValueError(f"{here}: its batch spec {sample.spec!r} differs from step 0's")
        elif isinstance(plan.schema, SingleEpoch) and sample.epoch != first.epoch:
            raise ValueError(
                f"{here}: a single_epoch run must stay in one epoch, got epochs {first.epoch} "
                f"and {sample.epoch}"
            )
        try:
            check_schema_spec(plan.schema, sample.spec, index=i, epoch=sample.epoch)
        except ValueError as err:
            raise ValueError(f"{here}: {err}") from None
    adjacency = ev.Adjacency.ZERO_OUT.value if first is None else first.spec.adjacency_value
    return ev.MatrixMechanism(
        run.noise_multiplier,
        max(run.sensitivity, exact),
        plan.steps,
        plan.strategy,
        plan.event(run.noise_multiplier).schema,
        band=plan.band,
        adjacency=adjacency,
    )

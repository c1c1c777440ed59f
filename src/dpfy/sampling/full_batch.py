"""Full batch: every example in every release, no sampling (used by :mod:`dpfy.features`).

There is no sampler class; the kind exists for the ledger entries of full-batch algorithms.
Event: ``SelfComposed(Gaussian(z), releases)``.
"""

from __future__ import annotations

from dpfy import events as ev
from dpfy.sampling.kinds import SamplerKind, register_kind
from dpfy.sampling.spec import SampleSpec


def full_batch_event(spec: SampleSpec, noise_multiplier: float, count: int) -> ev.Event:
    """``count`` Gaussian releases on the whole dataset."""
    return ev.SelfComposed(ev.Gaussian(noise_multiplier), count)


FULL_BATCH = register_kind(
    SamplerKind(
        name="full_batch",
        event=full_batch_event,
        allowed_adjacency=(ev.Adjacency.ADD_OR_REMOVE.value,),
        assumptions="every example used in every release (no sampling)",
        cli=True,
    )
)

"""The ledger of a run agrees with the event each sampler says it implements."""

from __future__ import annotations

import pytest

from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import (
    BallsAndBinsSampler,
    DeterministicSampler,
    FixedSizeSampler,
    PoissonSampler,
    ShuffleSampler,
)


def _samplers():
    rng = Randomness(seed=0)
    return [
        PoissonSampler(1000, sampling_rate=0.01, randomness=rng),
        PoissonSampler(1000, sampling_rate=0.01, max_batch_size=20, randomness=rng),
        BallsAndBinsSampler(1000, steps_per_epoch=10, randomness=rng),
        BallsAndBinsSampler(1000, steps_per_epoch=10, max_batch_size=150, randomness=rng),
        ShuffleSampler(1000, 100, randomness=rng),
        DeterministicSampler(1000, 100, randomness=rng),
        FixedSizeSampler(1000, 100, randomness=rng),
    ]


@pytest.mark.parametrize("index", range(len(_samplers())), ids=[repr(s) for s in _samplers()])
@pytest.mark.parametrize("steps", [7, 25])  # within one epoch; a partial third epoch
def test_ledger_event_equals_the_samplers_event(index, steps):
    sampler = _samplers()[index]
    ledger, done = Ledger(), 0
    for epoch in range(3):
        for _batch in sampler.batches(epoch):
            if done == steps:
                break
            sid = ledger.record_sample(sampler.sample_spec(), epoch=epoch, step=done)
            ledger.record_sum_queries(sid, [(1.0, 2.0, "a"), (1.0, 2.0, "b")])  # z = sqrt(2)
            done += 1
    z = ledger.noise_multipliers()[0]
    assert ledger.to_event() == sampler.privacy_event(z, steps=steps)

"""The noise multiplier a federated run needs for a target client-level (epsilon, delta).

Calibration runs before the first round on the event the cohort sampler will produce
(:func:`dpfy.sampling.spec.spec_event` of its ledger entry, ``rounds`` times), with dpfy's certified
search (:func:`dpfy.accounting.calibrate.calibrate_noise_multiplier`, docs/architecture.md 5.5).
The run itself never computes epsilon: the report accounts its ledger.
"""

from __future__ import annotations

from dpfy._validate import check_int
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.fed.cohort import CohortSampler
from dpfy.sampling.spec import spec_event


def calibrate_rounds(
    cohort: CohortSampler,
    rounds: int,
    target_epsilon: float,
    delta: float,
    *,
    method: str = "auto",
) -> float:
    """Smallest z such that ``rounds`` rounds drawn by ``cohort`` are (target_epsilon, delta)-DP
    for one client (Poisson: add/remove; fixed size: replace-one)."""
    check_int("rounds", rounds)
    spec = cohort.sample_spec()
    return calibrate_noise_multiplier(
        lambda z: spec_event(spec, z, int(rounds)), target_epsilon, delta, method
    )

"""Batch samplers that know the privacy event they implement, and the table of sampler kinds.

A sampler turns ``dataset_size`` example indices into batches of indices, epoch by epoch, states
the ledger entry describing them (``sample_spec``) and, through the same map the ledger uses
(:func:`~dpfy.sampling.spec.spec_event`), the :mod:`dpfy.events` event its batches give a
Gaussian sum query (``privacy_event``). Accounting therefore follows the sampler that actually
ran, never a hyperparameter that claims to.

* ``PoissonSampler``: each example joins each batch independently with probability q
  -> ``PoissonSampled`` (``TruncatedPoisson`` with a maximum batch size).
* ``BallsAndBinsSampler``: each example in one uniformly random batch per epoch
  -> ``BallsAndBins`` (``TruncatedBallsAndBins``).
* ``ShuffleSampler``: permute each epoch, cut into fixed-size batches -> ``Shuffled``.
* ``DeterministicSampler``: fixed order, fixed-size batches -> ``Deterministic``.
* ``CyclicSampler``: one permutation repeated every epoch -> ``Deterministic`` (the cyclic
  schema of matrix-mechanism runs, ``dpfy.correlated``).
* ``FixedSizeSampler``: ``batch_size`` examples without replacement per step
  -> ``FixedSizeSampled`` (replace-one adjacency).
* ``full_batch`` (no sampler class): every example in every release -> ``Gaussian``.

Modules: :mod:`~dpfy.sampling.kinds` (the table and its registry), :mod:`~dpfy.sampling.spec`
(``SampleSpec``, ``spec_event``), :mod:`~dpfy.sampling.base` (``Sampler``, shared base,
``pad_batch``), :mod:`~dpfy.sampling.factory` (``make_sampler``), and one module per kind, which
holds the sampler and registers the kind's row; :func:`registered_kinds` lists the rows.
Adding a kind is one such module (see ``docs/architecture.md``, section 4.1, "A sampler").

All randomness comes from an injected :class:`dpfy.randomness.Randomness` (seeded or secure).
This package imports neither torch nor :mod:`dpfy.accounting`.

Example:
    >>> from dpfy.randomness import Randomness
    >>> s = BallsAndBinsSampler(1000, steps_per_epoch=10, randomness=Randomness(0))
    >>> sum(len(b) for b in s.batches(0))
    1000
    >>> s.privacy_event(1.0, epochs=2)
    BallsAndBins(noise_multiplier=1.0, steps_per_epoch=10, epochs=2, adjacency='add_or_remove')
"""

from __future__ import annotations

from dpfy.sampling.base import BaseSampler, Sampler
from dpfy.sampling.kinds import SamplerKind, register_kind, registered_kinds
from dpfy.sampling.spec import SampleSpec

# The built-in kinds, in table order: each module registers its row on import.
# isort: off
from dpfy.sampling.poisson import PoissonSampler
from dpfy.sampling.balls_and_bins import BallsAndBinsSampler
from dpfy.sampling.shuffle import ShuffleSampler
from dpfy.sampling.deterministic import DeterministicSampler
from dpfy.sampling.fixed_size import FixedSizeSampler
from dpfy.sampling import full_batch as _full_batch  # noqa: F401  (registers "full_batch")
from dpfy.sampling.cyclic import CyclicSampler
# isort: on
from dpfy.sampling.factory import make_sampler

__all__ = [
    "Sampler",
    "BaseSampler",
    "SamplerKind",
    "SampleSpec",
    "PoissonSampler",
    "ShuffleSampler",
    "BallsAndBinsSampler",
    "FixedSizeSampler",
    "CyclicSampler",
    "DeterministicSampler",
    "make_sampler",
    "register_kind",
    "registered_kinds",
]

"""DP queries: clip per-example contributions, sum them, add Gaussian noise, record the release.

A query turns per-example contributions (gradients, or any vectors) into one noisy aggregate and
appends the facts of that release to a :class:`dpfy.ledger.Ledger` *before* returning it
(write-ahead). Every query runs the one release template of :class:`QueryBase`
(:mod:`dpfy.queries.base`); a query only declares its ledger entries, noise stds and clip
weights. The family (McMahan et al. 2018; Andrew et al. 2021):

* :class:`GaussianSumQuery` - flat clipping of all tensors as one vector to ``clip_norm`` and
  N(0, (noise_multiplier x S)^2) noise per coordinate, S = C (or 2C for microbatch averages).
* :class:`dpfy.queries.sum.AverageQuery` / :func:`dpfy.queries.sum.gaussian_average_query` -
  a query's release divided by a *fixed* denominator (the expected batch size; never the
  realised size of a Poisson batch).
* :class:`NestedQuery` - one query per parameter group (per-layer or any grouping), each with
  its own clip norm C_j and noise std s_j (McMahan Sec. 2, "separate clipping"); the sample's
  effective noise multiplier is ``(sum_j C_j^2 / s_j^2)^(-1/2)`` (Sec. 3, Eq. 1).
* :class:`JointClipQuery` - joint clipping with per-group scale parameters gamma_g (McMahan
  Sec. 2): clip ``(x_g / gamma_g)_g`` jointly to C, noise std ``gamma_g x z x C`` on group g.
* :class:`AdaptiveClipQuery` - flat clipping whose clip norm follows a target quantile of the
  per-example norms (Andrew et al. 2021); the noisy count of unclipped examples is a second
  Gaussian part of the release, recorded in the ledger, and the gradient noise is raised so
  that the two together have exactly the requested effective noise multiplier.
* :class:`dpfy.queries.adaptive.AdaptiveNestedQuery` - per-group clipping, each group's clip
  norm following the target quantile of that group's norms, with its own noisy count.
* :class:`dpfy.queries.sum.NoPrivacyQuery` - clip (optionally) and sum without noise, for
  debugging; it records a non-private entry, so the ledger reports epsilon = infinity.
* Noise allocation (McMahan Sec. 4), in :mod:`dpfy.queries.nested`: ``proportional_noise``,
  ``dimension_adjusted_noise`` and clip splitting ``split_clip_norm``.

Every query offers the materialised path ``release(per_example, ...)`` and the trainer's fast
path ``clip_weights`` -> weighted sum -> ``add_noise(..., out=, scale=)``; see :class:`Query`.

Example:
    >>> import torch
    >>> from dpfy.ledger import Ledger
    >>> from dpfy.sampling import SampleSpec
    >>> from dpfy.queries import GaussianSumQuery
    >>> from dpfy.randomness import Randomness
    >>> ledger, rng = Ledger(), Randomness(seed=0)
    >>> sid = ledger.record_sample(SampleSpec("poisson", sampling_rate=0.01))
    >>> query = GaussianSumQuery(clip_norm=1.0, noise_multiplier=1.1)
    >>> grads = {"w": torch.randn(8, 3, 2), "b": torch.randn(8, 2)}
    >>> noisy = query.release(grads, ledger=ledger, sample_id=sid, randomness=rng)
    >>> sorted(noisy), tuple(noisy["w"].shape)
    (['b', 'w'], (3, 2))
    >>> ledger.noise_multipliers()
    {0: 1.1}
"""

from dpfy.queries._tree import clip_weights_from_norms
from dpfy.queries.adaptive import AdaptiveClipQuery
from dpfy.queries.base import LedgerEntry, Query, QueryBase
from dpfy.queries.joint import JointClipQuery
from dpfy.queries.nested import NestedQuery
from dpfy.queries.sum import GaussianSumQuery

__all__ = [
    "Query",
    "QueryBase",
    "LedgerEntry",
    "GaussianSumQuery",
    "NestedQuery",
    "AdaptiveClipQuery",
    "JointClipQuery",
    "clip_weights_from_norms",
]

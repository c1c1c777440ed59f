"""DP-SGD inside a ``lightning.Trainer``: ``Trainer(..., strategy=DPStrategy(...))``.

:class:`DPStrategy` (one process) and :class:`DistributedDPStrategy` (several, Lightning's DDP
launch or ``torchrun``), in :mod:`dpfy.lightning.strategy`, train a user's ``LightningModule``
with dpfy's Poisson sampler, per-example clipping, noise and ledger; their Lightning
checkpoints resume the run on its ledger (:mod:`dpfy.lightning.run`). ``docs/lightning.md``
shows a script, the two-process command, what a resume counts and what is refused.
"""

from dpfy.lightning.strategy import DistributedDPStrategy, DPStrategy

__all__ = ["DPStrategy", "DistributedDPStrategy"]

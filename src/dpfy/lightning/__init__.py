"""DP-SGD inside a ``lightning.Trainer``: ``Trainer(..., strategy=DPStrategy(...))``.

:class:`DPStrategy` (:mod:`dpfy.lightning.strategy`) trains a user's ``LightningModule`` with
dpfy's Poisson sampler, per-example clipping, noise and ledger; ``docs/lightning.md`` shows a
script and lists what is refused.
"""

from dpfy.lightning.strategy import DPStrategy

__all__ = ["DPStrategy"]

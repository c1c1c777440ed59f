"""LP-FT under DP: a private linear probe on the frozen encoder, then DP fine-tuning from it.

Kumar et al. 2022 ("Fine-tuning can distort pretrained features") fit a linear head on the
frozen features first (LP) and fine-tune from it (FT); Tang et al. 2023 and others find the
two stages help most under DP, where a fresh zero head spends the first noisy steps learning
what a linear probe gets almost for free. Here:

1. *Probe.* The frozen pretrained encoder embeds every training snippet (the masked mean of its
   last hidden states, as the classification head sees them, then L2-normalised: a per-snippet
   map, no data statistics). DP-FC (Mehta et al. 2023, Alg. 4;
   :class:`dpfy.features.DPFeatureCovarianceClassifier`) fits a linear classifier on them with
   its noise calibrated to ``share x target_epsilon`` *alone*. Its releases (full-batch
   Gaussian sums) are the first records of the run's ledger.
2. *Fine-tuning.* The head starts at the probe's weights (DP-FC has no intercept: bias 0; on
   unnormalised pooled states the logits are the probe's times the positive norm of each
   snippet's state, so the predictions at step 0 are the probe's). DP-SGD's noise is calibrated
   so that the *composition* of the probe's event and the training's event, accounted by the
   run's accountant, meets ``target_epsilon`` (:func:`calibrate_after`); the budget guard then
   reads the same ledger, probe included. The two epsilons are never added.

Assumptions: the unit of privacy is one snippet in both stages (the probe's statistics are
per snippet); the probe sees the same training snippets as the fine-tuning.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from dpfy import events as ev
from dpfy._validate import check_range
from dpfy.ledger import Ledger
from dpfy.models.modes import evaluating

if TYPE_CHECKING:
    from dpfy.randomness import Randomness
    from dpfy.sampling import Sampler
    from dpfy.training.text import TokenDataset


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """The DP linear probe of stage 1.

    Attributes:
      ledger: its releases (in memory; the recipe replays them into the run's ledger).
      event: ``ledger.to_event()``.
      epsilon: the probe alone, at the run's delta (its calibration target, safe side).
      train_accuracy: the probe's accuracy on the training snippets (monitoring only: not
        released, not noised).
      seconds: wall time of embedding and fitting.
    """

    ledger: Ledger
    event: ev.Event
    epsilon: float
    train_accuracy: float
    seconds: float


@torch.no_grad()
def embed(net: nn.Module, data: TokenDataset, batch_size: int = 128) -> torch.Tensor:
    """L2-normalised masked means of the encoder's last hidden states, ``[N, width]`` float32.

    ``net`` is a :class:`dpfy.models.heads.MeanPooledClassifier` (its ``encoder``, on any
    device; the embeddings come back on the CPU); eval mode for the pass, the mode is
    restored.
    """
    from dpfy.models.heads import mean_pool
    from dpfy.training.text import trim_padding

    encoder = net.encoder
    assert isinstance(encoder, nn.Module)
    device = next(net.parameters()).device
    rows = []
    with evaluating(net):
        for i in range(0, len(data), batch_size):
            batch = trim_padding({k: v[i : i + batch_size].to(device)
                                  for k, v in data.tokens.items()})
            out = encoder(**batch)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            rows.append(mean_pool(hidden, batch["attention_mask"]).float().cpu())
    x = torch.cat(rows) if rows else torch.zeros(0, 0)
    normalised: torch.Tensor = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return normalised


def linear_probe(
    net: nn.Module,
    data: TokenDataset,
    epsilon: float,
    delta: float,
    randomness: Randomness,
) -> Probe:
    """Stage 1: fit DP-FC on :func:`embed` of ``data`` at ``(epsilon, delta)`` and set
    ``net.head`` to its weights (bias 0).

    Args:
      net: the classifier whose head is initialised (its encoder is only read).
      data: the training snippets (one row = one unit of privacy).
      epsilon, delta: the probe's own budget (``share x target_epsilon``).
      randomness: the noise stream (secure for a DP release).
    """
    from dpfy.features import DPFeatureCovarianceClassifier

    check_range("epsilon", epsilon, 0.0, None, low_open=True)
    start = time.perf_counter()
    x = embed(net, data)
    y = data.labels.numpy()
    probe = DPFeatureCovarianceClassifier(
        epsilon=epsilon, delta=delta, classes=[0, 1], random_state=randomness
    ).fit(x.numpy(), y)
    head = net.head
    assert isinstance(head, nn.Linear)
    with torch.no_grad():
        head.weight.copy_(torch.as_tensor(probe.coef_, dtype=head.weight.dtype))
        head.bias.zero_()
    accuracy = float((probe.predict(x.numpy()) == y).mean()) if len(y) else 0.0
    ledger = probe.ledger_
    return Probe(ledger, ledger.to_event(), float(probe.privacy_.epsilon), accuracy,
                 time.perf_counter() - start)


def calibrate_after(
    probe: ev.Event,
    sampler: Sampler,
    epochs: int,
    target_epsilon: float,
    delta: float,
    accounting: str,
) -> float:
    """Stage 2's noise multiplier: the smallest z (safe side) with
    ``epsilon(Composed(probe, sampler.privacy_event(z, epochs)), delta) <= target_epsilon``.

    Raises:
      ValueError: the probe alone (with any amount of training noise) reaches the target.
    """
    from dpfy.accounting.calibrate import calibrate_noise_multiplier

    def event(z: float) -> ev.Event:
        return ev.Composed((probe, sampler.privacy_event(z, epochs=int(epochs))))

    return float(calibrate_noise_multiplier(event, float(target_epsilon), float(delta),
                                            accounting))

"""A small random BERT in place of the shipped all-MiniLM-L6-v2 weights, for end-to-end text runs
whose checks are about the run (its ledger, report, saved tensors, data splits, plan), not about
what the pretrained weights compute.

It is the real model's ``BertModel`` class and configuration (vocabulary, positions, module
names: ``query``, ``key``, ``value``, ``intermediate``, ...), read from the shipped package, with
2 layers of width 32 instead of 6 of width 384; the real tokenizer still tokenises. Its weights
are drawn from a fixed seed without touching torch's global generator. A run on it trains in a
fraction of a second where MiniLM takes seconds.

The real weights stay under test where they matter: the LoRA run of
``tests/test_train_text.py`` and the encoder checks of ``tests/features``.

Use: ``monkeypatch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)`` (or
:func:`tiny_minilm` for a module's shared runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

#: The tiny encoder's shape; everything else is the shipped model's configuration.
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64}


def tiny_minilm_encoder(**kwargs: Any) -> Any:
    """What :func:`dpfy.models.pretrained.load_minilm_encoder` returns (a ``BertModel`` in eval
    mode, ``kwargs`` as configuration overrides and ``add_pooling_layer``), tiny and random."""
    import torch
    from transformers import BertConfig, BertModel

    from dpfy.models.pretrained import minilm_dir

    pooling = kwargs.pop("add_pooling_layer", True)
    config = BertConfig.from_pretrained(minilm_dir(), local_files_only=True, **kwargs)
    config.update(TINY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertModel(config, add_pooling_layer=pooling)
    return model.eval()


@contextlib.contextmanager
def tiny_minilm() -> Iterator[None]:
    """Text runs started meanwhile fine-tune :func:`tiny_minilm_encoder`."""
    from dpfy.models import pretrained

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretrained, "load_minilm_encoder", tiny_minilm_encoder)
        yield

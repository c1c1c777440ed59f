"""Make ``minilm_reference.npz``: all-MiniLM-L6-v2 embeddings from the hand-written encoder.

Run once, at commit bf8fa23 (the last commit whose ``dpfy.features.extract`` had its own
WordPiece tokenizer, safetensors reader and BERT encoder in plain torch), from the repository
root::

    git worktree add /tmp/old bf8fa23
    PYTHONPATH=/tmp/old/src OMP_NUM_THREADS=1 python tests/features/vectors/make_minilm_reference.py

The texts are the first 64 train and first 16 test snippets of
``dpfy.datasets.rotten_tomatoes`` plus hand-picked edge cases (empty and blank text, text long
enough to be truncated at 256 tokens, accents, CJK, punctuation, control characters). The file
stores the texts, their float32 ``[N, 384]`` unit-norm embeddings and the source commit;
``tests/features/test_feature_extract.py`` compares the ``transformers`` encoder against it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import torch

from dpfy import datasets
from dpfy.features import extract

EDGE_CASES = [
    "",
    "   ",
    "!",
    "...?!",
    "a",
    "Don't, won't -- can't; it's \"fine\" (really).",
    "Café crème brûlée, naïve façade, Ångström, Œuvre.",
    "这部电影很好看，但是太长了。",
    "Kurosawa 黒澤明 made Rashomon 羅生門 in 1950.",
    "tab\there\nnewline\r\nand\x00nul\u200bzero-width",
    "ΑΒΓ Привет мир Ελληνικά",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "$9.99 @ 50% off #1 film & more ~ ^_^ <3 [sic] {x} |y| `z`",
    " ".join(["a long review that goes on and on about the film"] * 40),
]


def main() -> None:
    torch.set_num_threads(1)
    train = datasets.rotten_tomatoes("train", limit=64)
    test = datasets.rotten_tomatoes("test", limit=16)
    texts = [*train.texts, *test.texts, *EDGE_CASES]
    encoder = extract.MiniLMEncoder.from_package()  # the hand-written encoder (old commit)
    embeddings = np.concatenate(
        [encoder.encode(texts[b : b + 16]) for b in range(0, len(texts), 16)]
    ).astype(np.float32)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True,
        cwd=Path(extract.__file__).parent, check=True,
    ).stdout.strip()
    np.savez_compressed(
        Path(__file__).with_name("minilm_reference.npz"),
        texts=np.array(texts, dtype=np.str_),
        embeddings=embeddings,
        commit=np.array(commit),
    )
    print(f"{len(texts)} texts, embeddings {embeddings.shape}, commit {commit}")


if __name__ == "__main__":
    main()

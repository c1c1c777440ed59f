"""Feature extraction: the cache, the rotten-tomatoes snippets and the MiniLM text encoder.

The encoder is checked against embeddings stored from the hand-written BERT it replaced
(``vectors/minilm_reference.npz``, made by ``vectors/make_minilm_reference.py`` at commit
bf8fa23): 80 corpus snippets and 14 edge cases (empty, truncated, accents, CJK, punctuation).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from dpfy.features import extract

REFERENCE = Path(__file__).parent / "vectors" / "minilm_reference.npz"
#: The stored embeddings are from another implementation; both are float32 (measured: 2.1e-7).
TOLERANCE = 1e-4
#: SHA-256 of (texts, labels, is_test) as returned by the hand-written
#: ``rotten_tomatoes_snippets`` that read the corpus itself (commit bf8fa23).
SNIPPETS_DIGEST = "811392b67593c138c5baacd053054d668269a8f1649a6c16cb6d28682d2571b6"


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], np.ndarray]:
    data = np.load(REFERENCE)
    return [str(t) for t in data["texts"]], data["embeddings"]


@pytest.fixture(scope="module")
def encoder() -> extract.SentenceEncoder:
    pytest.importorskip("transformers")
    import torch

    torch.set_num_threads(1)
    return extract.SentenceEncoder.from_package()


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path))
    assert extract.cache_dir() == tmp_path / "features" and (tmp_path / "features").is_dir()


def test_snippets_keep_the_corpus_order_labels_and_split():
    texts, labels, is_test = extract.rotten_tomatoes_snippets()
    assert labels.dtype == np.int64 and is_test.dtype == np.bool_
    assert len(texts) == len(labels) == len(is_test) == 12_808 and is_test.sum() == 1_975
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode() + b"\0")
    digest.update(labels.astype("<i8").tobytes())
    digest.update(is_test.astype(np.uint8).tobytes())
    assert digest.hexdigest() == SNIPPETS_DIGEST


def test_reference_texts_are_the_first_snippets_of_each_split(reference):
    from dpfy import datasets

    texts, embeddings = reference
    train = datasets.rotten_tomatoes("train", limit=64)
    test = datasets.rotten_tomatoes("test", limit=16)
    assert texts[:80] == [*train.texts, *test.texts]
    assert embeddings.dtype == np.float32 and embeddings.shape == (94, 384)


def test_encoder_reproduces_the_hand_written_embeddings(encoder, reference):
    texts, expected = reference
    got = np.concatenate([encoder.encode(texts[b : b + 16]) for b in range(0, len(texts), 16)])
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_encoder_truncates_at_the_configured_length(encoder, reference):
    texts, expected = reference
    long_text = texts[-1]
    assert len(encoder.tokenizer(long_text)["input_ids"]) > encoder.max_length == 256
    longer = encoder.encode([long_text + " but the ending changes everything"])
    assert np.abs(longer[0] - expected[-1]).max() <= TOLERANCE


def test_text_features_sort_batches_and_scatter_back(encoder, reference, monkeypatch):
    texts, expected = reference
    rows = list(range(0, 94, 3))  # mixed lengths, train, test and edge cases
    chosen = [texts[i] for i in rows]
    labels = np.arange(len(rows), dtype=np.int64) % 2
    is_test = np.arange(len(rows)) % 3 == 0
    monkeypatch.setattr(extract, "rotten_tomatoes_snippets", lambda: (chosen, labels, is_test))
    monkeypatch.setattr(extract.SentenceEncoder, "from_package", classmethod(lambda cls: encoder))
    feats, got_labels, got_test = extract.text_features(batch_size=7, progress=False, limit=25)
    assert feats.shape == (25, 384)
    assert np.abs(feats - expected[rows[:25]]).max() <= TOLERANCE
    assert np.array_equal(got_labels, labels[:25]) and np.array_equal(got_test, is_test[:25])


def test_dpfy_features_rotten_tomatoes_runs_on_real_embeddings(
    encoder, reference, tmp_path, monkeypatch
):
    """``dpfy features rotten-tomatoes`` end to end on 80 real snippets (cached in tmp)."""
    import contextlib
    import io

    from dpfy.cli import main

    texts, expected = reference
    labels = np.arange(80, dtype=np.int64) % 2
    is_test = np.arange(80) >= 64
    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(extract, "rotten_tomatoes_snippets", lambda: (texts[:80], labels, is_test))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["features", "rotten-tomatoes", "--method", "dp-ls", "--seed", "0",
                     "--out", str(tmp_path / "run")])
    assert code == 0, out.getvalue()
    assert "test accuracy" in out.getvalue()
    assert (tmp_path / "run" / "report.md").is_file()
    cached = np.load(tmp_path / "cache" / "features" / "all_minilm_l6_v2_rotten_tomatoes.npy")
    assert np.abs(cached - expected[:80]).max() <= TOLERANCE
    # a cache of another size (another corpus) is recomputed, not returned
    monkeypatch.setattr(extract, "rotten_tomatoes_snippets",
                        lambda: (texts[:5], labels[:5], is_test[:5]))
    feats, _, _ = extract.text_features(progress=False)
    assert feats.shape == (5, 384) and np.abs(feats - expected[:5]).max() <= TOLERANCE

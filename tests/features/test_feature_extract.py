"""Feature-extraction helpers that need no model weights: tokenizer, safetensors, cache dir."""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from dpfy.features import extract


def test_wordpiece_basic_and_greedy_longest_match():
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", ",", "world", "!", "un", "##aff",
             "##able", "it", "'", "s", "cafe"]
    tok = extract._WordPiece({w: i for i, w in enumerate(words)})
    assert tok._basic("Héllo,  WORLD!\tit's") == ["hello", ",", "world", "!", "it", "'", "s"]
    assert tok.tokenize("unaffable Café zzz") == [8, 9, 10, 14, 1]


def test_safetensors_reader_round_trip(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[7, 8]], dtype=np.int64)
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "I64", "shape": [1, 2], "data_offsets": [24, 40]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + a.tobytes() + b.tobytes())
    out = extract._load_safetensors(path)
    assert torch.equal(out["a"], torch.from_numpy(a)) and torch.equal(out["b"], torch.from_numpy(b))


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFY_CACHE_DIR", str(tmp_path))
    assert extract.cache_dir() == tmp_path / "features" and (tmp_path / "features").is_dir()

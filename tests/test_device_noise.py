"""The device path of :class:`dpfy.randomness.Randomness`: Philox4x32-10, secure words on a device.

Everything here runs on the CPU (and on the ``meta`` device, where reading any value raises):
the same torch code runs on a GPU with the tensors there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import dpfy.randomness as R
from dpfy._philox import PhiloxStream, philox4x32, philox4x32_reference, philox_key
from dpfy.randomness import Randomness

# Random123 kat_vectors (Salmon et al. 2011): counter[4], key[2] -> output[4]
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(counter, key, expected):
    assert philox4x32_reference(counter, key) == expected
    out = philox4x32(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


def test_tensor_philox_matches_the_reference_on_random_counters_and_keys():
    rng = np.random.default_rng(1)
    ctr = rng.integers(0, 2**32, size=(4, 300), dtype=np.uint64).astype(np.int64)
    ctr[:, :4] = [[0], [2**32 - 1], [2**31], [1]]  # edges of the uint32 range
    for key in [(0, 0), (2**32 - 1, 1), tuple(int(k) for k in rng.integers(0, 2**32, 2))]:
        out = philox4x32(tuple(torch.from_numpy(c) for c in ctr), key)
        got = torch.stack(out, 1).tolist()
        want = [philox4x32_reference(tuple(ctr[:, i]), key) for i in range(ctr.shape[1])]
        assert [tuple(g) for g in got] == want


def _reference_words(key, first_block, n):
    words = []
    for j in range(first_block, first_block + (n + 3) // 4):
        words.extend(philox4x32_reference((j & 0xFFFFFFFF, j >> 32, 0, 0), key))
    return np.array(words[:n], dtype=np.uint32).view(np.int32)


def test_stream_words_are_consecutive_blocks_and_resume_bit_for_bit():
    key = philox_key(123)
    stream = PhiloxStream(key, block=2**32 - 2)  # counter crosses into its second word
    a = stream.words(10)  # 3 blocks, 2 spare words skipped
    state = stream.state_dict()
    b = stream.words(7)
    np.testing.assert_array_equal(a.numpy(), _reference_words(key, 2**32 - 2, 10))
    np.testing.assert_array_equal(b.numpy(), _reference_words(key, 2**32 + 1, 7))
    resumed = PhiloxStream.from_state(state)
    assert torch.equal(resumed.words(7), b)
    assert philox_key(123) == key != philox_key(124)


def test_stream_refuses_bad_state():
    with pytest.raises(ValueError, match="key must be two integers"):
        PhiloxStream((1, 2**32))
    with pytest.raises(ValueError, match="block must be in"):
        PhiloxStream((1, 2), block=-1)
    with pytest.raises(ValueError, match="unknown device noise generator"):
        PhiloxStream.from_state({"generator": "mt19937", "key": [1, 2], "block": 0})


def test_seeded_device_noise_is_box_muller_on_the_philox_words():
    n, std = 1001, 0.5
    rng = Randomness(7, device_noise=True)
    base = torch.randn(n)
    out = torch.empty(n)
    rng.normal_([out], [std], add=[base])
    m = (n + 1) // 2
    words = torch.from_numpy(_reference_words(philox_key(7), 0, 2 * m))
    want = torch.empty(n)
    work = (torch.empty(m, dtype=torch.int32), torch.empty(m), torch.empty(m))
    R._box_muller32(words, want, *work, std=std, add=base)
    assert torch.equal(out, want)


# statistical: fixed seed 3 (deterministic)
def test_seeded_device_noise_is_standard_normal():
    t = torch.empty(200_000)
    Randomness(3, device_noise=True).normal_([t], [1.0])
    assert stats.kstest(t.double().numpy(), "norm").pvalue > 1e-4
    assert t.abs().max() <= Randomness(3).max_abs_z


def test_device_noise_resumes_from_a_checkpoint_and_cpu_default_is_unchanged():
    shapes = [(3, 5), (7,)]
    first = Randomness(11, device_noise=True)
    first.normal_([torch.empty(s) for s in shapes], [1.0, 2.0])
    state = first.state_dict()
    assert state["device_noise"]["block"] > 0
    again = Randomness(0, device_noise=True)
    again.load_state_dict(state)
    a, b = [torch.empty(s) for s in shapes], [torch.empty(s) for s in shapes]
    first.normal_(a, [1.0, 2.0])
    again.normal_(b, [1.0, 2.0])
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # an older state (no device stream) starts the device stream from the seed
    old = {k: v for k, v in state.items() if k != "device_noise"}
    fresh = Randomness(0, device_noise=True)
    fresh.load_state_dict(old)
    assert fresh._philox is None
    # CPU tensors keep the host generator by default: same draws as device_noise=False
    x, y = torch.empty(100), torch.empty(100)
    Randomness(5).normal_([x], [1.0])
    Randomness(5, device_noise=False).normal_([y], [1.0])
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="device_noise must be"):
        Randomness(0, device_noise="yes")  # type: ignore[arg-type]


def test_views_of_one_buffer_and_mixed_dtypes_on_the_device_path():
    flat = torch.empty(30)
    views = [flat[:12].view(3, 4), flat[12:]]
    Randomness(2, device_noise=True).normal_(views, [1.5, 1.5])
    single = torch.empty(30)
    Randomness(2, device_noise=True).normal_([single], [1.5])
    assert torch.equal(flat, single)  # the tiled buffer is one draw
    parts = [torch.empty(4), torch.empty(3, dtype=torch.float64), torch.empty(2)]
    adds = [torch.ones(4), None, torch.zeros(2)]
    Randomness(2, device_noise=True).normal_(parts, [1.0, 2.0, 3.0], add=adds)
    ref = torch.empty(9)
    Randomness(2, device_noise=True).normal_([ref], [1.0])
    torch.testing.assert_close(parts[0], 1.0 + ref[:4], rtol=0, atol=0)
    torch.testing.assert_close(parts[1], (2.0 * ref[4:7]).double(), rtol=0, atol=0)
    torch.testing.assert_close(parts[2], 3.0 * ref[7:], rtol=0, atol=0)


class _FakeKeystream:
    """Deterministic bytes with every 997th 32-bit word zero (forces deep radii)."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng(0)
        self._word = 0

    def fill(self, out: np.ndarray) -> None:
        b = out.view(np.uint8)
        b[:] = np.frombuffer(self._rng.bytes(b.size), dtype=np.uint8)
        w = out.view(np.uint32)
        idx = np.arange(self._word, self._word + w.size)
        w[idx % 997 == 0] = 0
        self._word += w.size


@pytest.mark.parametrize("n", [10_001, 4])
def test_secure_device_path_equals_the_host_path_on_the_same_keystream(monkeypatch, n):
    monkeypatch.setattr(R, "_Keystream", _FakeKeystream)
    calls: list[int] = []
    deep = Randomness._deep_radii
    monkeypatch.setattr(Randomness, "_deep_radii", lambda self, c: calls.append(c) or deep(self, c))
    base = torch.randn(n)
    host, device = torch.empty(n), torch.empty(n)
    Randomness(secure=True, device_noise=False).normal_([host], [0.7], add=[base])
    Randomness(secure=True, device_noise=True).normal_([device], [0.7], add=[base])
    assert torch.equal(host, device)
    if n > 1000:  # the zeroed words reached the deep tail, alike on both paths
        assert calls and calls[: len(calls) // 2] == calls[len(calls) // 2 :]


@pytest.mark.parametrize("secure", [False, True])
def test_device_path_reads_no_device_value(secure):
    """On the meta device any value read (item, bool, nonzero, numpy) raises."""
    rng = Randomness(secure=True) if secure else Randomness(0)
    flat = torch.empty(1001, device="meta")
    views = [flat[:1000].view(10, 100), flat[1000:]]
    rng.normal_(views, [1.0, 1.0], add=views)
    mixed = [torch.empty(3, device="meta"), torch.empty(2, dtype=torch.bfloat16, device="meta")]
    rng.normal_(mixed, [1.0, 2.0])
    assert rng.torch_normal((4,), 1.0, device="meta").device.type == "meta"

"""Secure mode of :class:`dpfy.randomness.Randomness`: keystream, noise, tails, sampling."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from scipy import stats

import dpfy.randomness as R
from dpfy.randomness import Randomness

# Per statistical check. The checks on secure draws take a fixed key (the ``fixed_os_key``
# fixture, tests/conftest.py), so they are deterministic; an OS key would fail each one in
# about 1 run in 10^4 (the level says how unlucky a key would have to be).
SIGNIFICANCE = 1e-4


def _poisson_two_sided(observed: int, expected: float) -> float:
    low = stats.poisson.cdf(observed, expected)
    high = stats.poisson.sf(observed - 1, expected)
    return float(min(1.0, 2.0 * min(low, high)))


def test_keystream_is_aes_ctr_of_zeros_across_chunks(monkeypatch):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(range(32))
    monkeypatch.setattr(R.os, "urandom", lambda n: key[:n])
    stream = R._Keystream()
    monkeypatch.setattr(stream, "_CHUNK", 1000)
    monkeypatch.setattr(stream, "_zeros", memoryview(bytes(1000)))
    sizes = [3, 1000, 2500, 7, 4096]  # within, at and across chunk boundaries
    got = []
    for n in sizes:
        buf = np.empty(n, dtype=np.uint8)
        stream.fill(buf)
        got.append(buf.tobytes())
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    assert b"".join(got) == enc.update(bytes(sum(sizes)))


def test_keystream_rekeys_in_a_forked_child(monkeypatch):
    stream = R._Keystream()
    stream.fill(np.empty(8, dtype=np.uint8))
    first = stream._enc
    monkeypatch.setattr(R.os, "getpid", lambda: -5)
    stream.fill(np.empty(8, dtype=np.uint8))
    assert stream._enc is not first and stream._used == 8


# statistical: secure noise under a fixed OS key (fixed_os_key): deterministic
def test_secure_gaussian_ks_and_tail_counts_on_ten_million_draws(fixed_os_key):
    n = 10_000_000
    t = torch.empty(n)
    Randomness.secure_mode().normal_([t], [1.0])
    x = t.double().numpy()
    assert np.isfinite(x).all()
    assert stats.kstest(x, "norm").pvalue > SIGNIFICANCE
    a = np.abs(x)
    for c in (4.0, 5.0, 6.0):
        expected = n * 2 * stats.norm.sf(c)
        assert _poisson_two_sided(int((a > c).sum()), expected) > SIGNIFICANCE, c
    assert a.max() <= Randomness.secure_mode().max_abs_z


# statistical: secure noise under a fixed OS key (fixed_os_key), addends seed 0: deterministic
def test_fused_flat_buffer_matches_unfused_secure_path_in_distribution(fixed_os_key):
    rng = Randomness.secure_mode()
    g = torch.Generator().manual_seed(0)
    sizes = [150_000, 3, 99_997]
    n = sum(sizes)
    flat, base = torch.empty(n), torch.randn(n, generator=g)
    views = list(torch.split(flat, sizes))
    rng.normal_(views, [2.5] * 3, add=list(torch.split(base, sizes)))  # fused
    z_fused = ((flat - base) / 2.5).double().numpy()
    separate = [torch.empty(k) for k in sizes]
    adds = [torch.randn(k, generator=g) for k in sizes]
    rng.normal_(separate, [2.5] * 3, add=adds)  # general path
    z_sep = torch.cat([(s - a) / 2.5 for s, a in zip(separate, adds, strict=True)])
    z_sep = z_sep.double().numpy()
    assert stats.ks_2samp(z_fused, z_sep).pvalue > SIGNIFICANCE
    for z in (z_fused, z_sep):
        assert stats.kstest(z, "norm").pvalue > SIGNIFICANCE


# statistical: secure noise under a fixed OS key (fixed_os_key): deterministic
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_secure_other_dtypes_and_float64_normal(dtype, fixed_os_key):
    rng = Randomness.secure_mode()
    t = torch.empty(200_001, dtype=dtype)
    rng.normal_([t], [1.0])
    x = t.double().numpy()
    assert abs(x.std() - 1.0) < 0.02
    if dtype == torch.float64:
        assert stats.kstest(x, "norm").pvalue > SIGNIFICANCE
    y = rng.normal((301, 3), std=2.0)
    assert y.shape == (301, 3) and stats.kstest(y.ravel() / 2.0, "norm").pvalue > SIGNIFICANCE


# statistical: fixed seed 0 (deterministic)
def test_deep_tail_radii_are_the_conditional_law_and_bounded():
    # Given u < 2^-31 (u uniform), R^2 / 2 - 31 ln 2 = -ln(u 2^31) is Exp(1).
    rng = np.random.default_rng(0)
    k2 = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    k3 = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    r = R._refined_radius(k2, k3)
    assert stats.kstest(r**2 / 2 - 31 * math.log(2), "expon").pvalue > SIGNIFICANCE
    extreme = R._refined_radius(np.zeros(1, np.uint32), np.zeros(1, np.uint32))[0]
    assert extreme == pytest.approx(math.sqrt(2 * 96 * math.log(2)))
    assert Randomness.secure_mode().max_abs_z == pytest.approx(math.sqrt(2) * extreme)


def test_transform_replaces_all_zero_radius_words_by_deep_radii():
    bits32 = torch.tensor([0, -(2**31), 5, 2**31 - 1] + [0, 2**30, -(2**30), 7], dtype=torch.int32)
    m = 4
    out = torch.empty(2 * m)
    scratch = (torch.empty(m, dtype=torch.int32), torch.empty(m), torch.empty(m))
    calls = []

    def deep(c):
        calls.append(c)
        return np.full(c, 11.0)

    R._box_muller32(bits32, out, *scratch, deep_tail=deep)
    assert calls == [2]  # the all-zero word and the sign bit alone
    radius = torch.hypot(out[:m], out[m:])
    torch.testing.assert_close(radius[:2], torch.full((2,), 11.0))
    assert float(radius[2:].max()) < 6.7


def test_tail_mass_against_the_gaussian_tails():
    secure, seeded = Randomness.secure_mode(), Randomness(seed=0)
    # per radius, the mass cut is P(R > r_cut) for a 2-D standard Gaussian radius
    r_cut = math.sqrt(2 * 95 * math.log(2))
    assert stats.chi2(2).sf(r_cut**2) == pytest.approx(2.0**-95, rel=1e-9)
    # ... which is at least the 1-D marginal mass beyond it (one coordinate of the pair)
    assert 2 * stats.norm.sf(r_cut) <= 2.0**-95
    assert secure.tail_mass(1) == pytest.approx(2 * 2.0**-95)
    run = 1e4 * 2.26e7  # steps x coordinates
    assert secure.tail_mass(run) < 1e-3 * 1e-5
    assert secure.tail_mass(run) >= run * 2 * stats.norm.sf(secure.max_abs_z)
    # seeded float32: 31 bits, |z| <= 6.66; its run mass is far above any delta
    assert seeded.max_abs_z == pytest.approx(6.6604, abs=1e-3)
    assert seeded.tail_mass(1) == pytest.approx(stats.chi2(2).sf(-2 * math.log(2.0**-31)))
    assert seeded.tail_mass(run) > 1.0
    with pytest.raises(ValueError, match="num_values"):
        secure.tail_mass(-1)


def test_secure_mode_has_no_state_and_streams_differ():
    a, b = Randomness.secure_mode(), Randomness(secure=True)
    with pytest.raises(RuntimeError, match="no state"):
        a.state_dict()
    with pytest.raises(RuntimeError, match="cannot load"):
        a.load_state_dict(Randomness(seed=0).state_dict())
    assert not np.array_equal(a.uniform(8), b.uniform(8))
    ta, tb = torch.empty(1000), torch.empty(1000)
    a.normal_([ta], [1.0])
    b.normal_([tb], [1.0])
    assert not torch.equal(ta, tb)
    assert repr(a) == "Randomness(secure=True)"


# statistical: secure draws under a fixed OS key (fixed_os_key): deterministic
def test_secure_uniform_and_bernoulli(fixed_os_key):
    rng = Randomness.secure_mode()
    u = rng.uniform((400, 500))
    assert u.shape == (400, 500) and u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u.ravel(), "uniform").pvalue > SIGNIFICANCE
    n, p = 200_000, 0.013
    hits = int(rng.bernoulli(p, n).sum())
    assert stats.binomtest(hits, n, p).pvalue > SIGNIFICANCE


# statistical: secure draws under a fixed OS key (fixed_os_key): deterministic
def test_secure_permutation_and_choice_are_uniform(fixed_os_key):
    rng = Randomness.secure_mode()
    counts: dict[tuple[int, ...], int] = {}
    draws = 12_000
    for _ in range(draws):
        key = tuple(int(i) for i in rng.permutation(4))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 24
    assert stats.chisquare(list(counts.values())).pvalue > SIGNIFICANCE
    picks = np.concatenate([rng.choice(10, 3) for _ in range(5000)])
    assert all(len(set(rng.choice(50, 50))) == 50 for _ in range(3))
    assert stats.chisquare(np.bincount(picks, minlength=10)).pvalue > SIGNIFICANCE


# statistical: secure draws under a fixed OS key (fixed_os_key): deterministic
def test_secure_binomial_matches_its_pmf(fixed_os_key):
    rng = Randomness.secure_mode()
    n, p, draws = 20, 0.3, 3000
    x = np.array([rng.binomial(n, p) for _ in range(draws)])
    observed = np.bincount(x, minlength=n + 1)
    expected = draws * stats.binom.pmf(np.arange(n + 1), n, p)
    keep = expected >= 5  # pool the sparse tails
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > SIGNIFICANCE


def test_secure_noise_does_not_come_from_os_urandom_per_value(monkeypatch):
    # Only the 32-byte key is read from the OS: the noise is a keystream.
    calls: list[int] = []
    real = os.urandom
    monkeypatch.setattr(R.os, "urandom", lambda k: calls.append(k) or real(k))
    rng = Randomness.secure_mode()
    rng.normal_([torch.empty(100_000)], [1.0])
    rng.uniform(10_000)
    assert calls == [32]

"""Block-wise float64 norms: the values of a whole-tensor float64 reduction, without its copy."""

from __future__ import annotations

import pytest
import torch

from dpfy.training.norms import wide


@pytest.mark.parametrize("n", [0, 1, 7, wide.BLOCK - 1, wide.BLOCK, 2 * wide.BLOCK + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_block_norms_match_whole_tensor_float64(n, dtype):
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 3).to(dtype)
    b = (torch.randn(n, generator=g)).to(dtype)
    x = a.double()
    rel = 1e-12
    assert wide.norm(a).item() == pytest.approx(torch.linalg.vector_norm(x).item(), rel=rel)
    fp = wide.fingerprint(a)
    want = [torch.linalg.vector_norm(x).item(), x.sum().item(), x.abs().sum().item()]
    assert fp.dtype == torch.float64 and fp.shape == (3,)
    assert fp.tolist() == pytest.approx(want, rel=rel, abs=1e-9)
    d = (a - b.to(a.dtype)).double()
    assert wide.difference_norm(a, b).item() == pytest.approx(
        torch.linalg.vector_norm(d).item(), rel=rel)


def test_shapes_are_flattened_and_must_agree():
    a = torch.arange(12.0).reshape(3, 4)
    assert wide.norm(a).item() == pytest.approx(torch.linalg.vector_norm(a.double()).item())
    with pytest.raises(ValueError, match="one shape"):
        wide.difference_norm(a, a.reshape(4, 3))


def test_at_most_one_block_is_cast_at_a_time(monkeypatch):
    # the float64 copies are of blocks: none is larger than BLOCK elements
    monkeypatch.setattr(wide, "BLOCK", 10)
    sizes: list[int] = []
    double = torch.Tensor.double

    def counting(self: torch.Tensor) -> torch.Tensor:
        sizes.append(self.numel())
        return double(self)

    monkeypatch.setattr(torch.Tensor, "double", counting)
    a = torch.randn(95)
    wide.norm(a), wide.fingerprint(a), wide.difference_norm(a, a)
    assert sizes and max(sizes) <= 10

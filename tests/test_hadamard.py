"""The fast Walsh–Hadamard transform against the dense matrices it stands for."""

import pytest
import torch

from kvquant.quant.hadamard import factor, fwht, hadamard_matrix, hadamard_transform, supported_size, sylvester

POWERS = [2**k for k in range(1, 11)]


@pytest.mark.parametrize("n", POWERS)
def test_fwht_is_the_sylvester_product_and_its_own_inverse_up_to_scale(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    h = sylvester(n, torch.float64)
    assert torch.allclose(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert torch.allclose(fwht(x), x @ h, atol=1e-9)
    assert torch.allclose(fwht(fwht(x)), n * x, atol=1e-9)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("n", [8, 12, 20, 24, 40, 64, 192, 256, 320, 768])
def test_paley_kronecker_sizes_are_hadamard_and_invertible(n, fast):
    """Both paths (dense matmul up to DENSE_MAX by default, structured fast transform) are the same rotation."""
    h = hadamard_matrix(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.allclose(h @ h.T, n * torch.eye(n))
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(0))
    y = hadamard_transform(x, fast=fast)
    assert torch.allclose(y, x @ h / n**0.5, atol=1e-4)
    assert torch.allclose(hadamard_transform(y, inverse=True, fast=fast), x, atol=1e-4)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # orthonormal


def test_sizes_without_a_transform_are_refused_with_the_size_to_pad_to():
    assert factor(10) is None and supported_size(10) == 12
    assert supported_size(72) == 80 and supported_size(192) == 192 and supported_size(64) == 64
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(6))
    with pytest.raises(ValueError, match="pad to 12"):
        hadamard_transform(torch.zeros(10))

"""Closed-form ridge: it recovers a known linear map, streams, and its λ shrinks."""

import torch

from kvquant.quant.ridge import RidgeStats, ridge


def synthetic(n=4000, n_in=12, n_out=5, noise=1e-3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g) * torch.linspace(0.5, 3.0, n_in) + 2.0
    w = torch.randn(n_in, n_out, generator=g)
    b = torch.randn(n_out, generator=g)
    y = x @ w + b + noise * torch.randn(n, n_out, generator=g)
    return x, y, w, b


def test_recovers_a_known_linear_map_with_bias():
    x, y, w, b = synthetic()
    w_hat, b_hat = ridge(x, y, lam=1e-6)
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape and b_hat.shape == b.shape
    assert torch.allclose(w_hat, w, atol=1e-3) and torch.allclose(b_hat, b, atol=1e-2)


def test_batches_give_the_one_shot_fit():
    x, y, _, _ = synthetic()
    stats = RidgeStats(x.shape[1], y.shape[1])
    for part in range(4):
        stats.add(x[part * 1000 : (part + 1) * 1000], y[part * 1000 : (part + 1) * 1000])
    w1, b1 = stats.fit()
    w2, b2 = ridge(x, y)
    assert torch.allclose(w1, w2, atol=1e-5) and torch.allclose(b1, b2, atol=1e-5)


def test_lambda_scales_with_the_mean_diagonal_and_shrinks():
    x, y, _, _ = synthetic(noise=0.5)
    small, _ = ridge(x, y, lam=1e-3)
    large, _ = ridge(x, y, lam=10.0)
    assert large.norm() < 0.5 * small.norm()
    scaled, _ = ridge(10 * x, y, lam=1e-3)  # λ relative to the data's scale: same shrinkage
    assert torch.allclose(scaled * 10, small, rtol=1e-3, atol=1e-4)

"""The shipped Gaussian grids: what the script makes, and better than a uniform grid at every preset."""

import pytest
import torch

from kvquant.quant.grids import PRESETS, gaussian_samples, grid_info, grid_mse, load_grid, make_grid, nearest


def best_uniform_mse(x, n, d):
    """MSE of the best square uniform grid of n points (step searched finely): a strong baseline.

    A square grid's nearest point is the nearest level on each axis, so it is a scalar search.
    """
    side = round(n ** (1 / d))
    best = float("inf")
    for step in torch.linspace(0.05, 2.0, 200).tolist():
        idx = (x / step + (side - 1) / 2).round().clamp(0, side - 1)
        best = min(best, float((x - (idx - (side - 1) / 2) * step).pow(2).mean()))
    return best


@pytest.mark.parametrize("bits", sorted(PRESETS))
def test_lloyd_grid_beats_uniform_grid_on_fresh_gaussian_samples(bits):
    d, n = PRESETS[bits]
    grid = load_grid(d, n)
    assert grid.shape == (n, d) and torch.isfinite(grid).all() and len(torch.unique(grid, dim=0)) == n
    x = gaussian_samples(1 << 15, d, seed=12345)  # not the generation seed
    lloyd, uniform = grid_mse(x, grid), best_uniform_mse(x, n, d)
    assert lloyd < uniform, (lloyd, uniform)
    assert lloyd < 0.97 * uniform  # a real gain, not a tie


@pytest.mark.parametrize("bits", sorted(PRESETS))
def test_shipped_grid_is_what_its_header_says(bits):
    d, n = PRESETS[bits]
    info = grid_info(d, n)
    x = gaussian_samples(info["samples"], d, info["seed"])
    assert grid_mse(x, load_grid(d, n)) == pytest.approx(info["mse"], rel=1e-4)


def test_make_grid_is_deterministic_and_nearest_is_exact():
    g1, info1 = make_grid(16, 2, samples=2048, seed=7)
    g2, info2 = make_grid(16, 2, samples=2048, seed=7)
    assert torch.equal(g1, g2) and info1 == info2
    x = gaussian_samples(3000, 2, seed=1)
    brute = torch.cdist(x, g1).argmin(-1)
    assert torch.equal(nearest(x, g1), brute)

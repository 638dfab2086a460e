"""Vector grids that are MSE-optimal for a standard Gaussian, made by our own seeded Lloyd (k-means).

HIGGS snaps each ``d``-dim chunk of a Hadamard-rotated, norm-scaled group — close to i.i.d.
N(0, 1) — to the nearest of ``n`` points. The points are Lloyd's fixed point on Gaussian samples:
``scripts/make_higgs_grids.py`` computes them once (two seeded starts, the better kept) and ships
them in ``kvquant/assets/higgs_grids.safetensors``, so every run uses the same grid without paying
for k-means. The file records how each grid was made (seed, samples, iterations, MSE).

Pure torch (+ safetensors): importable without transformers, Hydra or W&B.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from kvquant.errors import KvquantError

GRID_FILE = Path(__file__).resolve().parents[1] / "assets" / "higgs_grids.safetensors"
PRESETS: dict[int, tuple[int, int]] = {2: (2, 16), 3: (2, 64), 4: (2, 256)}  # bits/value -> (d, n)
SEARCH_BLOCK = 1 << 16


def grid_key(d: int, n: int) -> str:
    return f"d{d}_n{n}"


def nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point for each row of ``x`` (``[N, d]``), in blocks to bound memory."""
    half_sq = 0.5 * (grid * grid).sum(-1)
    if x.shape[0] <= SEARCH_BLOCK:  # one block (a decode step's rows): no buffer to copy it into
        return (x @ grid.T - half_sq).argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for start in range(0, x.shape[0], SEARCH_BLOCK):
        block = x[start : start + SEARCH_BLOCK]
        out[start : start + block.shape[0]] = (block @ grid.T - half_sq).argmax(-1)
    return out


def grid_mse(x: torch.Tensor, grid: torch.Tensor) -> float:
    """Mean squared error per coordinate of snapping the rows of ``x`` to ``grid``."""
    return float((x - grid[nearest(x, grid)]).pow(2).mean())


def gaussian_samples(n: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen)


def _kmeans_pp(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: each new centre drawn with probability ∝ squared distance to the nearest one."""
    centres = [x[torch.randint(x.shape[0], (1,), generator=gen)]]
    dist = (x - centres[0]).pow(2).sum(-1)
    for _ in range(1, n):
        pick = torch.multinomial(dist / dist.sum(), 1, generator=gen)
        centres.append(x[pick])
        dist = torch.minimum(dist, (x - x[pick]).pow(2).sum(-1))
    return torch.cat(centres)


def _product_init(n: int, d: int) -> torch.Tensor | None:
    """A square lattice of Gaussian quantiles (when ``n`` is a perfect ``d``-th power), else None."""
    side = round(n ** (1 / d))
    if side**d != n:
        return None
    probs = (torch.arange(side, dtype=torch.float64) + 0.5) / side
    axis = (torch.special.ndtri(probs)).float()
    mesh = torch.meshgrid(*([axis] * d), indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)


def lloyd(x: torch.Tensor, centres: torch.Tensor, max_iter: int = 100, tol: float = 1e-6) -> tuple[torch.Tensor, int]:
    """Lloyd iterations from ``centres`` on samples ``x`` until the MSE stops improving by ``tol`` (relative)."""
    centres = centres.clone()
    prev = float("inf")  # the first pass always continues: inf - err > tol·err
    for it in range(1, max_iter + 1):
        idx = nearest(x, centres)
        sums = torch.zeros_like(centres).index_add_(0, idx, x)
        counts = torch.bincount(idx, minlength=centres.shape[0]).unsqueeze(-1)
        centres = torch.where(counts > 0, sums / counts.clamp_min(1), centres)
        err = float((x - centres[idx]).pow(2).mean())
        if prev - err <= tol * err:
            return centres, it
        prev = err
    return centres, max_iter


def make_grid(
    n: int, d: int = 2, samples: int = 1 << 18, seed: int = 0, max_iter: int = 100
) -> tuple[torch.Tensor, dict]:
    """A Gaussian MSE-optimal ``n``-point grid in ``d`` dims: the better of k-means++ and lattice starts.

    Deterministic for a fixed ``seed`` (samples and seeding both come from it). Returns the grid,
    rows sorted lexicographically, and how it was made.
    """
    x = gaussian_samples(samples, d, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    starts = {"kmeans++": _kmeans_pp(x, n, gen)}
    lattice = _product_init(n, d)
    if lattice is not None:
        starts["lattice"] = lattice
    best = None
    for name, init in starts.items():
        grid, iters = lloyd(x, init, max_iter=max_iter)
        err = grid_mse(x, grid)
        if best is None or err < best[1]:
            best = (grid, err, name, iters)
    grid, err, start, iters = best
    order = sorted(range(n), key=lambda i: tuple(grid[i].tolist()))
    info = {"d": d, "n": n, "seed": seed, "samples": samples, "start": start, "iterations": iters, "mse": err}
    return grid[order].contiguous(), info


def save_grids(grids: dict[str, tuple[torch.Tensor, dict]], path: Path = GRID_FILE) -> None:
    from safetensors.torch import save_file

    meta = {"grids": json.dumps({k: info for k, (_, info) in grids.items()}, sort_keys=True)}
    save_file({k: g for k, (g, _) in grids.items()}, str(path), metadata=meta)


@cache
def _load_all(path: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    from safetensors import safe_open

    if not Path(path).is_file():
        raise KvquantError(f"HIGGS grid file not found: {path}; regenerate it with python scripts/make_higgs_grids.py")
    with safe_open(path, "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        info = json.loads(fh.metadata()["grids"])
    return tensors, info


def load_grid(d: int, n: int, path: Path = GRID_FILE) -> torch.Tensor:
    """The shipped ``n``-point ``d``-dim grid (``[n, d]`` fp32)."""
    tensors, _ = _load_all(str(path))
    key = grid_key(d, n)
    if key not in tensors:
        raise KvquantError(f"no HIGGS grid {key} in {path} (has {', '.join(sorted(tensors))})")
    return tensors[key]


def grid_info(d: int, n: int, path: Path = GRID_FILE) -> dict:
    """How the shipped grid was made (seed, samples, start, iterations, MSE)."""
    return _load_all(str(path))[1][grid_key(d, n)]

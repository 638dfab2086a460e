"""Generate the HIGGS grids shipped in ``kvquant/assets/higgs_grids.safetensors``.

Seeded Lloyd on standard-Gaussian samples, one grid per preset (d=2 with 16, 64, 256 points = 2,
3, 4 bits per value). Deterministic: rerunning it rewrites the same file.

    .venv/bin/python scripts/make_higgs_grids.py [--samples 262144] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvquant.quant.grids import GRID_FILE, PRESETS, grid_key, make_grid, save_grids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1 << 18)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=GRID_FILE)
    args = parser.parse_args(argv)
    grids = {}
    for bits, (d, n) in sorted(PRESETS.items()):
        started = time.perf_counter()
        grid, info = make_grid(n, d, samples=args.samples, seed=args.seed)
        grids[grid_key(d, n)] = (grid, info)
        print(
            f"{grid_key(d, n)} ({bits} bits/value): MSE {info['mse']:.5f} from {info['start']} start, "
            f"{info['iterations']} iterations, {time.perf_counter() - started:.1f}s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_grids(grids, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

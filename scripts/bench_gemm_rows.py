#!/usr/bin/env python
"""What a batched decode step can gain on this CPU: fp32 ``linear`` time for ``rows`` rows vs one row.

    python scripts/bench_gemm_rows.py                 # smollm2_135m's weight shapes, one thread

A decode step is mostly ``linear`` over the weights; if ``rows`` rows cost about one row, batching
decode gains ~``rows``×; the table gives the measured ratio (medians, same run, after a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {"lm_head": (49152, 576), "mlp_up": (1536, 576), "mlp_down": (576, 1536), "q_proj": (576, 576)}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch threads {torch.get_num_threads()}; ms per linear (× one row)")
    print("| weight | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---" * (1 + len(rows)) + "|")
    for name, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f)
        ms = []
        for r in rows:
            x = torch.randn(r, in_f)
            ms.append(median_ms(lambda x=x, w=weight: torch.nn.functional.linear(x, w), args.repeats))
        print(f"| {name} {out_f}×{in_f} | " + " | ".join(f"{m:.3f} (×{m / ms[0]:.1f})" for m in ms) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Time of one decode step's KV work: AlignedKV's CPU reference vs fp16, in the same run.

    python scripts/bench_alignedkv.py                      # contexts 1K/4K/16K, smollm2 and Llama-2-7B shapes
    python scripts/bench_alignedkv.py --contexts 1024 --shapes smollm2_135m --threads 1

Both start from their own store holding ``context − 1`` tokens (Gaussian K/V, seeded) and are
timed on storing the last token, reading and attending (``kvquant.analysis.timing``); fp16 attends
with transformers' SDPA, AlignedKV with its rules, plane reads and the same SDPA. Ratio = AlignedKV / fp16.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvquant import get_method
from kvquant.analysis.timing import SHAPES, decode_step_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--shapes", default="smollm2_135m,llama2_7b")
    parser.add_argument("--method", default="alignedkv")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    header = f"{'shape':<14}{'context':>8}{'fp16 ms':>10}{args.method + ' ms':>18}{'ratio':>8}{'bits read':>11}"
    print(header)
    print("-" * len(header))
    fp16, method = get_method("fp16"), get_method(args.method)
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            print(f"error: unknown shape '{shape}'; valid: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        for ctx in (int(c) for c in args.contexts.split(",")):
            t16, _ = decode_step_time(fp16, shape, ctx, args.repeats)
            tm, bits = decode_step_time(method, shape, ctx, args.repeats)
            print(f"{shape:<14}{ctx:>8}{t16 * 1e3:>10.2f}{tm * 1e3:>18.2f}{tm / t16:>8.2f}{bits:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

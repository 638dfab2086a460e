#!/usr/bin/env python
"""Time of one decode-step attention: AlignedKV's CPU reference vs fp16 SDPA, in the same run.

    python scripts/bench_alignedkv.py                      # contexts 1K/4K/16K, smollm2 and Llama-2-7B shapes
    python scripts/bench_alignedkv.py --contexts 1024 --shapes smollm2_135m

Both paths start from the cache as stored (fp16) and end with the attention output, on the same
K/V (Gaussian, seeded) and query: fp16 = cast + transformers' SDPA; AlignedKV = width rules + plane
reads + the same SDPA. Medians over ``--repeats`` after a warm-up; ratio = AlignedKV / fp16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvquant import get_method

SHAPES = {"smollm2_135m": (9, 3, 64), "llama2_7b": (32, 32, 128)}  # q heads, kv heads, head_dim


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(shape: str, context: int, repeats: int, method: str) -> tuple[float, float, float]:
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, hkv, context, d, generator=gen)
    v = torch.randn(1, hkv, context, d, generator=gen)
    q = torch.randn(1, hq, 1, d, generator=gen)
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    scaling = d**-0.5

    layer = get_method(method).new_layer(0, SimpleNamespace(num_key_value_heads=hkv, num_attention_heads=hq))
    layer.update(k, v)
    k16, v16 = k.half(), v.half()

    def fp16_step():
        return sdpa_attention_forward(module, q, k16.float(), v16.float(), None, scaling=scaling)

    def aligned_step():
        return layer.attend(module, q, None, scaling=scaling)

    t16 = timed(fp16_step, repeats)
    taligned = timed(aligned_step, repeats)
    return t16, taligned, layer.counts().summary()["bits_read"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--method", default="alignedkv")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    header = f"{'shape':<14}{'context':>8}{'fp16 ms':>10}{'aligned ms':>12}{'ratio':>8}{'bits read':>11}"
    print(header)
    print("-" * len(header))
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            print(f"error: unknown shape '{shape}'; valid: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        for ctx in (int(c) for c in args.contexts.split(",")):
            t16, ta, bits_read = bench(shape, ctx, args.repeats, args.method)
            print(f"{shape:<14}{ctx:>8}{t16 * 1e3:>10.2f}{ta * 1e3:>12.2f}{ta / t16:>8.2f}{bits_read:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode-step time of quantized KV caches vs the fp16 cache, measured in the same run.

    python scripts/bench_kv_methods.py                                  # kivi2,kivi4,gear2,gear4 at 1K and 4K
    python scripts/bench_kv_methods.py --methods kivi2,aquakv --contexts 2048 --threads 1

For each context length the model prefills ``context − 1`` WikiText-2 tokens once (a plain
DynamicCache); every cache then receives those exact K/V through its own ``update`` (what the model's
prefill would hand it) and decodes ``--new-tokens`` greedy tokens with
``kvquant.eval.fidelity.greedy_decode``. Repeats are interleaved across caches (so background load
hits them alike), one warm-up excluded; the table shows the median ms per decode step and its ratio
to the framework's fp16 cache and to transformers' ``DynamicCache`` (``hf_dynamic``).

A second table checks that a decode step does not re-quantize the cache: starting from the prefilled
context it feeds ``--profile-steps`` single-token K/V into all layers (cache work only, no model) and
prints, per bucket of steps, the median and max step time as a ratio to fp16's. A flat median ratio
across buckets (the cache now well past its fp16 window) means per-step work grows only like
fp16's own read of the history; the max shows the periodic block flushes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvquant.analysis.capture import capture_kv
from kvquant.data import wikitext2_test
from kvquant.errors import KvquantError
from kvquant.eval.fidelity import greedy_decode
from kvquant.methods import get_method
from kvquant.models import load_model

BASELINE = "fp16"
HF = "hf_dynamic"


def context_ids(tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of WikiText-2 (test)."""
    ids = tokenizer(wikitext2_test()[: 12 * n]).input_ids
    if len(ids) < n:
        raise KvquantError(f"not enough bundled text for a {n}-token context")
    return torch.tensor(ids[:n])


def filled_cache(make: Callable[[], object], kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh cache that has received ``kv`` through its own ``update``, layer by layer."""
    cache = make()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def cache_factories(model, names: list[str]) -> dict[str, Callable[[], object]]:
    makers: dict[str, Callable[[], object]] = {}
    for name in names:
        method = get_method(name)
        makers[name] = lambda m=method: m.new_cache(model)
    makers[HF] = DynamicCache
    return makers


def decode_times(model, kv, last: torch.Tensor, makers, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds per decode step for each cache, repeats interleaved, one warm-up excluded."""
    times: dict[str, list[float]] = {name: [] for name in makers}
    for rep in range(repeats + 1):
        for name, make in makers.items():
            run = greedy_decode(model, last, filled_cache(make, kv), new_tokens)
            if rep:
                times[name].append(run.decode_s / (new_tokens - 1))
    return {name: statistics.median(ts) for name, ts in times.items()}


def step_profile(kv, makers, steps: int, bucket: int, seed: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Per bucket of single-token cache updates (all layers): (median, max) seconds per step."""
    gen = torch.Generator().manual_seed(seed)
    k0, v0 = kv[0]
    new = [
        [(torch.randn(*k0.shape[:2], 1, k0.shape[-1], generator=gen) * k.std()).to(k.dtype) for k, _ in kv]
        for _ in range(steps)
    ]
    out: dict[str, list[tuple[float, float]]] = {}
    for name, make in makers.items():
        cache = filled_cache(make, kv)
        per_step = []
        for s in range(steps):
            t0 = time.perf_counter()
            for i, k in enumerate(new[s]):
                cache.update(k, k.to(v0.dtype), i)
            per_step.append(time.perf_counter() - t0)
        out[name] = [
            (statistics.median(per_step[b : b + bucket]), max(per_step[b : b + bucket]))
            for b in range(0, steps, bucket)
        ]
    return out


def print_profile(profiles: dict[str, list[tuple[float, float]]], start: int, bucket: int) -> None:
    """Per bucket of steps: median ms per step, its ratio to fp16's, and the max step as a ratio to fp16's max."""
    base = profiles[BASELINE]
    print(f"\ncache-only update time per step, all layers, from context {start} (median ms, ×fp16; max ×fp16 max):")
    spans = [f"{start + i * bucket + 1}-{start + (i + 1) * bucket}" for i in range(len(base))]
    print(f"{'cache':<12}" + "".join(f"{s:>26}" for s in spans))
    for name, rows in profiles.items():
        cells = [f"{1e3 * m:.2f} ×{m / bm:.2f}; max ×{x / bx:.1f}" for (m, x), (bm, bx) in zip(rows, base, strict=True)]
        print(f"{name:<12}" + "".join(f"{c:>26}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--methods", default="kivi2,kivi4,gear2,gear4", help="registry names (fp16 is always run)")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=256, help="0 skips the per-step table")
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [BASELINE] + [m for m in args.methods.split(",") if m and m != BASELINE]

    try:
        model, tokenizer = load_model(args.model, device=args.device)
        makers = cache_factories(model, names)
        limit = model.config.max_position_embeddings
        contexts = sorted({min(int(c), limit - args.new_tokens) for c in args.contexts.split(",")})
        header = f"{'context':>8}  {'cache':<12}{'ms/step':>10}{'×fp16':>8}{'×' + HF:>14}"
        print(header)
        print("-" * len(header))
        profiles = {}
        for ctx in contexts:
            ids = context_ids(tokenizer, ctx)
            kv = capture_kv(model, ids[:-1])
            step = decode_times(model, kv, ids[-1:], makers, args.new_tokens, args.repeats)
            for name, s in step.items():
                print(f"{ctx:>8}  {name:<12}{1e3 * s:>10.1f}{s / step[BASELINE]:>8.2f}{s / step[HF]:>14.2f}")
            if args.profile_steps and ctx == contexts[0]:
                profiles = step_profile(kv, makers, args.profile_steps, args.bucket)
                profile_ctx = ctx
        if profiles:
            print_profile(profiles, profile_ctx, args.bucket)
    except KvquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

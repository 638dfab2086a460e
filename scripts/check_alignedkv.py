#!/usr/bin/env python
"""AlignedKV on smollm2_135m: bits read at long context, and greedy fidelity to fp16.

    python scripts/check_alignedkv.py                 # the full check (≈15 min on 2 CPU cores)
    python scripts/check_alignedkv.py --prompts 4 --long-context 1024 --long-new 32   # quick look

Part 1: one ``--long-context``-token WikiText-2 prompt (default 2,048) + ``--long-new`` generated
tokens (128): mean bits read for K, V and both, and the width shares. Part 2: ``--prompts`` (20)
consecutive ``--prompt-tokens`` (512) windows of WikiText-2, ``--new`` (64) greedy tokens each:
share of generated tokens equal to fp16's at the same position, and prompts fully identical.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from kvquant import get_method, load_model
from kvquant.data import wikitext2_test
from kvquant.eval.fidelity import greedy_decode

METHODS = ("alignedkv", "alignedkv_release", "truncation")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--long-context", type=int, default=2048)
    parser.add_argument("--long-new", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)

    model, tok = load_model(args.model)
    ids = tok(wikitext2_test(), return_tensors="pt").input_ids[0]
    methods = args.methods.split(",")
    started = time.perf_counter()

    print(f"## Bits read: {args.model}, {args.long_context}-token WikiText-2 prompt + {args.long_new} tokens\n")
    print("| method | bits read K | bits read V | bits read | K widths 8/12/16 | V widths 8/12/16 |")
    print("|---|---|---|---|---|---|")
    long_prompt = ids[: args.long_context]
    for name in methods:
        cache = get_method(name).new_cache(model)
        greedy_decode(model, long_prompt, cache, args.long_new)
        s = cache.stats()

        def shares(h: dict) -> str:
            return " / ".join(f"{h.get(w, 0.0):.2f}" for w in (8, 12, 16)) if set(h) <= {8, 12, 16} else "—"

        print(
            f"| {name} | {s['bits_read_k']:.2f} | {s['bits_read_v']:.2f} | {s['bits_read']:.2f} "
            f"| {shares(s['widths_k'])} | {shares(s['widths_v'])} |"
        )

    print(f"\n## Greedy fidelity: {args.prompts} prompts × {args.new} tokens ({args.prompt_tokens}-token windows)\n")
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    fp16 = get_method("fp16")
    reference = [greedy_decode(model, p, fp16.new_cache(model), args.new).tokens for p in prompts]
    print("| method | tokens equal to fp16 | prompts identical | bits read |")
    print("|---|---|---|---|")
    for name in methods:
        method = get_method(name)
        same, identical, bits = [], 0, []
        for prompt, ref in zip(prompts, reference, strict=True):
            cache = method.new_cache(model)
            out = greedy_decode(model, prompt, cache, args.new).tokens
            same.append((out == ref).float().mean().item())
            identical += int(torch.equal(out, ref))
            bits.append(cache.stats()["bits_read"])
        print(f"| {name} | {sum(same) / len(same):.4f} | {identical}/{len(prompts)} | {sum(bits) / len(bits):.2f} |")
    print(f"\n(wall time {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

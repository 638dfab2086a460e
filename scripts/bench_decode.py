#!/usr/bin/env python
"""Decode and prefill throughput of KV methods, as ratios to fp16 measured in the same run.

    python scripts/bench_decode.py                       # fp16 + HF DynamicCache on both bundled models
    python scripts/bench_decode.py --methods fp16 --models smollm2_135m --contexts 2048

For each model and context length: prefill the context (real TinyStories text) in one forward,
then decode ``--new-tokens`` greedy tokens (a context past the model's limit is clamped to fit);
medians over ``--repeats`` after one warm-up. ``hf_dynamic`` is transformers' own DynamicCache in
the model's dtype: the cost of the framework's fp16 store.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from functools import partial

import torch
from transformers import DynamicCache

from kvquant.data import tinystories_pieces
from kvquant.errors import KvquantError
from kvquant.eval.fidelity import greedy_decode
from kvquant.methods import get_method
from kvquant.models import load_model

BASELINE = "fp16"


def context_ids(tokenizer, n: int) -> torch.Tensor:
    """The first ``n`` tokens of the concatenated validation stories."""
    ids: list[int] = []
    for piece in tinystories_pieces():
        ids.extend(tokenizer(piece).input_ids)
        if len(ids) >= n:
            return torch.tensor(ids[:n])
    raise KvquantError(f"not enough bundled text for a {n}-token context")


def measure(model, prompt: torch.Tensor, new_cache, new_tokens: int, repeats: int) -> tuple[float, float]:
    greedy_decode(model, prompt, new_cache(), min(new_tokens, 4))
    runs = [greedy_decode(model, prompt, new_cache(), new_tokens) for _ in range(repeats)]
    prefill = statistics.median(prompt.numel() / r.prefill_s for r in runs)
    decode = statistics.median((new_tokens - 1) / r.decode_s for r in runs)
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="stories260k,smollm2_135m")
    parser.add_argument("--methods", default=BASELINE, help="comma-separated registry names (fp16 is always run)")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    methods = [BASELINE] + [m for m in args.methods.split(",") if m and m != BASELINE]

    header = f"{'model':<14}{'context':>8}  {'cache':<14}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode ×fp16':>14}"
    print(header)
    print("-" * len(header))
    try:
        for model_name in args.models.split(","):
            model, tokenizer = load_model(model_name, device=args.device)
            limit = model.config.max_position_embeddings
            asked = [int(c) for c in args.contexts.split(",")]
            # A context that leaves no room to decode is clamped once to the longest that does.
            fitting = sorted({min(c, limit - args.new_tokens) for c in asked})
            for ctx in fitting:
                prompt = context_ids(tokenizer, ctx)
                rows = {}
                for name in methods:
                    method = get_method(name)
                    rows[name] = measure(model, prompt, partial(method.new_cache, model), args.new_tokens, args.repeats)
                rows["hf_dynamic"] = measure(model, prompt, DynamicCache, args.new_tokens, args.repeats)
                base = rows[BASELINE][1]
                for name, (prefill, decode) in rows.items():
                    print(f"{model_name:<14}{ctx:>8}  {name:<14}{prefill:>14.1f}{decode:>14.1f}{decode / base:>14.2f}")
    except KvquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Side by side with transformers' own ``QuantizedCache``: greedy fidelity to fp16 on the same prompts.

    pip install -e '.[compare]'                       # optimum-quanto, the backend HF's cache uses
    python scripts/compare_hf_quantized.py            # smollm2_135m, 20 WikiText-2 prompts × 64 tokens
    python scripts/compare_hf_quantized.py --prompts 4 --methods kivi2,kivi4

Every cache decodes ``--new`` greedy tokens after each ``--prompt-tokens``-token prompt (consecutive
WikiText-2 windows). Columns: share of generated tokens equal to fp16's at the same position, share
before the first divergence, prompts fully identical, bits stored and read per element (measured
for kvquant caches; for HF's quanto cache, the formula of ``hf_bits``), and decode time as a ratio
to fp16's.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from kvquant import get_method, load_model
from kvquant.data import wikitext2_test
from kvquant.eval.fidelity import greedy_decode

DEFAULT_METHODS = "kivi2,kivi4,gear2,gear4,alignedkv"


def hf_cache(model, nbits: int):
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=model.config, nbits=nbits)


def hf_bits(nbits: int, prompt: int, steps: int, residual: int = 128, group: int = 64) -> float:
    """HF's layer quantizes the whole prompt at once, then re-quantizes everything each time its
    fp16 window reaches ``residual`` tokens; codes plus an fp16 scale and zero per ``group``."""
    quantized = prompt + steps // residual * residual
    return (quantized * (nbits + 32 / group) + (prompt + steps - quantized) * 16) / (prompt + steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="kvquant registry names")
    parser.add_argument("--hf-bits", default="2,4", help="nbits of HF QuantizedCache(backend='quanto') runs")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        print("error: HF's QuantizedCache needs optimum-quanto: pip install -e '.[compare]'", file=sys.stderr)
        return 2

    model, tok = load_model(args.model)
    ids = tok(wikitext2_test(), return_tensors="pt").input_ids[0]
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    fp16 = get_method("fp16")
    reference = [greedy_decode(model, p, fp16.new_cache(model), args.new) for p in prompts]
    fp16_decode_s = sum(r.decode_s for r in reference)

    caches = {f"hf_quanto{b}": (lambda b=int(b): hf_cache(model, b)) for b in args.hf_bits.split(",") if b}
    caches |= {m: get_method(m).new_cache for m in args.methods.split(",") if m}
    print(f"{args.model}: {args.prompts} WikiText-2 prompts of {args.prompt_tokens} tokens, {args.new} greedy tokens\n")
    print(
        "| cache | tokens equal to fp16 | before first divergence | prompts identical | bits stored | bits read "
        "| decode ×fp16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, make in caches.items():
        same, prefix, identical, decode_s, stats = [], [], 0, 0.0, []
        for prompt, ref in zip(prompts, reference, strict=True):
            cache = make(model) if name in args.methods.split(",") else make()
            out = greedy_decode(model, prompt, cache, args.new)
            eq = out.tokens == ref.tokens
            same.append(eq.float().mean().item())
            first = (~eq).nonzero()
            prefix.append((int(first[0, 0]) if first.numel() else args.new) / args.new)
            identical += int(bool(eq.all()))
            decode_s += out.decode_s
            if hasattr(cache, "stats"):
                stats.append(cache.stats())
        if stats:
            stored = f"{sum(s['bits_stored'] for s in stats) / len(stats):.2f}"
            read = f"{sum(s['bits_read'] for s in stats) / len(stats):.2f}"
        else:
            bits = hf_bits(int(name.removeprefix("hf_quanto")), args.prompt_tokens, args.new - 1)
            stored = read = f"{bits:.2f} (formula)"
        print(
            f"| {name} | {sum(same) / len(same):.3f} | {sum(prefix) / len(prefix):.3f} | {identical}/{len(prompts)} "
            f"| {stored} | {read} | {decode_s / fp16_decode_s:.2f} |"
        )
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())

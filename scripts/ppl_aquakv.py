"""WikiText-2 perplexity of AQUA-KV vs HIGGS vs fp16 (and kivi2 if present), chunked through each cache.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/ppl_aquakv.py [--tokens 8192] [--chunk 128] [--out ppl.json]

The same token windows and chunks for every method. ``aquakv`` needs predictors calibrated for
each bit width (``python run.py experiment=calibrate method=aquakv method.bits=B``): calibration
text is TinyStories, so WikiText-2 judges the predictors out of domain. Prints perplexity, its
relative change vs fp16, bits stored per value as measured at this context (scales, sinks, window,
positions included) and the asymptotic bits of the quantized part (codes + scales, all layers).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvquant import get_method, load_model
from kvquant.data import wikitext2_test
from kvquant.errors import KvquantError
from kvquant.eval.perplexity import chunked_nll

DEFAULT_METHODS = [
    "fp16",
    "higgs:2",
    "higgs:3",
    "higgs:4",
    "higgs_l0b4:2",
    "aquakv:2",
    "aquakv:3",
    "aquakv:4",
    "kivi2",
]


def build(spec: str):
    """``name[:bits]``; ``higgs_l0b4`` = higgs with layer 0 at 4 bits (aquakv's layout without predictors)."""
    name, _, bits = spec.partition(":")
    kwargs = {"bits": int(bits)} if bits else {}
    if name == "higgs_l0b4":
        return get_method("higgs", first_layer_bits=4, **kwargs)
    return get_method(name, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--tokens", type=int, default=8192, help="WikiText-2 test tokens scored (from the start)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (fresh cache each)")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per forward through the cache")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    model, tok = load_model(args.model, device="cpu")
    ids = tok(wikitext2_test(), return_tensors="pt").input_ids[0][: args.tokens]
    seqs = [ids[i : i + args.seq_len] for i in range(0, ids.numel(), args.seq_len)]
    print(
        f"{args.model}: WikiText-2 test, {ids.numel()} tokens in {len(seqs)} sequence(s) of ≤{args.seq_len}, "
        f"chunks of {args.chunk}, {torch.get_num_threads()} threads"
    )
    rows = []
    for spec in args.methods.split(","):
        try:
            method = build(spec)
            started = time.perf_counter()
            nll, n, counts = 0.0, 0, None
            for seq in seqs:
                cache = method.new_cache(model)
                s, t = chunked_nll(model, seq, cache, args.chunk)
                nll, n = nll + s, n + t
                counts = cache.counts() if counts is None else counts + cache.counts()
                extra = cache.stats() if hasattr(cache, "predictors") else {}
        except KvquantError as exc:
            print(f"{spec}: skipped: {exc}")
            continue
        summary = counts.summary()
        rows.append(
            {
                "method": spec,
                "ppl": math.exp(nll / n),
                "tokens": n,
                "bits_stored": summary["bits_stored"],
                "bits_read": summary["bits_read"],
                "bits_asymptotic": method.analytic_bits(),
                "predictor_bytes": extra.get("predictor_bytes"),
                "bytes_by_part": extra.get("bytes_by_part"),
                "seconds": time.perf_counter() - started,
            }
        )
        print(
            f"  {spec}: ppl {rows[-1]['ppl']:.4f}, {summary['bits_stored']:.3f} bits stored, {rows[-1]['seconds']:.0f}s"
        )
    base = next((r["ppl"] for r in rows if r["method"] == "fp16"), None)
    print(f"\n| method | ppl | Δ vs fp16 | bits stored (measured, {args.seq_len} ctx) | bits asymptotic | predictors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["rel_change"] = r["ppl"] / base - 1 if base else None
        rel = f"{100 * r['rel_change']:+.2f}%" if base else "n/a"
        asym = f"{r['bits_asymptotic']:.3f}" if r["bits_asymptotic"] else "-"
        pred = f"{r['predictor_bytes'] / 1e6:.2f} MB" if r["predictor_bytes"] else "-"
        print(f"| {r['method']} | {r['ppl']:.4f} | {rel} | {r['bits_stored']:.3f} | {asym} | {pred} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

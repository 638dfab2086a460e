"""Calibrate AQUA-KV predictors without Hydra and record how long it took.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/calibrate_aquakv.py --model smollm2_135m [--bits 2] [--predict kv]

Same defaults and output path as ``python run.py experiment=calibrate method=aquakv``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvquant import get_method, load_model
from kvquant.methods.aquakv import METHOD_FOR_PREDICT, model_identity

METHODS = METHOD_FOR_PREDICT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--predict", choices=sorted(METHODS), default="kv")
    parser.add_argument("--first-layer-bits", type=int, default=4)
    parser.add_argument("--n-seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lam", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="default: where the method loads predictors from")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device)
    method = get_method(METHODS[args.predict], bits=args.bits, first_layer_bits=args.first_layer_bits)
    pred = method.calibrate(model, tokenizer, n_seqs=args.n_seqs, seq_len=args.seq_len, seed=args.seed, lam=args.lam)
    config = model.config.get_text_config(decoder=True)
    out = args.out or method.default_path(model_identity(config), method.quantizers(model.config))
    path = pred.save(out)
    total = time.perf_counter() - started
    seconds = pred.header["seconds"]
    print(
        f"calibrated {args.model} ({METHODS[args.predict]}, {args.bits} bits) "
        f"on {pred.header['data']['tokens']} tokens "
        f"with {torch.get_num_threads()} threads: {seconds['total']:.1f}s (collect K/V {seconds['collect']:.1f}s), "
        f"{total:.1f}s including model load"
    )
    print(f"predictors: {path} ({pred.nbytes() / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Convert a llama2.c checkpoint (legacy v0 .bin) + SentencePiece tokenizer into a HF Llama folder.

    python scripts/convert_llama2c.py kvquant/assets/models/stories260K/stories260K.bin \\
        kvquant/assets/models/stories260K/tok512.model stories260k-hf

The same converter ``kvquant.load_model("stories260k")`` runs on first use.
"""

from __future__ import annotations

import argparse
import sys

from kvquant.errors import KvquantError
from kvquant.fsutil import atomic_directory
from kvquant.models import convert_llama2c


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="llama2.c .bin checkpoint (legacy v0 format)")
    parser.add_argument("tokenizer", help="SentencePiece .model file")
    parser.add_argument("out_dir", help="output folder (created atomically; must not exist)")
    args = parser.parse_args(argv)
    try:
        for path in (args.checkpoint, args.tokenizer):
            with open(path, "rb"):
                pass
        with atomic_directory(args.out_dir) as tmp:
            convert_llama2c(args.checkpoint, args.tokenizer, tmp)
    except (OSError, KvquantError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""A whole decode step on a random-weight model of a hub layout: each method's cache vs DynamicCache.

    python scripts/bench_step.py                                         # Llama-2-7B layout, 4K and 32K, batch 1
    python scripts/bench_step.py --layout smollm2_135m --contexts 1024,8192 --methods fp16,kivi2,alignedkv_block
    python scripts/bench_step.py --layout llama2_7b --layers 4 --contexts 4096     # fewer layers: a CPU's memory

One token per sequence through every layer of ``kvquant.analysis.timing.layout_model`` (the hub model's
sizes, random weights, no download; fp16 on a GPU, fp32 on a CPU), after every layer's cache was filled
with synthetic K/V untimed (``model_step_time``); medians of ``--repeats`` steps after 2 warm-up steps.
``x dyn`` is the time over transformers' ``DynamicCache`` on the same model in the same run (issue 33's
whole-step criteria: fp16 <= 1.05, kivi2/kivi4 <= 0.8, gear2/gear4 <= 0.9, higgs_post_rope <= 1.0 at
32K); ``x fp16`` over our fp16 cache; ``bits`` the mean bits read per K/V element. Methods are built on
``--backend`` (``auto``: the device's kernels where they are picked automatically, else torch;
``cupy``/``cpu``/``torch`` by name), or ``name@backend`` for one (``kivi2@cupy``). Needs torch and
transformers only (no Hydra, W&B or lm-eval), so ``scripts/gpu_check.sh`` runs it on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = "fp16,kivi2,kivi4,gear2,gear4,higgs_post_rope,truncation,alignedkv,alignedkv_block"
COLUMNS = ("layout", "batch", "context", "method", "backend", "ms", "x dyn", "x fp16", "bits")


def table(rows: list[dict]) -> str:
    """The markdown table of the rows measured so far (a skipped cell says why in its method column)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row.get(c, "") for c in COLUMNS]
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure(layout: str, batch: int, context: int, methods: dict, args, device: str) -> list[dict]:
    """One cell: DynamicCache first, then each method, each row with its ratios."""
    from kvquant.analysis.timing import model_step_time

    def time_of(method):
        return model_step_time(method, layout, context, args.repeats, device=device, batch=batch, layers=args.layers)

    dynamic = time_of(None)
    timed = {name: time_of(method) for name, method in methods.items()}
    base = timed["fp16"].seconds if "fp16" in timed else None
    rows = [{"method": "DynamicCache", "backend": "torch", "ms": dynamic.seconds * 1e3, "x dyn": 1.0}]
    for name, t in timed.items():
        row = {"method": name, "backend": t.backend, "ms": t.seconds * 1e3, "x dyn": t.seconds / dynamic.seconds}
        if base:
            row["x fp16"] = t.seconds / base
        rows.append(row | {"bits": t.bits_read})
    return [{"layout": layout, "batch": batch, "context": context} | row for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="llama2_7b")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batches", default="1")
    parser.add_argument(
        "--methods", default=METHODS, help="registry names, name@backend for one backend (fp16 gives x fp16)"
    )
    parser.add_argument("--backend", default="auto", help="auto | torch | cpu | cupy, for methods that take one")
    parser.add_argument("--layers", type=int, default=0, help="layers of the random model (0: the layout's own)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop starting new cells after this")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args(argv)

    from kvquant.analysis.timing import LAYOUTS
    from kvquant.errors import KvquantError
    from kvquant.methods import get_method

    if args.layout not in LAYOUTS:
        print(f"error: unknown layout '{args.layout}'; valid: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    try:
        methods = {}
        for label in args.methods.split(","):
            name, _, backend = label.partition("@")
            method = get_method(name)
            if hasattr(method, "backend"):
                method = method.on_backend(backend or args.backend)
            elif backend:
                raise KvquantError(f"method {name} has no backend parameter: drop '@{backend}'")
            methods[label] = method
    except KvquantError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    header = f"device: {where}; torch {torch.__version__}; layout {args.layout} (random weights)"
    if args.layers:
        header += f", {args.layers} layers"
    print(header, flush=True)
    start, rows = time.monotonic(), []
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            cell = {"layout": args.layout, "batch": batch, "context": context}
            if args.max_seconds and time.monotonic() - start > args.max_seconds:
                rows.append(cell | {"method": "skipped: time budget"})
                continue
            try:
                rows += measure(args.layout, batch, context, methods, args, device)
            except torch.OutOfMemoryError:
                rows.append(cell | {"method": "out of memory"})
            if device == "cuda":
                torch.cuda.empty_cache()
            if args.out:  # rewritten after every cell, so a cut-short run still leaves its table
                args.out.write_text(f"{header}\n\n{table(rows)}\n")
    print(f"\n{table(rows)}")
    if not any("ms" in row for row in rows):  # a benchmark that measured nothing has not passed
        print("error: no cell was measured (time budget or out of memory)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

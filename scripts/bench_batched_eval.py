#!/usr/bin/env python
"""Batched evaluation against one request at a time, in the same run: wall time and equality.

    python scripts/bench_batched_eval.py                      # gsm8k, limit 16, smollm2_135m
    python scripts/bench_batched_eval.py --methods fp16 --limit 4 --batch-sizes 1,4

For each method, the task's pass over its examples is timed at every ``--batch-sizes`` entry (the
fp16 reference a lossy method is compared with is computed once first, untimed; fp16 itself is the
reference pass). The table gives wall seconds, the speed-up over the first batch size, whether the
answers equal the first batch size's, the share of generated tokens that equal it, and the engine's
own split: seconds in prompts (on a CPU each row's prompt runs alone: compute-bound, batching gains
nothing there) and in decode steps (batched), with decoded tokens per second. The method's pass
includes its teacher-forced re-reads of units that part from fp16's tokens (for KL).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from kvquant.eval.tasks import get_task
from kvquant.methods import get_method
from kvquant.models import load_model


def run_pass(task, model, tok, method, reference):
    t0 = time.perf_counter()
    engine, evaluation = task._pass(model, tok, method, reference, progress=False)
    return time.perf_counter() - t0, engine, evaluation


def token_agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Share of generated positions whose tokens agree between two runs (a length difference disagrees)."""
    same = total = 0
    for key, tokens in a.items():
        other = b[key]
        m = min(len(tokens), len(other))
        same += int((tokens[:m] == other[:m]).sum())
        total += max(len(tokens), len(other))
    return same / total if total else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--methods", default="fp16,kivi2,alignedkv")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    model, tok = load_model(args.model)
    fp16 = get_method("fp16")
    reference = None
    rows = []
    for name in args.methods.split(","):
        method = get_method(name)
        if name != "fp16" and reference is None:
            reference = get_task(args.task, limit=args.limit, batch_size=max(sizes)).reference(
                model, tok, fp16, False, None
            )
        base = None
        for size in sizes:
            task = get_task(args.task, limit=args.limit, batch_size=size)
            wall, engine, evaluation = run_pass(task, model, tok, method, None if name == "fp16" else reference)
            answers = [str(ex.get("answer")) for ex in evaluation.examples]
            if base is None:
                base = (wall, answers, engine.generated)
            same_tokens = token_agreement(base[2], engine.generated)
            rows.append(
                (
                    name,
                    size,
                    wall,
                    base[0] / wall,
                    answers == base[1],
                    same_tokens,
                    engine.counts.summary()["bits_read"],
                    engine.prefill_s,
                    engine.decode_s,
                    engine.decode_steps,
                )
            )
    cpu = torch.get_num_threads()
    print(f"\n{args.task} limit={args.limit} on {args.model}, torch threads {cpu}")
    print(f"speed-up = wall(batch {sizes[0]}) / wall; equal = against batch {sizes[0]}")
    head = ("method", "batch", "wall s", "speed-up", "answers equal", "tokens equal", "bits read", "prefill s")
    head += ("decode s", "decode tok/s")
    print(
        f"{head[0]:<12}{head[1]:>6}{head[2]:>9}{head[3]:>10}{head[4]:>15}{head[5]:>14}{head[6]:>11}{head[7]:>11}"
        f"{head[8]:>10}{head[9]:>14}"
    )
    for name, size, wall, speed, same, tokens, bits, prefill, decode, steps in rows:
        print(
            f"{name:<12}{size:>6}{wall:>9.1f}{speed:>10.2f}{str(same):>15}{tokens:>14.3f}{bits:>11.3f}{prefill:>11.1f}"
            f"{decode:>10.1f}{steps / decode if decode else float('nan'):>14.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode attention on a GPU: torch fp16 SDPA vs the AlignedKV kernels (paper rule, block rule) vs their 16-bit control.

    python scripts/bench_kernels.py                            # 4K..128K, batch 1 and 8, Llama-2-7B / Llama-3-8B shapes
    python scripts/bench_kernels.py --contexts 4096,32768 --batches 1 --out bench.md

One decode step (one query token per sequence) over a cache of ``context`` tokens, on K/V with
Llama-like channel outliers (log-normal channel scales, a few channels 20x larger) and values with
per-token scales; queries give logits of a few units. Times are CUDA-event medians after warm-up, of eager
calls (host work included: what a Python loop pays) or, with ``--graph``, of CUDA-graph replays of one call
(the device's time alone; a method whose capture fails is noted in the row).

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on fp16 K/V (GQA without copies).
- ``aligned`` / ``aligned+``: ``kernels_cupy.ops.aligned_attention`` (widths, QKᵀ, softmax, value
  rule, SV: three launches) on the plane layout with the paper's value rule; ``aligned+`` uses per-block
  key exponents.
- ``block``: the same with the block-bound value rule (``alignedkv_block``, ``v_block`` 32: one width
  per 32 tokens from the exponent bytes kept at append).
- ``control``: the same kernels reading every plane, no rule (``full=True``).
- ``block_w`` / ``control_w`` / ``aligned_w``: ``block`` / ``control`` / ``aligned`` with the warp QK kernel
  (``qk_kernel="warp"``: each warp reads whole blocks straight from the planes into registers; the others use the
  tile kernel) and SV's byte-permute reads (``sv_read="permute"``).

Bytes: ``KV MB`` counts what the kernels load from the planes at the widths they chose, plus the
fp16 tail and metadata; ``all MB`` adds the fp32 score traffic (logits, softmax, top-k, SV). GB/s
is all bytes over time, ``%copy`` that against a device-to-device copy measured in the same run
(counted as bytes read + written). Below the table, issue 32's GPU targets for the block rule (``targets``:
PASS / FAIL / not measured, the worst row each). Needs only torch, numpy and cupy.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = {"llama2_7b": (32, 32, 128), "llama3_8b": (32, 8, 128)}  # q heads, kv heads, head_dim
NEW_KERNELS = {"qk_kernel": "warp", "sv_read": "permute"}  # the _w methods' kernels
#: each kernel method's ``aligned_attention`` keywords (SDPA is the baseline)
KERNEL_METHODS = {
    "aligned": {},
    "aligned+": {"blockwise": True},
    "block": {"value_rule": "block"},
    "control": {"full": True},
    "block_w": {"value_rule": "block", **NEW_KERNELS},
    "control_w": {"full": True, **NEW_KERNELS},
    "aligned_w": {**NEW_KERNELS},  # the paper's per-token value widths: fewer bits, warps split by them
}
METHODS = ("sdpa", *KERNEL_METHODS)
VALUE_BLOCK = 32


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def graph_time(fn, repeats: int) -> float:
    """Median seconds of replaying ``fn`` captured in a CUDA graph (warmed up on a side stream first, so
    compilation, ticket counters and workspaces exist before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, repeats)


def copy_bandwidth(n_bytes: int = 2**31, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n_bytes / cuda_time(lambda: dst.copy_(src), repeats)


def make_kv(batch: int, hq: int, hkv: int, d: int, n: int, seed: int = 0):
    """fp16 K/V ``[b, hkv, n, d]`` with channel outliers, and fp16 queries ``[b, hq, 1, d]``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    channel = torch.exp(torch.randn(hkv, d, device="cuda", generator=gen))
    outliers = torch.rand(hkv, d, device="cuda", generator=gen).argsort(dim=-1)[:, :4]
    channel.scatter_(1, outliers, channel.gather(1, outliers) * 20)
    k = torch.randn(batch, hkv, n, d, dtype=torch.float16, device="cuda", generator=gen)
    k.mul_(channel.half()[None, :, None, :])
    v = torch.randn(batch, hkv, n, d, dtype=torch.float16, device="cuda", generator=gen)
    v.mul_(torch.exp(0.5 * torch.randn(batch, hkv, n, 1, device="cuda", generator=gen)).half())
    rms = channel.pow(2).mean().sqrt()
    q = (torch.randn(batch, hq, 1, d, device="cuda", generator=gen) * 3 / rms).half()
    return k, v, q


def kv_bytes(
    store, wk: torch.Tensor | None, wv: torch.Tensor | None, blockwise: bool, block_rule: bool = False
) -> tuple[int, float, float]:
    """``(bytes loaded from the cache, mean bits read per K element, per V element)`` for one step.

    ``None`` widths mean the 16-bit control. Plane A is always loaded; B where the width is >= 12,
    C where it is 16. Tail tokens are fp16; metadata is the fp16 max ``|K|`` (and the key block exponents,
    and the block rule's value exponent bytes).
    """
    b, h, n_tail, d = store.tail_k.shape
    total = 2 * 2 * b * h * n_tail * d + 2 * b * h * d
    bits_k = bits_v = 16.0
    if store.k_a is not None:
        n_blk, n_full = store.k_a.shape[2], store.n_full
        if wk is None:
            wk_blocks = torch.full((b, h, n_blk, d), 16, device=store.k_a.device)
        else:
            wk_blocks = wk if wk.dim() == 4 else wk[:, :, None, :].expand(b, h, n_blk, d)
        wv_tokens = torch.full((b, h, n_full), 16, device=store.v_a.device) if wv is None else wv
        k_extra = int((wk_blocks >= 12).sum()) + int((wk_blocks == 16).sum())
        v_extra = int((wv_tokens >= 12).sum()) + int((wv_tokens == 16).sum())
        total += 64 * b * h * n_blk * d + 32 * k_extra + d * b * h * n_full + (d // 2) * v_extra
        if blockwise and store.k_exp is not None:
            total += store.k_exp.numel()
        if block_rule and store.v_exp is not None:
            total += store.v_exp.numel()
        bits_k = 8 + 4 * k_extra / max(1, wk_blocks.numel())
        bits_v = 8 + 4 * v_extra / max(1, wv_tokens.numel())
    return total, bits_k, bits_v


def score_bytes(batch: int, hq: int, n: int, rule: bool) -> int:
    """fp32 score traffic of one step: logits written, softmax read + written, SV reads (and the rule's reads)."""
    per_row = 4 * n * (1 + 2 + 1 + (2 if rule else 0))  # write logits, softmax r/w, SV; top-k scan + row max
    return batch * hq * per_row


def kernel_times(runs: dict, steps: int) -> list[dict]:
    """Per method, what one step runs on the device: each kernel's calls and microseconds per step.

    torch.profiler's CUPTI trace sees CuPy's launches as it sees torch's (both on torch's stream), so the
    launches per step and the split of a step's time between QK, softmax and SV are read off the same run.
    Without CUDA (a CPU test) it times the CPU ops instead.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    rows = []
    for method, fn in runs.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
            if cuda:
                torch.cuda.synchronize()
        events = []
        for event in prof.key_averages():
            us = getattr(event, "device_time_total", 0.0) if cuda else event.self_cpu_time_total
            if us > 0:
                events.append({"method": method, "kernel": event.key, "calls": event.count / steps, "us": us / steps})
        events.sort(key=lambda e: -e["us"])
        total = {"calls": sum(e["calls"] for e in events), "us": sum(e["us"] for e in events)}
        rows += [{"method": method, "kernel": "(all)", **total}, *events]
    return rows


def kernel_table(rows: list[dict]) -> str:
    lines = ["| method | kernel | calls/step | us/step |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['kernel']} | {r['calls']:.1f} | {r['us']:.1f} |" for r in rows]
    return "\n".join(lines)


def host_times(runs: dict, repeats: int, drain=torch.cuda.synchronize) -> dict[str, float]:
    """Per method, the median host seconds of one eager call: from the call until it returns, with the device
    drained (``drain``) before each call, so the time is the host's work (argument preparation, allocations,
    launches) and never a wait on the device. Where it exceeds the device's time, it is what an eager step costs."""
    times = {}
    for name, fn in runs.items():
        fn()
        samples = []
        for _ in range(repeats):
            drain()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        drain()
        times[name] = statistics.median(samples)
    return times


def host_profile(fn, calls: int, rows: int = 15) -> str:
    """``calls`` calls of ``fn`` under cProfile: the Python functions (CuPy's launches and torch's calls among
    them) by the host time spent in each itself, per call; which part of an eager call's host time is whose."""
    import cProfile
    import io
    import pstats

    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    body = text.getvalue()
    return f"{calls} calls; seconds are totals over them\n{body[body.index('   ncalls') :].rstrip()}"


def host_table(row: dict) -> str:
    """Host microseconds per eager call of each method at ``row``'s configuration, beside the eager call's whole
    time (CUDA events, host and device) and the host's share of it."""
    lines = ["| method | host us/call | eager ms | host share |", "|---|---|---|---|"]
    for name, seconds in row["host"].items():
        eager = row.get(f"{name} ms")
        share = f"{100 * seconds * 1e3 / eager:.0f}%" if eager else ""
        lines.append(f"| {name} | {seconds * 1e6:.1f} | {'' if eager is None else f'{eager:.3f}'} | {share} |")
    return "\n".join(lines)


def host_section(row: dict) -> str:
    """The host table of ``row`` and its profiles, as the benchmark prints them below the kernel lists."""
    where = f"{row['shape']} batch {row['batch']} context {row['context']}"
    profiles = "".join(
        f"\n\n`{name}`'s host time by function:\n\n```\n{text}\n```" for name, text in row["host_profile"].items()
    )
    return f"\n\nhost work per eager call, {where}:\n\n{host_table(row)}{profiles}"


def bench_one(
    shape: str,
    batch: int,
    context: int,
    repeats: int,
    copy_bw: float,
    methods: tuple[str, ...] = METHODS,
    profile_steps: int = 0,
    graph: bool = False,
    host: bool = False,
) -> dict:
    from kernels_cupy.ops import aligned_attention, append
    from kvquant.formats.planes import PlaneStore

    hq, hkv, d = SHAPES[shape]
    k, v, q = make_kv(batch, hq, hkv, d, context)
    store = PlaneStore(block_exponents=True, value_block=VALUE_BLOCK)  # v_exp: read only by the block rule
    append(store, k, v)
    scaling = d**-0.5
    row = {"shape": shape, "batch": batch, "context": context}

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=hq != hkv)

    runs = {"sdpa": sdpa}
    runs |= {
        name: functools.partial(aligned_attention, store, q, None, scaling, **kw) for name, kw in KERNEL_METHODS.items()
    }
    runs = {name: fn for name, fn in runs.items() if name in methods}
    for name, fn in runs.items():
        try:
            row[f"{name} ms"] = (graph_time if graph else cuda_time)(fn, repeats) * 1e3
        except RuntimeError as exc:  # a capture that fails is this method's result, not the run's end
            row["note"] = f"{row.get('note', '')} {name}: graph capture failed ({str(exc).splitlines()[0][:80]})"
    runs = {name: fn for name, fn in runs.items() if f"{name} ms" in row}
    fp16_bytes = 2 * 2 * batch * hkv * context * d
    if "sdpa ms" in row:
        row["sdpa GB/s"] = fp16_bytes / row["sdpa ms"] * 1e-6
    for name, kw in KERNEL_METHODS.items():
        if name not in runs:
            continue
        _, wk, wv = runs[name]()
        full, block_rule = kw.get("full", False), kw.get("value_rule") == "block"
        loaded, bits_k, bits_v = kv_bytes(store, wk, wv, kw.get("blockwise", False), block_rule=block_rule)
        moved = loaded + score_bytes(batch, hq, context, rule=not full)
        row[f"{name} KV MB"] = loaded / 1e6
        row[f"{name} GB/s"] = moved / row[f"{name} ms"] * 1e-6
        row[f"{name} %copy"] = 100 * moved / (row[f"{name} ms"] * 1e-3) / copy_bw
        if not full:
            row[f"{name} bits K"], row[f"{name} bits V"] = bits_k, bits_v
    row["fp16 KV MB"] = fp16_bytes / 1e6
    if profile_steps:
        row["kernels"] = kernel_times(runs, profile_steps)
    if host:
        row["host"] = host_times(runs, repeats)
        row["host_profile"] = {name: host_profile(runs[name], 50) for name in ("block", "block_w") if name in runs}
    return row


COLUMNS = [
    ("shape", "{}"),
    ("batch", "{}"),
    ("context", "{}"),
    ("sdpa ms", "{:.3f}"),
    ("aligned ms", "{:.3f}"),
    ("aligned+ ms", "{:.3f}"),
    ("block ms", "{:.3f}"),
    ("control ms", "{:.3f}"),
    ("block_w ms", "{:.3f}"),
    ("control_w ms", "{:.3f}"),
    ("aligned_w ms", "{:.3f}"),
    ("sdpa/aligned", "{:.2f}"),
    ("sdpa/aligned+", "{:.2f}"),
    ("sdpa/block", "{:.2f}"),
    ("sdpa/block_w", "{:.2f}"),
    ("sdpa/aligned_w", "{:.2f}"),
    ("control/aligned", "{:.2f}"),
    ("aligned bits K", "{:.2f}"),
    ("aligned bits V", "{:.2f}"),
    ("block bits V", "{:.2f}"),
    ("aligned+ bits K", "{:.2f}"),
    ("fp16 KV MB", "{:.1f}"),
    ("aligned KV MB", "{:.1f}"),
    ("aligned GB/s", "{:.0f}"),
    ("aligned %copy", "{:.0f}"),
    ("block KV MB", "{:.1f}"),
    ("block GB/s", "{:.0f}"),
    ("block %copy", "{:.0f}"),
    ("control GB/s", "{:.0f}"),
    ("control %copy", "{:.0f}"),
    ("block_w GB/s", "{:.0f}"),
    ("block_w %copy", "{:.0f}"),
    ("control_w %copy", "{:.0f}"),
    ("aligned_w %copy", "{:.0f}"),
    ("sdpa GB/s", "{:.0f}"),
    ("note", "{}"),
]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        row = dict(row)
        for ratio, (num, den) in {
            "sdpa/aligned": ("sdpa", "aligned"),
            "sdpa/aligned+": ("sdpa", "aligned+"),
            "sdpa/block": ("sdpa", "block"),
            "sdpa/block_w": ("sdpa", "block_w"),
            "sdpa/aligned_w": ("sdpa", "aligned_w"),
            "control/aligned": ("control", "aligned"),
        }.items():
            if f"{num} ms" in row and f"{den} ms" in row:
                row[ratio] = row[f"{num} ms"] / row[f"{den} ms"]
        cells = [fmt.format(row[name]).strip() if name in row else "" for name, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TARGET_SHAPE = "llama2_7b"
#: issue 32's GPU targets: (what, rows: "large" (>= 32K, batch 8) or "small" (4K, batch 1), the value read ("ratio":
#: time over SDPA's, "%copy"), which row is the worst, the bound, the value's format)
TARGETS = (
    ("time <= 0.87x SDPA's at >= 32K, batch 8", "large", "ratio", max, lambda x: x <= 0.87, "{:.2f}x"),
    (">= 75% of the copy bandwidth there", "large", "%copy", min, lambda x: x >= 75, "{:.0f}%"),
    ("time <= 2x SDPA's at 4K, batch 1", "small", "ratio", max, lambda x: x <= 2, "{:.2f}x"),
)


def targets(rows: list[dict]) -> str:
    """Issue 32's GPU targets (``TARGETS``) read off ``rows``, for the block rule on each pair of QK / SV kernels
    (``block``, ``block_w``) at the Llama-2-7B shape, and beside them the paper's rule on the new pair
    (``aligned_w``: fewer value bits than the block rule's, if its split warps let them pay); ``%copy`` counts the
    K/V bytes at the chosen widths plus the score traffic. Each verdict is the worst of its rows; with no measured
    row it says so (a target whose rows were not measured has not been met)."""
    lines = [
        f"issue 32's GPU targets for the block rule at the {TARGET_SHAPE} shape (the worst row of the table; "
        "`aligned_w`, the paper's rule, beside them):",
        "",
    ]
    for name in ("block", "block_w", "aligned_w"):
        timed = [r for r in rows if r.get("shape") == TARGET_SHAPE and f"{name} ms" in r and "sdpa ms" in r]
        picked = {
            "large": [r for r in timed if r["batch"] == 8 and r["context"] >= 32768],
            "small": [r for r in timed if r["batch"] == 1 and r["context"] == 4096],
        }
        checks = [
            _verdict(
                what,
                [(x, r["context"]) for r in picked[which] if (x := _target_value(r, name, value)) is not None],
                *test,
            )
            for what, which, value, *test in TARGETS
        ]
        lines.append(f"- `{name}`: " + "; ".join(checks))
    return "\n".join(lines)


def _target_value(row: dict, name: str, value: str) -> float | None:
    return row[f"{name} ms"] / row["sdpa ms"] if value == "ratio" else row.get(f"{name} {value}")


def _verdict(what: str, values: list[tuple[float, int]], worst, ok, fmt: str) -> str:
    """``what: PASS (value at context)`` for the worst of ``values`` ((value, context) pairs), or not measured."""
    if not values:
        return f"{what}: not measured"
    value, context = worst(values)
    return f"{what}: {'PASS' if ok(value) else 'FAIL'} ({fmt.format(value)} at {context // 1024}K)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop starting new configurations after this")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each call (device time)")
    parser.add_argument(
        "--profile",
        default="",
        metavar="SHAPE:BATCH:CONTEXT",
        help="also list the kernels one step of each method runs at this configuration (torch.profiler)",
    )
    parser.add_argument(
        "--host",
        default="",
        metavar="SHAPE:BATCH:CONTEXT",
        help="also time each method's host work per eager call at this configuration, and cProfile the block rule's",
    )
    args = parser.parse_args(argv)

    from kernels_cupy import cupy_status

    ok, why = cupy_status()
    if not ok:
        print(f"error: the kernels cannot run here: {why}", file=sys.stderr)
        return 2
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            print(f"error: unknown shape '{shape}'; valid: {', '.join(SHAPES)}", file=sys.stderr)
            return 2
    configs = [
        f"{s}:{b}:{c}"
        for s in args.shapes.split(",")
        for b in args.batches.split(",")
        for c in args.contexts.split(",")
    ]
    for option, config in (("--profile", args.profile), ("--host", args.host)):
        if config and config not in configs:
            print(
                f"error: {option} {config} is not a measured configuration; one of {', '.join(configs)}",
                file=sys.stderr,
            )
            return 2
    methods = tuple(args.methods.split(","))
    if "sdpa" not in methods or any(m not in METHODS for m in methods):
        print(f"error: --methods must include sdpa and name only {', '.join(METHODS)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    copy_bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    timing = "CUDA-graph replays (device time)" if args.graph else "eager calls (host work included)"
    header = (
        f"device: {device}; torch {torch.__version__}; measured D2D copy: {copy_bw / 1e9:.0f} GB/s (read + write); "
        f"times: {timing}"
    )
    print(header, flush=True)
    rows = []
    for batch in (int(x) for x in args.batches.split(",")):
        for shape in args.shapes.split(","):
            for context in (int(x) for x in args.contexts.split(",")):
                if args.max_seconds and time.monotonic() - start > args.max_seconds:
                    rows.append({"shape": shape, "batch": batch, "context": context, "note": "skipped: time budget"})
                    continue
                config = f"{shape}:{batch}:{context}"
                steps, host = (20 if args.profile == config else 0), args.host == config
                try:
                    rows.append(
                        bench_one(shape, batch, context, args.repeats, copy_bw, methods, steps, args.graph, host)
                    )
                except torch.OutOfMemoryError:
                    rows.append({"shape": shape, "batch": batch, "context": context, "note": "out of memory"})
                torch.cuda.empty_cache()  # this configuration's K/V and planes are gone with bench_one's frame
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                if args.out:  # rewritten after every row, so a cut-short run still leaves its table
                    args.out.write_text(f"{header}\n\n{table(rows)}\n")
    profiled = [row for row in rows if "kernels" in row]
    kernels = "".join(
        f"\n\nkernels per step, {r['shape']} batch {r['batch']} context {r['context']}:\n\n{kernel_table(r['kernels'])}"
        for r in profiled
    )
    kernels += "".join(host_section(r) for r in rows if "host" in r)
    verdicts = f"\n\n{targets(rows)}" if {"block", "block_w", "aligned_w"} & set(methods) else ""
    if args.out:
        args.out.write_text(f"{header}\n\n{table(rows)}{verdicts}{kernels}\n")
    print(f"\n{header}\n\n{table(rows)}{verdicts}{kernels}")
    if not any("sdpa ms" in row for row in rows):  # a check that measured nothing has not passed
        print("error: no configuration was measured (time budget or out of memory)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

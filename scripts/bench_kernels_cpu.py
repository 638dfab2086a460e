#!/usr/bin/env python
"""Attention-only decode step on the CPU: today's torch fp16 path vs the fused C++ kernels (kernels_cpu).

    python scripts/bench_kernels_cpu.py                       # 9q/3kv x 64 and 32q/32kv x 128, 4K..32K, 1 thread
    python scripts/bench_kernels_cpu.py --threads 2 --contexts 16384 --warm
    python scripts/bench_kernels_cpu.py --planes --contexts 4096,16384   # AlignedKV planes (below)
    python scripts/bench_kernels_cpu.py --higgs --shapes "9q/3kv x 64,32q/32kv x 128,32q/8kv x 128"

One query token per sequence (batch 1) over a cache of ``context`` tokens. Columns (milliseconds,
medians over ``--repeats``; with ``--cold``, the default, a buffer larger than the last-level
cache is written before each call, as when a model's other layers ran in between):

- ``torch``: what the ``fp16`` method does today, ``k.float()``, ``v.float()`` and SDPA (GQA in SDPA);
- ``fp16``: ``kernels_cpu.attend_fp16`` on the same fp16 K/V;
- ``kivi2``/``kivi4``: ``kernels_cpu.attend_kivi`` on a KIVI store (group 32, window 128, the
  layout ``KiviLayer`` holds after a prefill of ``context`` tokens; codes are random, which timing
  does not depend on);
- ``gear2``/``gear4`` (``--gear``): ``kernels_cpu.attend_gear`` on a GEAR store (group 64, window
  128, 2% outliers at random positions, one rank-4 segment over the quantized prefill);
- ``x``: time over fused fp16's; ``GB/s``: bytes the kernel reads (every stored byte) over its time;
  ``%cp``: that over the memcpy bandwidth measured in the same run (bytes read + written per second,
  as STREAM counts a copy); the header also gives a read-only bandwidth (an fp32 sum).

With ``--planes``, AlignedKV's planes instead (``kernels_cpu.attend_planes`` on a ``PlaneStore``):

- ``fp16``: fused fp16 on the same K/V (ms); ``u8``/``u12``/``u16``: every element read at that width;
- ``vb1``: the paper's widths, as ``kvquant.formats.planes.decide_widths`` (the torch rules) chooses them for
  the store and the query; ``vb8``/``vb16``/``vb64``: the same with value widths per block of that
  many tokens (``v_block``). Each gives ``bits`` (mean bits read per K/V element, the fp16 tail at 16;
  the rule's metadata not counted), ``x`` (``attend_planes`` at those widths: time / fused fp16), ``st``
  (the whole step as ``backend=cpu`` runs it, ``kernels_cpu.attend_aligned``: the value rule on fp64
  scores, then the attention; time / fused fp16) and ``id`` (the byte-proportional ideal, bits / 16);
- ``bk16``/``bk32``/``bk64``: the block-bound rule (``alignedkv_block``) at that ``v_block``, its whole
  step as ``backend=cpu`` runs it (``attend_aligned`` with ``block_rule``), after its ``bits``: time / fused fp16;
- ``pb8``/``pb32``: the same with AlignedKV+'s key widths per 64-token block (``alignedkv_plus_block``; its
  ``v_block`` 8 is the configuration that keeps every greedy token at <= 12.5 bits in README's frontier table);
  ``x32``: ``bk32`` with every item rescored in fp64 (``exact_scores``): what an item costs whose widths the
  fp32 scores' error bounds cannot decide (on top of the fp32 attempt that found so);
  ``fp32``: the share of the timed ``st``/``bk`` steps' (head, row) items the rules decided from fp32 scores
  within their error bounds (``kernels_cpu.aligned_rule_counts``; the rest were rescored in fp64).

With ``--higgs``, HIGGS stores (``kernels_cpu.attend_higgs``; default group 1,024 channels, 4 fp16
sinks, a 128-token fp16 window, random codes) against fused fp16 on the same shape (``fp16``, ms):
``pre`` keys coded before RoPE (``higgs``: RoPE computed per token from its position), ``post`` keys
coded after RoPE (``higgs_post_rope``) as the kernel picks, ``rot``/``keys`` the same forced to score
in the rotated domain / to rebuild each key; all as time / fused fp16. ``32q/8kv x 128`` (Llama-3's
GQA: 32 query rows per group) is where the rotated domain costs more.

K/V are synthetic with the statistics the rules react to: per-channel key scales (log-uniform over
four binades, four outlier channels eight times larger), attention logits of standard deviation
``SPREAD`` plus four attention-sink tokens aligned with the queries at logit ``ln(context)`` (about
half the attention, as in trained models), values N(0, 1). The widths are whatever the rules decide
on them, reported as bits.

Needs only torch and a built ``kernels_cpu`` (``python -m kernels_cpu build``). Times on a shared
machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels_cpu  # noqa: E402
from kernels_cpu.backend import plane_keys, v8_magnitudes  # noqa: E402
from kernels_cpu.ops import CodeStream  # noqa: E402
from kvquant.formats.planes import AlignedRule, decide_widths  # noqa: E402

SHAPES = {"9q/3kv x 64": (9, 3, 64), "32q/32kv x 128": (32, 32, 128), "32q/8kv x 128": (32, 8, 128)}
DEFAULT_SHAPES = "9q/3kv x 64,32q/32kv x 128"
GROUP, RESIDUAL = 32, 128
GEAR_GROUP, GEAR_OUTLIERS, GEAR_RANK = 64, 0.02, 4
FLUSH_BYTES = 1 << 30


def median_ms(fn, repeats: int, flush: torch.Tensor | None) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def copy_gbps(repeats: int) -> tuple[float, float]:
    """Memcpy bandwidth (bytes read + written per second, as STREAM counts a copy) and read-only
    bandwidth (an fp32 sum) at the current thread count, on 256 MiB buffers."""
    src = torch.ones(1 << 26)
    dst = torch.empty_like(src)
    dst.copy_(src)
    size = src.numel() * src.element_size()
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    read = min(_timed(src.sum) for _ in range(repeats))
    return 2 * size / copy / 1e9, size / read / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _half(*shape: int) -> torch.Tensor:
    return (torch.rand(*shape) * 0.1).half()


def _quantized(name: str, hkv: int, n: int, d: int, bits: int, group: int) -> tuple:
    """Random codes and fp16 scale/zero of ``n`` coded tokens of a key (``k``) or value stream."""
    codes = torch.randint(0, 256, (1, hkv, n, d * bits // 8), dtype=torch.uint8)
    meta = (1, hkv, n // group, 1, d) if name == "k" else (1, hkv, n, d // group, 1)
    return codes, _half(*meta), _half(*meta)


def kivi_store(hkv: int, length: int, d: int, bits: int) -> dict:
    """KIVI's streams for a ``length``-token prefill: quantized keys in whole blocks of RESIDUAL, the rest fp16."""
    w_k = (length - 1) % RESIDUAL + 1 if length > RESIDUAL else length
    w_v = min(length, RESIDUAL)
    k = CodeStream(*_quantized("k", hkv, length - w_k, d, bits, GROUP), torch.randn(1, hkv, w_k, d).half())
    v = CodeStream(*_quantized("v", hkv, length - w_v, d, bits, GROUP), torch.randn(1, hkv, w_v, d).half())
    return {"k": k, "v": v, "bits": bits, "group_size": GROUP}


def gear_store(hkv: int, length: int, d: int, bits: int) -> dict:
    """GEAR's streams (defaults: group 64, 2% outliers, rank 4) after a ``length``-token prefill: one
    segment of whole RESIDUAL blocks with its outliers (random positions) and one low-rank run."""
    w = (length - 1) % RESIDUAL + 1 if length > RESIDUAL else length
    n = length - w
    store: dict = {"bits": bits, "group_size": GEAR_GROUP}
    for name in ("k", "v"):
        count = 2 * int(GEAR_OUTLIERS * n * d / 2)
        index = torch.randint(0, max(n * d, 1), (1, hkv, count), dtype=torch.int32)
        runs = [(0, n, _half(1, hkv, 1, n, GEAR_RANK), _half(1, hkv, 1, d, GEAR_RANK))] if n else []
        window = torch.randn(1, hkv, w, d).half()
        quantized = _quantized(name, hkv, n, d, bits, GEAR_GROUP)
        store[name] = CodeStream(*quantized, window, index, torch.randn(1, hkv, count).half(), runs)
    return store


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def stored_bytes(store: dict) -> int:
    """Every byte a store holds (and a kernel reads): its streams' tensors and low-rank runs' factors."""
    total = 0
    for stream in (store["k"], store["v"]):
        total += nbytes([stream.codes, stream.scale, stream.zero, stream.window, stream.index, stream.value])
        total += sum(nbytes(factors) for _, _, *factors in stream.runs)
    return total


def bench_row(
    hq: int, hkv: int, d: int, length: int, repeats: int, flush: torch.Tensor | None, bw: float, gear: bool
) -> str:
    """The table's columns after shape and context, for one shape and context."""
    q = torch.randn(1, hq, 1, d)
    k = torch.randn(1, hkv, length, d).half()
    v = torch.randn(1, hkv, length, d).half()

    def torch_path() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float(), enable_gqa=True)

    t_torch = median_ms(torch_path, repeats, flush)
    t_fp16 = median_ms(lambda: kernels_cpu.attend_fp16(q, k, v), repeats, flush)
    gb = nbytes([k, v]) / t_fp16 / 1e6
    row = f" {t_torch:>8.2f} {t_torch / t_fp16:>6.2f} {t_fp16:>7.2f} {gb:>6.1f} {100 * gb / bw:>4.0f}"
    kernels = [(kivi_store, kernels_cpu.attend_kivi)] + ([(gear_store, kernels_cpu.attend_gear)] if gear else [])
    for make, kernel in kernels:
        for bits in (2, 4):
            store = make(hkv, length, d, bits)
            t = median_ms(lambda store=store, kernel=kernel: kernel(q, **store), repeats, flush)
            gb = stored_bytes(store) / t / 1e6
            row += f" {t:>7.2f} {t / t_fp16:>5.2f} {gb:>5.1f} {100 * gb / bw:>4.0f}"
    return row


V_BLOCKS = (1, 8, 16, 64)
BLOCK_RULE = (16, 32, 64)  # alignedkv_block's v_block values
PLUS_BLOCK = (8, 32)  # alignedkv_plus_block's
SPREAD = 2.5  # standard deviation of the non-sink attention logits


def planes_inputs(
    hq: int, hkv: int, d: int, length: int, value_block: int = 0, seed: int = 0, block_exponents: bool = False
):
    """``(q, k, v, store)``: the synthetic K/V (module docstring) in fp16 and as planes (with the block
    rule's exponent bytes per ``value_block`` tokens where given, AlignedKV+'s key block exponents with
    ``block_exponents``), and a query; the same for a seed."""
    torch.manual_seed(seed)
    from kvquant.formats.planes import PlaneStore

    scale = 2.0 ** (torch.rand(d) * 4 - 2)
    scale[:4] *= 8
    k = torch.randn(1, hkv, length, d) * scale
    v = torch.randn(1, hkv, length, d)
    q = torch.randn(1, hq, 1, d) * SPREAD * d**0.25 / scale.square().mean().sqrt()
    direction = q.view(1, hkv, hq // hkv, d).mean(2)
    unit = direction / direction.norm(dim=-1, keepdim=True)
    sink = math.log(length) * d**0.5 / (q.view(1, hkv, hq // hkv, d) * unit.unsqueeze(2)).sum(-1).mean(-1)
    k[:, :, :4] = (unit * sink.unsqueeze(-1)).unsqueeze(2)
    store = PlaneStore(value_block=value_block, block_exponents=block_exponents)
    store.append(k.half(), v.half())
    return q, k.half(), v.half(), store


def rule_widths(q: torch.Tensor, store, v_block: int, value_rule: str = "token", blockwise: bool = False):
    """The rules' widths for one decode step, as the cpu backend's unfused path decides them
    (``kvquant.formats.planes.decide_widths`` with the keys and exponent gaps read in C++), as uint8, the
    kernels' type (the cpu backend's ``key_widths`` gives uint8; int32 would be converted in every timed call:
    for AlignedKV+'s per-block key widths 1 MiB at 32 heads x 16K)."""
    store.visible = store.n_tokens
    rule = AlignedRule(v_block=v_block, value_rule=value_rule, blockwise=blockwise)
    _, wk, wv = decide_widths(store, rule, q, None, q.shape[-1] ** -0.5, plane_keys)
    return wk.to(torch.uint8), wv.to(torch.uint8)


def bits_read(store, wk: torch.Tensor | int, wv: torch.Tensor | int) -> float:
    """Mean bits per K/V element for one step: plane tokens at their widths, the fp16 tail at 16."""
    _, h, tail, d = store.tail_k.shape
    n = store.n_full
    k_bits = float(torch.as_tensor(wk).double().mean()) * h * n * d
    v_bits = float(torch.as_tensor(wv).double().mean()) * h * n * d
    return (k_bits + v_bits + 2 * 16 * h * tail * d) / (2 * h * (n + tail) * d)


def interleaved_ms(fns: dict, repeats: int, flush: torch.Tensor | None) -> dict:
    """Median milliseconds of each function, timed in rounds of one call each (a shared machine's load
    then weighs on all of them alike, so their ratios hold better than with back-to-back repeats)."""
    times: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush is not None:
                flush.add_(1)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def block_rule_step(q: torch.Tensor, store, wk: torch.Tensor, v_block: int, exact_scores: bool = False):
    """The block rule's whole step as ``backend=cpu`` runs it, for ``interleaved_ms``."""
    return lambda: kernels_cpu.attend_aligned(
        q,
        store,
        k_widths=wk,
        v8=v8_magnitudes(),
        v_thresholds=(4, 8),
        topk=32,
        v_block=v_block,
        block_rule=True,
        exact_scores=exact_scores,
    )


def planes_row(hq: int, hkv: int, d: int, length: int, repeats: int, flush: torch.Tensor | None) -> str:
    """The ``--planes`` table's columns after shape and context."""
    q, k, v, store = planes_inputs(hq, hkv, d, length)
    fns = {"fp16": lambda: kernels_cpu.attend_fp16(q, k, v)}
    for w in (8, 12, 16):
        fns[f"u{w}"] = lambda w=w: kernels_cpu.attend_planes(q, store, k_widths=w, v_widths=w)
    bits = {}
    for v_block in V_BLOCKS:
        wk, wv = rule_widths(q, store, v_block)
        bits[v_block] = bits_read(store, wk, wv)
        fns[f"vb{v_block}"] = lambda wk=wk, wv=wv: kernels_cpu.attend_planes(q, store, k_widths=wk, v_widths=wv)
        fns[f"st{v_block}"] = lambda wk=wk, v_block=v_block: kernels_cpu.attend_aligned(
            q, store, k_widths=wk, v8=v8_magnitudes(), v_thresholds=(4, 8), topk=32, v_block=v_block
        )
    # The block rule: its own store (exponent bytes), the same K/V and query; with AlignedKV+'s key blocks (pb).
    for name, v_block in [(f"bk{b}", b) for b in BLOCK_RULE] + [(f"pb{b}", b) for b in PLUS_BLOCK]:
        plus = name.startswith("pb")
        _, _, _, kept = planes_inputs(hq, hkv, d, length, value_block=v_block, block_exponents=plus)
        wk, wv = rule_widths(q, kept, v_block, "block", blockwise=plus)
        bits[name] = bits_read(kept, wk, wv)
        fns[name] = block_rule_step(q, kept, wk, v_block)
        if name == "bk32":
            fns["x32"] = block_rule_step(q, kept, wk, v_block, exact_scores=True)
    before = kernels_cpu.aligned_rule_counts()
    t = interleaved_ms(fns, repeats, flush)
    after = kernels_cpu.aligned_rule_counts()
    fp32, fp64 = after[0] - before[0], after[1] - before[1]  # every attend_aligned call here was timed
    row = f" {t['fp16']:>7.2f}" + "".join(f" {t[f'u{w}'] / t['fp16']:>5.2f}" for w in (8, 12, 16))
    for b in V_BLOCKS:
        row += f" {bits[b]:>5.2f} {t[f'vb{b}'] / t['fp16']:>5.2f} {t[f'st{b}'] / t['fp16']:>5.2f} {bits[b] / 16:>5.2f}"
    for name in [f"bk{b}" for b in BLOCK_RULE] + [f"pb{b}" for b in PLUS_BLOCK]:
        row += f" {bits[name]:>5.2f} {t[name] / t['fp16']:>5.2f}"
    return row + f" {t['x32'] / t['fp16']:>5.2f} {fp32 / max(1, fp32 + fp64):>5.3f}"


HIGGS_BITS, HIGGS_SINK = 2, 4


def higgs_store(hkv: int, d: int, length: int) -> tuple[dict, dict]:
    """``attend_higgs`` arguments for a ``length``-token HIGGS store (random codes and scales; fp16 sinks and
    window), keys coded before RoPE (positions and ``inv_freq``) and after it (``post_rope``)."""
    from kvquant.quant import bitpack
    from kvquant.quant.higgs import Higgs

    quant = Higgs(hkv * d, HIGGS_BITS)
    n = max(0, length - HIGGS_SINK - RESIDUAL)
    width = bitpack.packed_size(quant.n_codes, quant.code_bits)
    store: dict = {"grid": quant.grid, "signs": quant.signs, "outer": quant.outer}
    store.update(code_bits=quant.code_bits, group=quant.group)
    for side in ("k", "v"):
        store[f"{side}_codes"] = torch.randint(0, 256, (1, n, width), dtype=torch.uint8) if n else None
        store[f"{side}_scales"] = (torch.rand(1, n, quant.n_groups) + 0.5).half() if n else None
        store[f"{side}_sinks"] = torch.randn(1, hkv, HIGGS_SINK, d).half()
        store[f"{side}_recent"] = torch.randn(1, hkv, min(length, RESIDUAL), d).half()
    rope = {"cos": None, "sin": None}
    if n:
        rope["positions"] = torch.arange(HIGGS_SINK, HIGGS_SINK + n, dtype=torch.int32).view(1, n)
        rope["inv_freq"] = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    return {**store, **rope}, {**store, "cos": None, "sin": None, "post_rope": True}


def higgs_row(hq: int, hkv: int, d: int, length: int, repeats: int, flush: torch.Tensor | None) -> str:
    """The ``--higgs`` table's columns after shape and context."""
    q = torch.randn(1, hq, 1, d)
    k, v = torch.randn(1, hkv, length, d).half(), torch.randn(1, hkv, length, d).half()
    pre, post = higgs_store(hkv, d, length)
    fns = {
        "fp16": lambda: kernels_cpu.attend_fp16(q, k, v),
        "pre": lambda: kernels_cpu.attend_higgs(q, **pre),
        "post": lambda: kernels_cpu.attend_higgs(q, **post),
        "rot": lambda: kernels_cpu.attend_higgs(q, **post, rotated_scores=True),
        "keys": lambda: kernels_cpu.attend_higgs(q, **post, rotated_scores=False),
    }
    t = interleaved_ms(fns, repeats, flush)
    return f" {t['fp16']:>7.2f}" + "".join(f" {t[name] / t['fp16']:>5.2f}" for name in ("pre", "post", "rot", "keys"))


def planes_header() -> str:
    head = f"{'shape':<15} {'ctx':>6} {'fp16':>7} {'u8':>5} {'u12':>5} {'u16':>5}"
    head += "".join(f" {'bits':>5} {f'vb{b}':>5} {f'st{b}':>5} {'id':>5}" for b in V_BLOCKS)
    blocks = [f"bk{b}" for b in BLOCK_RULE] + [f"pb{b}" for b in PLUS_BLOCK]
    return head + "".join(f" {'bits':>5} {name:>5}" for name in blocks) + f" {'x32':>5} {'fp32':>5}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="4096,8192,16384,32768")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warm", dest="cold", action="store_false", help="do not flush the caches between calls")
    parser.add_argument("--gear", action="store_true", help="add GEAR-2/4 columns (group 64, 2%% outliers, rank 4)")
    parser.add_argument("--planes", action="store_true", help="AlignedKV's planes vs fused fp16 instead")
    parser.add_argument("--higgs", action="store_true", help="HIGGS, keys coded before / after RoPE, vs fused fp16")
    args = parser.parse_args(argv)

    ok, why = kernels_cpu.status()
    if not ok:
        print(f"kernels_cpu unavailable: {why}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flush = torch.zeros(FLUSH_BYTES // 4) if args.cold else None
    bandwidth, read = copy_gbps(args.repeats)
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    caches = "cold" if args.cold else "warm"
    print(f"# {cpu}; {args.threads} thread(s); {caches} caches; memcpy {bandwidth:.1f} GB/s, read {read:.1f} GB/s")
    if args.higgs:
        print(f"# medians of {args.repeats} interleaved rounds; fp16: ms; the rest: time / fp16 ({HIGGS_BITS}-bit)")
        print(f"{'shape':<15} {'ctx':>6} {'fp16':>7} {'pre':>5} {'post':>5} {'rot':>5} {'keys':>5}")
        for shape in args.shapes.split(","):
            hq, hkv, d = SHAPES[shape.strip()]
            for length in (int(c) for c in args.contexts.split(",")):
                print(f"{shape:<15} {length:>6}{higgs_row(hq, hkv, d, length, args.repeats, flush)}", flush=True)
        return 0
    if args.planes:
        print(f"# medians of {args.repeats} interleaved rounds; fp16: ms; the rest: time / fp16; id = bits / 16")
        print(planes_header())
        for shape in args.shapes.split(","):
            hq, hkv, d = SHAPES[shape.strip()]
            for length in (int(c) for c in args.contexts.split(",")):
                print(f"{shape:<15} {length:>6}{planes_row(hq, hkv, d, length, args.repeats, flush)}", flush=True)
        return 0
    print(f"# medians of {args.repeats} (ms); x = time / fused fp16; %cp = read GB/s / copy GB/s; provisional")
    head = f"{'shape':<15} {'ctx':>6} {'torch':>8} {'x':>6} {'fp16':>7} {'GB/s':>6} {'%cp':>4}"
    names = ["kivi2", "kivi4"] + (["gear2", "gear4"] if args.gear else [])
    head += "".join(f" {name:>7} {'x':>5} {'GB/s':>5} {'%cp':>4}" for name in names)
    print(head)
    for shape in args.shapes.split(","):
        hq, hkv, d = SHAPES[shape.strip()]
        for length in (int(c) for c in args.contexts.split(",")):
            row = bench_row(hq, hkv, d, length, args.repeats, flush, bandwidth, args.gear)
            print(f"{shape:<15} {length:>6}{row}", flush=True)
    return 0


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())

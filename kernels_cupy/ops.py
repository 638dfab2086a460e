"""The kernels behind the torch reference's interface (``kvquant.alignment``, ``kvquant.formats.planes``).

Every function takes a ``PlaneStore`` whose tensors live on a CUDA device and works on them in
place: nothing is copied to the host or converted, and K/V are never materialised at full width.
Thresholds are the ``(t12, t8)`` binade gaps after any margin (``AlignedRule.k_tiers``/``v_tiers``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels_cupy.loader import i32, launch, ptr, shared_memory_budget, sm_count
from kvquant.errors import InvalidParameterError, KvquantError

if TYPE_CHECKING:
    from kvquant.formats.planes import PlaneStore

BLOCK = 64
THREADS = 256
INT_MAX = 2**31 - 1
TOKENS_PER_STEP = 4  # sv.cu TOKENS_PER_STEP
TILE_STRIDE = 66  # pack.cu / qk.cu TILE_STRIDE
FP16_MAX = 65504.0  # kvquant.cache.FP16_MAX (not imported: kvquant.cache needs transformers)
ALIGN = 16  # bytes: the widest vector load (uint4) any kernel makes from a tensor's start


def check_head_dim(d: int) -> None:
    """The kernels take head dims that are multiples of 8 up to 256 (the plane layout needs a multiple of 8)."""
    if d % 8 or not 8 <= d <= 256:
        raise ValueError(f"the AlignedKV kernels support head_dim in 8..256, a multiple of 8; got {d}")


def tiers(thresholds: tuple[float, float]) -> tuple[int, int]:
    """Integer ``(t12, t8)``: an integer gap clears ``t`` exactly when it clears ``ceil(t)``; nothing clears inf."""
    return tuple(INT_MAX if math.isinf(t) else min(INT_MAX, math.ceil(t)) for t in thresholds)


def kernel_arg(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous and 16-byte aligned: a view at an odd offset would fault on the kernels' vector loads."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def row_chunks(rows: int, bytes_per_row: int, fixed_bytes: int, budget: int, what: str) -> list[tuple[int, int]]:
    """``(row0, n_rows)`` launches covering ``rows`` query rows, as few as fit ``fixed + n·per_row ≤ budget``.

    A ``prefill_aligned`` chunk brings (query heads per KV head) × (tokens) rows, which can exceed
    one block's shared memory; sizes differ by at most one row, so no launch is a sliver.
    """
    fit = (budget - fixed_bytes) // bytes_per_row
    if fit < 1:
        raise InvalidParameterError(
            f"{what} needs {fixed_bytes + bytes_per_row} bytes of shared memory for one query row; "
            f"the device allows {budget}"
        )
    n = math.ceil(rows / fit)
    base, extra = divmod(rows, n)
    sizes = [base + 1] * extra + [base] * (n - extra)
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def qk_shared_bytes(d: int) -> tuple[int, int]:
    """``(per query row, fixed)`` dynamic shared memory of ``qk.cu``."""
    return d * 4, (2 * d + max(d, THREADS // 32)) * 4 + d * TILE_STRIDE * 2


def check_storable(x: torch.Tensor, what: str) -> None:
    """``kvquant.cache.to_fp16_checked``'s rule: NaN, ±inf and values beyond fp16's range are refused.

    The model path refuses them before its store sees them (a plane read would turn inf into NaN),
    so the kernels' store refuses them too, with the same message, before anything is written.
    """
    if bool((~(x.abs() <= FP16_MAX)).any()):  # one pass; NaN fails the comparison
        bad = ~torch.isfinite(x) | (x.abs() > FP16_MAX)
        raise KvquantError(
            f"{int(bad.sum())} {what} values are NaN/inf or outside fp16's range "
            f"(±{FP16_MAX:g}; {int(torch.isnan(x).sum())} NaN) and cannot be stored as fp16"
        )


def _geometry(store: PlaneStore, query: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """``(b, hq, q_len, d, hkv, rows per KV head, n_tokens)``, checked."""
    b, hq, q_len, d = query.shape
    if store.tail_k is None or store.n_tokens == 0:
        raise ValueError("the plane store is empty: append K/V before attending")
    hkv = store.tail_k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads evenly")
    if not query.is_cuda:
        raise ValueError(f"the kernels need CUDA tensors, got query on {query.device}")
    check_head_dim(d)
    return b, hq, q_len, d, hkv, (hq // hkv) * q_len, store.n_tokens


def append(store: PlaneStore, k: torch.Tensor, v: torch.Tensor) -> None:
    """``PlaneStore.append`` with the plane split, the max ``|K|`` and the block exponents done by one kernel pass.

    ``k``/``v``: ``[b, h, t, d]`` on a CUDA device (cast to fp16, as the store holds). The tails the
    store keeps are always its own aligned copies, never the caller's tensors.
    """
    check_head_dim(k.shape[-1])
    check_storable(k, "key")
    check_storable(v, "value")
    k16, v16 = kernel_arg(k.to(torch.float16)), kernel_arg(v.to(torch.float16))
    b, h, t, d = k16.shape
    owned = not store._empty  # a torch.cat below is the store's own; k16 may be the caller's tensor
    if store._empty:
        chunk_k, chunk_v = k16, v16
        store.k_absmax = torch.zeros(b, h, d, dtype=torch.float16, device=k.device)
        store._empty = False
    else:
        chunk_k, chunk_v = torch.cat([store.tail_k, k16], dim=2), torch.cat([store.tail_v, v16], dim=2)
    if store.k_absmax.data_ptr() % 4:  # the kernel's max works on aligned 32-bit words
        store.k_absmax = store.k_absmax.clone()
    store.n_tokens += t
    n = chunk_k.shape[2]
    n_blk = n // BLOCK
    full = n_blk * BLOCK
    planes = {}
    if n_blk:
        u8 = {"dtype": torch.uint8, "device": k.device}
        planes = {
            "k_a": torch.empty(b, h, n_blk, d, BLOCK, **u8),
            "k_b": torch.empty(b, h, n_blk, d, BLOCK // 2, **u8),
            "k_c": torch.empty(b, h, n_blk, d, BLOCK // 2, **u8),
            "v_a": torch.empty(b, h, full, d, **u8),
            "v_b": torch.empty(b, h, full, d // 2, **u8),
            "v_c": torch.empty(b, h, full, d // 2, **u8),
        }
        if store.block_exponents:
            planes["k_exp"] = torch.empty(b, h, n_blk, d, **u8)
    flags = torch.zeros(2, dtype=torch.int32, device=k.device)
    if n:
        names = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp")
        args = (ptr(chunk_k), ptr(chunk_v), i32(n), i32(full), i32(d), *(ptr(planes.get(x)) for x in names))
        args = (*args, ptr(store.k_absmax), i32(n_blk), i32(0), ptr(flags))
        launch("pack.cu", "pack_kv", (math.ceil(n / BLOCK), b * h), THREADS, args, shared_mem=d * TILE_STRIDE * 2)
    if n_blk:
        tiny_k, tiny_v = flags.tolist()
        store.tiny_k = store.tiny_k or bool(tiny_k)
        store.tiny_v = store.tiny_v or bool(tiny_v)
        for name, tensor in planes.items():
            old = getattr(store, name)
            setattr(store, name, tensor if old is None else torch.cat([old, tensor], dim=2))
    if full or not owned:
        contiguous = torch.contiguous_format
        chunk_k = chunk_k[:, :, full:].clone(memory_format=contiguous)
        chunk_v = chunk_v[:, :, full:].clone(memory_format=contiguous)
    store.tail_k, store.tail_v = chunk_k, chunk_v


def qk(
    store: PlaneStore,
    query: torch.Tensor,
    scaling: float,
    k_thresholds: tuple[float, float] = (4, 8),
    blockwise: bool = False,
    full: bool = False,
    return_keys: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Scaled logits ``[b, hq, q_len, L]`` (fp32) from keys read at the rule's widths.

    Returns ``(logits, wk, keys)``: ``wk`` as ``key_widths`` (``[b, hkv, d]``) or, for AlignedKV+ with
    block exponents, ``block_key_widths`` (``[b, hkv, blocks, d]``); ``None`` for the 16-bit control
    (``full``). ``keys`` (``[b, hkv, L, d]`` fp16, only with ``return_keys``) is what was read.
    """
    b, hq, q_len, d, hkv, rows, n_tokens = _geometry(store, query)
    q = kernel_arg(query.float())
    n_tail = store.tail_k.shape[2]
    n_blk = 0 if store.k_a is None else store.k_a.shape[2]
    use_blocks = blockwise and store.k_exp is not None and not full
    dev = query.device
    logits = torch.empty(b, hq, q_len, n_tokens, dtype=torch.float32, device=dev)
    wk = None
    if not full:
        wk = torch.empty((b, hkv, n_blk, d) if use_blocks else (b, hkv, d), dtype=torch.int32, device=dev)
    keys = torch.empty(b, hkv, n_tokens, d, dtype=torch.float16, device=dev) if return_keys else None
    n_units = n_blk + (1 if n_tail else 0)
    per_cta = max(1, math.ceil(n_units * b * hkv / (sm_count(dev.index or 0) * 16)))
    name = "qk_full" if full else ("qk_aligned_blockwise" if use_blocks else "qk_aligned")
    t12, t8 = tiers(k_thresholds)
    k_a, k_b, k_c, tail_k, k_absmax = (
        kernel_arg(x) for x in (store.k_a, store.k_b, store.k_c, store.tail_k, store.k_absmax)
    )
    k_exp = kernel_arg(store.k_exp) if use_blocks else None
    per_row, fixed = qk_shared_bytes(d)
    chunks = row_chunks(rows, per_row, fixed, shared_memory_budget(dev.index or 0), "QKᵀ")
    q_max_bits = None
    if len(chunks) > 1 and not full:  # each launch holds some rows; the widths need max |q| over all
        q_max_bits = (q.view(b * hkv, rows, d).view(torch.int32) & 0x7FFFFFFF).amax(dim=1)
    for row0, rc in chunks:
        first = row0 == 0  # later chunks decide the same widths and read the same keys: not written twice
        args = (
            ptr(q),
            ptr(q_max_bits),
            ptr(k_a),
            ptr(k_b),
            ptr(k_c),
            ptr(tail_k),
            ptr(k_absmax),
            ptr(k_exp),
            ptr(logits),
            ptr(wk if first else None),
            ptr(keys if first else None),
            i32(rc),
            i32(rows),
            i32(row0),
            i32(d),
            i32(n_blk),
            i32(n_blk),
            i32(n_tail),
            i32(per_cta),
            np.float32(scaling),
            i32(t12),
            i32(t8),
        )
        launch("qk.cu", name, (math.ceil(n_units / per_cta), b * hkv), THREADS, args, shared_mem=fixed + rc * per_row)
    return logits, wk, keys


def softmax_scores(logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities (fp32) from logits, the mask applied as ``kvquant.methods.alignedkv._scores`` does."""
    if attention_mask is not None:
        mask = attention_mask[..., : logits.shape[-1]]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def value_exponents(store: PlaneStore, scores: torch.Tensor, topk: int = 32) -> torch.Tensor:
    """``e(O_est) + 15`` per (batch·KV head, channel) (int32), as inside ``reference_value_widths``.

    ``scores``: ``[b, hq, q_len, L]`` attention probabilities.
    """
    b, hq, q_len, n_tokens = scores.shape
    hkv = store.tail_v.shape[1]
    d = store.tail_v.shape[-1]
    rows = (hq // hkv) * q_len
    bh = b * hkv
    s = kernel_arg(scores.float())
    dev = s.device
    n_strided = math.ceil(n_tokens / topk)
    wanted_splits = max(1, math.ceil(sm_count(dev.index or 0) * 16 / (bh * rows)))
    rows_per_split = max(16, math.ceil(n_strided / wanted_splits))
    splits = math.ceil(n_strided / rows_per_split)
    best_val = torch.empty(bh * rows, splits, topk, dtype=torch.float32, device=dev)
    best_idx = torch.empty(bh * rows, splits, topk, dtype=torch.int32, device=dev)
    threads = min(THREADS, 32 * math.ceil(topk / 32))
    args = (ptr(s), ptr(best_val), ptr(best_idx), i32(n_tokens), i32(topk), i32(rows_per_split))
    launch("sv.cu", "topk_partial", (splits, bh * rows), threads, args)
    e_o = torch.empty(bh, d, dtype=torch.int32, device=dev)
    n_full = store.n_full
    v_a, tail_v = kernel_arg(store.v_a), kernel_arg(store.tail_v)
    per_row = topk * 8
    for row0, rc in row_chunks(rows, per_row, 0, shared_memory_budget(dev.index or 0), f"topk={topk}"):
        args = (
            ptr(best_val),
            ptr(best_idx),
            ptr(v_a),
            ptr(tail_v),
            ptr(e_o),
            i32(rc),
            i32(rows),
            i32(row0),
            i32(d),
            i32(topk),
            i32(splits),
            i32(n_full),
            i32(n_full),
            i32(store.tail_v.shape[2]),
        )
        launch("sv.cu", "value_exponents", (bh,), THREADS, args, shared_mem=rc * per_row)
    return e_o


def sv(
    store: PlaneStore,
    scores: torch.Tensor,
    e_o: torch.Tensor | None,
    v_thresholds: tuple[float, float] = (4, 8),
    full: bool = False,
    return_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``scores @ V`` ``[b, hq, q_len, d]`` (fp32) with values read at the rule's widths.

    Returns ``(out, wv, values)``: ``wv`` ``[b, hkv, n_full]`` as ``reference_value_widths`` over the plane
    tokens (``None`` for the 16-bit control); ``values`` (``[b, hkv, L, d]`` fp16, only with
    ``return_values``) is what was read. ``e_o`` comes from ``value_exponents`` (unused if ``full``).
    """
    b, hq, q_len, n_tokens = scores.shape
    hkv, d = store.tail_v.shape[1], store.tail_v.shape[-1]
    check_head_dim(d)
    rows = (hq // hkv) * q_len
    bh = b * hkv
    s = kernel_arg(scores.float())
    dev = s.device
    n_full, n_tail = store.n_full, store.tail_v.shape[2]
    cpt = 4 if d <= 128 else 8
    seg = 1 << (d // cpt - 1).bit_length()
    step = (THREADS // seg) * TOKENS_PER_STEP
    wanted_chunks = max(1, math.ceil(sm_count(dev.index or 0) * 4 / bh))
    per_cta = max(step, math.ceil(math.ceil(n_tokens / wanted_chunks) / step) * step)
    n_chunks = math.ceil(n_tokens / per_cta)
    partial = torch.empty(bh, n_chunks, rows, d, dtype=torch.float32, device=dev)
    wv = None if full else torch.empty(b, hkv, n_full, dtype=torch.int32, device=dev)
    values = torch.empty(b, hkv, n_tokens, d, dtype=torch.float16, device=dev) if return_values else None
    t12, t8 = tiers(v_thresholds)
    row_chunk = 8 if d <= 128 else 4
    v_a, v_b, v_c, tail_v = (kernel_arg(x) for x in (store.v_a, store.v_b, store.v_c, store.tail_v))
    for row0 in range(0, rows, row_chunk):
        rc = min(row_chunk, rows - row0)
        name = f"sv_{'full' if full else 'aligned'}_r{rc}_c{cpt}"
        first = row0 == 0
        args = (
            ptr(s),
            ptr(v_a),
            ptr(v_b),
            ptr(v_c),
            ptr(tail_v),
            ptr(None if full else e_o),
            ptr(partial),
            ptr(wv if first else None),
            ptr(values if first else None),
            i32(rows),
            i32(row0),
            i32(d),
            i32(seg),
            i32(n_full),
            i32(n_full),
            i32(n_tail),
            i32(per_cta),
            i32(t12),
            i32(t8),
        )
        shared = d * 4 + (THREADS // 32) * rc * d * 4
        launch("sv.cu", name, (n_chunks, bh), THREADS, args, shared_mem=shared)
    return partial.sum(dim=1).view(b, hq, q_len, d), wv, values


def aligned_attention(
    store: PlaneStore,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    k_thresholds: tuple[float, float] = (4, 8),
    v_thresholds: tuple[float, float] = (4, 8),
    topk: int = 32,
    blockwise: bool = False,
    full: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One AlignedKV attention step on the GPU: ``(out [b, hq, q_len, d] fp32, wk, wv)``.

    The chain of ``kvquant.formats.planes.aligned_read`` + attention: K widths, QKᵀ over what they read,
    fp32 softmax, V widths from plane A and the scores, SV. ``blockwise`` is AlignedKV+ (used when
    the store has block exponents); ``full`` is the 16-bit control (same kernels, every plane, no
    rule; ``wk``/``wv`` are ``None``).
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits, wk, _ = qk(store, query, scaling, k_thresholds, blockwise, full)
    scores = softmax_scores(logits, attention_mask)
    e_o = None if full else value_exponents(store, scores, topk)
    out, wv, _ = sv(store, scores, e_o, v_thresholds, full)
    return out, wk, wv

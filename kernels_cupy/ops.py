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

from kernels_cupy.launch import (
    BLOCK,
    THREADS,
    TILE_STRIDE,
    qk_shared_bytes,
    qk_split,
    qk_warp_rows,
    qk_warp_shared_bytes,
    qk_warp_split,
    row_chunks,
    softmax_shared_bytes,
    softmax_split,
    sv_lanes,
    sv_rows,
    sv_shared_bytes,
    sv_split,
    tiers,
)
from kernels_cupy.loader import check_device, i32, launch, ptr, shared_memory_budget, sm_count
from kvquant.errors import InvalidParameterError, KvquantError

if TYPE_CHECKING:
    from kvquant.formats.planes import PlaneStore

#: the QK kernel a step uses by default: ``tile`` (validated on an H100, 2026-12-06) or ``warp`` (decode rows read
#: straight from the planes in registers, launch.qk_warp_rows; not yet run on a GPU). ``aligned_attention(qk_kernel=)``
#: picks one per call; scripts/bench_kernels.py times both.
QK_KERNEL = "tile"
QK_KERNELS = ("tile", "warp")
#: how SV turns plane bytes into fp16 by default: ``bytes`` (an element at a time; validated on an H100) or
#: ``permute`` (eight at a time with byte permutes, the ``sv_*_p`` kernels; the same bits, not yet run on a GPU)
SV_READ = "bytes"
SV_READS = ("bytes", "permute")
TILE_KERNELS = {"full": "qk_full", "blockwise": "qk_aligned_blockwise", "aligned": "qk_aligned"}

FP16_MAX = 65504.0  # kvquant.cache.FP16_MAX (not imported: kvquant.cache needs transformers)
ALIGN = 16  # bytes: the widest vector load (uint4) any kernel makes from a tensor's start


def check_head_dim(d: int) -> None:
    """The kernels take head dims that are multiples of 8 up to 256 (the plane layout needs a multiple of 8)."""
    if d % 8 or not 8 <= d <= 256:
        raise ValueError(f"the AlignedKV kernels support head_dim in 8..256, a multiple of 8; got {d}")


def kernel_arg(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous and 16-byte aligned: a view at an odd offset would fault on the kernels' vector loads."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


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


def append(store: PlaneStore, k: torch.Tensor, v: torch.Tensor, checked: bool = False) -> None:
    """``PlaneStore.append`` with the plane split, the max ``|K|``, the key block exponents and the value
    exponent bytes (``store.value_block`` > 0: the block rule's ``v_exp``) done by one kernel pass.

    ``k``/``v``: ``[b, h, t, d]`` on a CUDA device (cast to fp16, as the store holds). The tails the
    store keeps are always its own aligned copies, never the caller's tensors. ``checked``: the caller has
    refused NaN, ±inf and values beyond fp16's range already (a layer's ``to_fp16_checked``, whose verdict on
    CUDA is read at the next step), so ``check_storable`` and its two host syncs are skipped.
    """
    if store.value_block and BLOCK % store.value_block:
        raise InvalidParameterError(f"value_block {store.value_block} must divide the {BLOCK}-token plane block")
    check_head_dim(k.shape[-1])
    check_device(k)
    if not checked:
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
        if store.value_block:
            planes["v_exp"] = torch.empty(b, h, full // store.value_block, d, **u8)
    # the kernel flags tiny high bytes only in whole blocks: with none this append, no flags (nor their memset)
    flags = torch.zeros(2, dtype=torch.int32, device=k.device) if n_blk else None
    if n:
        names = ("k_a", "k_b", "k_c", "v_a", "v_b", "v_c", "k_exp", "v_exp")
        args = (ptr(chunk_k), ptr(chunk_v), i32(n), i32(full), i32(d), *(ptr(planes.get(x)) for x in names))
        args = (*args, ptr(store.k_absmax), i32(n_blk), i32(0), i32(store.value_block), ptr(flags))
        launch("pack.cu", "pack_kv", (math.ceil(n / BLOCK), b * h), THREADS, args, shared_mem=d * TILE_STRIDE * 2)
    if n_blk:
        tiny_k, tiny_v = flags.tolist()
        store.tiny_k = store.tiny_k or bool(tiny_k)
        store.tiny_v = store.tiny_v or bool(tiny_v)
        for name, tensor in planes.items():
            old = getattr(store, name)
            setattr(store, name, tensor if old is None else torch.cat([old, tensor], dim=2))
        store.fold_v_exp_max(planes["v_a"])
    if full or not owned:
        contiguous = torch.contiguous_format
        chunk_k = chunk_k[:, :, full:].clone(memory_format=contiguous)
        chunk_v = chunk_v[:, :, full:].clone(memory_format=contiguous)
    store.tail_k, store.tail_v = chunk_k, chunk_v


_COUNTERS: dict[int, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int32 zeros on ``device`` for the kernels' last-CTA tickets, reused: every kernel leaves its
    counters at zero, so a step (or a CUDA graph replay of it) needs no memset. Allocated outside a capture
    (warm up before capturing); one step at a time per device (two streams at once would share them)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    have = _COUNTERS.get(index)
    if have is None or have.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernels_cupy: run the step once before capturing it in a CUDA graph (ticket counters)")
        _COUNTERS[index] = have = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


def mask_arg(
    mask: torch.Tensor | None, b: int, hq: int, q_len: int, n: int
) -> tuple[torch.Tensor | None, int, tuple[int, int, int, int]]:
    """``(tensor, kind, element strides)`` of an attention mask for ``qk.cu``: bool (kind 1, read as bytes)
    or additive (kind 2, fp32), broadcast to ``[b, hq, q_len, n]`` without copying (strides 0)."""
    if mask is None:
        return None, 0, (0, 0, 0, 0)
    m = mask[..., :n]
    if m.dtype == torch.bool:
        m, kind = m.view(torch.uint8), 1
    else:
        m, kind = m.float(), 2
    m = torch.broadcast_to(m, (b, hq, q_len, n))
    return m, kind, tuple(int(x) for x in m.stride())


def _qk(
    store: PlaneStore,
    query: torch.Tensor,
    scaling: float,
    k_thresholds: tuple[float, float],
    blockwise: bool,
    full: bool,
    return_keys: bool,
    mask: torch.Tensor | None,
    qk_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, int]:
    """QKᵀ launches: ``(masked logits [b, hq, q_len, L], wk, keys, partial_ml [bh, rows, n_qk, 2], n_qk)``.
    ``qk_kernel`` ``warp`` takes the warp kernel where the rows of a KV head allow it (at most 4), else the tile
    kernel; None: ``QK_KERNEL``."""
    qk_kernel = QK_KERNEL if qk_kernel is None else qk_kernel
    if qk_kernel not in QK_KERNELS:
        raise InvalidParameterError(f"qk_kernel must be one of {', '.join(QK_KERNELS)}, got {qk_kernel!r}")
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
    warp_rows = qk_warp_rows(rows) if qk_kernel == "warp" else None
    split = qk_split if warp_rows is None else qk_warp_split
    per_cta, n_qk = split(n_units, b * hkv, sm_count(dev.index or 0))
    partial_ml = torch.empty(b * hkv, rows, n_qk, 2, dtype=torch.float32, device=dev)
    kind = "full" if full else ("blockwise" if use_blocks else "aligned")
    name = TILE_KERNELS[kind] if warp_rows is None else f"qk_warp_{kind}_r{warp_rows}"
    t12, t8 = tiers(k_thresholds)
    k_a, k_b, k_c, tail_k, k_absmax = (
        kernel_arg(x) for x in (store.k_a, store.k_b, store.k_c, store.tail_k, store.k_absmax)
    )
    k_exp = kernel_arg(store.k_exp) if use_blocks else None
    m, kind, (msb, msh, msq, msn) = mask_arg(mask, b, hq, q_len, n_tokens)
    if m is not None and m.device != dev:
        raise ValueError(f"the attention mask is on {m.device}, the query on {dev}")
    mask_ptr = np.uint64(m.data_ptr()) if m is not None else np.uint64(0)
    per_row, fixed = qk_shared_bytes(d) if warp_rows is None else (d * 4, qk_warp_shared_bytes(d, 0))
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
            ptr(partial_ml),
            mask_ptr,
            i32(kind),
            np.int64(msb),
            np.int64(msh),
            np.int64(msq),
            np.int64(msn),
            i32(hq // hkv),
            i32(q_len),
            i32(hkv),
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
        launch("qk.cu", name, (n_qk, b * hkv), THREADS, args, shared_mem=fixed + rc * per_row)
    return logits, wk, keys, partial_ml, n_qk


def qk(
    store: PlaneStore,
    query: torch.Tensor,
    scaling: float,
    k_thresholds: tuple[float, float] = (4, 8),
    blockwise: bool = False,
    full: bool = False,
    return_keys: bool = False,
    mask: torch.Tensor | None = None,
    qk_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Scaled logits ``[b, hq, q_len, L]`` (fp32, ``mask`` applied as ``masked_logits``) from keys read at
    the rule's widths.

    Returns ``(logits, wk, keys)``: ``wk`` as ``key_widths`` (``[b, hkv, d]``) or, for AlignedKV+ with
    block exponents, ``block_key_widths`` (``[b, hkv, blocks, d]``); ``None`` for the 16-bit control
    (``full``). ``keys`` (``[b, hkv, L, d]`` fp16, only with ``return_keys``) is what was read.
    """
    logits, wk, keys, _, _ = _qk(store, query, scaling, k_thresholds, blockwise, full, return_keys, mask, qk_kernel)
    return logits, wk, keys


def softmax_scores(logits: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities (fp32) from logits in torch, the mask applied as ``masked_logits`` does: the
    reference's softmax (the kernels' own is ``softmax.cu``)."""
    if attention_mask is not None:
        mask = attention_mask[..., : logits.shape[-1]]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def _softmax_topk(
    store: PlaneStore,
    scores: torch.Tensor,
    partial_ml: torch.Tensor | None,
    n_qk: int,
    topk: int,
    normalize: bool,
) -> torch.Tensor | None:
    """One ``softmax_topk`` launch over ``scores`` ``[b, hq, q_len, L]`` fp32 (logits normalised in place when
    ``normalize``); returns ``e(O_est) + 15`` ``[b·hkv, d]`` (int32), or None when ``topk`` is 0."""
    b, hq, q_len, n_tokens = scores.shape
    hkv, d = store.tail_v.shape[1], store.tail_v.shape[-1]
    rows, bh, dev = (hq // hkv) * q_len, b * hkv, scores.device
    shared = softmax_shared_bytes(topk)
    budget = shared_memory_budget(dev.index or 0)
    if shared > budget:
        raise InvalidParameterError(f"topk={topk} needs {shared} bytes of shared memory; the device allows {budget}")
    span, n_splits = softmax_split(n_tokens, topk, bh * rows, sm_count(dev.index or 0))
    e_o = best_val = best_idx = None
    if topk > 0:
        best_val = torch.empty(bh, rows, n_splits, topk, dtype=torch.float32, device=dev)
        best_idx = torch.empty(bh, rows, n_splits, topk, dtype=torch.int32, device=dev)
        e_o = torch.empty(bh, d, dtype=torch.int32, device=dev)
    v_a, tail_v = kernel_arg(store.v_a), kernel_arg(store.tail_v)
    args = (
        ptr(scores),
        ptr(partial_ml),
        ptr(best_val),
        ptr(best_idx),
        ptr(v_a),
        ptr(tail_v),
        ptr(e_o),
        ptr(counters(dev, 2 * bh)),
        i32(rows),
        i32(n_tokens),
        i32(d),
        i32(topk),
        i32(span),
        i32(n_qk),
        i32(store.n_full),
        i32(store.tail_v.shape[2]),
        i32(1 if normalize else 0),
    )
    launch("softmax.cu", "softmax_topk", (n_splits, rows, bh), THREADS, args, shared_mem=shared)
    return e_o


def value_exponents(store: PlaneStore, scores: torch.Tensor, topk: int = 32) -> torch.Tensor:
    """``e(O_est) + 15`` per (batch·KV head, channel) (int32), as ``kvquant.alignment.output_exponents``
    (``O_est`` in ``pairwise_sum``'s order), from probabilities ``scores`` ``[b, hq, q_len, L]`` (not written)."""
    return _softmax_topk(store, kernel_arg(scores.float()), None, 0, topk, normalize=False)


def _sv(
    store: PlaneStore,
    scores: torch.Tensor,
    e_o: torch.Tensor | None,
    v_thresholds: tuple[float, float],
    mode: str,
    return_values: bool,
    sv_read: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One SV launch (``mode``: ``full``, ``token`` or ``block``): ``(out [b, hq, q_len, d] fp32, wv, values)``.
    ``sv_read``: ``bytes`` or ``permute`` (None: ``SV_READ``)."""
    sv_read = SV_READ if sv_read is None else sv_read
    if sv_read not in SV_READS:
        raise InvalidParameterError(f"sv_read must be one of {', '.join(SV_READS)}, got {sv_read!r}")
    b, hq, q_len, n_tokens = scores.shape
    hkv, d = store.tail_v.shape[1], store.tail_v.shape[-1]
    check_head_dim(d)
    rows, bh, dev = (hq // hkv) * q_len, b * hkv, scores.device
    n_full, n_tail = store.n_full, store.tail_v.shape[2]
    if mode == "block" and (store.value_block % 32 or (n_full and store.v_exp is None)):
        raise InvalidParameterError(
            f"the block rule on CuPy reads whole warps of 32 tokens: value_block must be 32 or 64, "
            f"got {store.value_block}"
        )
    cpt, seg = sv_lanes(d)
    rc = sv_rows(rows)
    per_cta, n_chunks = sv_split(n_tokens, bh, sm_count(dev.index or 0))
    partial = torch.empty(bh, n_chunks, rows, d, dtype=torch.float32, device=dev)
    out = torch.empty(b, hq, q_len, d, dtype=torch.float32, device=dev)
    wv = None if mode == "full" else torch.empty(b, hkv, n_full, dtype=torch.int32, device=dev)
    values = torch.empty(b, hkv, n_tokens, d, dtype=torch.float16, device=dev) if return_values else None
    t12, t8 = tiers(v_thresholds)
    v_a, v_b, v_c, tail_v = (kernel_arg(x) for x in (store.v_a, store.v_b, store.v_c, store.tail_v))
    v_exp = kernel_arg(store.v_exp) if mode == "block" else None
    args = (
        ptr(scores),
        ptr(v_a),
        ptr(v_b),
        ptr(v_c),
        ptr(tail_v),
        ptr(v_exp),
        ptr(None if mode == "full" else e_o),
        ptr(partial),
        ptr(out),
        ptr(counters(dev, 2 * bh)[bh:]),
        ptr(wv),
        ptr(values),
        i32(rows),
        i32(d),
        i32(seg),
        i32(n_full),
        i32(n_tail),
        i32(per_cta),
        i32(store.value_block if mode == "block" else 0),
        i32(t12),
        i32(t8),
    )
    name = f"sv_{mode}_r{rc}_c{cpt}" + ("_p" if sv_read == "permute" else "")
    launch("sv.cu", name, (n_chunks, bh), THREADS, args, shared_mem=sv_shared_bytes(d, rc))
    return out, wv, values


def sv(
    store: PlaneStore,
    scores: torch.Tensor,
    e_o: torch.Tensor | None,
    v_thresholds: tuple[float, float] = (4, 8),
    full: bool = False,
    return_values: bool = False,
    value_rule: str = "token",
    sv_read: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``scores @ V`` ``[b, hq, q_len, d]`` (fp32) with values read at the rule's widths.

    Returns ``(out, wv, values)``: ``wv`` ``[b, hkv, n_full]`` as ``value_widths`` (``value_rule`` token) or
    ``block_value_widths`` (block, per ``store.value_block`` tokens) over the plane tokens (``None`` for the
    16-bit control); ``values`` (``[b, hkv, L, d]`` fp16, only with ``return_values``) is what was read.
    ``e_o`` comes from ``value_exponents`` (unused if ``full``).
    """
    s = kernel_arg(scores.float())
    return _sv(store, s, e_o, v_thresholds, "full" if full else value_rule, return_values, sv_read)


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
    value_rule: str = "token",
    return_scores: bool = False,
    qk_kernel: str | None = None,
    sv_read: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """One AlignedKV attention step on the GPU: ``(out [b, hq, q_len, d] fp32, wk, wv)`` (and the fp32
    probabilities the rule and SV used, ``[b, hq, q_len, L]``, with ``return_scores``).

    The chain of ``kvquant.formats.planes.aligned_read`` + attention in three kernels (one more QK launch
    per extra row chunk of a long prefill chunk), nothing in torch between them: QK at the key widths with
    the mask and per-CTA softmax statistics; the softmax merged by log-sum-exp, the strided top-k and
    ``e(O_est)``; the value widths (``value_rule`` token: per token; block: per ``store.value_block`` tokens)
    and SV split over CTAs, merged by the last. ``blockwise`` is AlignedKV+ (used when the store has block
    exponents); ``full`` is the 16-bit control (same kernels, every plane, no rule; ``wk``/``wv`` None).
    ``qk_kernel``: ``tile`` or ``warp`` (``_qk``; None: ``QK_KERNEL``); ``sv_read``: ``bytes`` or ``permute``
    (``_sv``; None: ``SV_READ``).
    """
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if value_rule not in ("token", "block"):
        raise InvalidParameterError(f"value_rule must be token or block, got {value_rule!r}")
    logits, wk, _, partial_ml, n_qk = _qk(
        store, query, scaling, k_thresholds, blockwise, full, False, attention_mask, qk_kernel
    )
    e_o = _softmax_topk(store, logits, partial_ml, n_qk, 0 if full else topk, normalize=True)
    out, wv, _ = _sv(store, logits, e_o, v_thresholds, "full" if full else value_rule, False, sv_read)
    return (out, wk, wv, logits) if return_scores else (out, wk, wv)

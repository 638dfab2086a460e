"""Decode attention over integer codes (KIVI) and GEAR on the GPU: ``codes.cu`` through the backend protocol.

``attend_codes`` / ``attend_gear`` take a ``kvquant.formats.codes.CodesState`` / ``gear.GearState`` as the
methods store it (nothing converted or copied: the codes, scales, windows, outliers and low-rank factors
are read where they lie) and return ``(out [B, Hq, q_len, D] in the query's dtype, Reads())``, the torch
reference ``kvquant.formats.codes.attend`` up to fp32 summation order. The launch arithmetic (lane
groups, row tiles, the split of the sequence, shared memory) and the argument preparation (mask
strides, GEAR's outliers by token, the runs' table, ``q B``) are plain functions, so the CPU tests and
``kernels_cupy.codes_emulate`` (the kernel line for line in torch) use the very same numbers.

Importing this module needs torch and numpy only; cupy is imported at the first launch.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch

from kernels_cupy.loader import i32, launch, ptr, sm_count
from kvquant.formats.base import Reads

SOURCE = "codes.cu"
#: KIVI's value coding by ``quantize_values`` (``store.KernelQuantStore``): opt-in until a GPU run validates it
#: (tests/test_kernels_cupy_codes.py compares it with ``kvquant.quant.integer.quantize`` bit for bit)
QUANTIZE_KERNEL = False
THREADS = 128  # codes.cu CODES_THREADS
WARPS = THREADS // 32
CHANNELS_PER_LANE = 8
RANK_MAX = 8  # codes.cu CODES_RANK: the largest GEAR rank the kernel takes
RUN_FIELDS = 18  # codes.cu CODES_RUN_FIELDS
HEAD_DIM_MAX = 256
ROW_TILES = {"kivi": (1, 2, 4, 8), "gear": (1, 2, 4)}
#: tokens in flight per lane group, per (format, rows of a tile): codes.cu's CODES_ROWS instantiations
TOKENS_IN_FLIGHT = {("kivi", 1): 4, ("kivi", 2): 4, ("kivi", 4): 4, ("kivi", 8): 2}
TOKENS_IN_FLIGHT |= {("gear", 1): 4, ("gear", 2): 4, ("gear", 4): 2}
MIN_CHUNK = 256  # fewest keys a split of the sequence is given
WAVES = 4  # CTAs aimed for per SM when splitting the sequence
#: queries in one step from which the torch reference runs instead (a prompt: one dequantization of the
#: history is then cheaper than re-reading it once per row tile)
PROMPT_QUERIES = 16
ALIGN = 16  # bytes: the widest vector load (uint4) the kernel makes from a tensor's start


def lanes_per_token(d: int) -> int:
    """Lanes that read one token: a power of two >= d / 8 (each lane holds 8 channels)."""
    need = -(-d // CHANNELS_PER_LANE)
    return 1 << (need - 1).bit_length()


def lane_groups(d: int) -> int:
    """Lane groups of a CTA (each runs its own online softmax over its tokens)."""
    return WARPS * 32 // lanes_per_token(d)


def row_tile(fmt: str, rows: int) -> int:
    """Rows of one CTA: the smallest instantiated tile holding ``rows``, else the largest (several tiles)."""
    tiles = ROW_TILES[fmt]
    return next((t for t in tiles if t >= rows), tiles[-1])


def plan(length: int, ctas: int, sms: int, d: int, tokens_in_flight: int) -> tuple[int, int]:
    """``(n_split, chunk)``: the sequence cut into ``n_split`` chunks of ``chunk`` keys (the last may be
    shorter), about ``WAVES`` CTAs per SM over ``ctas`` (KV heads × row tiles) but never below
    ``MIN_CHUNK`` keys a split; ``chunk`` is a whole number of the CTA's steps (lane groups × tokens in flight)."""
    step = lane_groups(d) * tokens_in_flight
    want = max(1, _ceil(WAVES * sms, max(1, ctas)))
    n_split = max(1, min(want, _ceil(length, MIN_CHUNK)))
    chunk = _ceil(_ceil(length, n_split), step) * step
    return _ceil(length, chunk), chunk


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def shared_bytes(d: int, rt: int) -> int:
    """Dynamic shared memory of one CTA: m, l and the accumulators of every lane group (the final merge)."""
    lpt = lanes_per_token(d)
    return 4 * lane_groups(d) * rt * (2 + CHANNELS_PER_LANE * lpt)


def kernel_name(fmt: str, bits: int, rt: int) -> str:
    return f"codes_{fmt}_b{bits}_r{rt}"


def limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    """What of a model these kernels lack, one phrase each (``kvquant.backends.Backend.limits``): logit
    soft-capping, sliding-window layers (the formats' ``Stream.forget``), head dims that are not a multiple
    of 8 up to 256. (Windows with attention sinks, which no KIVI/GEAR method makes, are refused per call.)"""
    missing = []
    if geometry.softcap is not None:
        missing.append(f"attention-logit soft-capping ({geometry.softcap})")
    if geometry.sliding_window is not None:
        missing.append(f"sliding-window layers ({geometry.sliding_window})")
    d = geometry.head_dim
    if d % CHANNELS_PER_LANE or d > HEAD_DIM_MAX:
        missing.append(f"heads of {d} channels (they need a multiple of 8 up to 256)")
    return missing


def mask_view(
    mask: torch.Tensor | None, b: int, hq: int, q_len: int, length: int
) -> tuple[torch.Tensor | None, int, tuple[int, int, int, int]]:
    """``(mask, kind, strides)`` as the kernel reads it: kind 0 none, 1 bool (bytes), 2 additive fp32; a
    broadcast view ``[b, hq, q_len, length]`` (strides in elements, 0 where broadcast), never a copy
    unless the mask is a float other than fp32."""
    if mask is None:
        return None, 0, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        kind, mask = 1, mask.view(torch.uint8)
    else:
        kind, mask = 2, mask if mask.dtype == torch.float32 else mask.float()
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = mask[..., :length].expand(b, hq, q_len, length)
    return mask, kind, tuple(mask.stride())


def outlier_rows(index: torch.Tensor, value: torch.Tensor, n: int, d: int) -> tuple[torch.Tensor, ...]:
    """GEAR's outliers by token: ``(row_ptr [B, H, n + 1], pos [B, H, n_out], val)`` int32/int32/fp16,
    positions sorted, so token ``t``'s are ``pos[row_ptr[t]:row_ptr[t + 1]]`` (channel ``pos - t·d``)."""
    pos, order = index.sort(dim=-1)
    val = value.gather(-1, order)
    bounds = (torch.arange(n + 1, device=index.device, dtype=torch.int32) * d).expand(*index.shape[:2], n + 1)
    row_ptr = torch.searchsorted(pos, bounds.contiguous(), out_int32=True)
    return row_ptr.contiguous(), pos.to(torch.int32).contiguous(), val.contiguous()


def segment_bases(runs: list[Any]) -> list[int]:
    """The first segment of each run in ``q B`` (``query_times_b``'s segment axis)."""
    bases, total = [], 0
    for run in runs:
        bases.append(total)
        total += run.a.shape[2]
    return bases


def run_rows(runs: list[Any]) -> list[list[int]]:
    """The runs' table as codes.cu reads it (``RUN_FIELDS`` int64 a run): start, segment length, segments,
    rank, first segment in ``q B``, then A's data pointer and strides (b, h, s, t, j), B's (b, h, s, c, j)."""
    rows = []
    for run, base in zip(runs, segment_bases(runs), strict=True):
        rank = run.a.shape[-1]
        if rank > RANK_MAX:
            raise ValueError(f"kernels_cupy: GEAR ranks up to {RANK_MAX} are supported, got {rank}")
        if run.a.dtype != torch.float16 or run.b.dtype != torch.float16:
            raise ValueError("kernels_cupy: GEAR's low-rank factors must be fp16")
        row = [run.start, run.seg_len, run.a.shape[2], rank, base]
        row += [run.a.data_ptr(), *run.a.stride(), run.b.data_ptr(), *run.b.stride()]
        rows.append(row + [0] * (RUN_FIELDS - len(row)))
    return rows


def query_times_b(q_rows: torch.Tensor, runs: list[Any]) -> torch.Tensor:
    """``q B`` of every key segment and query row, ``[B, Hkv, segments, R, RANK_MAX]`` fp32 (ranks padded
    with zeros): what the scores' low-rank term ``A_t · (q B)`` reads, so ``A Bᵀ`` is never formed.
    ``q_rows``: ``[B, Hkv, R, D]`` fp32."""
    parts = []
    for run in runs:
        x = torch.einsum("bhrd,bhsdj->bhsrj", q_rows, run.b.float())
        parts.append(torch.nn.functional.pad(x, (0, RANK_MAX - x.shape[-1])))
    if not parts:
        return q_rows.new_zeros(*q_rows.shape[:2], 1, q_rows.shape[2], RANK_MAX)
    return torch.cat(parts, dim=2).contiguous()


def check_geometry(d: int, hq: int, hkv: int) -> None:
    if d % CHANNELS_PER_LANE or not CHANNELS_PER_LANE <= d <= HEAD_DIM_MAX:
        raise ValueError(f"kernels_cupy: the codes kernels take head_dim a multiple of 8 up to 256, got {d}")
    if hq % hkv:
        raise ValueError(f"kernels_cupy: {hq} query heads cannot share {hkv} KV heads evenly")


def check_state(state: Any, d: int) -> None:
    """What the kernel assumes of a state: no sinks, codes at the state's bits and group size, keys per
    channel (grouped along tokens), values per token (groups dividing the head dim)."""
    if state.bits not in (2, 4, 8):
        raise ValueError(f"kernels_cupy: codes of 2, 4 or 8 bits, got {state.bits}")
    if d % state.group_size:
        raise ValueError(f"kernels_cupy: value groups of {state.group_size} channels must divide head_dim {d}")
    for name, stream, axis in (("key", state.k, 2), ("value", state.v, 3)):
        if stream.fp16.sinks is not None:
            raise ValueError("kernels_cupy: a window with attention sinks is not supported")
        q = stream.store.q
        if q is not None and (q.bits, q.axis, q.group_size) != (state.bits, axis, state.group_size):
            raise ValueError(f"kernels_cupy: {name} codes of another layout ({q.bits} bits, axis {q.axis})")


def check_cuda(query: torch.Tensor, what: str = "codes") -> None:
    """One line where a query is not on a GPU: the ``what`` kernels read device memory only."""
    if not query.is_cuda:
        raise ValueError(f"kernels_cupy: the {what} kernels need CUDA tensors, got the query on {query.device}")


def raw(t: torch.Tensor | None) -> np.uint64:
    """The device pointer of a tensor ``rows_of`` checked (a buffer's view: not contiguous, read in place)."""
    if t is not None and not t.is_cuda:
        raise ValueError(f"kernels_cupy: kernel arguments must be CUDA tensors, got one on {t.device}")
    return np.uint64(0 if t is None else t.data_ptr())


def kernel_arg(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous and 16-byte aligned (the state's own tensors are; anything else is copied)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


class _GearArgs:
    """One GEAR stream's outliers by token and runs' table, rebuilt only when the store changed (a new
    segment, a beam reorder). The store's tensors are referenced weakly: identity, never kept alive."""

    def __init__(self, store: Any, d: int, device: torch.device) -> None:
        self.length = store.length
        self.refs = [weakref.ref(t) for t in _gear_tensors(store)]
        self.rows = None if store.index is None else outlier_rows(store.index, store.value, store.length, d)
        table = run_rows(store.runs)
        self.runs = torch.tensor(table, dtype=torch.int64, device=device) if table else None
        self.n_runs = len(table)

    def current(self, store: Any) -> bool:
        held = _gear_tensors(store)
        return (
            self.length == store.length
            and len(held) == len(self.refs)
            and all(ref() is t for ref, t in zip(self.refs, held, strict=True))
        )


def _gear_tensors(store: Any) -> list[torch.Tensor]:
    held = [] if store.index is None else [store.index, store.value]
    return held + [t for run in store.runs for t in (run.a, run.b)]


_GEAR_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gear_args(store: Any, d: int, device: torch.device) -> _GearArgs:
    """The cached ``_GearArgs`` of a GEAR store."""
    got = _GEAR_CACHE.get(store)
    if got is None or not got.current(store):
        got = _GearArgs(store, d, device)
        _GEAR_CACHE[store] = got
    return got


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(tensor, rows)``: ``t`` ``[B, H, n, ...]`` as the kernel addresses it, row ``i`` of ``(b, h)`` at element
    ``((b·H + h)·rows + i)·inner`` (``inner`` = the product of dims 3…). A store's ``RowBuffer`` view is read in
    place, its buffer's capacity the row stride (``rows`` ≥ ``n``); anything else is made contiguous (``rows`` = n)."""
    b, h, n = t.shape[:3]
    inner = math.prod(t.shape[3:])
    dense = all(t.shape[k] == 1 or t.stride(k) == math.prod(t.shape[k + 1 :]) for k in range(3, t.dim()))
    if dense and inner and (n == 1 or t.stride(2) == inner) and t.data_ptr() % ALIGN == 0:
        per_bh = t.stride(1) if h > 1 else (t.stride(0) if b > 1 else n * inner)
        rows, rest = divmod(per_bh, inner)
        if not rest and rows >= n and (b == 1 or t.stride(0) == h * per_bh):
            return t, rows
    return kernel_arg(t), n


def quant_rows(q: Any, per_token_scale: bool) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """``((codes, scale, zero), code rows, scale rows)`` of a stream's coded part (values: scales per token share
    the codes' row stride, so where the two differ both are made contiguous)."""
    (codes, rows), (scale, groups), (zero, zgroups) = (rows_of(t) for t in (q.codes, q.scale, q.zero))
    if zgroups != groups or (per_token_scale and groups != rows):
        (codes, rows), (scale, groups), (zero, _) = ((kernel_arg(t), t.shape[2]) for t in (q.codes, q.scale, q.zero))
    return (codes, scale, zero), rows, groups


def _stream_args(stream: Any, d: int, gear: _GearArgs | None) -> tuple:
    q = stream.store.q
    codes = scale = zero = None
    rows = groups = 0
    if q is not None:
        (codes, scale, zero), rows, groups = quant_rows(q, q.axis == 3)
    window = kernel_arg(stream.window)
    n = stream.store.length
    head = (raw(codes), raw(scale), raw(zero), i32(n), i32(rows), i32(groups), ptr(window), i32(window.shape[2]))
    if gear is None or gear.rows is None:
        sparse = (ptr(None), ptr(None), ptr(None), i32(0))
    else:
        row_ptr, pos, val = gear.rows
        sparse = (ptr(row_ptr), ptr(pos), ptr(val), i32(pos.shape[-1]))
    runs = (ptr(None), i32(0)) if gear is None or gear.runs is None else (ptr(gear.runs), i32(gear.n_runs))
    return head, sparse, runs, (codes, scale, zero, window)


def _attend(fmt: str, state: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    b, hq, q_len, d = query.shape
    hkv = state.k.window.shape[1]
    check_geometry(d, hq, hkv)
    check_state(state, d)
    if q_len > PROMPT_QUERIES:
        from kvquant.formats.codes import attend

        return attend(state, None, query, mask, scaling)[0]
    check_cuda(query)
    length = state.length
    rows = (hq // hkv) * q_len
    bh = b * hkv
    q32 = query.float().contiguous()
    gear = fmt == "gear"
    kg = gear_args(state.k.store, d, query.device) if gear else None
    vg = gear_args(state.v.store, d, query.device) if gear else None
    # the (possibly copied) tensors are held until the launches are queued
    k_head, k_sparse, k_runs, _k_held = _stream_args(state.k, d, kg)
    v_head, v_sparse, v_runs, _v_held = _stream_args(state.v, d, vg)
    qb = query_times_b(q32.view(b, hkv, rows, d), state.k.store.runs) if gear else None
    qb_segs = qb.shape[2] if gear else 0
    mask_t, kind, (mb, mh, mq, mt) = mask_view(mask, b, hq, q_len, length)
    mask_ptr = np.uint64(0 if mask_t is None else mask_t.data_ptr())
    causal = mask is None and q_len > 1
    rt = row_tile(fmt, rows)
    tiles = -(-rows // rt)
    u = TOKENS_IN_FLIGHT[(fmt, rt)]
    n_split, chunk = plan(length, bh * tiles, sm_count(query.device.index or 0), d, u)
    f32 = {"dtype": torch.float32, "device": query.device}
    part_acc = torch.empty(n_split, bh, rows, d, **f32)
    part_ml = torch.empty(n_split, bh, rows, 2, **f32)
    args = (ptr(q32), *k_head, *k_sparse, *k_runs)
    args += (*v_head[:5], *v_head[6:], *v_sparse, *v_runs)  # values: scale rows = code rows
    args += (ptr(qb), i32(qb_segs), mask_ptr, i32(kind), *(np.int64(x) for x in (mb, mh, mq, mt)))
    args += (i32(hkv), i32(hq // hkv), i32(q_len), i32(rows), i32(d), i32(state.group_size), i32(length))
    args += (i32(chunk), i32(causal), np.float32(scaling), i32(lanes_per_token(d)), ptr(part_acc), ptr(part_ml))
    name = kernel_name(fmt, state.bits, rt)
    launch(SOURCE, name, (n_split, bh, tiles), THREADS, args, shared_mem=shared_bytes(d, rt))
    out = torch.empty(bh * rows, d, **f32)
    merge = (ptr(part_acc), ptr(part_ml), i32(n_split), i32(bh * rows), i32(d), ptr(out))
    launch(SOURCE, "codes_merge", (bh * rows,), THREADS, merge)
    return out.view(b, hq, q_len, d).to(query.dtype)


def attend_codes(
    state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The backend protocol for format ``kivi`` (a ``CodesState``): ``(out, Reads())``."""
    return _attend("kivi", state, query, mask, scaling), Reads()


def attend_gear(
    state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The backend protocol for format ``gear`` (a ``GearState``): ``(out, Reads())``."""
    return _attend("gear", state, query, mask, scaling), Reads()

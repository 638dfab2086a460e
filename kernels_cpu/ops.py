"""The Python face of the kernels: one function per storage format, over the tensors a layer holds.

Each takes the query ``[B, Hq, q_len, D]`` (any float dtype; computed in fp32), the layer's stored
tensors untouched, an optional mask broadcastable to ``[B, Hq, q_len, L]`` (bool: True = attend,
or additive float), ``scaling`` (default ``D**-0.5``) and ``causal`` (query ``i`` sees keys
``t <= L - q_len + i``; for a mask-less multi-token step). GQA: query head ``j`` reads KV head
``j // (Hq / Hkv)``, as transformers' ``repeat_kv`` does. Returns ``[B, Hq, q_len, D]`` in the
query's dtype. A row that sees no key gives zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kernels_cpu.loader import module


def _query(q: torch.Tensor) -> torch.Tensor:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, q_len, D], got shape {tuple(q.shape)}")
    q = q if q.dtype == torch.float32 else q.float()
    return q if q.stride(-1) == 1 else q.contiguous()


def _mask(mask: torch.Tensor | None, q: torch.Tensor, length: int) -> torch.Tensor | None:
    """A broadcast view ``[B, Hq, q_len, L]`` (no copy unless the dtype is neither bool nor fp32)."""
    if mask is None:
        return None
    if mask.dtype not in (torch.bool, torch.float32):
        mask = mask.float()
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    b, h, n, _ = q.shape
    try:
        return mask.expand(b, h, n, length)
    except RuntimeError as exc:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, n, length)}") from exc


def _scaling(scaling: float | None, q: torch.Tensor) -> float:
    return float(q.shape[-1]) ** -0.5 if scaling is None else float(scaling)


def attend_fp16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
    keep_bits: int = 16,
) -> torch.Tensor:
    """Attention over fp16 ``k``/``v`` ``[B, Hkv, L, D]`` (``Fp16Layer.keys``/``.values``), read in place.

    ``keep_bits`` < 16 reads every element as ``kvquant.bits.truncate`` does (the truncation method):
    the truncation happens in registers, so all 16 stored bits are still loaded.
    """
    q32 = _query(q)
    out = module().attend_fp16(q32, k, v, _mask(mask, q32, k.shape[-2]), causal, _scaling(scaling, q), int(keep_bits))
    return out if out.dtype == q.dtype else out.to(q.dtype)


Widths = torch.Tensor | int


def _widths(w: Widths, batch: int, heads: int, n: int, d: int | None) -> torch.Tensor:
    """uint8 widths ``[B, H, n, D]`` (keys: ``d`` given; a ``[B, H, D]`` tensor is one width per
    column) or ``[B, H, n]`` (values); an int is one width for all, as a stride-0 view."""
    if isinstance(w, int):
        shape = (batch, heads, 1, d) if d is not None else (batch, heads, 1)
        return torch.full((1,) * len(shape), w, dtype=torch.uint8).expand(shape)
    if d is not None and w.dim() == 3:
        w = w.unsqueeze(2)
    return w if w.dtype == torch.uint8 else w.to(torch.uint8)


def _plane_inputs(q: torch.Tensor, k_a: torch.Tensor | None, tail_k: torch.Tensor, k_widths: Widths, mask):
    """fp32 query, uint8 key widths (None before the first block) and the mask view, for a plane store."""
    q32 = _query(q)
    nb = 0 if k_a is None else k_a.shape[2]
    wk = None if k_a is None else _widths(k_widths, q.shape[0], tail_k.shape[1], nb, q.shape[-1])
    return q32, wk, _mask(mask, q32, nb * 64 + tail_k.shape[-2])


def attend_planes(
    q: torch.Tensor,
    k_a: torch.Tensor | None,
    k_b: torch.Tensor | None,
    k_c: torch.Tensor | None,
    tail_k: torch.Tensor,
    v_a: torch.Tensor | None,
    v_b: torch.Tensor | None,
    v_c: torch.Tensor | None,
    tail_v: torch.Tensor,
    *,
    k_widths: Widths,
    v_widths: Widths,
    tiny_k: bool = True,
    tiny_v: bool = True,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over AlignedKV's planes (``kvquant.alignment.PlaneStore``) read at given widths.

    Keys: ``k_a`` uint8 ``[B, Hkv, nb, D, 64]`` and nibble-packed ``k_b``/``k_c`` ``[B, Hkv, nb, D, 32]``
    (64-token blocks, channel-major), then the fp16 ``tail_k`` ``[B, Hkv, T, D]``; ``k_widths`` 8/12/16
    per (batch, head, channel) ``[B, Hkv, D]`` or per block ``[B, Hkv, nb, D]`` (AlignedKV+). Values:
    ``v_a`` ``[B, Hkv, nb·64, D]``, ``v_b``/``v_c`` ``[B, Hkv, nb·64, D/2]``, then ``tail_v``;
    ``v_widths`` per token ``[B, Hkv, nb·64]``. An int width reads everything at it. Tails are read
    at 16 bits, as the torch path does. Before the first block the planes are ``None``. ``tiny_k``/
    ``tiny_v`` False (``PlaneStore.tiny_k``/``tiny_v``: no plane-A byte reads as ±0) lets the kernel
    skip the ±0 rule, which then cannot apply. ``plane_tensors(store)`` gives all of these but the widths.
    """
    q32, wk, mask32 = _plane_inputs(q, k_a, tail_k, k_widths, mask)
    wv = None if k_a is None else _widths(v_widths, q.shape[0], tail_k.shape[1], k_a.shape[2] * 64, None)
    out = module().attend_planes(
        q32,
        k_a,
        k_b,
        k_c,
        wk,
        tail_k,
        v_a,
        v_b,
        v_c,
        wv,
        tail_v,
        bool(tiny_k),
        bool(tiny_v),
        mask32,
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attend_aligned(
    q: torch.Tensor,
    k_a: torch.Tensor | None,
    k_b: torch.Tensor | None,
    k_c: torch.Tensor | None,
    tail_k: torch.Tensor,
    v_a: torch.Tensor | None,
    v_b: torch.Tensor | None,
    v_c: torch.Tensor | None,
    tail_v: torch.Tensor,
    *,
    k_widths: Widths,
    v8: torch.Tensor,
    v_thresholds: tuple[float, float],
    topk: int,
    v_block: int = 1,
    tiny_k: bool = True,
    tiny_v: bool = True,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AlignedKV's step in one call: ``(out, v_widths)``, the value widths decided by
    ``kvquant.alignment.value_widths`` on fp64 scores of the keys read at ``k_widths`` (strided
    top-``topk``, ``O_est`` by the pairwise tree, exponent gaps, ``v_block``), then attention over
    the values read at them with those scores. ``v8``: fp32 ``[256]``, ``|v8|`` of each plane-A byte
    (``kvquant.alignment.high_byte_values``); ``v_thresholds`` ``(t12, t8)``. The store arguments are
    ``attend_planes``'; ``v_widths`` int32 ``[B, Hkv, nb·64]`` (the block tokens). A multi-token step
    needs its mask (the rule reads no causal limit)."""
    q32, wk, mask32 = _plane_inputs(q, k_a, tail_k, k_widths, mask)
    out, wv = module().attend_aligned(
        q32,
        k_a,
        k_b,
        k_c,
        wk,
        tail_k,
        v_a,
        v_b,
        v_c,
        tail_v,
        bool(tiny_k),
        bool(tiny_v),
        mask32,
        _scaling(scaling, q),
        v8.float().contiguous(),
        float(v_thresholds[0]),
        float(v_thresholds[1]),
        int(topk),
        int(v_block),
    )
    return (out if out.dtype == q.dtype else out.to(q.dtype)), wv.to(torch.int32)


def read_plane_keys(
    k_a: torch.Tensor | None,
    k_b: torch.Tensor | None,
    k_c: torch.Tensor | None,
    tail_k: torch.Tensor,
    *,
    k_widths: Widths,
    tiny_k: bool = True,
) -> torch.Tensor:
    """Every key ``[B, Hkv, L, D]`` as fp32, the planes read at ``k_widths`` (as ``attend_planes`` takes
    them) and the tail at 16 bits: bit for bit ``PlaneStore.read_keys(k_widths, torch.float32)``, in
    one pass. What the value rule's scores are computed from on the cpu backend."""
    batch, heads, _, d = tail_k.shape
    nb = 0 if k_a is None else k_a.shape[2]
    wk = None if k_a is None else _widths(k_widths, batch, heads, nb, d)
    return module().read_plane_keys(k_a, k_b, k_c, wk, tail_k, bool(tiny_k))


def exponent_gaps(e_o: torch.Tensor, v_high: torch.Tensor) -> torch.Tensor:
    """``kvquant.alignment.exponent_gaps`` in one pass (int16 ``[B, Hkv, L]``, the same integers):
    ``min_c (e_o[c] − exponent_field(v_high[..., t, c]))`` for ``e_o`` int16 ``[B, Hkv, D]``."""
    return module().exponent_gaps(e_o, v_high)


def plane_tensors(store: Any) -> dict[str, Any]:
    """``attend_planes``' store arguments from a ``kvquant.alignment.PlaneStore`` (duck-typed)."""
    names = ("k_a", "k_b", "k_c", "tail_k", "v_a", "v_b", "v_c", "tail_v", "tiny_k", "tiny_v")
    return {name: getattr(store, name) for name in names}


def attend_kivi(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    k_window: torch.Tensor,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    v_window: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a KIVI store: quantized keys then the fp16 key window, likewise for values.

    Keys: ``k_codes`` uint8 ``[B, Hkv, Tk, D·bits/8]``, ``k_scale``/``k_zero`` fp16
    ``[B, Hkv, Tk/G, 1, D]`` (per channel, groups of ``G`` tokens). Values: ``v_codes``
    ``[B, Hkv, Tv, D·bits/8]``, ``v_scale``/``v_zero`` ``[B, Hkv, Tv, D/G, 1]`` (per token, groups of
    ``G`` channels). ``Tk`` and ``Tv`` may differ; ``Tk + window length`` must equal ``Tv + window``.
    A part not quantized yet is ``None``. ``kivi_tensors(layer)`` gives all of these from a layer.
    """
    q32 = _query(q)
    length = k_window.shape[-2] + (0 if k_codes is None else k_codes.shape[-2])
    out = module().attend_kivi(
        q32,
        k_codes,
        k_scale,
        k_zero,
        k_window,
        v_codes,
        v_scale,
        v_zero,
        v_window,
        int(bits),
        int(group_size),
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _streams(layer: Any) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """The layer's (name, stream) pairs; the kernels take no attention sinks (KIVI and GEAR keep none)."""
    pairs = (("k", layer.k_stream), ("v", layer.v_stream))
    for _, stream in pairs:
        if getattr(getattr(stream, "fp16", None), "sinks", None) is not None:
            raise ValueError("kernels_cpu: a window with attention sinks is not supported")
    return pairs


def kivi_tensors(layer: Any) -> dict[str, Any]:
    """``attend_kivi``'s store arguments from a ``kvquant.methods.kivi.KiviLayer`` (duck-typed)."""
    args: dict[str, Any] = {"bits": layer.bits, "group_size": layer.group_size}
    for name, stream in _streams(layer):
        quant = stream.store.q
        args[f"{name}_codes"] = None if quant is None else quant.codes
        args[f"{name}_scale"] = None if quant is None else quant.scale
        args[f"{name}_zero"] = None if quant is None else quant.zero
        args[f"{name}_window"] = stream.window
    return args


Run = tuple[int, int, torch.Tensor, torch.Tensor]


def attend_gear(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    k_window: torch.Tensor,
    k_index: torch.Tensor | None,
    k_value: torch.Tensor | None,
    k_runs: Sequence[Run],
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    v_window: torch.Tensor,
    v_index: torch.Tensor | None,
    v_value: torch.Tensor | None,
    v_runs: Sequence[Run],
    *,
    bits: int,
    group_size: int,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a GEAR store: ``attend_kivi``'s codes and windows, plus per stream the exact
    outliers (``index`` int32 ``[B, Hkv, n]`` = token·D + channel, ``value`` fp16 ``[B, Hkv, n]``; they
    replace the reconstruction there) and the low-rank runs ``(start, seg_len, A, B)`` with ``A``
    ``[B, Hkv, n_seg, seg_len, r]`` and ``B`` ``[B, Hkv, n_seg, D, r]`` fp16, applied as ``q·(A Bᵀ)``
    and ``(p A) Bᵀ`` without expanding ``A Bᵀ``. ``gear_tensors(layer)`` gives all of these.
    """
    q32 = _query(q)
    length = k_window.shape[-2] + (0 if k_codes is None else k_codes.shape[-2])

    def runs(rs: Sequence[Run]) -> list:
        return [[int(r[0]) for r in rs], [int(r[1]) for r in rs], [r[2] for r in rs], [r[3] for r in rs]]

    out = module().attend_gear(
        q32,
        k_codes,
        k_scale,
        k_zero,
        k_window,
        k_index,
        k_value,
        *runs(k_runs),
        v_codes,
        v_scale,
        v_zero,
        v_window,
        v_index,
        v_value,
        *runs(v_runs),
        int(bits),
        int(group_size),
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def gear_tensors(layer: Any) -> dict[str, Any]:
    """``attend_gear``'s store arguments from a ``kvquant.methods.gear.GearLayer`` (duck-typed)."""
    args: dict[str, Any] = {"bits": layer.bits, "group_size": layer.group_size}
    for name, stream in _streams(layer):
        store, quant = stream.store, stream.store.q
        args[f"{name}_codes"] = None if quant is None else quant.codes
        args[f"{name}_scale"] = None if quant is None else quant.scale
        args[f"{name}_zero"] = None if quant is None else quant.zero
        args[f"{name}_window"] = stream.window
        args[f"{name}_index"] = store.index
        args[f"{name}_value"] = store.value
        args[f"{name}_runs"] = [(run.start, run.seg_len, run.a, run.b) for run in store.runs]
    return args


def attend_higgs(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scales: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_sinks: torch.Tensor | None,
    v_sinks: torch.Tensor | None,
    k_recent: torch.Tensor,
    v_recent: torch.Tensor,
    *,
    grid: torch.Tensor,
    signs: torch.Tensor,
    outer: torch.Tensor,
    code_bits: int,
    group: int,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    rope_scale: float = 1.0,
    post_rope: bool = False,
    rotated_scores: bool | None = None,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over a HIGGS store: fp16 sinks, then the coded tokens, then the fp16 recent window.

    Codes ``k_codes``/``v_codes`` uint8 ``[B, n, bytes]`` (``kvquant.quant.bitpack``, ``code_bits`` per
    code, over the whole row of Hkv·D channels) and fp16 scales ``[B, n, groups]``; keys are coded
    before RoPE, which is re-applied with ``cos``/``sin`` fp32 ``[B, n, D]`` or, with those None, computed
    per token as transformers' rotary modules do, ``cos/sin(positions · inv_freq) · rope_scale`` (int32
    ``positions`` ``[B, n]``, ``inv_freq`` ``[D/2]``); ``post_rope``: keys coded after RoPE
    (``higgs_post_rope``), nothing re-applied, no RoPE inputs given; such keys are scored in the
    rotated domain (each row's query rotated once, no inverse rotation per token) where that is less
    work, else rebuilt per token — ``rotated_scores`` True/False forces one (the same scores up to fp32
    summation order). Sinks and window: fp16 ``[B, Hkv, *, D]`` after
    RoPE. The quantizer: ``grid`` ``[2^code_bits, 2]``, ``signs`` ``[P]``, the dense Hadamard factor
    ``outer`` ``[m, m]`` (P = m·2^k), ``group`` channels per scale (a multiple of D). Nothing coded yet:
    codes, scales and RoPE inputs None. ``higgs_tensors(layer)`` gives all of these.
    """
    q32 = _query(q)
    length = k_recent.shape[-2] + (0 if k_codes is None else k_codes.shape[1])
    length += 0 if k_sinks is None else k_sinks.shape[-2]
    out = module().attend_higgs(
        q32,
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        cos,
        sin,
        positions,
        inv_freq,
        float(rope_scale),
        bool(post_rope),
        -1 if rotated_scores is None else int(bool(rotated_scores)),
        k_sinks,
        v_sinks,
        k_recent,
        v_recent,
        grid,
        signs,
        outer,
        int(code_bits),
        int(group),
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def higgs_tensors(layer: Any) -> dict[str, Any]:
    """``attend_higgs``' store arguments from a higgs ``AquaKVLayer`` (duck-typed; full-attention layers).

    AQUA-KV's codes are of a predictor's residual, which this kernel does not add back: refused.
    """
    if layer.pred_k is not None or layer.pred_v is not None:
        raise ValueError("kernels_cpu: HIGGS codes of a predictor residual (AQUA-KV) are not supported")
    quant, qk, qv = layer.quant, layer.qk, layer.qv
    return {
        "k_codes": None if qk is None else qk.codes,
        "k_scales": None if qk is None else qk.scales,
        "v_codes": None if qv is None else qv.codes,
        "v_scales": None if qv is None else qv.scales,
        "cos": None,
        "sin": None,
        **layer.kernel_rope(),
        "k_sinks": layer.k_win.sinks,
        "v_sinks": layer.v_win.sinks,
        "k_recent": layer.k_win.recent,
        "v_recent": layer.v_win.recent,
        "grid": quant.grid,
        "signs": quant.signs,
        "outer": quant.outer,
        "code_bits": quant.code_bits,
        "group": quant.group,
    }


Pred = tuple[torch.Tensor, torch.Tensor] | None


def aquakv_reconstruct(
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    *,
    grid: torch.Tensor,
    signs: torch.Tensor,
    outer: torch.Tensor,
    code_bits: int,
    group: int,
    pred_k: Pred = None,
    pred_v: Pred = None,
    prev_k: torch.Tensor | None = None,
    prev_v: torch.Tensor | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    channels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An AQUA-KV layer's pre-RoPE keys and values ``[B, n, C]`` fp32, ``pred + deHIGGS(codes)``, in one call:
    ``kvquant.methods.aquakv.predictors.dequantize_pair`` up to fp32 summation order.

    Codes ``[B, n, bytes]`` uint8 and fp16 scales ``[B, n, groups]`` (an ``AquaKVLayer``'s ``qk``/``qv``);
    the quantizer's ``grid``, ``signs``, ``outer``, ``code_bits`` and ``group``; the predictors
    ``(W [in, out], b [out])`` (keys: ``in = C``; values: ``in = 2C``, reading ``[keys, prev_v]``) with the
    previous layer's reconstruction ``prev_k``/``prev_v`` ``[B, n, C]`` fp32 (any row strides). Each
    side's residual and bias are decoded straight into ``out_k``/``out_v`` (contiguous fp32 ``[B, n, C]``,
    e.g. views of a reused workspace; allocated when None, then ``channels`` gives C), and the
    predictions are added in place by BLAS (``addmm_``): nothing else is allocated.
    """
    if out_k is None or out_v is None:
        c = channels if channels is not None else (pred_k or pred_v)[0].shape[1]
        out_k = torch.empty(k_codes.shape[0], k_codes.shape[1], c) if out_k is None else out_k
        out_v = torch.empty_like(out_k) if out_v is None else out_v
    wk, bk = pred_k if pred_k is not None else (None, None)
    wv, bv = pred_v if pred_v is not None else (None, None)
    module().aquakv_reconstruct(
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        grid,
        signs,
        outer,
        int(code_bits),
        int(group),
        wk,
        bk,
        wv,
        bv,
        prev_k if wk is not None else None,
        prev_v if wv is not None else None,
        out_k,
        out_v,
    )
    return out_k, out_v


def aquakv_encode(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    grid: torch.Tensor,
    signs: torch.Tensor,
    outer: torch.Tensor,
    code_bits: int,
    group: int,
    pred_k: Pred = None,
    pred_v: Pred = None,
    prev_k: torch.Tensor | None = None,
    prev_v: torch.Tensor | None = None,
) -> tuple[Any, Any]:
    """HIGGS codes of new rows of an AQUA-KV layer, ``kvquant.methods.aquakv.predictors.encode_pair``'s
    rule in one call: ``Q(k − pred_k(prev_k))``, then ``Q(v − pred_v([pred_k + deQ(key codes), prev_v]))``.

    ``k``/``v``: pre-RoPE rows ``[B, m, C]`` fp32; ``prev_k``/``prev_v``: the previous layer's
    reconstruction of them (with the predictors). Returns ``(qk, qv)`` as ``HiggsTensor``s (codes
    ``[B, m, bytes]`` uint8, fp16 scales ``[B, m, groups]``). Equal to ``Higgs.quantize`` up to fp32
    summation order (the rotation and the RMS are summed in another order, so a value on a rounding
    boundary may take the neighbouring code).
    """
    from kvquant.quant.higgs import HiggsTensor

    wk, bk = pred_k if pred_k is not None else (None, None)
    wv, bv = pred_v if pred_v is not None else (None, None)
    kc, ks, vc, vs = module().aquakv_encode(
        k,
        v,
        grid,
        signs,
        outer,
        int(code_bits),
        int(group),
        wk,
        bk,
        wv,
        bv,
        prev_k if wk is not None else None,
        prev_v if wv is not None else None,
    )
    return HiggsTensor(kc, ks), HiggsTensor(vc, vs)


def attend_aquakv(
    q: torch.Tensor,
    k_rows: torch.Tensor | None,
    v_rows: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_sinks: torch.Tensor | None,
    v_sinks: torch.Tensor | None,
    k_recent: torch.Tensor,
    v_recent: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    rope_scale: float = 1.0,
    mask: torch.Tensor | None = None,
    scaling: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over an AQUA-KV layer: fp16 sinks, then its reconstructed coded tokens, then the fp16 window.

    ``k_rows``/``v_rows``: the layer's pre-RoPE keys and values ``[B, n, Hkv·D]`` fp32 (what
    ``aquakv_reconstruct`` wrote; head ``h`` at channels ``h·D …``, row stride free); RoPE is applied to
    the keys as they are loaded, from ``cos``/``sin`` fp32 ``[B, n, D]`` or, with those None, computed
    from int32 ``positions`` ``[B, n]`` as ``cos/sin(positions · inv_freq) · rope_scale`` (as
    ``attend_higgs``). Sinks and window: fp16 ``[B, Hkv, *, D]`` after RoPE. Nothing coded yet: rows
    and RoPE inputs None. ``aquakv_tensors(layer)`` gives all of these.
    """
    q32 = _query(q)
    length = k_recent.shape[-2] + (0 if k_rows is None else k_rows.shape[1])
    length += 0 if k_sinks is None else k_sinks.shape[-2]
    out = module().attend_aquakv(
        q32,
        k_rows,
        v_rows,
        cos,
        sin,
        positions,
        inv_freq,
        float(rope_scale),
        k_sinks,
        v_sinks,
        k_recent,
        v_recent,
        _mask(mask, q32, length),
        causal,
        _scaling(scaling, q),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def aquakv_tensors(layer: Any) -> dict[str, Any]:
    """``attend_aquakv``'s store arguments from an ``AquaKVLayer`` on a kernel backend (duck-typed): the
    rows its cache reconstructed this forward (``layer.workspace_rows()``), RoPE, sinks and window."""
    rows = layer.workspace_rows()
    return {
        "k_rows": None if rows is None else rows[0],
        "v_rows": None if rows is None else rows[1],
        "cos": None,
        "sin": None,
        **(layer.kernel_rope() if rows is not None else {}),
        "k_sinks": layer.k_win.sinks,
        "v_sinks": layer.v_win.sinks,
        "k_recent": layer.k_win.recent,
        "v_recent": layer.v_win.recent,
    }

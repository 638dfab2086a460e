"""The Python face of the kernels over HIGGS codes (``higgs``, ``higgs_post_rope``) and AQUA-KV layers.

As ``kernels_cpu.ops`` (query, stored tensors, mask, scaling, causal), plus AQUA-KV's two steps that are
not attention: coding new rows (``aquakv_encode``) and reconstructing a layer into a workspace
(``aquakv_reconstruct``).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_cpu.loader import module
from kernels_cpu.ops import _scaling, as_query, call


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
    codes, scales and RoPE inputs None. ``kernels_cpu.backend.higgs_tensors(state)`` gives all of these.
    """
    length = k_recent.shape[-2] + (0 if k_codes is None else k_codes.shape[1])
    length += 0 if k_sinks is None else k_sinks.shape[-2]
    rotated = -1 if rotated_scores is None else int(bool(rotated_scores))
    stored = (
        *(k_codes, k_scales, v_codes, v_scales, cos, sin, positions, inv_freq, float(rope_scale), bool(post_rope)),
        *(rotated, k_sinks, v_sinks, k_recent, v_recent, grid, signs, outer, int(code_bits), int(group)),
    )
    return as_query(call("attend_higgs", q, stored, mask, length, causal, _scaling(scaling, q)), q)


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
    and RoPE inputs None. ``kernels_cpu.backend.aquakv_tensors(state)`` gives all of these.
    """
    length = k_recent.shape[-2] + (0 if k_rows is None else k_rows.shape[1])
    length += 0 if k_sinks is None else k_sinks.shape[-2]
    stored = (k_rows, v_rows, cos, sin, positions, inv_freq, float(rope_scale), k_sinks, v_sinks, k_recent, v_recent)
    return as_query(call("attend_aquakv", q, stored, mask, length, causal, _scaling(scaling, q)), q)
